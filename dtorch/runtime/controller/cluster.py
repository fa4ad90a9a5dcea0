"""Starting and supervising worker processes: local ones by default, over SSH from a hostfile
through dtorch_launcher's spawner. Both hand back handles with the same surface
(rank, host, pid, poll(), wait(), kill(), terminate()). `WorkerPool` is the controller's record of
them: who registered, who was lost and why (process exit, heartbeat silence)."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ...errors import MeshError, StartupError, WorkerLostError
from . import interrupts
from ..protocol import lost_worker_key
from ..processes.local_relays import LocalRelays, local_relays_enabled
from ..processes.zygote import Zygote, ZygoteUnavailable, zygote_enabled

__all__ = ["LocalWorker", "ForkedWorker", "LocalSpawner", "worker_config", "forward_lines", "WorkerRecord",
           "WorkerPool", "loss_reason", "stop_process", "threads_setting", "default_threads", "ENV_THREADS"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def worker_config(controller, rank: int, device: str, threads: int, curve: dict | None = None,
                  gloo_host: str = "127.0.0.1", controller_timeout: float = 6.0, threads_chosen: bool = False) -> dict:
    """The one JSON line a worker reads from stdin (it holds the run's secret: never put it on a
    command line or in a file). `threads_chosen`: the user set `threads` (dtorch.init's
    threads_per_worker, DTORCH_THREADS), so no spawner replaces it with its own default (SLURM's
    --cpus-per-task)."""
    return {"command_address": controller.sockets.command_address, "secret": controller.secret,
            "reply_address": controller.sockets.reply_address,
            "rank": rank, "device": device, "threads": threads, "threads_chosen": threads_chosen, "curve": curve,
            "gloo_host": gloo_host, "controller_timeout": controller_timeout,
            # shared-GPU mode (runtime/devices/shared_gpu.py), a session setting: a replaced worker keeps it
            "share_gpu": getattr(controller, "share_gpu", False)}


# --- torch threads per worker --------------------------------------------------------------------
ENV_THREADS = "DTORCH_THREADS"


def threads_setting(given: int | None) -> int | None:
    """The torch intra-op threads each worker is told to use: `given` (dtorch.init's
    threads_per_worker), else DTORCH_THREADS, else None: default_threads when each starts."""
    source = "threads_per_worker"
    if given is None:
        text = os.environ.get(ENV_THREADS, "").strip()
        if not text:
            return None
        source, given = ENV_THREADS, text
    try:
        count = int(given)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or isinstance(given, (bool, float)):
        raise ValueError(f"{source}={given!r}: expected a whole number of torch threads per worker, at least 1 "
                         f"(unset: {DEFAULT_THREADS_RULE})")
    return count


DEFAULT_THREADS_RULE = ("the CPUs this process may run on, shared by the workers in the pool when a worker starts "
                        "(at least 1); under SLURM, --cpus-per-task")


def default_threads(pool_size: int) -> int:
    """DEFAULT_THREADS_RULE, without SLURM's (launcher/slurm.py applies that one): the CPUs this
    process may use (its affinity, which taskset, cgroups' cpusets and container limits narrow;
    os.cpu_count() where the platform has none) over the pool's size, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, pool_size))


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


def _worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


