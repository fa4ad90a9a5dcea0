"""Lost workers, on the controller: the loop thread's watchdog finds them (a process that
exited, heartbeats silent too long, one command running past the hang timeout), and each loss
fails the reads that wait on the worker and retires every mesh it belongs to. After
dtorch.replace_lost_workers (recovery.py drives it), meshes.MeshBook.regroup lets the meshes be
defined again and refuses the tensors built on them before.

LostWorkers is owned by the Controller. It takes the pool, the meshes, the reads and the command
sites; of the controller it reads `_Stream`. Its watchdog (`watch`, a task of the loop thread)
takes the ROUTER socket through the reply receiver it is given.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from typing import Protocol

from .cluster import WorkerPool, WorkerRecord
from .command_sites import CommandSites
from .meshes import MeshBook
from .reads import ReadBook
from .reply_receiving import ReplyReceiver

__all__ = ["LostWorkers"]

WATCH_PERIOD_S = 0.1
STALL_EXCUSED_S = 0.5   # a watchdog tick this late means the controller itself stalled (see _watch_once)


class _Stream(Protocol):
    """What the watchdog reads of the controller, and the one thing it asks of it."""
    closed: bool
    hang_timeout_s: float   # 0: no hang check

    def flush_stale(self) -> None:
        """Publish commands that no timer published (a safety net the watchdog runs each tick)."""


class LostWorkers:
    def __init__(self, stream: _Stream, pool: WorkerPool, meshes: MeshBook, reads: ReadBook, sites: CommandSites):
        self._stream, self._pool, self._meshes, self._reads, self._sites = stream, pool, meshes, reads, sites

    # --- the watchdog (loop thread) -------------------------------------------------------------
    async def watch(self, receiver: ReplyReceiver) -> None:
        ticked = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            late, ticked = now - ticked - WATCH_PERIOD_S, now
            receiver.loop_ticked = now   # a blocking read watches this (reply_receiving.py)
            try:
                self._watch_once(receiver, late)
            except Exception:  # keep watching: a silent end would leave lost workers unreported
                traceback.print_exc()

    def _watch_once(self, receiver: ReplyReceiver, late: float) -> None:
        """`late`: how long past its period this tick came, i.e. how long this process did not
        run its loop (a long GC pause, a starved or suspended machine)."""
        with receiver.held_by_watchdog():   # lose fails reads that a reading thread's handlers may resolve
            if late > STALL_EXCUSED_S:   # nobody listened meanwhile: that is not the workers' silence
                self._pool.excuse_silence(late, time.monotonic())
            self._find_losses()
        self._stream.flush_stale()

    def _find_losses(self) -> None:
        stream = self._stream
        if stream.closed:
            return
        for worker, reason in self._pool.newly_lost(time.monotonic()):
            self.lose(worker, reason)
        if stream.hang_timeout_s:
            for worker in self._pool.stuck(stream.hang_timeout_s):
                self.lose(worker, f"stuck for {worker.busy_s:.0f}s in {self._sites.describe(worker.busy_seq)}, "
                                  f"past the hang timeout of {stream.hang_timeout_s:g}s; dtorch ended it")
                _end(worker.handle)

    def lose(self, worker: WorkerRecord, reason: str) -> None:
        """Fail what waits on the worker and retire every mesh it belongs to."""
        error = self._pool.mark_lost(worker, reason)
        self._meshes.retire(worker.rank, error)
        self._reads.fail_reads_of(worker.rank, error)


def _end(handle) -> None:
    """Kill a stuck worker and reap it (a local child would otherwise linger as a zombie)."""
    if handle is None:
        return
    handle.kill()
    try:
        handle.wait(2)
    except Exception:  # an ssh session slow to go: its worker exits on stdin EOF anyway
        pass
