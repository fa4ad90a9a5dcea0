"""A pre-imported worker template (a zygote): one process per controller that has imported torch,
zmq, msgpack and the worker's modules once, and forks a local worker on request.

Why: a fresh `python -m dtorch.runtime.processes.worker_process` imports torch again (about a second of CPU
and 230 MiB of private memory each). Forked workers start in milliseconds and share the
template's pages copy-on-write; gc.freeze() keeps the collector from touching (and so copying)
the pages of every object imported before the fork. benchmarks/worker_start.py measures both.

The channel: a private AF_UNIX SOCK_SEQPACKET socketpair, one JSON message per packet, never pickle.
  controller -> template  {"fork": rank, "env": {...}, "cwd": "..."} with two fds attached
                          (SCM_RIGHTS): the read end of the worker's stdin pipe and the write end
                          of its output pipe, both made by the controller.
  template -> controller  {"ready": pid, "threads": n}       once, after the imports
                          {"forked": rank, "pid": pid}      or {"forked": rank, "error": "..."}
                          {"exited": pid, "code": code}     each child it reaped (-N: signal N)

Every guarantee of a directly started worker holds, because a forked child becomes exactly that
worker: its stdin is the controller's own pipe (the config with the secret arrives on it, and EOF
on it means the controller is gone), its output goes to the controller line by line, and from
there it runs worker_process.main(). The template itself exits at EOF on its socket, that is when
the controller closes it (shutdown) or dies.

Fork safety: the template never starts a thread (OpenBLAS's server is kept off with
OPENBLAS_NUM_THREADS=1, torch's intra-op pool is created only by the child's first parallel op,
no zmq context exists yet); it checks its thread count before every fork and refuses with a
reason instead of forking a multi-threaded process. Each child sets its own state: a new
session, its stdio, its environment and cwd, and torch's thread count (worker_process.main).
Python's `random` is reseeded by CPython's at-fork hook; torch's default generator keeps its
import-time seed, as in a fresh process, and dtorch's random ops use their own counter-based
generators (dtorch/spec/rng.py) anyway.
"""
from __future__ import annotations

import json
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time

__all__ = ["Zygote", "ZygoteUnavailable", "zygote_enabled", "ZYGOTE_ENV", "main"]

ZYGOTE_ENV = "DTORCH_ZYGOTE"      # "0": start every local worker as its own `python -m ...`
READY_TIMEOUT_S = 120.0           # the template's imports, on a loaded machine
FORK_TIMEOUT_S = 30.0
REAP_INTERVAL_S = 0.05            # how soon an exited child is reported (loss detection)
_MAX_MESSAGE = 1 << 20            # a fork request carries the environment
_TEMPLATE_START = "import sys; from dtorch.runtime.processes.zygote import main; main(sys.argv)"


class ZygoteUnavailable(RuntimeError):
    """The template could not start or cannot fork safely; workers start directly instead."""


