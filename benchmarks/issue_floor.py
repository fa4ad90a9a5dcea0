"""How far the eager issue is from its floor: what a single controller's per-op issue costs when
it does nothing but look up a plan, number a result, append a command row and make the result
object, against torch eager on the same `z = z * 1.0001 + 1` chain (issue 14 part 2, whose goal
is 1.5x torch eager). Then, for a profiler, dtorch's own issue loop with the user thread's batch
sends timed.

    python -m benchmarks.issue_floor                      # the floor against torch eager (10 s)
    py-spy record -r 2000 -f raw -o spy.txt -- python -m benchmarks.issue_floor --dtorch-loop 25
    python -m benchmarks.issue_floor --spy-report spy.txt # share of the issue line's samples, by line

The floor keeps none of dtorch's per-op duties (autograd recording, aliasing, the user's line for
errors, the lock that lets any thread issue, batching and flushing, session and lost-worker
checks): the gap between it and dtorch is those duties, not Python itself.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import re
import statistics
import time

from .chain import run_chain, seconds_per_op, torch_eager_per_op

OPS = 20_000
ISSUE_LINE = "chain.py"   # run_chain's `z = z * 1.0001 + 1`: the frame under which issuing runs


class _FloorTensor:
    """A result symbol: an id and the spec its plan gives."""
    __slots__ = ("_id", "_spec")

    def __init__(self, tensor_id: int, spec) -> None:
        self._id, self._spec = tensor_id, spec

    def __mul__(self, other):
        return _issue("mul", self, other)

    def __add__(self, other):
        return _issue("add", self, other)


_ids = itertools.count()
_rows: list = []
_plans: dict = {}


def _issue(name: str, tensor: _FloorTensor, other) -> _FloorTensor:
    key = (name, tensor._spec, type(other))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = tensor._spec
    tensor_id = next(_ids)
    _rows.append((tensor_id, name, tensor._id, other))
    if len(_rows) >= 256:   # a batch "sent"
        _rows.clear()
    return _FloorTensor(tensor_id, plan)


def floor(rounds: int = 3, reps: int = 5) -> None:
    for _ in range(rounds):
        eager = statistics.median(torch_eager_per_op((64, 128), OPS) for _ in range(reps))
        bare = statistics.median(seconds_per_op(_FloorTensor(0, "S(0)"), OPS)[0] for _ in range(reps))
        print(f"torch eager {eager * 1e6:.2f} us/op; bare single-controller issue {bare * 1e6:.2f} us/op "
              f"= {bare / eager:.2f}x torch eager")


def dtorch_loop(seconds: float, workers: int = 4) -> None:
    """Issue the chain on `workers` workers for `seconds` (for a profiler), timing each batch the
    issuing thread publishes itself."""
    import dtorch
    from dtorch.spec.placements import Shard, init_device_mesh
    dtorch.init(num_workers=workers)
    try:
        mesh = init_device_mesh("cpu", (workers,))
        z = dtorch.zeros(64, 128, device_mesh=mesh, placements=[Shard(0)])
        dtorch.synchronize()
        sockets = z._controller.sockets   # runtime/transport.py: every batch leaves through publish()
        publish, sends = sockets.publish, []

        def timed(frames, copy=True):
            started = time.perf_counter()
            publish(frames, copy=copy)
            sends.append(time.perf_counter() - started)
        issuing, ops, end = 0.0, 0, time.monotonic() + seconds
        while time.monotonic() < end:
            sockets.publish = timed
            started = time.perf_counter()
            z = run_chain(z, 10_000)
            issuing += time.perf_counter() - started
            ops += 10_000
            del sockets.publish
            dtorch.synchronize()
        print(f"{ops} ops, {issuing / ops * 1e6:.2f} us/op issuing; the issuing thread published {len(sends)} "
              f"batches, {statistics.median(sends) * 1e6:.0f} us each (median), {sum(sends) / issuing:.1%} "
              "of the issue time")
    finally:
        dtorch.shutdown()


def spy_report(path: str, top: int = 25) -> None:
    """py-spy's raw samples under the chain's line: inclusive share by function, self share by line."""
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        starts = [i for i, frame in enumerate(frames) if ISSUE_LINE in frame and "run_chain" in frame]
        if not starts or not count.isdigit():
            continue
        below, samples = frames[starts[-1] + 1:], int(count)
        total += samples
        leaf[below[-1] if below else "(the chain line itself)"] += samples
        for function in {re.sub(r":\d+\)$", ")", frame) for frame in below}:
            inclusive[function] += samples
    print(f"{total} samples under the chain's line")
    for title, counter in (("inclusive, by function", inclusive), ("self, by line", leaf)):
        print(f"--- {title}")
        for name, samples in counter.most_common(top):
            print(f"{samples / total:6.1%}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.issue_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the floor against torch eager")
    parser.add_argument("--dtorch-loop", type=float, metavar="SECONDS", help="issue dtorch's chain this long")
    parser.add_argument("--workers", type=int, default=4, help="workers for --dtorch-loop")
    parser.add_argument("--spy-report", metavar="RAW", help="summarize `py-spy record -f raw` output")
    args = parser.parse_args()
    if args.spy_report:
        spy_report(args.spy_report)
    elif args.dtorch_loop:
        dtorch_loop(args.dtorch_loop, args.workers)
    else:
        floor(args.rounds)


if __name__ == "__main__":
    main()
