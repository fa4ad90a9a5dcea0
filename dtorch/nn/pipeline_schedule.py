"""Pipeline schedules: GPipe, and one forward, one backward (1F1B): the pipeline schedule that keeps
at most (stages - s) microbatches' activations alive on stage s, where GPipe (all forwards, then
all backwards) keeps all of them.

The single controller needs no scheduler on the workers: each stage's workers run their own
commands in the order the controller issues them. So the schedule is only an ORDER in which the
controller issues every microbatch's per-stage forward and per-stage backward: each stage's
subsequence is its 1F1B order (warm-up forwards, then alternating, then the cool-down backwards),
merged so that no step is issued before the steps it depends on (the previous stage's forward
of the same microbatch, the next stage's backward of it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from ..autograd import backward_stages

__all__ = ["run_schedule", "stage_orders", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")


def stage_orders(stages: int, microbatches: int, schedule: str = "1f1b") -> list[list[tuple[str, int]]]:
    """Each stage's order of ("F", k) / ("B", k) actions: 1F1B, or GPipe (every forward, then
    every backward; unlike `loss.backward()` on the summed loss, each microbatch's backward is its
    own command per stage, so stage s-1 starts on microbatch k while stage s does k+1)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    orders = []
    for stage in range(stages):
        warmup = microbatches if schedule == "gpipe" else min(stages - 1 - stage, microbatches)
        forwards, backwards = iter(range(microbatches)), iter(range(microbatches))
        order = [("F", next(forwards)) for _ in range(warmup)]
        for _ in range(microbatches - warmup):
            order += [("F", next(forwards)), ("B", next(backwards))]
        order += [("B", k) for k in backwards]
        orders.append(order)
    return orders


def run_schedule(stages: int, forwards: list[Iterator], finish: Callable, schedule: str = "1f1b") -> list:
    """Run the microbatches' forwards and backwards in `schedule`'s order. `forwards[k]` is a
    generator that issues microbatch k's forward one stage per next() and, after the last stage,
    returns (StopIteration.value) what `finish(k, value)` turns into the scalar to differentiate.
    Returns those scalars."""
    orders, done = stage_orders(stages, len(forwards), schedule), set()
    losses, backwards = [None] * len(forwards), {}
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for stage in range(stages):
            if position[stage] == len(orders[stage]):
                continue
            kind, k = orders[stage][position[stage]]
            if not _ready(kind, k, stage, stages, done):
                continue
            if kind == "F":
                try:
                    next(forwards[k])
                except StopIteration as end:
                    losses[k] = finish(k, end.value)
                    backwards[k] = backward_stages(losses[k])
            else:
                next(backwards[k])   # this stage's Backward of microbatch k (last stage first)
                if stage == stages - 1:   # its loss's graph goes now: each stage's part of
                    losses[k] = losses[k].detach()   # microbatch k is freed after its backward
            done.add((kind, k, stage))
            position[stage] += 1
            progressed = True
        if not progressed:   # the orders above never get here; a guard against a bad edit
            raise RuntimeError("1F1B schedule: no stage can proceed")
    return losses


def _ready(kind: str, k: int, stage: int, stages: int, done: set) -> bool:
    if kind == "F":
        return stage == 0 or ("F", k, stage - 1) in done
    if stage == stages - 1:
        return ("F", k, stage) in done
    return ("B", k, stage + 1) in done
