"""Two worker settings side by side on 16 MiB redistributes, alternated in fresh pools so that
a drifting load touches both alike (benchmark 4 divides by a raw Gloo run measured apart, whose
own swing hides a 15% change). By default: workers keeping freed blocks
(worker_process.KEEP_FREED_MIB) against glibc's defaults (DTORCH_KEEP_FREED_MIB=0). For a
change in code, run it on the commit before and after.

    python -m benchmarks.redistribute_ab [--workers 2] [--rounds 3] [--bursts 25]
                                         [--setting NAME=VALUE ...]  (each --setting is one column)

Per round and setting: a pool of `--workers`, a 16 MiB float32 matrix sharded S(0), then
bursts of 4 redistributes to S(1) and to R, each burst timed to `dtorch.synchronize()`; the
median per redistribute, and each worker's minor page faults per burst (pages touched for the
first time: what keeping freed blocks saves).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SIDE = 2048   # 16 MiB of float32
BURST = 4
DEFAULT_SETTINGS = ("DTORCH_KEEP_FREED_MIB=0", "")   # "" = the environment as it is


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def measure(workers: int, bursts: int) -> dict:
    """{target placement: (seconds per redistribute, faults per burst per worker)} in a fresh pool."""
    import dtorch
    from dtorch.distributed_spec import Replicate, Shard, init_device_mesh
    dtorch.init(num_workers=workers)
    try:
        mesh = init_device_mesh("cpu", (workers,))
        pids = [w["pid"] for w in dtorch.workers()]
        source = dtorch.ones(SIDE, SIDE, device_mesh=mesh, placements=[Shard(0)])
        results = {}
        for name, target in (("S(0)->S(1)", Shard(1)), ("S(0)->R", Replicate())):
            def burst() -> float:
                start = time.perf_counter()
                outputs = [source.redistribute(placements=[target]) for _ in range(BURST)]
                dtorch.synchronize()
                seconds = (time.perf_counter() - start) / BURST
                del outputs
                return seconds
            for _ in range(3):   # warm-up
                burst()
            before = [_minor_faults(p) for p in pids]
            seconds = statistics.median(burst() for _ in range(bursts))
            faults = [(_minor_faults(p) - b) / bursts for p, b in zip(pids, before)]
            results[name] = (seconds, statistics.mean(faults))
        return results
    finally:
        dtorch.shutdown()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redistribute_ab", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=25)
    parser.add_argument("--setting", action="append", help="NAME=VALUE for the workers' environment, or ''")
    args = parser.parse_args(argv)
    settings, original = args.setting or DEFAULT_SETTINGS, dict(os.environ)
    print(f"{args.workers} workers, 16 MiB, bursts of {BURST}: ms per redistribute (faults per burst per worker)")
    for round_ in range(args.rounds):
        for setting in settings:
            os.environ.clear()
            os.environ.update(original)
            if setting:
                name, value = setting.split("=", 1)
                os.environ[name] = value
            cells = [f"{case} {s * 1e3:.2f} ms ({f:.0f})" for case, (s, f) in measure(args.workers, args.bursts).items()]
            print(f"round {round_ + 1}, {setting or '(as is)':24s}", " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
