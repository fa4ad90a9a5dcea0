"""4. Redistribute: S(0)->R, P->R and S(0)->S(1) of a square float32 matrix, against the raw Gloo
collective (all_gather / all_reduce / all_to_all) moving the same bytes.

dtorch is timed from issuing `redistribute` to the return of `dtorch.synchronize()`, so its
number includes one controller round trip (see the fetch benchmark for that cost alone).
"""
from __future__ import annotations

from . import dtorch_session
from .gloo_collectives import COLLECTIVES, collective_seconds, square_side
from .timing import Row, failed, guarded, stopwatch

NAME = "redistribute"
TITLE = "4. Redistribute vs the raw Gloo collective"
DTORCH = "dtorch redistribute + synchronize"


def run(suite) -> list[Row]:
    rows = []
    for world in suite.redistribute_worlds:
        for transition, nbytes, raw in _gloo_rows(suite, world):  # each raw row, then dtorch's
            rows += [raw, guarded(lambda: _dtorch_row(suite, transition, nbytes, world),
                                  NAME, raw.case, DTORCH, "redistribute")]
    return rows


def _case(transition: str, nbytes: int, world: int) -> str:
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    return f"{transition}, {size}, {world} workers"


def _gloo_variant(transition: str) -> str:
    return f"raw Gloo {COLLECTIVES[transition]}"


def _gloo_rows(suite, world: int) -> list[tuple[str, int, Row]]:
    """(transition, nbytes, row) for each case, all measured in one process group of `world` ranks."""
    cases = [(COLLECTIVES[t], nbytes) for t in COLLECTIVES for nbytes in suite.redistribute_bytes]
    try:
        measured = collective_seconds(world, cases, suite.collective_reps, suite.process_timeout_s)
    except Exception as error:  # noqa: BLE001 -- every row of this world reports the failure
        measured = error
    rows = []
    for transition in COLLECTIVES:
        for nbytes in suite.redistribute_bytes:
            case, variant = _case(transition, nbytes, world), _gloo_variant(transition)
            row = (failed(NAME, case, variant, "redistribute", measured) if isinstance(measured, Exception)
                   else Row(NAME, case, variant, "redistribute", measured[(COLLECTIVES[transition], nbytes)]))
            rows.append((transition, nbytes, row))
    return rows


def _dtorch_row(suite, transition: str, nbytes: int, world: int) -> Row:
    import dtorch
    mesh = dtorch_session.mesh((world,), ("dp",))
    source, target = _source_and_target(transition, square_side(nbytes), mesh)
    dtorch.synchronize()
    samples = [_redistribute_once(dtorch, source, target) for _ in range(suite.collective_reps + 1)][1:]
    case = _case(transition, nbytes, world)
    return Row(NAME, case, DTORCH, "redistribute", samples, reference=(case, _gloo_variant(transition)))


def _source_and_target(transition: str, side: int, mesh):
    import dtorch
    from dtorch.distributed_spec import Partial, Replicate, Shard
    if transition == "P->R":
        return dtorch.randn(side, side, device_mesh=mesh, placements=[Partial()]), [Replicate()]
    source = dtorch.randn(side, side, device_mesh=mesh, placements=[Shard(0)])
    return source, [Replicate()] if transition == "S(0)->R" else [Shard(1)]


def _redistribute_once(dtorch, source, target) -> float:
    elapsed = stopwatch()
    result = source.redistribute(placements=target)
    dtorch.synchronize()
    seconds = elapsed()
    del result
    return seconds
