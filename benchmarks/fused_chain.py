"""The (64, 128) chain (benchmarks/chain.py: `z = z * 1.0001 + 1`, OPS ops) end to end, fused by
dtorch.compile(fn, backend="inductor") on 1 and 4 workers, against torch eager and torch.compile
of the same chain in this one process; and the first call's compile time, cold (an empty
TORCHINDUCTOR_CACHE_DIR) and warm (a new session on the same directory: new processes).

    python -m benchmarks.fused_chain [--ops 100] [--calls 200] [--workers 1 4] [--smoke]
    python -m benchmarks --only fused_chain     (the same rows in the suite: fused_chain_suite.py)

A step is one call of the chain on the output of the last, timed over `calls` calls through the
final read (so a dtorch call's issue, the workers' run and the read all count), per call; the
rows take turns in each round, and torch's rows are timed just before and just after each worker
count's two sessions (with no session open: see reference_rows). The first replay compiles (the
first call captures, running the chain eagerly): its time is "first fused replay". Prints one
line per row; the machine's load moves every figure.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from .chain import run_chain

SHAPE = (64, 128)
TORCH_EAGER, TORCH_COMPILE = "torch eager", "torch.compile, 1 process"


def _per_call(step, z, calls: int, read) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        z = step(z)
    read(z)
    return (time.perf_counter() - started) / calls


def torch_steps(ops: int) -> tuple[dict, float]:
    """({name: (step, its input, its read)} for torch eager and torch.compile here, the seconds
    torch.compile's first call took)."""
    import torch   # here: the suite imports every benchmark module, and its helper processes too
    chain = lambda z: run_chain(z, ops)   # noqa: E731
    z = torch.zeros(SHAPE)
    compiled = torch.compile(chain, backend="inductor", dynamic=False)
    started = time.perf_counter()
    compiled(z)
    first = time.perf_counter() - started
    read = lambda r: r.sum().item()   # noqa: E731
    return {"torch eager": (chain, z, read), "torch.compile, 1 process": (compiled, z, read)}, first


def reference_rows(reference: dict, calls: int, rounds: int) -> dict:
    """Per call ({name: one sample per round}, in turns) of each torch row, with no session open:
    an idle worker's OpenMP threads spin for a while after each fused kernel, which slowed this
    process's own OpenMP loops (torch.compile's) by up to 100x while a session was open."""
    samples: dict = {name: [] for name in reference}
    for _ in range(rounds):
        for name, (step, start, finish) in reference.items():
            samples[name].append(_per_call(step, start, calls, finish))
    return samples


def session_rows(workers: int, ops: int, calls: int, rounds: int) -> dict:
    """In a fresh session of `workers` workers: the first fused replay's seconds ("first"), and per
    call (one sample per round, the rows taking turns in each round) fused and replayed (the
    default backend)."""
    import torch
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
        replayed = dtorch.compile(lambda z: run_chain(z, ops))   # the default: the rows, one by one
        replayed(z).to_torch()
        read = lambda r: r.to_torch()   # noqa: E731
        steps = {"fused": (fused, z, read), "replay": (replayed, z, read)}
        samples: dict = {name: [] for name in steps}
        for _ in range(rounds):
            for name, (step, start, finish) in steps.items():
                samples[name].append(_per_call(step, start, calls, finish))
        return {"first": first, **samples}
    finally:
        dtorch.shutdown()


def measure(ops: int, calls: int, rounds: int, worlds, cold_caches: bool) -> tuple[dict, dict]:
    """({"torch.compile first": seconds, name: samples per round for torch's rows}, {workers:
    (cold session, warm session)}): each worker count's pair of sessions between two turns of
    torch's rows. cold_caches: each its own empty TORCHINDUCTOR_CACHE_DIR (else the host's, warm
    after a first run: the smoke suite's)."""
    with tempfile.TemporaryDirectory(prefix="dtorch-fused-chain-") as caches:
        def use_cache(name: str) -> None:
            if cold_caches:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, name)
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        try:
            use_cache("torch")
            reference, torch_first = torch_steps(ops)
            torch_rows: dict = {"torch.compile first": torch_first, **{name: [] for name in reference}}
            sessions = {}
            for workers in worlds:   # each count its own empty directory, which its workers inherit
                use_cache(f"dtorch{workers}")
                for name, values in reference_rows(reference, calls, rounds).items():
                    torch_rows[name] += values
                cold, warm = session_rows(workers, ops, calls, rounds), session_rows(workers, ops, calls, rounds)
                sessions[workers] = (cold, warm)
                for name, values in reference_rows(reference, calls, rounds).items():
                    torch_rows[name] += values
        finally:
            if cold_caches:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
                if before is not None:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    return torch_rows, sessions


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
    import torch
    torch_rows, sessions = measure(args.ops, args.calls, args.rounds, args.workers, cold_caches=not args.smoke)
    print(f"chain of {args.ops} ops on {SHAPE}, per call over {args.calls} calls (best of {args.rounds} "
          f"rounds, rows in turns); torch threads here: {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    print(f"  {'torch.compile first call (cold)':<34} {torch_rows['torch.compile first']:9.2f} s")
    for turn, (workers, (cold, warm)) in enumerate(sessions.items()):
        # torch's rounds before this count's sessions, and after them
        before = {name: min(torch_rows[name][2 * turn * args.rounds:(2 * turn + 1) * args.rounds])
                  for name in (TORCH_EAGER, TORCH_COMPILE)}
        after = {name: min(torch_rows[name][(2 * turn + 1) * args.rounds:(2 * turn + 2) * args.rounds])
                 for name in (TORCH_EAGER, TORCH_COMPILE)}
        best = lambda found: {k: (min(v) if type(v) is list else v) for k, v in found.items()}   # noqa: E731
        _print(workers, {**before, **best(cold)}, {**after, **best(warm)})


def _print(workers: int, cold: dict, warm: dict) -> None:
    """The warm session's rows (the cold one's in brackets; torch's: timed after both sessions,
    and before them in brackets), and both first replays."""
    def row(name: str, label: str, ratios: bool) -> None:
        text = f"  {label:<34} {warm[name] * 1e6:9.1f} us ({cold[name] * 1e6:.1f})"
        if ratios:
            text += (f"   {warm[name] / warm['torch.compile, 1 process']:.2f}x torch.compile "
                     f"({cold[name] / cold['torch.compile, 1 process']:.2f}), "
                     f"{warm[name] / warm['torch eager']:.2f}x eager ({cold[name] / cold['torch eager']:.2f})")
        print(text)
    print(f"{workers} worker(s), load {os.getloadavg()[0]:.1f}:")
    row("torch eager", "torch eager", False)
    row("torch.compile, 1 process", "torch.compile, 1 process", False)
    row("fused", f"dtorch fused, {workers} worker(s)", True)
    row("replay", f"dtorch replay, {workers} worker(s)", True)
    print(f"  {'first fused replay (compiles)':<34} cold {cold['first']:.2f} s, warm {warm['first']:.2f} s")

if __name__ == "__main__":
    main()