def zygote_enabled(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(ZYGOTE_ENV, "1") != "0"


# --- the controller's end --------------------------------------------------------------------
class Zygote:
    """Starts the template, asks it for workers, and learns from it when they exit (they are the
    template's children, so only it can reap them and read their exit codes)."""

    def __init__(self, env: dict, python: str = sys.executable):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(env)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")   # else numpy's import starts a BLAS thread
        # `-c`, not `-m`: importing dtorch imports this module, and runpy would warn about it.
        self.process = subprocess.Popen([python, "-c", _TEMPLATE_START, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        theirs.close()
        self.output = self.process.stdout   # the caller forwards it (cluster.forward_lines)
        self._socket = ours
        self._fork_lock = threading.Lock()  # one request in flight: replies come in order
        self._forked: queue.Queue = queue.Queue()
        self._exited = threading.Condition()
        self._codes: dict[int, int] = {}
        self.alive = True
        ready = self._await_ready()
        if ready.get("threads") != 1:
            self.close()
            raise ZygoteUnavailable(f"the worker template runs {ready.get('threads')} threads after its imports; "
                                    "forking it would be unsafe")
        self.pid = ready["ready"]
        threading.Thread(target=self._listen, name="dtorch-zygote", daemon=True).start()

    def _await_ready(self) -> dict:
        readable, _, _ = select.select([self._socket], [], [], READY_TIMEOUT_S)
        data = self._socket.recv(_MAX_MESSAGE) if readable else b""
        if not data:
            self.close()
            raise ZygoteUnavailable("the worker template exited or stayed silent during its imports "
                                    f"(exit code {self.process.poll()})")
        return json.loads(data)

    def _listen(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exited" in message:
                with self._exited:
                    self._codes[message["exited"]] = message["code"]
                    self._exited.notify_all()
            else:
                self._forked.put(message)
        with self._exited:
            self.alive = False
            self._exited.notify_all()
        self._forked.put({"error": "the worker template exited"})

    def fork(self, rank: int, env: dict, cwd: str):
        """A new worker process: (pid, its stdin as a binary file, its output as a binary file)."""
        stdin_read, stdin_write = os.pipe()
        output_read, output_write = os.pipe()
        request = json.dumps({"fork": rank, "env": env, "cwd": cwd}).encode()
        try:
            with self._fork_lock:
                if not self.alive:
                    raise ZygoteUnavailable("the worker template exited")
                socket.send_fds(self._socket, [request], [stdin_read, output_write])
                reply = self._forked.get(timeout=FORK_TIMEOUT_S)
        except BaseException as error:
            for fd in (stdin_write, output_read):
                os.close(fd)
            if isinstance(error, queue.Empty):
                self.close()   # a late reply would answer the next request: end this template
                raise ZygoteUnavailable(f"the worker template did not fork rank {rank} within "
                                        f"{FORK_TIMEOUT_S:.0f}s") from None
            raise
        finally:   # the child holds its ends now; ours would hide its EOFs
            os.close(stdin_read)
            os.close(output_write)
        if "error" in reply:
            for fd in (stdin_write, output_read):
                os.close(fd)
            raise ZygoteUnavailable(f"the worker template could not fork rank {rank}: {reply['error']}")
        return reply["pid"], os.fdopen(stdin_write, "wb"), os.fdopen(output_read, "rb")

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code (negative: killed by that signal), None while it runs."""
        with self._exited:
            code = self._codes.get(pid)
            if code is None and not self.alive and _gone(pid):
                code = self._codes[pid] = -1   # reaped by init after the template died: code unknown
            return code

    def wait_exit(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._exited:
            while (code := self.exit_code(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"dtorch worker pid {pid}", timeout)
                # Once the template is gone no exit is reported: look at /proc again shortly.
                pause = left if self.alive else REAP_INTERVAL_S if left is None else min(left, REAP_INTERVAL_S)
                self._exited.wait(pause)
        return code

    def close(self, timeout: float = 5.0) -> None:
        """Closing our end is the template's signal to exit. shutdown() first: a plain close
        would wait for the listening thread's recv, and the template would see no EOF."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- the template's end ------------------------------------------------------------------------
def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(control: socket.socket, message: dict) -> None:
    try:
        control.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)   # the controller is gone: nobody is left to start workers for


def _report_exits(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(control, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(control: socket.socket, request: dict, fds: list) -> dict:
    threads = _thread_count()
    if threads != 1 or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return {"forked": request.get("fork"), "error": f"{threads} threads in the template, {len(fds)} fds sent"}
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_worker(request, fds)   # never returns
    for fd in fds:
        os.close(fd)
    return {"forked": request["fork"], "pid": pid}


def _become_worker(request: dict, fds: list) -> None:
    """In the child: take the controller's pipes as stdio, drop everything of the template's,
    and run the worker exactly as `python -m dtorch.runtime.processes.worker_process` would."""
    try:
        os.setsid()   # as start_new_session: a signal to the template's group is not ours
        stdin_fd, output_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))   # the control socket and the received fds
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])   # sys.path[0] is "" (from `-c`): the controller's cwd, as for `-m`
        from . import worker_process
        worker_process.main()   # ends with os._exit
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(1)   # never return into the template's loop


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[1]))
    # What every worker imports, once: the forked children find it all in memory.
    import msgpack  # noqa: F401
    import torch  # noqa: F401
    import zmq  # noqa: F401
    from ..worker import worker  # noqa: F401
    from . import worker_process  # noqa: F401
    import gc
    gc.collect()
    gc.freeze()   # imported objects move out of the collector's reach: children never copy their pages
    _send(control, {"ready": os.getpid(), "threads": _thread_count()})
    while True:
        readable, _, _ = select.select([control], [], [], REAP_INTERVAL_S)
        _report_exits(control)
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, 2)
        if not message:
            break   # the controller closed its end or died: nothing more to start
        _send(control, _fork(control, json.loads(message), fds))
    os._exit(0)

