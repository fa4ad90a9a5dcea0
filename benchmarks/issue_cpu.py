"""The issuing thread's own CPU time per small op, and a read's latency, for A/B runs of two
checkouts. Benchmark 1's wall time on a 2-core machine also counts the time the issuing thread
waits for a core while 4 workers run the chain, and this machine's speed drifts by up to 2x
within minutes; CPU time (time.thread_time) and alternated runs hold still enough to show a
10-20% change in the controller's code.

    PYTHONPATH=<checkout> python benchmarks/issue_cpu.py [--workers 1] [--reps 15]

Run it alternately with PYTHONPATH on the commit before and after a change (a `git worktree`
of each): it imports dtorch from that checkout, and its workers import the controller's code.
A standalone script (no relative imports), so that one copy measures either checkout.

Rows: `z = z * 1.0001 + 1` on a (64, 128) S(0) tensor, 4,000 ops per repetition, issued from a
short function and from a loop 300 lines into one (the controller notes each command's line:
see docs/design/architecture.md, "Enqueue"); then a read of a fresh ready (1,) Replicate tensor, median
of 300; then the CPU of one replay of a dtorch.compile'd 100-op chain (one RunGraph command and,
as a replay's batch rarely waits, one published message per call). Each prints the minimum and
median over repetitions.
"""
from __future__ import annotations

import argparse
import statistics
import time

OPS = 4_000
REPLAY_OPS = 100
FILLER_LINES = 300


def _chain_source(filler_lines: int) -> str:
    filler = "".join(f"    x{i} = {i}\n" for i in range(filler_lines))
    return ("import time\n"
            "def issue(z, ops):\n" + filler +
            "    started = time.thread_time()\n"
            "    for _ in range(ops // 2):\n"
            "        z = z * 1.0001 + 1\n"
            "    return (time.thread_time() - started) / ops, z\n")


def _issuer(filler_lines: int):
    namespace: dict = {}
    exec(compile(_chain_source(filler_lines), f"<chain, {filler_lines} lines in>", "exec"), namespace)
    return namespace["issue"]


def cpu_per_op(dtorch, mesh, issue, reps: int) -> list[float]:
    from dtorch.spec.placements import Shard
    samples = []
    for _ in range(reps + 1):   # the first warms the plan cache
        z = dtorch.zeros(64, 128, device_mesh=mesh, placements=[Shard(0)])
        dtorch.synchronize()
        seconds, z = issue(z, OPS)
        dtorch.synchronize()
        samples.append(seconds)
    return samples[1:]


def replay_cpu(dtorch, mesh, reps: int, calls: int = 2_000) -> list[float]:
    from dtorch.spec.placements import Shard

    def chain(z):
        for _ in range(REPLAY_OPS // 2):
            z = z * 1.0001 + 1
        return z
    compiled = dtorch.compile(chain)
    z = dtorch.zeros(64, 128, device_mesh=mesh, placements=[Shard(0)])
    samples = []
    for _ in range(reps + 1):   # the first captures
        dtorch.synchronize()
        started = time.thread_time()
        for _ in range(calls):
            z = compiled(z)
        samples.append((time.thread_time() - started) / calls)
    dtorch.synchronize()
    return samples[1:]


def read_latency(dtorch, mesh, reads: int = 300) -> list[float]:
    from dtorch.spec.placements import Replicate
    source = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
    samples = []
    for _ in range(reads + 1):
        ready = source * 1.0
        dtorch.synchronize()
        started = time.perf_counter()
        ready.to_torch()
        samples.append(time.perf_counter() - started)
    return samples[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    import dtorch
    from dtorch.spec.placements import init_device_mesh
    dtorch.init(num_workers=args.workers)
    try:
        mesh = init_device_mesh("cpu", (args.workers,))
        where = dtorch.__file__.rsplit("/dtorch/", 1)[0]
        for label, lines in (("short function", 0), (f"{FILLER_LINES} lines into a function", FILLER_LINES)):
            samples = cpu_per_op(dtorch, mesh, _issuer(lines), args.reps)
            print(f"{where}  {args.workers} worker(s)  issue, {label}: CPU us/op min "
                  f"{min(samples) * 1e6:.2f} median {statistics.median(samples) * 1e6:.2f}")
        samples = replay_cpu(dtorch, mesh, args.reps)
        print(f"{where}  {args.workers} worker(s)  replay of a compiled {REPLAY_OPS}-op chain: CPU us/call min "
              f"{min(samples) * 1e6:.2f} median {statistics.median(samples) * 1e6:.2f}")
        samples = read_latency(dtorch, mesh)
        print(f"{where}  {args.workers} worker(s)  read of a ready (1,) tensor: us min "
              f"{min(samples) * 1e6:.0f} median {statistics.median(samples) * 1e6:.0f}")
    finally:
        dtorch.shutdown()


if __name__ == "__main__":
    main()
