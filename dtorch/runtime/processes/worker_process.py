"""A worker process: start-up, registration, heartbeats and exit. The command loop itself is
`worker.Worker`; cluster.py and dtorch-launch start `python -m dtorch.runtime.processes.worker_process`.

The config is one line of JSON on stdin (so secrets never show in `ps`); stdin then stays open,
and EOF on it means the controller (or the ssh session carrying us) is gone: exit at once.
"""
from __future__ import annotations

import gc
import json
import math
import os
import socket
import sys
import threading
import time
import traceback

import torch

from .. import protocol as wire
from ..devices.device import make_device
from ..transport import WorkerSockets
from ..worker.worker import Worker

__all__ = ["main"]


def _exit_when_stdin_closes() -> None:
    """EOF on stdin: the controller (or the ssh session carrying us) is gone."""
    def watch():
        while sys.stdin.buffer.read(65536):
            pass
        os._exit(0)
    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


EXIT_CANNOT_START = 2   # a worker that cannot start; launcher/failures.py quotes its last stderr line
_stopping = threading.Event()   # set before the sockets close, so the heartbeat thread goes quietly


def _heartbeat(sockets: WorkerSockets, rank: int, timeout_s: float, status) -> None:
    """Heartbeats both ways on a socket of its own; exit if the controller stops answering,
    even while the main thread is blocked inside a collective. Each beat also says how many
    tensors the worker holds, its resident memory, and which command it has been running for
    how long (`status()` gives (live tensors, busy seq)): the controller ends a worker stuck in
    one command past its hang timeout.

    The controller counts as gone only when both say so: its Python has left `timeout_s` worth
    of beats in a row unanswered, and ZeroMQ has dropped the connection (its I/O thread stopped
    answering ZMTP heartbeats too). Beats are counted, not seconds: a machine that stops this
    process with the controller (a suspended VM, a starved CI host) makes one long wait, after
    which the controller answers again. A pause of the controller's Python alone (a long garbage
    collection) keeps the connection up. (The controller excuses its own stalls the same way:
    cluster.WorkerPool.excuse_silence.) A controller that exits closes our stdin, which ends us
    at once."""
    link = sockets.heartbeat_link(rank, timeout_s)
    beats_allowed, unanswered = max(1, math.ceil(timeout_s / wire.HEARTBEAT_INTERVAL)), 0
    watched_seq, since = -1, time.monotonic()
    while not _stopping.is_set():
        live, busy_seq = status()
        if busy_seq != watched_seq:
            watched_seq, since = busy_seq, time.monotonic()
        busy_s = time.monotonic() - since if busy_seq >= 0 else 0.0
        try:
            link.send([wire.encode(wire.Heartbeat(rank, live, _resident_bytes(), busy_seq, busy_s))])
            answer = link.receive(int(wire.HEARTBEAT_INTERVAL * 1000))
            gone = answer is None and unanswered + 1 >= beats_allowed and not link.connected()
        except Exception:
            if _stopping.is_set():
                return
            raise
        if answer is not None:
            unanswered = 0
            time.sleep(wire.HEARTBEAT_INTERVAL)
            continue
        unanswered += 1
        if gone:
            print(f"dtorch worker {rank}: controller silent for {timeout_s:.0f}s, exiting", file=sys.stderr)
            os._exit(3)


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:   # Linux: resident pages are the second field
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return 0


def _register(sockets: WorkerSockets, config: dict) -> wire.Welcome:
    """Wait until our SUB sees a probe (so no command can be missed), then register."""
    deadline = time.monotonic() + config.get("register_timeout", 120)
    while time.monotonic() < deadline:
        frames = sockets.receive_command(timeout_ms=100)
        if frames is not None and len(frames) >= 2 and _is_probe(frames[1].bytes):
            break
    else:
        raise SystemExit(f"dtorch worker {config['rank']}: never heard the controller")
    host = config.get("host_label") or socket.gethostname()
    sockets.send([wire.encode(wire.Register(config["rank"], host, os.getpid(), config["device"],
                                            config.get("secret", ""), torch.get_num_threads()))])
    while time.monotonic() < deadline:
        reply = sockets.receive_reply(timeout_ms=1000)
        if reply is not None:
            answer = wire.decode(reply[0], (wire.Welcome, wire.Refused))
            if type(answer) is wire.Refused:
                raise SystemExit(f"dtorch worker {config['rank']}: controller refused: {answer.reason}")
            return answer
    raise SystemExit(f"dtorch worker {config['rank']}: no welcome from the controller")


