"""2. End-to-end: the chain from benchmark 1 including the final read, on 1, 2, 4 and 8 workers.

The controller broadcasts each command once, so its cost must stay flat as the world grows.
The note gives the controller process's CPU time per op (user thread + controller thread)
and its message count per op: both should not grow with the number of workers. Wall time may
grow a little on a 2-core machine, where 8 workers share the cores that run the controller.

Each world size is compared with what a torch.distributed user would write instead (issue 14's
reference): N Gloo processes, each running the same chain on its own row block of the tensor,
then `dist.gather` of the blocks to rank 0 as the final read; the slowest rank's time. The
compiled rows run the chain as replays of a dtorch.compile'd 100-op function, then read: what
capture and replay make of the same program end to end (the dtorch rows run in turns, so a
drifting machine weighs on both alike).
"""
from __future__ import annotations

import time

from . import dtorch_session
from .chain import run_chain, torch_eager_per_op
from .dispatch import COMPILED_OPS
from .local_ranks import run_ranks
from .timing import Row, failed, guarded, interleaved, median, raising, repeat, stopwatch

NAME = "end_to_end"
TITLE = "2. End-to-end chain incl. final read, by world size"
SHAPE = (64, 128)
CASE = str(SHAPE)
EAGER = "torch eager (local)"


def run(suite) -> list[Row]:
    rows = [guarded(lambda: Row(NAME, CASE, EAGER, "op", repeat(
        lambda: torch_eager_per_op(SHAPE, suite.chain_ops), suite.reps)), NAME, CASE, EAGER, "op")]
    for world in suite.end_to_end_worlds:
        rows += _rows_for_world(suite, world)
    return rows


def _rows_for_world(suite, world: int) -> list[Row]:
    workers = f"{world} worker{'s' if world > 1 else ''}"
    spmd, eager, compiled = (f"hand-written torch.distributed, {world} proc{'s' if world > 1 else ''}",
                             f"dtorch S(0), {workers}", f"dtorch.compile replay, {workers}")
    spmd_row = guarded(lambda: Row(NAME, CASE, spmd, "op", run_ranks(
        _spmd_chain_rank, world, (suite.chain_ops, suite.reps), suite.process_timeout_s)[0]),
        NAME, CASE, spmd, "op")
    reference = (CASE, spmd) if spmd_row.status == "ok" else (CASE, EAGER)
    cpu_seconds: list[float] = []
    try:
        import dtorch
        mesh = dtorch_session.mesh((world,), ("dp",))
        function = dtorch.compile(lambda z: run_chain(z, COMPILED_OPS))
        measures = {eager: lambda: _chain_and_read(mesh, suite.chain_ops, cpu_seconds),
                    compiled: lambda: _replays_and_read(mesh, function, suite.chain_ops)}
        before = dtorch_session.traffic()
    except Exception as error:  # noqa: BLE001 -- no session: the dtorch rows say why
        measures = {eager: raising(error), compiled: raising(error)}
    samples = interleaved(measures, suite.reps)
    rows = [spmd_row]
    for variant in (eager, compiled):
        if isinstance(samples[variant], BaseException):
            rows.append(failed(NAME, CASE, variant, "op", samples[variant]))
            continue
        note = ""
        if variant == eager:
            # the compiled variant's replays add one command per 100 ops to these counters
            traffic = dtorch_session.traffic_note(before, dtorch_session.traffic(), suite.chain_ops * (suite.reps + 1))
            note = "; ".join(part for part in (f"controller CPU {median(cpu_seconds[1:]) * 1e6:.1f} us/op",
                                               traffic) if part)
        rows.append(Row(NAME, CASE, variant, "op", samples[variant], reference=reference, note=note))
    return rows


def _chain_and_read(mesh, ops: int, cpu_seconds: list) -> float:
    import dtorch
    from dtorch.spec.placements import Shard
    z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    cpu_start, elapsed = time.process_time(), stopwatch()
    run_chain(z, ops).to_torch()
    cpu_seconds.append((time.process_time() - cpu_start) / ops)
    return elapsed() / ops


def _replays_and_read(mesh, function, ops: int) -> float:
    """Seconds per op of ops / 100 replays and the final read (the first call captures: untimed)."""
    import dtorch
    from dtorch.spec.placements import Shard
    z = function(dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)]))
    dtorch.synchronize()
    calls = max(1, ops // COMPILED_OPS)
    elapsed = stopwatch()
    for _ in range(calls):
        z = function(z)
    z.to_torch()
    return elapsed() / (calls * COMPILED_OPS)


def _spmd_chain_rank(rank: int, world: int, ops: int, reps: int) -> list | None:
    """One rank of the multi-controller program: the chain on this rank's row block, then the
    blocks gathered to rank 0 and joined (the final read). Each sample is the slowest rank's."""
    import torch
    import torch.distributed as dist

    def once() -> float:
        z = torch.zeros(SHAPE[0] // world, SHAPE[1])
        dist.barrier()
        elapsed = stopwatch()
        z = run_chain(z, ops)
        blocks = [torch.empty_like(z) for _ in range(world)] if rank == 0 else None
        dist.gather(z, blocks, dst=0)
        if rank == 0:
            torch.cat(blocks)
        return elapsed() / ops

    samples = torch.tensor(repeat(once, reps), dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return samples.tolist() if rank == 0 else None
