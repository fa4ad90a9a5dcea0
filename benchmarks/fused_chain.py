"""The (64, 128) chain (benchmarks/chain.py: `z = z * 1.0001 + 1`, OPS ops) end to end, fused by
dtorch.compile(fn, backend="inductor") on 1 and 4 workers, against torch eager and torch.compile
of the same chain in this one process; and the first call's compile time, cold (an empty
TORCHINDUCTOR_CACHE_DIR) and warm (a new session on the same directory: new processes).

    python -m benchmarks.fused_chain [--ops 100] [--calls 200] [--workers 1 4] [--smoke]

A step is one call of the chain on the output of the last, timed over `calls` calls through the
final read (so a dtorch call's issue, the workers' run and the read all count), per call. The
first replay compiles (the first call captures, running the chain eagerly): its time is
"compile, first replay". Prints one line per row; the machine's load moves every figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from .chain import run_chain

SHAPE = (64, 128)


def _per_call(step, z, calls: int, read) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        z = step(z)
    read(z)
    return (time.perf_counter() - started) / calls


def torch_rows(ops: int, calls: int, rounds: int) -> dict:
    chain = lambda z: run_chain(z, ops)   # noqa: E731
    z = torch.zeros(SHAPE)
    eager = min(_per_call(chain, z, calls, lambda r: r.sum().item()) for _ in range(rounds))
    compiled = torch.compile(chain, backend="inductor", dynamic=False)
    started = time.perf_counter()
    compiled(z)
    first = time.perf_counter() - started
    fused = min(_per_call(compiled, z, calls, lambda r: r.sum().item()) for _ in range(rounds))
    return {"torch eager": eager, "torch.compile, 1 process": fused, "torch.compile first call": first}


def dtorch_rows(workers: int, ops: int, calls: int, rounds: int) -> dict:
    """Per call fused and replayed (the default backend), and the first fused replay's seconds,
    in a fresh session of `workers` workers."""
    import dtorch
    from dtorch.spec.placements import Shard, init_device_mesh
    dtorch.init(num_workers=workers)
    try:
        mesh = init_device_mesh("cpu", (workers,))
        z = dtorch.tensor(torch.zeros(SHAPE), device_mesh=mesh, placements=[Shard(0)])
        fused = dtorch.compile(lambda z: run_chain(z, ops), backend="inductor")
        fused(z).to_torch()   # the capture: eager
        started = time.perf_counter()
        fused(z).to_torch()   # the first replay: every worker compiles its run
        first = time.perf_counter() - started
        per_call = min(_per_call(fused, z, calls, lambda r: r.to_torch()) for _ in range(rounds))
        replayed = dtorch.compile(lambda z: run_chain(z, ops))   # the default: the rows, one by one
        replayed(z).to_torch()
        replay = min(_per_call(replayed, z, calls, lambda r: r.to_torch()) for _ in range(rounds))
        return {"per_call": per_call, "first": first, "replay": replay}
    finally:
        dtorch.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--smoke", action="store_true", help="a few calls, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ops, args.calls, args.rounds, args.workers = 10, 3, 1, [1]
    with tempfile.TemporaryDirectory(prefix="dtorch-fused-chain-") as caches:
        cache_for = (lambda name: os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")) if args.smoke else \
            (lambda name: os.path.join(caches, name))   # the smoke test's: the host's, warm after its first run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_for("torch")
        reference = torch_rows(args.ops, args.calls, args.rounds)
        print(f"chain of {args.ops} ops on {SHAPE}, per call over {args.calls} calls (best of {args.rounds}); "
              f"torch threads here: {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
        for name in ("torch eager", "torch.compile, 1 process"):
            print(f"  {name:<34} {reference[name] * 1e6:9.1f} us")
        print(f"  {'torch.compile first call (cold)':<34} {reference['torch.compile first call']:9.2f} s")
        for workers in args.workers:   # each count its own empty directory, which its workers inherit
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_for(f"dtorch{workers}")
            cold = dtorch_rows(workers, args.ops, args.calls, args.rounds)
            warm = dtorch_rows(workers, args.ops, args.calls, args.rounds)
            per_call = statistics.median([cold["per_call"], warm["per_call"]])
            print(f"  {f'dtorch fused, {workers} worker(s)':<34} {per_call * 1e6:9.1f} us   "
                  f"{per_call / reference['torch.compile, 1 process']:.2f}x torch.compile, "
                  f"{per_call / reference['torch eager']:.2f}x eager; first replay compiles: "
                  f"cold {cold['first']:.2f} s, warm {warm['first']:.2f} s")
            replay = statistics.median([cold["replay"], warm["replay"]])
            print(f"  {f'dtorch replay, {workers} worker(s)':<34} {replay * 1e6:9.1f} us   "
                  f"{replay / reference['torch eager']:.2f}x eager")


if __name__ == "__main__":
    main()