def _is_probe(frame) -> bool:
    # Before registering, a batch or private upload is not ours yet: only a probe counts. A
    # controller of another protocol version raises here, and the start fails saying so.
    return wire.read_header(frame)[1] == wire.Kind.PROBE


def _gloo_host(config: dict) -> str:
    """The address peers reach this worker on: by default the interface that routes to the
    controller (a UDP connect sends nothing; it only picks the route)."""
    host = config.get("gloo_host", "auto")
    if host != "auto":
        return host
    # The reply address: commands may come from this host's relay (ipc), replies never do.
    controller_host = config["reply_address"].split("//", 1)[1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((controller_host, 9))
        return probe.getsockname()[0]


def _freeze_collector() -> None:
    """Move every object this process holds so far (torch's ~176,000 import-time objects, the
    worker's sockets and tables) out of the cyclic collector's reach. A worker started directly
    (dtorch-launch over ssh or slurm, DTORCH_ZYGOTE=0) otherwise pays now and then for a full
    collection that walks all of them: an 80-100 ms pause of the command loop that every peer
    waits out at its next collective (`benchmarks/worker_gc.py`). A worker forked from the
    template inherits the template's freeze; this adds what it built since. No gc.collect()
    first: it would cost that same pause at start, for the few cycles the imports leave."""
    gc.freeze()


def _fail_start(rank: int, error: BaseException) -> None:
    """Leave with the reason as the last line of stderr, which the launcher quotes. A normal
    interpreter exit would wait on the stdin-watch thread's lock and die with a fatal error."""
    traceback.print_exc()
    reason = str(error) if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
    print(f"dtorch worker {rank} cannot start: {reason}", file=sys.stderr, flush=True)
    os._exit(EXIT_CANNOT_START)


def main() -> None:
    config = json.loads(sys.stdin.readline())
    _exit_when_stdin_closes()
    # dtorch.init's threads_per_worker, DTORCH_THREADS or the controller's default (cluster.py);
    # Register tells the controller what torch took, which dtorch.workers() shows.
    torch.set_num_threads(max(1, int(config.get("threads", 1))))
    rank = config["rank"]
    topics = [wire.TOPIC_ALL, wire.TOPIC_PROBE, wire.topic_for_rank(rank)]
    try:
        # The device first: a host without a GPU or without cupy fails here, before registering,
        # and the controller reports it as a failed start naming the host and this reason.
        device = make_device(config["device"], config.get("share_gpu", False))
        # With a relay on this host (launcher/relays.py), commands come from it, not the controller.
        relay = config.get("relay_address")
        sockets = WorkerSockets(relay or config["command_address"], config["reply_address"], rank, topics,
                                config.get("curve"), relayed=relay is not None)
        start_seq, store_address, gloo_timeout = _register(sockets, config)
        holding: list = []   # the Worker, once it exists: the heartbeat reports on it
        status = lambda: (len(holding[0].tensors), holding[0].busy_seq) if holding else (0, -1)  # noqa: E731
        threading.Thread(target=_heartbeat, args=(sockets, rank, config.get("controller_timeout", 6.0), status),
                         name="heartbeat", daemon=True).start()
        comm = device.communicator(store_address, rank, _gloo_host(config), gloo_timeout)
        host_comm = comm.host
    except (Exception, SystemExit) as error:
        _fail_start(rank, error)
    worker = Worker(rank, sockets, comm, device, start_seq, host_comm)
    holding.append(worker)
    _freeze_collector()
    exit_code = 0
    try:
        worker.run()
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    finally:
        _stopping.set()
        for closing in {id(comm): comm, id(host_comm): host_comm}.values():
            closing.close()
        device.close()
        sockets.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Daemon threads (stdin watch, heartbeat) hold locks that a normal interpreter
        # shutdown would wait on; nothing is left to clean up, so leave at once.
        os._exit(exit_code)


if __name__ == "__main__":
    main()
