"""Recovery from lost workers in the same controller process: dtorch.replace_lost_workers.

Each lost rank gets a new process that keeps the rank number, started by the session's spawner
(locally, or over SSH on the same hostfile slot), so the meshes that named the rank work again.
In order:
  1. the survivors run everything issued so far: one still inside a collective with a lost peer
     leaves it with PeerLostError (it watches the peer's lost key), so nothing waits on the dead;
  2. the lost process is ended and reaped if it still runs (a silent one), and its lost key leaves
     the rendezvous store, so collectives with the new process are not refused;
  3. the new processes start and register (they run commands from then on);
  4. the regroup (meshes.MeshBook.regroup): every worker drops cached groups that held a replaced rank and names new
     groups with the new generation (the Regroup command); meshes that held one get new ids when
     next used; tensors built on them before are refused with LostTensorError. Tensors on meshes
     of survivors only stay valid.
"""
from __future__ import annotations

import time

from ...errors import WorkerLostError
from .. import protocol as wire
from .cluster import default_threads, stop_process, worker_config
from .reads import SyncRead

__all__ = ["replace_lost_workers"]


def replace_lost_workers(controller, spawner, timeout: float, progress_for=None) -> list[dict]:
    """Start a process for each lost rank; returns one dict per replaced rank (rank, host, pid,
    lost_pid, reason), [] when nothing was lost."""
    if not any(w.lost for w in controller.workers.values()):
        return []
    deadline = time.monotonic() + timeout
    _settle(controller, timeout)
    lost = sorted((w for w in controller.workers.values() if w.lost), key=lambda w: w.rank)
    losses = [controller.pool.lost_among([w.rank]) for w in lost]
    for worker in lost:
        stop_process(worker.handle, time.monotonic())
        # its lost key leaves the rendezvous store, so a new process can take the rank
        controller.store.delete_key(wire.lost_worker_key(worker.rank))
    handles = [spawner.spawn(w.rank, _config(controller, spawner, w)) for w in lost]
    for worker, handle in zip(lost, handles):
        controller.add_workers([handle], worker.device)
    ranks = [w.rank for w in lost]
    controller.wait_registered(ranks, max(1.0, deadline - time.monotonic()),
                               progress_for(handles) if progress_for else None)
    controller.meshes.regroup(losses)
    for failure in controller.reads.failures.values():   # survivors' collectives that broke with the loss,
        if failure.exception_type == "PeerLostError":    # which WorkerLostError already reported
            failure.reported = True
    return [{"rank": w.rank, "host": controller.workers[w.rank].host, "pid": controller.workers[w.rank].pid,
             "lost_pid": w.pid, "reason": w.lost} for w in lost]


def _settle(controller, timeout: float) -> None:
    """Survivors idle; one found lost meanwhile (dead, but not yet noticed) is replaced too."""
    while True:
        try:
            return _settle_survivors(controller, timeout)
        except WorkerLostError:   # each retry waits on fewer ranks; none left returns at once
            continue


def _settle_survivors(controller, timeout: float) -> None:
    """Wait until every live worker has run everything issued so far: a survivor still in a
    collective with a lost peer leaves it (it sees the peer's lost key) before that key goes."""
    live = controller.pool.live_ranks()
    if not live:   # every worker was lost: nobody to wait for
        return
    future = controller.new_future()
    controller.submit(wire.Sync, read=SyncRead(live, future))
    future.result(timeout)


def _config(controller, spawner, lost) -> dict:
    """What the lost process was started with: same rank, device and thread count."""
    remote = getattr(spawner, "capacity", None) is not None
    threads = lost.threads or default_threads(len(controller.workers))   # 0: it never registered
    return worker_config(controller, lost.rank, lost.device, threads, controller.curve_for_worker(),
                         gloo_host="auto" if remote else "127.0.0.1", threads_chosen=lost.threads > 0)
