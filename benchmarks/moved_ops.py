"""Ops whose input the planner moves, for A/B runs of two checkouts: the issuing thread's CPU per
op, and the workers' peak memory over a chain of large temporaries.

    PYTHONPATH=<checkout> python benchmarks/moved_ops.py [--reps 7] [--ops 200] [--layers 12]

Rows:
- `x + y` on a (64, 128) float32 tensor, x S(0) and y S(1) on 4 workers: each call moves y to
  S(0) (an all-to-all). The issuing thread's CPU per op (time.thread_time), and the wall time per
  op to `synchronize()`, which the all-to-all dominates on a 2-core machine. Min and median over
  repetitions.
- `layers` times `h = (h @ w).tanh()` with h a (1024, 1024) float32 Replicate tensor and each w
  a (1024, 1024) S(0) weight: the matmul yields P(sum) and each tanh moves it to R (an
  all-reduce). The peak resident set above idle of the largest worker (VmHWM after resetting it
  through /proc/PID/clear_refs), with every worker on MALLOC_MMAP_THRESHOLD_=131072 from its
  start, so that a freed buffer leaves the resident set (as benchmark 10 runs them).

A standalone script (no relative imports), like issue_cpu.py: one copy measures either checkout,
and its workers import the controller's code. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

SIDE = 1024


def per_op(dtorch, mesh, ops: int, reps: int) -> tuple[list, list]:
    """(CPU seconds per op, wall seconds per op) of each repetition after a warm-up."""
    from dtorch.spec.placements import Shard
    x = dtorch.randn(64, 128, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.randn(64, 128, device_mesh=mesh, placements=[Shard(1)])
    cpu, wall = [], []
    for _ in range(reps + 1):   # the first warms the plan cache
        dtorch.synchronize()
        started, started_cpu = time.perf_counter(), time.thread_time()
        for _ in range(ops):
            z = x + y
        cpu.append((time.thread_time() - started_cpu) / ops)
        dtorch.synchronize()
        wall.append((time.perf_counter() - started) / ops)
    del z
    return cpu[1:], wall[1:]


def peak_above_idle_mib(dtorch, mesh, layers: int) -> float:
    from dtorch.spec.placements import Replicate, Shard
    pids = [w["pid"] for w in dtorch.workers()]
    weights = [dtorch.randn(SIDE, SIDE, device_mesh=mesh, placements=[Shard(0)]) for _ in range(layers)]
    h = dtorch.randn(SIDE, SIDE, device_mesh=mesh, placements=[Replicate()])
    dtorch.synchronize()
    for pid in pids:   # "5": reset the peak resident set to the current one
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")
    idle = max(_status_kib(pid, "VmRSS") for pid in pids)
    for w in weights:
        h = (h @ w).tanh()
    dtorch.synchronize()
    return (max(_status_kib(pid, "VmHWM") for pid in pids) - idle) / 1024


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"   # before the workers start: glibc reads it once
    import dtorch
    from dtorch.spec.placements import init_device_mesh
    dtorch.init(num_workers=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        where = dtorch.__file__.rsplit("/dtorch/", 1)[0]
        cpu, wall = per_op(dtorch, mesh, args.ops, args.reps)
        print(f"{where}  x + y, y moved S(1) -> S(0), (64, 128) on 4 workers: issuing CPU us/op min "
              f"{min(cpu) * 1e6:.1f} median {statistics.median(cpu) * 1e6:.1f}; wall us/op median "
              f"{statistics.median(wall) * 1e6:.0f}")
        peak = peak_above_idle_mib(dtorch, mesh, args.layers)
        print(f"{where}  {args.layers} layers h = (h @ w).tanh(), ({SIDE}, {SIDE}) float32: peak worker memory "
              f"above idle {peak:.1f} MiB")
    finally:
        dtorch.shutdown()


if __name__ == "__main__":
    main()
