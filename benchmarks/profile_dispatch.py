"""Where the user thread's time goes while issuing ops (benchmark 1, steady state).

    python -m benchmarks.profile_dispatch [--ops 20000] [--top 15] [--out /tmp/dispatch.prof]

Warms the plan cache first, then runs cProfile around the issuing loop only, so one-time costs
(worker start-up, first-call shape inference) stay out of the picture. cProfile inflates every
Python call, so read the ranking and the shares, not the absolute times.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from . import dtorch_session
from .chain import run_chain
from .dispatch import WORKERS, issue_chain_once


def profile_issuing(shape: tuple, ops: int) -> cProfile.Profile:
    import dtorch
    from dtorch.spec.placements import Shard
    mesh = dtorch_session.mesh((WORKERS,), ("dp",))
    issue_chain_once(mesh, shape, 1_000)  # plans cached, workers warm
    z = dtorch.zeros(*shape, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    z = run_chain(z, ops)
    profiler.disable()
    dtorch.synchronize()
    return profiler


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_dispatch", description=__doc__)
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", help="also save the raw profile here (for snakeviz, pstats)")
    args = parser.parse_args(argv)
    try:
        profiler = profile_issuing((64, 128), args.ops)
    finally:
        dtorch_session.close()
    if args.out:
        profiler.dump_stats(args.out)
    stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
