"""Lost workers, on the controller: the loop thread's watchdog finds them (a process that
exited, heartbeats silent too long, one command running past the hang timeout), and each loss
fails the reads that wait on the worker and retires every mesh it belongs to. After
dtorch.replace_lost_workers (runtime/controller/recovery.py drives it), regroup lets the meshes be defined
again and refuses the tensors built on them before.

A mixin of Controller (controller.py), which provides what these methods use: `pool`,
`store`, `sites`, `hang_timeout_s`, `closed`, `failures`, `lost_tensors`,
`generation` and `_first_valid_id`, `_mesh_ids`, `_mesh_lock` and `_lost_meshes`, `_reads`, `_abandoned`,
`_router_lock`, `_watchdog_waiting`, `_sockets_open`, `_pending`, `_pending_since`,
`_released`, `_flush_scheduled`, and `submit`, `new_future`, `new_id`, `announce_meshes`,
`_flush` and `_handle_queued` (reply_receiving.py).
"""
from __future__ import annotations

import asyncio
import time
import traceback

from .. import protocol as wire
from .cluster import WorkerRecord
from .reads import SyncRead

__all__ = ["LostWorkers"]

WATCH_PERIOD_S = 0.1
STALL_EXCUSED_S = 0.5   # a watchdog tick this late means the controller itself stalled (see _watch_once)
STALE_PENDING_S = 0.1   # the watchdog publishes commands pending this long (no timer did: a safety net)


class LostWorkers:
    # --- the watchdog (loop thread) -------------------------------------------------------------
    async def _watch(self) -> None:
        ticked = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            late, ticked = now - ticked - WATCH_PERIOD_S, now
            self._loop_ticked = now   # a blocking read watches this (reply_receiving.py)
            try:
                self._watch_once(late)
            except Exception:  # keep watching: a silent end would leave lost workers unreported
                traceback.print_exc()

    def _watch_once(self, late: float) -> None:
        """`late`: how long past its period this tick came, i.e. how long this process did not
        run its loop (a long GC pause, a starved or suspended machine)."""
        self._watchdog_waiting = True   # reading threads stop taking the lock: no starvation
        with self._router_lock:   # _lose fails reads that a reading thread's handlers may resolve
            self._watchdog_waiting = False
            if self._sockets_open:   # heartbeats queued in the socket count before silence is judged
                self._handle_queued()
            if late > STALL_EXCUSED_S:   # nobody listened meanwhile: that is not the workers' silence
                self.pool.excuse_silence(late, time.monotonic())
            self._watch_locked()

    def _watch_locked(self) -> None:
        if not self.closed:
            for worker, reason in self.pool.newly_lost(time.monotonic()):
                self._lose(worker, reason)
            if self.hang_timeout_s:
                for worker in self.pool.stuck(self.hang_timeout_s):
                    self._lose(worker, f"stuck for {worker.busy_s:.0f}s in {self.sites.describe(worker.busy_seq)}, "
                                       f"past the hang timeout of {self.hang_timeout_s:g}s; dtorch ended it")
                    _end(worker.handle)
        stale = self._pending and time.monotonic() - self._pending_since > STALE_PENDING_S
        if stale or (self._released and not self._flush_scheduled):
            self._flush()   # dropped ids, or commands no timer published (a safety net)

    def _lose(self, worker: WorkerRecord, reason: str) -> None:
        """Fail what waits on the worker and retire every mesh it belongs to."""
        error = self.pool.mark_lost(worker, reason)
        for mesh in [m for m in self._mesh_ids if worker.rank in m.ranks]:
            self._lost_meshes[mesh] = error
            del self._mesh_ids[mesh]
        for owed in self._abandoned.values():   # it will not answer reads abandoned before either
            owed.discard(worker.rank)
        for seq, read in list(self._reads.items()):
            if worker.rank in read.waiting:
                read.fail(error)
                self._reads.pop(seq, None)
                # The survivors still answer it: their replies are expected, not a protocol error.
                self._abandoned[seq] = read.waiting - {worker.rank}
        for seq in [seq for seq, owed in self._abandoned.items() if not owed]:
            del self._abandoned[seq]

    # --- recovery (runtime/controller/recovery.py drives it) ----------------------------------------------
    def settle_survivors(self, timeout: float) -> None:
        """Wait until every live worker has run everything issued so far: a survivor still in a
        collective with a lost peer leaves it (it sees the peer's lost key) before that key goes."""
        live = self.pool.live_ranks()
        if not live:   # every worker was lost: nobody to wait for
            return
        future = self.new_future()
        self.submit(wire.Sync, read=SyncRead(live, future))
        future.result(timeout)

    def forget_loss(self, rank: int) -> None:
        """The lost rank's key leaves the rendezvous store, so a new process can take the rank."""
        self.store.delete_key(wire.lost_worker_key(rank))

    def regroup(self, losses: list) -> None:
        """The lost ranks of `losses` (WorkerLostErrors) run in new, registered processes: every
        worker drops the groups that held them (Regroup), meshes that held them can be defined
        again (new ids), and tensors built on those meshes before now are refused."""
        replaced = tuple(sorted(loss.rank for loss in losses))
        by_rank = {loss.rank: loss for loss in losses}
        with self._mesh_lock:
            self.generation += 1
            self.submit(wire.Regroup, self.generation, replaced)
            cutoff = self.new_id()   # every tensor built from here on has a larger id
            for mesh in list(self._lost_meshes):
                held = [r for r in mesh.ranks if r in by_rank]
                if held:
                    self.lost_tensors.record(mesh, cutoff, by_rank[held[0]])
                if not self.pool.lost_among(mesh.ranks):
                    del self._lost_meshes[mesh]
            self._first_valid_id = cutoff
        for failure in self.failures.values():   # survivors' collectives that broke with the loss,
            if failure.exception_type == "PeerLostError":   # which WorkerLostError already reported
                failure.reported = True
        self.announce_meshes()   # the new processes learn the meshes of the survivors


def _end(handle) -> None:
    """Kill a stuck worker and reap it (a local child would otherwise linger as a zombie)."""
    if handle is None:
        return
    handle.kill()
    try:
        handle.wait(2)
    except Exception:  # an ssh session slow to go: its worker exits on stdin EOF anyway
        pass
