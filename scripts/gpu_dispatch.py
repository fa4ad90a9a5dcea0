"""GPU dispatch cost: the user's thread issuing a chain of `z = z * 1.0001 + 1` ops (10,000 ops by
default) on a cuda (1,) mesh, against torch eager on the same GPU. Prints a markdown table.

"issue" times only the loop that issues the chain (what the user's thread pays per op); "end to
end" adds the wait until the device has run it all (dtorch.synchronize waits on a device fence).
Medians over --reps repetitions, after one warm-up. The chain is benchmarks/chain.py's, so the CPU
benchmarks run the same Python.

Then overlap: --rounds of a P(sum) -> R redistribute of --comm-mib (NCCL on the communication
stream; forced on for a one-rank mesh) and an independent --matmul square matmul (compute stream),
timed alone and together. overlap = (comm + compute - together) / min(comm, compute): 0% means
the streams ran one after the other, 100% that the shorter one hid entirely.

    python scripts/gpu_dispatch.py [--ops 10000] [--reps 3] [--rounds 20] [--comm-mib 512] [--matmul 4096]
                                   [--json PATH]   (the figures as JSON too, for scripts/gpu_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import dtorch
from benchmarks.chain import run_chain
from dtorch.spec.placements import Partial, Replicate, init_device_mesh
from dtorch.runtime.devices.nccl import SINGLE_RANK_VARIABLE

SHAPE = (64, 128)


def dtorch_once(mesh, ops: int):
    z = dtorch.zeros(*SHAPE, device_mesh=mesh)
    dtorch.synchronize()
    start = time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    dtorch.synchronize()
    return (issued - start) / ops, (time.perf_counter() - start) / ops, z


def eager_once(ops: int, device: str):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    z = torch.zeros(SHAPE, device=device)
    sync()
    start = time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    sync()
    return (issued - start) / ops, (time.perf_counter() - start) / ops, z


def measure(once, reps: int):
    once()
    runs = [once() for _ in range(reps)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[-1][2])


def overlap_seconds(mesh, args) -> dict:
    """Median seconds for --rounds of communication alone, compute alone, and both interleaved."""
    partial = dtorch.ones(args.comm_mib * 2**18, device_mesh=mesh, placements=[Partial()])
    a = dtorch.randn(args.matmul, args.matmul, device_mesh=mesh)

    def communicate():
        return partial.redistribute(placements=[Replicate()])

    def compute():
        return a @ a

    def timed(*work):
        def once():
            dtorch.synchronize()
            start = time.perf_counter()
            for _ in range(args.rounds):
                for step in work:
                    step()
            dtorch.synchronize()
            return time.perf_counter() - start
        once()
        return statistics.median(once() for _ in range(args.reps))
    return {"comm": timed(communicate), "compute": timed(compute), "both": timed(communicate, compute)}


def print_overlap(mesh, args) -> dict:
    t = overlap_seconds(mesh, args)
    hidden = (t["comm"] + t["compute"] - t["both"]) / min(t["comm"], t["compute"])
    print(f"\n{args.rounds} rounds on a {mesh.shape} {mesh.device_type} mesh: P(sum) -> R of {args.comm_mib} MiB "
          f"float32 and an independent {args.matmul}x{args.matmul} matmul, median of {args.reps}\n")
    print("| communication alone (ms) | compute alone (ms) | both (ms) | overlap |")
    print("|---|---|---|---|")
    print(f"| {t['comm'] * 1e3:.1f} | {t['compute'] * 1e3:.1f} | {t['both'] * 1e3:.1f} | {hidden:.0%} |")
    return {"comm_ms": t["comm"] * 1e3, "compute_ms": t["compute"] * 1e3, "both_ms": t["both"] * 1e3,
            "overlap": hidden}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--comm-mib", type=int, default=512)
    parser.add_argument("--matmul", type=int, default=4096)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU workers")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    # A one-rank group normally skips NCCL; run it so one GPU shows the communication stream.
    os.environ.setdefault(SINGLE_RANK_VARIABLE, "1")
    mesh = init_device_mesh(args.device, (1,))
    eager = measure(lambda: eager_once(args.ops, args.device), args.reps)
    ours = measure(lambda: dtorch_once(mesh, args.ops), args.reps)
    same = torch.allclose(ours[2].to_torch(), eager[2].cpu(), rtol=1e-4)
    print(f"{args.ops} ops on a {SHAPE} float32 tensor, median of {args.reps}, "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}; results agree: {same}\n")
    print("| variant | issue per op (µs) | end to end per op (µs) | issue vs eager |")
    print("|---|---|---|---|")
    for name, (issue, total, _) in [(f"torch eager, {args.device}", eager), (f"dtorch, {args.device} (1,) mesh", ours)]:
        print(f"| {name} | {issue * 1e6:.1f} | {total * 1e6:.1f} | {issue / eager[0]:.1f}x |")
    figures = {"results_agree": same, "eager_issue_us": eager[0] * 1e6, "eager_end_to_end_us": eager[1] * 1e6,
               "dtorch_issue_us": ours[0] * 1e6, "dtorch_end_to_end_us": ours[1] * 1e6,
               **print_overlap(mesh, args)}
    dtorch.shutdown()
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"status": "passed" if same else "failed", "figures": figures}, file)


if __name__ == "__main__":
    main()
