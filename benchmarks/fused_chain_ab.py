"""The fused (64, 128) chain (benchmarks/fused_chain.py) side by side on checkouts and environment
settings, alternated so that a drifting load touches each alike: for a change in the code around
a fused call (run it with the commit before and after as two checkouts), or a setting such as
OMP_WAIT_POLICY.

    python -m benchmarks.fused_chain_ab [--checkout PATH ...] [--setting NAME=VALUE ...]
                                        [--rounds 5] [--calls 200] [--ops 100] [--workers 1]

Each round runs every (checkout, setting) pair once, in turn, each in a controller process of its
own started with PYTHONPATH=<checkout> and the setting in its environment (so the worker template
and the workers see it from their start: libgomp reads OMP_WAIT_POLICY once). That process times
torch eager and torch.compile of the chain by themselves first, then opens a session of
`--workers` workers and times `dtorch.compile(chain, backend="inductor")`: per call, `--calls`
calls through the final read, `--repeats` times; and the CPU time the calling thread spent
issuing them ("issuing CPU": the controller's side of a call, batched publishes included), and,
through the final read, the CPU of the controller's whole process and of the workers' (every
thread: the loop thread, zmq's I/O threads, OpenMP's; /proc's schedstat). All
processes share one TORCHINDUCTOR_CACHE_DIR, warmed by a first run that is not counted, so each
compiles warm. Prints per pair the best and
the median over every repeat of every round, and the dtorch row over the same process's
torch.compile (best over best).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = (64, 128)
CHILD = "--child"


def child(ops: int, calls: int, repeats: int, workers: int) -> dict:
    """In this process: {row: [seconds per call, ...]} for torch eager, torch.compile and the
    fused dtorch chain (in that order: no session is open while torch's rows run)."""
    import torch
    from benchmarks.chain import run_chain
    from benchmarks.process_memory import cpu_seconds   # every live thread's, from schedstat

    def per_call(step, z, read, cpu_rows: dict | None = None, pids: tuple = ()) -> float:
        started, cpu = time.perf_counter(), time.thread_time()
        processes = [cpu_seconds("self"), *map(cpu_seconds, pids)]
        for _ in range(calls):
            z = step(z)
        if cpu_rows is not None:   # this thread's CPU for issuing the calls: the controller's side
            cpu_rows["issuing CPU"].append((time.thread_time() - cpu) / calls)
        read(z)
        if cpu_rows is not None:   # every thread's, through the read: the controller's process, the workers'
            spent = [after - before for before, after in zip(processes, [cpu_seconds("self"), *map(cpu_seconds, pids)])]
            cpu_rows["controller CPU"].append(spent[0] / calls)
            cpu_rows["workers' CPU"].append(sum(spent[1:]) / calls)
        return (time.perf_counter() - started) / calls

    chain = lambda z: run_chain(z, ops)   # noqa: E731
    compiled = torch.compile(chain, backend="inductor", dynamic=False)
    z = torch.zeros(SHAPE)
    compiled(z)
    import dtorch
    found = {"dtorch": [os.path.dirname(os.path.dirname(dtorch.__file__))], "torch eager": [], "torch.compile": [],
             "dtorch fused": [], "issuing CPU": [], "controller CPU": [], "workers' CPU": []}
    for _ in range(repeats):
        found["torch eager"].append(per_call(chain, z, lambda r: r.sum().item()))
        found["torch.compile"].append(per_call(compiled, z, lambda r: r.sum().item()))
    from dtorch.spec.placements import Shard, init_device_mesh
    dtorch.init(num_workers=workers)
    try:
        mesh = init_device_mesh("cpu", (workers,))
        x = dtorch.tensor(torch.zeros(SHAPE), device_mesh=mesh, placements=[Shard(0)])
        fused = dtorch.compile(chain, backend="inductor")
        fused(x).to_torch()   # the capture
        fused(x).to_torch()   # the first replay compiles (warm: the cache holds it)
        pids = tuple([worker["pid"] for worker in dtorch.workers()])
        for _ in range(repeats):
            found["dtorch fused"].append(per_call(fused, x, lambda r: r.to_torch(), found, pids))
    finally:
        dtorch.shutdown()
    return found


def _run(checkout: str, setting: str, args, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout, TORCHINDUCTOR_CACHE_DIR=cache)
    if setting:
        name, _, value = setting.partition("=")
        env[name] = value
    # this file by its path, from the checkout: `-m` would put the working directory, and its
    # dtorch, ahead of PYTHONPATH
    command = [sys.executable, os.path.abspath(__file__), CHILD, str(args.ops), str(args.calls),
               str(args.repeats), str(args.workers)]
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout} {setting!r} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", help="a dtorch checkout (default: this one)")
    parser.add_argument("--setting", action="append", help='NAME=VALUE in the environment ("" = as is)')
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of `calls` calls per process")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pairs = [(checkout, setting) for checkout in (args.checkout or [here]) for setting in (args.setting or [""])]
    samples: dict = {pair: {} for pair in pairs}
    with tempfile.TemporaryDirectory(prefix="dtorch-fused-ab-") as cache:
        _run(pairs[0][0], pairs[0][1], argparse.Namespace(**{**vars(args), "repeats": 1}), cache)   # warms the cache
        for round_number in range(args.rounds):
            for pair in pairs:
                for row, values in _run(*pair, args, cache).items():
                    samples[pair].setdefault(row, []).extend(values)
            print(f"round {round_number + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print(f"chain of {args.ops} ops on {SHAPE}, {args.workers} worker(s), per call over {args.calls} calls; "
          f"{args.rounds} rounds x {args.repeats} repeats, in turns; load {os.getloadavg()[0]:.1f}")
    for (checkout, setting), rows in samples.items():
        print(f"{checkout} {setting or '(environment as is)'}:   (dtorch from {rows['dtorch'][0]})")
        for row, values in rows.items():
            if row == "dtorch":
                continue
            print(f"  {row:14s} best {min(values) * 1e6:8.1f} us, median {statistics.median(values) * 1e6:8.1f} us")
        print(f"  dtorch fused / torch.compile: best {min(rows['dtorch fused']) / min(rows['torch.compile']):.2f}x, "
              f"median {statistics.median(rows['dtorch fused']) / statistics.median(rows['torch.compile']):.2f}x; "
              f"/ torch eager: best {min(rows['dtorch fused']) / min(rows['torch eager']):.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        print(json.dumps(child(*map(int, sys.argv[2:6]))))
    else:
        main()
