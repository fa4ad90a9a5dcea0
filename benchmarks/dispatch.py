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
from .timing import Row, failed, interleaved, median, raising

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
        rows += _rows_for_shape(suite, shape, str(tuple(shape)))
    return rows


def _rows_for_shape(suite, shape, case: str) -> list[Row]:
    """torch eager, dtorch eager and the compiled replay, one repetition of each in turn."""
    import dtorch
    from .chain import run_chain
    ops = suite.chain_ops
    cpu: list[float] = []
    measures = {EAGER: lambda: torch_eager_per_op(shape, ops)}
    try:
        mesh = dtorch_session.mesh((WORKERS,), ("dp",))
        function = dtorch.compile(lambda z: run_chain(z, COMPILED_OPS))
        measures[DTORCH] = lambda: issue_chain_once(mesh, shape, ops, cpu)
        measures[COMPILED] = lambda: replay_chain_once(mesh, shape, function, max(1, ops // COMPILED_OPS))
        before = dtorch_session.traffic()
    except Exception as error:  # noqa: BLE001 -- no session: the dtorch rows say why
        measures[DTORCH] = measures[COMPILED] = raising(error)
    samples = interleaved(measures, suite.reps)
    notes = {EAGER: ""}
    if isinstance(samples[DTORCH], list):
        # both dtorch variants ran in the same session: its traffic counters cover both (the
        # replays add one command per call, ~1% of the eager chain's)
        note = dtorch_session.traffic_note(before, dtorch_session.traffic(), ops * (suite.reps + 1))
        # The workers share this machine's cores with the issuing thread, so the wall time
        # includes time the thread spent preempted; its own CPU time is the issuing cost alone.
        notes[DTORCH] = note + f"; issuing thread's CPU: {median(cpu[1:]) * 1e6:.3g} us/op"
    if isinstance(samples[COMPILED], list):
        notes[COMPILED] = f"{function.captures} capture, then one command per {COMPILED_OPS} ops"
    return [_row(case, variant, samples[variant], notes.get(variant, "")) for variant in (EAGER, DTORCH, COMPILED)]


def _row(case: str, variant: str, samples, note: str = "") -> Row:
    if isinstance(samples, BaseException):
        return failed(NAME, case, variant, "op", samples)
    reference = None if variant == EAGER else (case, EAGER)
    return Row(NAME, case, variant, "op", samples, reference=reference, note=note)


def issue_chain_once(mesh, shape, ops: int, cpu: list | None = None) -> float:
    """Seconds per op to issue the chain, starting and ending with idle workers (untimed);
    the issuing thread's CPU seconds per op go to `cpu` when given."""
    import dtorch
    from dtorch.spec.placements import Shard
    z = dtorch.zeros(*shape, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    started = time.thread_time()
    per_op, z = seconds_per_op(z, ops)
    if cpu is not None:
        cpu.append((time.thread_time() - started) / ops)
    dtorch.synchronize()
    return per_op


def replay_chain_once(mesh, shape, function, calls: int) -> float:
    """Seconds per op to issue `calls` replays (the first call of a fresh function captures: untimed)."""
    import dtorch
    from dtorch.spec.placements import Shard
    from .timing import stopwatch
    z = function(dtorch.zeros(*shape, device_mesh=mesh, placements=[Shard(0)]))
    dtorch.synchronize()
    elapsed = stopwatch()
    for _ in range(calls):
        z = function(z)
    per_op = elapsed() / (calls * COMPILED_OPS)
    dtorch.synchronize()
    return per_op