class LocalWorker:
    """A worker process on this machine, started as its own `python -m ...` (DTORCH_ZYGOTE=0,
    or when the worker template cannot start)."""

    host = "localhost"
    relay = None   # the local relay its commands come through (runtime/processes/local_relays.py), if any

    def __init__(self, rank: int, config: dict, python: str = sys.executable):
        self.rank = rank
        self.process = subprocess.Popen([python, "-m", "dtorch.runtime.processes.worker_process"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=True)
        self.pid = self.process.pid
        self._start(config, self.process.stdin, self.process.stdout)

    def _start(self, config: dict, stdin, output) -> None:
        # The config travels on stdin; stdin then stays open: its EOF tells the worker we are gone.
        stdin.write((json.dumps(config) + "\n").encode())
        stdin.flush()
        self._tail: collections.deque = collections.deque(maxlen=1)
        self._output = forward_lines(output, f"[rank {self.rank}] ", tail=self._tail)

    def failure_message(self) -> str | None:
        """Why the process exited, in one sentence (a worker that cannot start says so last)."""
        code = self.poll()
        if code is None or code == 0:
            return None
        self._output.join(2.0)
        last = f": {self._tail[-1]}" if self._tail else ""
        return f"worker rank {self.rank} on localhost exited with code {code}{last}"

    def relay_lost(self) -> str | None:
        return self.relay.loss() if self.relay is not None else None

    def poll(self):
        return self.process.poll()

    def wait(self, timeout=None):
        return self.process.wait(timeout)

    def kill(self) -> None:
        self.process.kill()

    def terminate(self) -> None:
        self.process.terminate()


class ForkedWorker(LocalWorker):
    """A worker forked from the worker template (runtime/processes/zygote.py): the same process, stdin and
    output as a LocalWorker's, without a torch import of its own. It is the template's child, so
    the template reports its exit code; signals go to it directly."""

    def __init__(self, rank: int, config: dict, zygote: Zygote):
        self.rank, self._zygote = rank, zygote
        self.pid, self._stdin, output = zygote.fork(rank, _worker_env(), os.getcwd())
        self._start(config, self._stdin, output)

    def poll(self):
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout=None):
        return self._zygote.wait_exit(self.pid, timeout)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, number: int) -> None:
        if self.poll() is None:   # once reaped, the pid may name another process
            try:
                os.kill(self.pid, number)
            except ProcessLookupError:
                pass


# A local pool past this many workers needs DTORCH_MAX_LOCAL_WORKERS: init_device_mesh("cpu",
# (1000,)) once started 1,063 processes and took 15.6 GB in 78 s before anything said no. A
# directly started worker holds about 150 MiB once it has run an op (docs/design/worker_template.md);
# forked ones share most of it, but each grows by what it computes.
WORKER_BYTES = 150 << 20
MIN_LOCAL_LIMIT = 64   # tests/test_scale.py's pool, on any machine with the memory for it


def local_worker_limit() -> tuple[int, str]:
    """(how many local workers start without an explicit setting, why that many)."""
    given = os.environ.get("DTORCH_MAX_LOCAL_WORKERS")
    if given:
        return int(given), "DTORCH_MAX_LOCAL_WORKERS"
    cores = os.cpu_count() or 1
    limit, why = max(MIN_LOCAL_LIMIT, 8 * cores), f"8 per core on {cores} cores, at least {MIN_LOCAL_LIMIT}"
    available = _available_memory()
    if available is not None and available // WORKER_BYTES < limit:
        limit = max(1, available // WORKER_BYTES)
        why = f"{available / 2**30:.1f} GiB available at about {WORKER_BYTES >> 20} MiB per worker"
    return limit, why


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class LocalSpawner:
    """Local workers: forked from one worker template, started on the first spawn and ended by
    close(); each started directly with DTORCH_ZYGOTE=0 or if the template cannot start."""

    capacity = None  # no hostfile: the local limit is check_pool_size's

    def check_pool_size(self, total: int) -> None:
        """Refuse, before any start, a local pool larger than local_worker_limit() says fits."""
        limit, why = local_worker_limit()
        if total > limit:
            raise MeshError(f"a pool of {total} local worker processes: this machine fits {limit} by default "
                            f"({why}). Use a smaller mesh, or a hostfile of several machines (dtorch-launch "
                            f"--hostfile); to start them here anyway, set DTORCH_MAX_LOCAL_WORKERS={total}")

    def __init__(self):
        self._zygote: Zygote | None = None
        self._use_zygote = zygote_enabled()
        self._relays = LocalRelays(local_relays_enabled(), forward_lines)

    def host_for(self, rank: int) -> str:
        return "localhost"

    def relays(self) -> list:
        return self._relays.all()

    def spawn(self, rank: int, config: dict) -> LocalWorker:
        config, relay = self._relays.route(rank, config, _worker_env())
        worker = self._start(rank, config)
        worker.relay = relay
        return worker

    def _start(self, rank: int, config: dict) -> LocalWorker:
        zygote = self._template()
        if zygote is not None:
            try:
                return ForkedWorker(rank, config, zygote)
            except ZygoteUnavailable as reason:
                self._give_up_on_template(reason)
        return LocalWorker(rank, config)

    def _template(self) -> Zygote | None:
        if self._use_zygote and (self._zygote is None or not self._zygote.alive):
            self._close_template()   # a template that died: release its socket before starting the next
            try:
                self._zygote = Zygote(_worker_env())
                forward_lines(self._zygote.output, "[worker template] ")
            except ZygoteUnavailable as reason:
                self._give_up_on_template(reason)
        return self._zygote

    def _give_up_on_template(self, reason: Exception) -> None:
        print(f"dtorch: starting local workers directly from now on ({reason})", file=sys.stderr)
        self._use_zygote = False
        self._close_template()

    def close(self) -> None:
        """End the relays and the worker template (after the workers: they are its children)."""
        self._relays.close()
        self._close_template()

    def _close_template(self) -> None:
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()


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
        self.live_tensors = self.rss_bytes = 0         # from the latest heartbeat
        self.busy_seq, self.busy_s = -1, 0.0           # the command it runs, and for how long
        self.threads = 0                               # its torch intra-op threads, from its registration

    def as_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "device": self.device,
                "alive": self.lost is None, "threads": self.threads, "live_tensors": self.live_tensors,
                "rss_bytes": self.rss_bytes}


