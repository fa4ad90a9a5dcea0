"""1. Dispatch cost per op: the time the user's thread spends issuing one small elementwise op.

Only the issuing loop is timed, not the final read: this is the price of the single-controller
model on the user's critical path. The floor is the same chain on a local torch tensor. The
compiled row issues the same ops as replays of a dtorch.compile'd 100-op function (one RunGraph
command per call; goal: at most 0.25x torch eager per op).
"""
from __future__ import annotations

import time

from . import dtorch_session
from .chain import seconds_per_op, torch_eager_per_op
from .timing import Row, guarded, median, repeat

NAME = "dispatch"
TITLE = "1. Dispatch cost per op (issuing loop only)"
WORKERS = 4
EAGER = "torch eager (local)"
DTORCH = f"dtorch S(0), {WORKERS} workers"
COMPILED_OPS = 100
COMPILED = f"dtorch.compile replay of a {COMPILED_OPS}-op function, {WORKERS} workers"


def run(suite) -> list[Row]:
    rows = []
    for shape in suite.chain_shapes:
        case = str(tuple(shape))
        rows.append(guarded(lambda: _eager_row(suite, shape, case), NAME, case, EAGER, "op"))
        rows.append(guarded(lambda: _dtorch_row(suite, shape, case), NAME, case, DTORCH, "op"))
        rows.append(guarded(lambda: _compiled_row(suite, shape, case), NAME, case, COMPILED, "op"))
    return rows


def _eager_row(suite, shape, case: str) -> Row:
    samples = repeat(lambda: torch_eager_per_op(shape, suite.chain_ops), suite.reps)
    return Row(NAME, case, EAGER, "op", samples)


def _dtorch_row(suite, shape, case: str) -> Row:
    mesh = dtorch_session.mesh((WORKERS,), ("dp",))
    before = dtorch_session.traffic()
    cpu: list[float] = []
    samples = repeat(lambda: issue_chain_once(mesh, shape, suite.chain_ops, cpu), suite.reps)
    after = dtorch_session.traffic()
    note = dtorch_session.traffic_note(before, after, suite.chain_ops * (suite.reps + 1))
    # The workers share this machine's cores with the issuing thread, so the wall time above
    # includes time the thread spent preempted; its own CPU time is the issuing cost alone.
    note += f"; issuing thread's CPU: {median(cpu[1:]) * 1e6:.3g} us/op"
    return Row(NAME, case, DTORCH, "op", samples, reference=(case, EAGER), note=note)


def issue_chain_once(mesh, shape, ops: int, cpu: list | None = None) -> float:
    """Seconds per op to issue the chain, starting and ending with idle workers (untimed);
    the issuing thread's CPU seconds per op go to `cpu` when given."""
    import dtorch
    from dtorch.distributed_spec import Shard
    z = dtorch.zeros(*shape, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    started = time.thread_time()
    per_op, z = seconds_per_op(z, ops)
    if cpu is not None:
        cpu.append((time.thread_time() - started) / ops)
    dtorch.synchronize()
    return per_op


def _compiled_row(suite, shape, case: str) -> Row:
    import dtorch
    from .chain import run_chain
    mesh = dtorch_session.mesh((WORKERS,), ("dp",))
    function = dtorch.compile(lambda z: run_chain(z, COMPILED_OPS))
    samples = repeat(lambda: replay_chain_once(mesh, shape, function, max(1, suite.chain_ops // COMPILED_OPS)),
                     suite.reps)
    return Row(NAME, case, COMPILED, "op", samples, reference=(case, EAGER),
               note=f"{function.captures} capture, then one command per {COMPILED_OPS} ops")


def replay_chain_once(mesh, shape, function, calls: int) -> float:
    """Seconds per op to issue `calls` replays (the first call of a fresh function captures: untimed)."""
    import dtorch
    from dtorch.distributed_spec import Shard
    from .timing import stopwatch
    z = function(dtorch.zeros(*shape, device_mesh=mesh, placements=[Shard(0)]))
    dtorch.synchronize()
    elapsed = stopwatch()
    for _ in range(calls):
        z = function(z)
    per_op = elapsed() / (calls * COMPILED_OPS)
    dtorch.synchronize()
    return per_op
