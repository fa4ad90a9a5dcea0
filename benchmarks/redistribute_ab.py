"""Environment settings side by side on 16 MiB redistributes, alternated so that a drifting load
touches each alike. Benchmark 4 divides by a raw Gloo run measured apart, and that reference
swings by 1.3-2x between runs on a busy 2-core machine, which hides a 15% change; this script
compares absolute times of the same code under each setting instead.

    python -m benchmarks.redistribute_ab [--workers 2] [--rounds 3] [--bursts 25]
                                         [--setting NAME=VALUE ...]   (one row each; "" = as is)

By default it compares glibc's malloc defaults with a worker that keeps freed blocks
(GLIBC_TUNABLES: blocks up to 32 MiB from the heap, 256 MiB of free heap kept), the experiment
in docs/design/benchmarks.md, "Redistribute". For a change in code, run it on the commit before and
after.

Each round and setting runs in a controller process of its own, started with the setting in its
environment, so that the worker template and the workers see it from their start (glibc reads
its tunables once). It starts a pool of `--workers`, shards a 16 MiB float32 matrix S(0), then
times bursts of 4 redistributes to S(1) and to R, each burst to `dtorch.synchronize()`: the
median per redistribute, each worker's minor page faults per burst (pages the process touched
for the first time), and each worker's CPU time per redistribute (every thread: Gloo's too),
which other load on the machine inflates far less than the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from .process_memory import cpu_seconds, minor_faults

SIDE = 2048   # 16 MiB of float32
BURST = 4
DEFAULT_SETTINGS = (
    "",
    "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456",
)


def measure(workers: int, bursts: int) -> dict:
    """{case: [seconds per redistribute, faults per burst per worker]} in a fresh pool."""
    import dtorch
    from dtorch.spec.placements import Replicate, Shard, init_device_mesh
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
                dtorch.synchronize()
                return seconds
            for _ in range(3):   # warm-up
                burst()
            before = [minor_faults(p) for p in pids]
            cpu_before = [cpu_seconds(p) for p in pids]
            seconds = statistics.median(burst() for _ in range(bursts))
            faults = [(minor_faults(p) - b) / bursts for p, b in zip(pids, before)]
            cpu = [(cpu_seconds(p) - b) / bursts / BURST for p, b in zip(pids, cpu_before)]
            results[name] = [seconds, statistics.mean(faults), statistics.mean(cpu)]
        return results
    finally:
        dtorch.shutdown()


def _measure_in_process(setting: str, workers: int, bursts: int) -> dict:
    env = dict(os.environ)
    if setting:
        name, value = setting.split("=", 1)
        env[name] = value
    command = [sys.executable, "-m", "benchmarks.redistribute_ab", "--one", f"--workers={workers}",
               f"--bursts={bursts}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redistribute_ab", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=25)
    parser.add_argument("--setting", action="append", help="NAME=VALUE added to the environment, or ''")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # one measurement, as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.workers, args.bursts)))
        return 0
    print(f"{args.workers} workers, 16 MiB, bursts of {BURST}: ms per redistribute (faults per burst per worker; "
          "each worker's CPU ms per redistribute, all its threads)")
    for round_ in range(args.rounds):
        for setting in args.setting or DEFAULT_SETTINGS:
            measured = _measure_in_process(setting, args.workers, args.bursts)
            cells = [f"{case} {s * 1e3:.2f} ms ({f:.0f}; CPU {c * 1e3:.2f} ms)" for case, (s, f, c) in measured.items()]
            print(f"round {round_ + 1}, {setting or '(as is)'}:", " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