def loss_reason(worker: WorkerRecord, now: float) -> str | None:
    code = worker.handle.poll() if worker.handle is not None else None
    if code is not None:
        return f"its process exited with code {code}"
    relay_lost = getattr(worker.handle, "relay_lost", None)   # dtorch-launch's per-host relays
    reason = relay_lost() if relay_lost is not None else None
    if reason:
        worker.handle.terminate()   # no command can reach it any more: it exits on stdin EOF
        return reason
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


class WorkerPool:
    """The controller's view of its worker processes: started, registered, lost. The loop thread
    changes it; the user thread waits on it (registration) and asks it (is a rank lost?)."""

    def __init__(self, lock: threading.Lock, store):
        self.workers: dict[int, WorkerRecord] = {}
        self._changed = threading.Condition(lock)
        self._store = store     # peers waiting in a collective watch it for lost ranks

    def add(self, handles: list, device: str) -> None:
        with self._changed:
            for handle in handles:
                self.workers[handle.rank] = WorkerRecord(handle.rank, handle, device)

    def mark_registered(self, worker: WorkerRecord) -> None:
        with self._changed:
            worker.registered = True
            self._changed.notify_all()

    def mark_lost(self, worker: WorkerRecord, reason: str) -> WorkerLostError:
        with self._changed:
            worker.lost = reason
            self._changed.notify_all()
        self._store.set(lost_worker_key(worker.rank), reason)
        return WorkerLostError(worker.rank, worker.host, worker.pid, reason)

    def excuse_silence(self, seconds: float, now: float) -> None:
        """The controller did not run for `seconds` until `now`: nobody heard heartbeats then,
        and workers suspended with it (a paused VM) could not send any, so that time is not
        their silence."""
        for worker in self.workers.values():
            worker.last_heartbeat = min(now, worker.last_heartbeat + seconds)

    def newly_lost(self, now: float) -> list:
        """(worker, reason) for each worker that exited or went silent since the last look."""
        found = [(w, loss_reason(w, now)) for w in list(self.workers.values()) if w.lost is None]
        return [(w, reason) for w, reason in found if reason]

    def stuck(self, hang_timeout_s: float) -> list:
        """Live workers running one command past the timeout, those on the earliest such command
        only: the others are most likely waiting for them inside a collective, and go free (with
        PeerLostError) once the stuck ones are ended."""
        hung = [w for w in self.workers.values() if w.lost is None and w.busy_seq >= 0 and w.busy_s > hang_timeout_s]
        first = min((w.busy_seq for w in hung), default=None)
        return [w for w in hung if w.busy_seq == first]

    def exited(self, ranks) -> WorkerLostError | None:
        """The first of `ranks` whose process has exited, not yet marked lost (a blocking read
        asks, when the loop thread that marks losses has not run lately)."""
        for rank in ranks:
            w = self.workers.get(rank)
            code = w.handle.poll() if w is not None and w.lost is None and w.handle is not None else None
            if code is not None:
                return WorkerLostError(w.rank, w.host, w.pid, f"its process exited with code {code}")
        return None

    def lost_among(self, ranks) -> WorkerLostError | None:
        for rank in ranks:
            w = self.workers.get(rank)
            if w is not None and w.lost:
                return WorkerLostError(w.rank, w.host, w.pid, w.lost)
        return None

    def live_ranks(self) -> list:
        return [r for r, w in self.workers.items() if w.lost is None]

    def starting(self) -> bool:
        return any(not w.registered and not w.lost for w in self.workers.values())

    def check_ranks(self, mesh) -> None:
        """A mesh may name only ranks that are running."""
        lost = self.lost_among(mesh.ranks)
        if lost:
            raise lost
        unknown = [r for r in mesh.ranks if r not in self.workers]
        if unknown:
            raise MeshError(f"{mesh} names rank(s) {unknown}, but only ranks {sorted(self.workers)} are "
                            "running; build meshes with init_device_mesh, which starts workers")

    def wait_registered(self, ranks, timeout: float, progress=None) -> None:
        """Block until `ranks` registered; a failed start raises StartupError naming the host and
        the cause (the spawner's explanation when it has one, e.g. an ssh failure)."""
        deadline = time.monotonic() + timeout
        reported: set = set()
        for rank in ranks:
            progress and progress.worker_started(rank, self.workers[rank].host)
        with self._changed:
            while True:
                for w in (self.workers[r] for r in ranks if self.workers[r].registered and r not in reported):
                    reported.add(w.rank)
                    progress and progress.worker_registered(w.rank, w.host)
                failed = [self.workers[r] for r in ranks if self.workers[r].lost]
                if failed:
                    raise StartupError(_start_failure(failed[0], progress))
                if len(reported) == len(ranks):
                    progress and progress.done()
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = [r for r in ranks if r not in reported]
                    raise StartupError(f"worker rank(s) {pending} on {sorted({self.workers[r].host for r in pending})} "
                                       f"did not register within {timeout:.0f}s")
                self._changed.wait(min(left, 0.05))
                interrupts.raise_pending()   # Ctrl-C while workers start (the with releases the lock)

    def stop_all(self, deadline: float, announce_after_s: float, describe) -> None:
        """Wait until every worker process has exited (each runs what was issued, then its
        Shutdown), up to `deadline`; then, or at once on a Ctrl-C meanwhile, end the rest. Once
        the wait passes `announce_after_s`, say on stderr whom it waits for (`describe(worker)`)
        and how to stop waiting: a shutdown never waits in silence."""
        started = time.monotonic()
        announced = False
        while True:
            running = [w for w in self.workers.values() if w.handle is not None and w.handle.poll() is None]
            if not running:
                return
            now = time.monotonic()
            if interrupts.take_pending() or now >= deadline:
                _end_all([w.handle for w in running])
                if announced:
                    print(f"dtorch: ended {len(running)} worker(s)", file=sys.stderr, flush=True)
                return
            if not announced and now - started >= announce_after_s:
                announced = True
                waiting_for = "; ".join(describe(w) for w in running[:4]) + ("; ..." if len(running) > 4 else "")
                print(f"dtorch: shutting down: waiting up to {deadline - now:.1f}s for {len(running)} worker(s) "
                      f"to finish ({waiting_for}); press Ctrl-C to end them now", file=sys.stderr, flush=True)
            time.sleep(0.02)


def _end_all(handles: list) -> None:
    """Kill every process, then reap each (a killed child would linger as a zombie)."""
    for handle in handles:
        try:
            handle.kill()
        except Exception:  # exited meanwhile
            pass
    for handle in handles:
        try:
            handle.wait(2)
        except Exception:  # an ssh session slow to go: its worker exits on stdin EOF anyway
            pass


def _start_failure(worker: WorkerRecord, progress) -> str:
    explain = getattr(worker.handle, "failure_message", None)
    message = ((explain() if explain else None)
               or f"worker rank {worker.rank} on {worker.host} failed to start: {worker.lost}")
    if progress is not None:
        progress.host_failed(worker.host, message)
    return message
