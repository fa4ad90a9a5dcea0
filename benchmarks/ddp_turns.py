"""torch DDP's training step on N Gloo processes that stay alive beside a dtorch session and run
their steps only when asked, so that a dtorch row and its DDP reference are measured in turns.

Measured one after the other, the two sides see different machines: on a shared VM the host's
steal comes and goes within seconds, and benchmark 10 once read dp4 at 0.83x and at 1.31x DDP on
the same day. In turns (a few dtorch steps, the same number of DDP steps, again), a slow spell
weighs on both. While one side runs, the other waits blocked (the ranks in a broadcast, the
workers on their sockets) and uses no CPU.
"""
from __future__ import annotations

import gc
import multiprocessing
import threading
import time

from .local_ranks import run_ranks
from .process_memory import peak_mib, reset_peak, rss_mib
from .steal import Meter

__all__ = ["DdpTurns", "Turn"]


class Turn:
    """One turn of one optimizer: per-step wall times of the slowest rank, each rank's CPU per step
    (user, system), the host's steal over the turn (None: not measured), each rank's peak RSS."""

    def __init__(self, rows: list) -> None:   # rows: per rank [walls..., user, system, steal, peak MiB]
        self.walls = [max(step) for step in zip(*(row[:-4] for row in rows))]
        self.cpu = [(row[-4], row[-3]) for row in rows]
        self.steal = None if rows[0][-2] < 0 else rows[0][-2]
        self.peak_mib = [row[-1] for row in rows]


class DdpTurns:
    """DistributedDataParallel(transformers' LlamaForCausalLM) on `world` ranks, each a 1/world share
    of `ids`, with one torch.optim.AdamW per entry of `fused` (False: torch's default, True: fused),
    and with `compile_backend` a second model, torch.compile(DDP(model), backend=compile_backend),
    with torch's default AdamW. `turn(steps)` runs `steps` steps with each optimizer, then with the
    compiled model, and returns a Turn for each in that order (the first turn's compiled steps
    include its compile: cold, each rank on an empty TORCHINDUCTOR_CACHE_DIR of its own)."""

    def __init__(self, fields: dict, ids, world: int, fused: tuple = (False,), timeout_s: float = 1800,
                 compile_backend: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._orders, self._done, self._failure = context.Queue(), context.Queue(), None
        self._thread = threading.Thread(target=self._run, args=(fields, ids, world, fused, compile_backend, timeout_s),
                                        daemon=True)
        self._thread.start()
        self.idle_mib = [row[0] for row in self._wait()[0]]   # each rank's resident set before its model

    def _run(self, fields, ids, world, fused, compile_backend, timeout_s) -> None:
        try:
            run_ranks(_rank, world, (fields, ids, fused, compile_backend, self._orders, self._done), timeout_s)
        except Exception as error:  # noqa: BLE001 -- raised in the caller's thread at its next turn
            self._failure = error
            self._done.put(None)

    def turn(self, steps: int, warmup: bool = False) -> list[Turn]:
        """`steps` steps with each optimizer in turn; `warmup`: the peak-memory mark is reset after."""
        self._orders.put((steps, int(warmup)))
        return [Turn(rows) for rows in self._wait()]

    def _wait(self):
        result = self._done.get(timeout=900)
        if result is None:
            raise RuntimeError(f"the DDP ranks failed: {self._failure}")
        return result

    def close(self) -> None:
        self._orders.put((0, 0))
        self._thread.join(timeout=60)


def _rank(rank: int, world: int, fields: dict, ids, fused: tuple, compile_backend: str | None, orders, done) -> None:
    """Rank 0 takes each order (steps, warm-up) from the parent and broadcasts it; every rank's
    measurements are gathered to rank 0, which hands them back."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    from .train_baselines import _ddp, tiny_fields
    own = ids.chunk(world)[rank]
    tiny = tiny_fields(fields)   # trained first, as train_baselines does: what a process loads on
    warm = _ddp(tiny)            # its first step is not counted as the model's memory
    _steps(warm, torch.optim.AdamW(warm.parameters(), lr=1e-3), own.remainder(tiny["vocab_size"]), 2)
    del warm
    gc.collect()
    idle = torch.tensor([rss_mib()], dtype=torch.float64)
    model = _ddp(fields)
    steppers = [(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=f)) for f in fused]
    if compile_backend:   # cold: a fresh folder per rank, so that nothing else's kernels answer
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ddp-turns-inductor-rank{rank}-")
        second = _ddp(fields)
        steppers.append((torch.compile(second, backend=compile_backend),
                         torch.optim.AdamW(second.parameters(), lr=1e-3)))
    _gathered_to_rank_0([idle.reshape(1, 1)], world, rank, done)
    while True:
        order = torch.tensor(orders.get() if rank == 0 else (0, 0))
        dist.broadcast(order, 0)
        steps, warmup = order.tolist()
        if steps == 0:
            return
        measured = [_steps(stepped, optimizer, own, steps) for stepped, optimizer in steppers]
        if warmup:
            reset_peak()
        _gathered_to_rank_0([torch.tensor(m, dtype=torch.float64).reshape(1, -1) for m in measured], world, rank, done)


def _gathered_to_rank_0(mine: list, world: int, rank: int, done) -> None:
    """Each of this rank's (1, n) rows gathered over the ranks; rank 0 puts [[row per rank] per row]."""
    import torch
    import torch.distributed as dist
    stacked = torch.cat(mine)
    every = [torch.zeros_like(stacked) for _ in range(world)]
    dist.all_gather(every, stacked)
    if rank == 0:
        done.put([[every[r][k].tolist() for r in range(world)] for k in range(len(mine))])


def _steps(model, optimizer, ids, steps: int) -> list:
    """[wall of each step..., user, system per step, steal (-1: not measured), peak RSS MiB]."""
    import os

    import torch.distributed as dist
    walls, meter = [], Meter()
    before = os.times()
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        walls.append(time.perf_counter() - start)
    after, stolen = os.times(), meter.share()
    return walls + [(after.user - before.user) / steps, (after.system - before.system) / steps,
                    -1.0 if stolen is None else stolen, peak_mib()]
