"""GPU dispatch cost: the user's thread issuing a chain of `z = z * 1.0001 + 1` ops (10,000 ops by
default) on a cuda (1,) mesh, against torch eager on the same GPU. Prints a markdown table.

"issue" times only the loop that issues the chain (what the user's thread pays per op); "end to
end" adds the wait until the device has run it all. Medians over --reps repetitions, after one
warm-up. The chain is benchmarks/chain.py's, so the CPU benchmarks run the same Python.

    python scripts/gpu_dispatch.py [--ops 10000] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dtorch  # noqa: E402
from benchmarks.chain import run_chain  # noqa: E402
from dtorch.distributed_spec import init_device_mesh  # noqa: E402

SHAPE = (64, 128)


def dtorch_once(mesh, ops: int):
    z = dtorch.zeros(*SHAPE, device_mesh=mesh)
    dtorch.synchronize()
    start = time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    dtorch.synchronize()
    return (issued - start) / ops, (time.perf_counter() - start) / ops, z


def eager_once(ops: int):
    z = torch.zeros(SHAPE, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / ops, (time.perf_counter() - start) / ops, z


def measure(once, reps: int):
    once()
    runs = [once() for _ in range(reps)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[-1][2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    mesh = init_device_mesh("cuda", (1,))
    eager = measure(lambda: eager_once(args.ops), args.reps)
    ours = measure(lambda: dtorch_once(mesh, args.ops), args.reps)
    same = torch.allclose(ours[2].to_torch(), eager[2].cpu(), rtol=1e-4)
    print(f"{args.ops} ops on a {SHAPE} float32 tensor, median of {args.reps}, "
          f"{torch.cuda.get_device_name(0)}; results agree: {same}\n")
    print("| variant | issue per op (µs) | end to end per op (µs) | issue vs eager |")
    print("|---|---|---|---|")
    for name, (issue, total, _) in [("torch eager, cuda:0", eager), ("dtorch, cuda (1,) mesh", ours)]:
        print(f"| {name} | {issue * 1e6:.1f} | {total * 1e6:.1f} | {issue / eager[0]:.1f}x |")
    dtorch.shutdown()


if __name__ == "__main__":
    main()
