"""Forward a remote worker's output to the controller's terminal, one prefixed line at a time.

Each pipe of the local ssh client gets a daemon thread: a worker that prints a lot must never
block on a full pipe, and the controller must never block on a quiet worker. The first stdout
line of the remote shell carries the worker's pid (the shell echoes ``$$`` before it ``exec``s
python, and exec keeps the pid); it is taken out of the stream, not printed.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import threading
from typing import IO

__all__ = ["OutputForwarder", "PID_MARKER"]

PID_MARKER = "DTORCH_REMOTE_PID="
_PID_LINE = re.compile(rf"^{PID_MARKER}(\d+)$")
_STDERR_LINES_KEPT = 40

# One lock for every worker's lines, so that lines of different ranks never interleave mid-line.
_terminal_lock = threading.Lock()


class OutputForwarder:
    """Reads one worker's stdout and stderr, writes ``[rank R host] line`` to the controller's stderr."""

    def __init__(self, rank: int, host: str, log_path: str | None = None, name: str | None = None):
        self.prefix = f"[{name or f'rank {rank}'} {host}] "   # name: a process that is not a rank (a relay)
        self.remote_pid: int | None = None
        self.pid_known = threading.Event()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES_KEPT)
        self._log = _open_log(log_path)
        self._log_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._open_pipes = 0

    def follow(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self._open_pipes = 2
        for pipe, is_stdout in ((stdout, True), (stderr, False)):
            thread = threading.Thread(target=self._pump, args=(pipe, is_stdout), daemon=True,
                                      name=f"dtorch-output {self.prefix.strip()}")
            thread.start()
            self._threads.append(thread)

    def join(self, timeout: float) -> None:
        """Wait (bounded) until both pipes are drained, so the stderr tail is complete."""
        for thread in self._threads:
            thread.join(timeout)

    @property
    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    def _pump(self, pipe: IO[bytes], is_stdout: bool) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if is_stdout and self._take_pid(line):
                    continue
                if not is_stdout:
                    self._stderr_tail.append(line)
                self._write(line)
        finally:
            pipe.close()
            self._finish_pipe()

    def _take_pid(self, line: str) -> bool:
        match = None if self.pid_known.is_set() else _PID_LINE.match(line)
        if match:
            self.remote_pid = int(match.group(1))
            self.pid_known.set()
        return match is not None

    def _write(self, line: str) -> None:
        with _terminal_lock:
            try:
                sys.stderr.write(self.prefix + line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # the controller's stderr is gone (closed or at interpreter exit): keep draining
        with self._log_lock:
            if self._log is not None:
                self._log.write(line + "\n")

    def _finish_pipe(self) -> None:
        # The second pipe to close closes the log file; both pipes share it.
        with self._log_lock:
            self._open_pipes -= 1
            if self._open_pipes == 0 and self._log is not None:
                self._log.close()
                self._log = None


def _open_log(log_path: str | None):
    if log_path is None:
        return None
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    # Append, so that a worker restarted under the same rank does not erase its predecessor's crash.
    return open(log_path, "a", encoding="utf-8", errors="replace", buffering=1)
