"""What dtorch.profile costs: the dispatch chain (benchmark 1) with profiling off and on.

    python -m benchmarks.profile_overhead [--ops 4000] [--reps 7]

Per op, median of the repetitions, alternating off and on so that load on a shared machine
hits both alike: the user thread's issuing time (what benchmark 1 reports) and the time until
every worker has run the chain (issue + synchronize), plus what ending a profile of that chain
costs (clock pings, collecting the workers' rows, building the trace). With profiling off the
only cost is one attribute check per hooked call and per worker command; compare the "off"
rows with benchmark 1 before and after the profiler landed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from . import dtorch_session
from .chain import run_chain
from .dispatch import WORKERS

SHAPE = (64, 128)


def one_chain(mesh, ops: int, profiled: bool) -> tuple[float, float, float]:
    """(issue s/op, issue-to-synchronized s/op, seconds to end the profile) for one chain."""
    import dtorch
    from dtorch.spec.placements import Shard
    z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize(timeout=120)
    recording = dtorch.profile() if profiled else None
    if recording is not None:
        recording.__enter__()
    started = time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    dtorch.synchronize(timeout=120)
    done = time.perf_counter()
    if recording is not None:
        recording.__exit__(None, None, None)
    ended = time.perf_counter()
    return (issued - started) / ops, (done - started) / ops, ended - done


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_overhead", description=__doc__)
    parser.add_argument("--ops", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        mesh = dtorch_session.mesh((WORKERS,), ("dp",))
        one_chain(mesh, 1000, False)   # plans cached, workers warm
        one_chain(mesh, 1000, True)
        samples = {False: [], True: []}
        for _ in range(args.reps):
            for profiled in (False, True):
                samples[profiled].append(one_chain(mesh, args.ops, profiled))
    finally:
        dtorch_session.close()
    print(f"dispatch chain, {args.ops} ops on {SHAPE}, {WORKERS} workers, median of {args.reps}")
    print(f"{'profiling':<10} {'issue us/op':>12} {'to synchronized us/op':>22} {'ending the profile s':>21}")
    for profiled in (False, True):
        issue, total, ending = (statistics.median(column) for column in zip(*samples[profiled]))
        print(f"{'on' if profiled else 'off':<10} {issue * 1e6:>12.1f} {total * 1e6:>22.1f} "
              f"{ending if profiled else 0.0:>21.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
