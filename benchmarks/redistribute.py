"""4. Redistribute: S(0)->R, P->R, S(0)->S(1) and P->S(0) of a square float32 matrix, against
the raw Gloo collective (all_gather / all_reduce / all_to_all / reduce_scatter) moving the same
bytes on buffers allocated once.

A sample is a burst of `suite.redistribute_burst` redistributes issued back to back, then one
`dtorch.synchronize()`, divided by the burst: what a redistribute costs in a program, where the
controller runs ahead of the workers. The reference is the same burst of raw collectives between
two barriers. The note gives the latency of ONE redistribute timed to the return of
`synchronize()` against one raw collective: that adds a controller round trip (see the fetch
benchmark for that cost alone), which dominates at small sizes.

P->R is measured twice: on a temporary (`(a @ b).redistribute(...)`: the workers reduce it in
place, see kernels.apply_steps) and on a source the program keeps (it is copied first).
"""
from __future__ import annotations

from typing import NamedTuple

from . import dtorch_session
from .gloo_collectives import collective_seconds, square_side
from .timing import Row, failed, guarded, median, stopwatch

NAME = "redistribute"
TITLE = "4. Redistribute vs the raw Gloo collective"
DTORCH = "dtorch redistribute"


class Transition(NamedTuple):
    name: str
    collective: str
    source: str        # "S(0)" or "P"
    target: str        # "R", "S(0)" or "S(1)"
    temporary: bool    # each redistribute gets a fresh source nothing else holds


TRANSITIONS = (
    Transition("S(0)->R", "all_gather", "S(0)", "R", False),
    Transition("P->R", "all_reduce", "P", "R", True),
    Transition("P->R, source kept", "all_reduce", "P", "R", False),
    Transition("S(0)->S(1)", "all_to_all", "S(0)", "S(1)", False),
    Transition("P->S(0)", "reduce_scatter", "P", "S(0)", False),
)


def run(suite) -> list[Row]:
    rows = []
    for world in suite.redistribute_worlds:
        for transition, nbytes, raw, alone in _gloo_rows(suite, world):  # each raw row, then dtorch's
            rows += [raw, guarded(lambda: _dtorch_row(suite, transition, nbytes, world, raw, alone),
                                  NAME, raw.case, DTORCH, "redistribute")]
    return rows


def _case(transition: Transition, nbytes: int, world: int) -> str:
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    return f"{transition.name}, {size}, {world} workers"


def _gloo_variant(transition: Transition) -> str:
    return f"raw Gloo {transition.collective}"


def _gloo_rows(suite, world: int) -> list[tuple]:
    """(transition, nbytes, row, alone) for each case, all measured in one process group of
    `world` ranks: the row's samples are bursts, `alone` the single collectives' (or [])."""
    collectives = sorted({t.collective for t in TRANSITIONS})
    bursts = (1, suite.redistribute_burst)
    cases = [(c, nbytes) for c in collectives for nbytes in suite.redistribute_bytes]
    try:
        measured = collective_seconds(world, cases, suite.collective_reps, suite.process_timeout_s, bursts)
    except Exception as error:  # noqa: BLE001 -- every row of this world reports the failure
        measured = error
    rows = []
    for transition in TRANSITIONS:
        for nbytes in suite.redistribute_bytes:
            case, variant = _case(transition, nbytes, world), _gloo_variant(transition)
            if isinstance(measured, Exception):
                row, alone = failed(NAME, case, variant, "redistribute", measured), []
            else:
                alone = measured[(transition.collective, nbytes, 1)]
                row = Row(NAME, case, variant, "redistribute", measured[(transition.collective, nbytes, bursts[1])],
                          note=f"one alone: {_ms(median(alone))}")
            rows.append((transition, nbytes, row, alone))
    return rows


def _dtorch_row(suite, transition: Transition, nbytes: int, world: int, raw: Row, raw_alone: list) -> Row:
    import dtorch
    mesh = dtorch_session.mesh((world,), ("dp",))
    make_source, target = _source_and_target(transition, square_side(nbytes), mesh)
    kept = None if transition.temporary else make_source()
    burst, alone, samples = suite.redistribute_burst, [], []
    for _ in range(suite.collective_reps + 1):   # the first of each is a warm-up
        alone.append(_redistribute_burst(dtorch, make_source, kept, target, 1))
        samples.append(_redistribute_burst(dtorch, make_source, kept, target, burst))
    alone, samples = alone[1:], samples[1:]
    note = f"one alone + synchronize: {_ms(median(alone))}"
    if raw_alone:
        note += f" = {median(alone) / median(raw_alone):.2f}x one raw"
    return Row(NAME, raw.case, DTORCH, "redistribute", samples, reference=(raw.case, raw.variant), note=note)


def _source_and_target(transition: Transition, side: int, mesh):
    import dtorch
    from dtorch.spec.placements import Partial, Replicate, Shard
    placement = {"P": Partial(), "R": Replicate(), "S(0)": Shard(0), "S(1)": Shard(1)}
    source = placement[transition.source]
    return (lambda: dtorch.ones(side, side, device_mesh=mesh, placements=[source])), [placement[transition.target]]


def _redistribute_burst(dtorch, make_source, kept, target, burst: int) -> float:
    """Seconds per redistribute of `burst` issued back to back, then one synchronize. Without
    `kept`, each one's source is a fresh temporary (popped from a list: nothing else holds it)."""
    sources = [make_source() for _ in range(burst)] if kept is None else None
    dtorch.synchronize()
    elapsed = stopwatch()
    if kept is None:
        results = [sources.pop().redistribute(placements=target) for _ in range(burst)]
    else:
        results = [kept.redistribute(placements=target) for _ in range(burst)]
    dtorch.synchronize()
    seconds = elapsed() / burst
    del results
    return seconds


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
