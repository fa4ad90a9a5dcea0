"""2. End-to-end: the chain from benchmark 1 including the final read, on 1, 2, 4 and 8 workers.

The controller broadcasts each command once, so its cost must stay flat as the world grows.
The note gives the controller process's CPU time per op (user thread + controller thread)
and its message count per op: both should not grow with the number of workers. Wall time may
grow a little on a 2-core machine, where 8 workers share the cores that run the controller.
"""
from __future__ import annotations

import time

from . import dtorch_session
from .chain import run_chain, torch_eager_per_op
from .timing import Row, guarded, repeat, stopwatch

NAME = "end_to_end"
TITLE = "2. End-to-end chain incl. final read, by world size"
SHAPE = (64, 128)
CASE = str(SHAPE)
EAGER = "torch eager (local)"


def run(suite) -> list[Row]:
    rows = [guarded(lambda: Row(NAME, CASE, EAGER, "op", repeat(
        lambda: torch_eager_per_op(SHAPE, suite.chain_ops), suite.reps)), NAME, CASE, EAGER, "op")]
    for world in suite.end_to_end_worlds:
        variant = f"dtorch S(0), {world} worker{'s' if world > 1 else ''}"
        rows.append(guarded(lambda: _dtorch_row(suite, world, variant), NAME, CASE, variant, "op"))
    return rows


def _dtorch_row(suite, world: int, variant: str) -> Row:
    mesh = dtorch_session.mesh((world,), ("dp",))
    cpu_seconds = []
    before = dtorch_session.traffic()
    samples = repeat(lambda: _chain_and_read(mesh, suite.chain_ops, cpu_seconds), suite.reps)
    after = dtorch_session.traffic()
    units = suite.chain_ops * (suite.reps + 1)
    cpu_note = f"controller CPU {1e6 * sorted(cpu_seconds)[len(cpu_seconds) // 2]:.1f} us/op"
    traffic = dtorch_session.traffic_note(before, after, units)
    note = "; ".join(part for part in (cpu_note, traffic) if part)
    return Row(NAME, CASE, variant, "op", samples, reference=(CASE, EAGER), note=note)


def _chain_and_read(mesh, ops: int, cpu_seconds: list) -> float:
    import dtorch
    from dtorch.distributed_spec import Shard
    z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    cpu_start, elapsed = time.process_time(), stopwatch()
    run_chain(z, ops).to_torch()
    cpu_seconds.append((time.process_time() - cpu_start) / ops)
    return elapsed() / ops
