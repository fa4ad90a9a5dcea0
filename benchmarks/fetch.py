"""3. Fetch round trip: the latency of `x.to_torch()` on a small tensor that is already computed,
against a raw pyzmq DEALER/ROUTER ping-pong carrying the same 4-byte payload.

Each read gets a fresh tensor (made and synchronized outside the timer) so that a controller-
side cache could not turn the read into a no-op. It is measured on more than one world size
because a read completes only when every rank of the mesh has answered.
"""
from __future__ import annotations

import contextlib
import time

from . import dtorch_session
from .timing import Row, failed, interleaved, raising, stopwatch
from .zmq_pingpong import EchoServer

NAME = "fetch"
TITLE = "3. Read of a ready (1,) float32 tensor"
CASE = "(1,) float32, 4 B"
RAW = "raw pyzmq DEALER/ROUTER (tcp loopback)"


TURNS = 5   # the reads of each variant are split into this many turns, the variants alternating


def run(suite) -> list[Row]:
    """For each world size, the raw round trip and the dtorch read take turns, a batch of reads
    each, so that a drift in this machine's speed weighs on both alike; the raw row holds every
    raw turn (taken across both world sizes' runs). Each world size has a pool of its own, as
    elsewhere (benchmarks/dtorch_session.py)."""
    turns = max(1, min(TURNS, suite.fetch_reads))
    per_turn = -(-suite.fetch_reads // turns)
    raw: list | BaseException = []
    rows = []
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(EchoServer(suite.process_timeout_s))
            raw_turn = lambda: server.round_trips(per_turn, 4)   # noqa: E731
        except Exception as error:  # noqa: BLE001 -- the raw row says why
            raw_turn = raising(error)
        for world in suite.fetch_worlds:
            variant = f"dtorch to_torch(), R, {world} worker{'s' if world > 1 else ''}"
            measures = {variant: _dtorch_reads(world, per_turn)}
            if not isinstance(raw, BaseException):
                measures[RAW] = raw_turn
            samples = interleaved(measures, turns, warmup=0)
            if RAW in samples:
                raw = samples[RAW] if isinstance(samples[RAW], BaseException) else raw + samples[RAW]
            rows.append(_row(variant, samples[variant]))
    return [_row(RAW, raw)] + rows


def _dtorch_reads(world: int, reads: int):
    """A measurement: `reads` timed reads of fresh tensors on a `world`-worker pool (one more
    first, untimed); `raising` its error if the pool cannot start."""
    import dtorch
    from dtorch.spec.placements import Replicate
    try:
        mesh = dtorch_session.mesh((world,), ("dp",))
        source = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
    except Exception as error:  # noqa: BLE001 -- that world's row says why
        return raising(error)
    return lambda: [read_fresh_tensor(dtorch, source) for _ in range(reads + 1)][1:]


def _row(variant: str, turns) -> Row:
    if isinstance(turns, BaseException):
        return failed(NAME, CASE, variant, "read", turns)
    samples = [sample for turn in turns for sample in turn]
    return Row(NAME, CASE, variant, "read", samples, reference=None if variant == RAW else (CASE, RAW))


def read_fresh_tensor(dtorch, source, pause_s: float = 0.0) -> float:
    """Seconds to read a fresh copy of `source`, made and synchronized before the timer (then,
    with `pause_s`, the processes left idle that long: benchmarks/read_idle.py)."""
    ready = source * 1.0
    dtorch.synchronize()
    if pause_s:
        time.sleep(pause_s)
    elapsed = stopwatch()
    ready.to_torch()
    return elapsed()
