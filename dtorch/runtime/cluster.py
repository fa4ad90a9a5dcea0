"""Starting and supervising worker processes: local ones by default, over SSH from a hostfile
through dtorch_launcher's spawner. Both hand back handles with the same surface
(rank, host, pid, poll(), wait(), kill(), terminate())."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

__all__ = ["LocalWorker", "LocalSpawner", "worker_config", "forward_lines", "WorkerRecord", "loss_reason", "stop_process"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_config(controller, rank: int, device: str, threads: int, curve: dict | None = None,
                  gloo_host: str = "127.0.0.1", controller_timeout: float = 6.0) -> dict:
    """The one JSON line a worker reads from stdin (it holds the run's secret: never put it on a
    command line or in a file)."""
    return {"command_address": controller.sockets.command_address, "secret": controller.secret,
            "reply_address": controller.sockets.reply_address,
            "rank": rank, "device": device, "threads": threads, "curve": curve,
            "gloo_host": gloo_host, "controller_timeout": controller_timeout}


def forward_lines(stream, prefix: str, sink=None, log_file=None, tail=None) -> threading.Thread:
    """Copy a worker's output line by line to the controller's stderr, prefixed with its rank;
    `tail` (a bounded deque) keeps the last lines, to explain a failed start."""
    def pump():
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            (sink or sys.stderr).write(prefix + line)
            if tail is not None and line.strip():
                tail.append(line.strip())
            if log_file is not None:
                log_file.write(line)
                log_file.flush()
        stream.close()
    thread = threading.Thread(target=pump, name=f"output {prefix.strip()}", daemon=True)
    thread.start()
    return thread


class LocalWorker:
    """A worker process on this machine."""

    host = "localhost"

    def __init__(self, rank: int, config: dict, python: str = sys.executable):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self.rank = rank
        self.process = subprocess.Popen([python, "-m", "dtorch.runtime.worker_process"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pid = self.process.pid
        # The config travels on stdin; stdin then stays open: its EOF tells the worker we are gone.
        self.process.stdin.write((json.dumps(config) + "\n").encode())
        self.process.stdin.flush()
        self._tail: collections.deque = collections.deque(maxlen=1)
        self._output = forward_lines(self.process.stdout, f"[rank {rank}] ", tail=self._tail)

    def failure_message(self) -> str | None:
        """Why the process exited, in one sentence (a worker that cannot start says so last)."""
        code = self.process.poll()
        if code is None or code == 0:
            return None
        self._output.join(2.0)
        last = f": {self._tail[-1]}" if self._tail else ""
        return f"worker rank {self.rank} on localhost exited with code {code}{last}"

    def poll(self):
        return self.process.poll()

    def wait(self, timeout=None):
        return self.process.wait(timeout)

    def kill(self) -> None:
        self.process.kill()

    def terminate(self) -> None:
        self.process.terminate()


class LocalSpawner:
    capacity = None  # any number of local workers

    def host_for(self, rank: int) -> str:
        return "localhost"

    def spawn(self, rank: int, config: dict) -> LocalWorker:
        return LocalWorker(rank, config)


# --- supervision: what the controller knows of each worker process --------------------------
WORKER_SILENCE_S = 3.0       # a worker without heartbeats this long is reported lost


class WorkerRecord:
    def __init__(self, rank: int, handle, device: str):
        self.rank, self.handle, self.device = rank, handle, device
        self.host = getattr(handle, "host", "localhost")
        self.pid = getattr(handle, "pid", None)
        self.registered = False
        self.identity: bytes | None = None            # the DEALERs that registered with the secret
        self.heartbeat_identity: bytes | None = None
        self.start_seq = 0                            # the first command this rank runs
        self.last_heartbeat = time.monotonic()
        self.lost: str | None = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "device": self.device,
                "alive": self.lost is None}


def loss_reason(worker: WorkerRecord, now: float) -> str | None:
    code = worker.handle.poll() if worker.handle is not None else None
    if code is not None:
        return f"its process exited with code {code}"
    if worker.registered and now - worker.last_heartbeat > WORKER_SILENCE_S:
        return f"no heartbeat for {now - worker.last_heartbeat:.1f}s"
    return None


def stop_process(handle, deadline: float) -> None:
    if handle is None:
        return
    try:
        handle.wait(max(0.05, deadline - time.monotonic()))
    except Exception:
        pass
    if handle.poll() is None:
        handle.kill()
        try:
            handle.wait(2)
        except Exception:
            pass
