"""3. Fetch round trip: the latency of `x.to_torch()` on a small tensor that is already computed,
against a raw pyzmq DEALER/ROUTER ping-pong carrying the same 4-byte payload.

Each read gets a fresh tensor (made and synchronized outside the timer) so that a controller-
side cache could not turn the read into a no-op. It is measured on more than one world size
because a read completes only when every rank of the mesh has answered.
"""
from __future__ import annotations

from . import dtorch_session
from .timing import Row, guarded, stopwatch
from .zmq_pingpong import round_trip_seconds

NAME = "fetch"
TITLE = "3. Read of a ready (1,) float32 tensor"
CASE = "(1,) float32, 4 B"
RAW = "raw pyzmq DEALER/ROUTER (tcp loopback)"


def run(suite) -> list[Row]:
    rows = [guarded(lambda: Row(NAME, CASE, RAW, "read", round_trip_seconds(
        suite.fetch_reads, 4, suite.process_timeout_s)), NAME, CASE, RAW, "read")]
    for world in suite.fetch_worlds:
        variant = f"dtorch to_torch(), R, {world} worker{'s' if world > 1 else ''}"
        rows.append(guarded(lambda: _dtorch_row(suite, world, variant), NAME, CASE, variant, "read"))
    return rows


def _dtorch_row(suite, world: int, variant: str) -> Row:
    import dtorch
    from dtorch.distributed_spec import Replicate
    mesh = dtorch_session.mesh((world,), ("dp",))
    source = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
    samples = [_read_fresh_tensor(dtorch, source) for _ in range(suite.fetch_reads + 1)][1:]
    return Row(NAME, CASE, variant, "read", samples, reference=(CASE, RAW))


def _read_fresh_tensor(dtorch, source) -> float:
    ready = source * 1.0
    dtorch.synchronize()
    elapsed = stopwatch()
    ready.to_torch()
    return elapsed()
