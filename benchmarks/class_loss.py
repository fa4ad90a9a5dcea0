"""cross_entropy's mean over sharded logits: dtorch.nn.functional's form against the op as the
planner runs it alone (it gathers the logits to every rank first), in turns, in one session.
`--sharded batch` (logits S(0) over "dp"): a sharded sum over an all-reduced count of kept
targets. `--sharded classes` (logits S(1), a vocabulary-parallel head): the loss from the shards
(max, sum of exponentials, target logit: three all-reduces of one value per row).

    python -m benchmarks.class_loss [--sharded batch|classes] [--batch 256] [--classes 1000]
                                    [--workers 4] [--reps 15]

Each repetition: forward, backward, and dtorch.synchronize(), on logits that require grad.
Prints the median milliseconds of each and the bytes the planner's gather moves.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharded", choices=("batch", "classes"), default="batch")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    import torch
    import dtorch
    from dtorch.spec.placements import Replicate, Shard
    from dtorch.dtensor.tensor import call_op
    dtorch.init(num_workers=args.workers)
    try:
        mesh = dtorch.init_device_mesh("cpu", (args.workers,), mesh_dim_names=["dp"])
        dim = 0 if args.sharded == "batch" else 1
        logits = dtorch.randn(args.batch, args.classes, device_mesh=mesh, placements=[Shard(dim)], requires_grad=True)
        target = dtorch.tensor(torch.randint(0, args.classes, (args.batch,)), device_mesh=mesh,
                               placements=[Shard(0) if dim == 0 else Replicate()])
        form = "sharded sum / count" if dim == 0 else "from the class shards"
        variants = {f"{form} (F.cross_entropy)": dtorch.nn.functional.cross_entropy,
                    "the op alone (planner gathers the logits)": lambda x, t: call_op("cross_entropy", (x, t), {})}
        times = {name: [] for name in variants}
        for rep in range(args.reps + 1):   # the first warms up
            for name, loss_of in variants.items():
                started = time.perf_counter()
                loss_of(logits, target).backward()
                dtorch.synchronize()
                if rep:
                    times[name].append(time.perf_counter() - started)
                logits.grad = None
        gathered = args.batch * args.classes * 4 * (args.workers - 1) // args.workers
        print(f"logits ({args.batch}, {args.classes}) float32 S({dim}) on {args.workers} workers "
              f"(a gather brings each rank {gathered / 2**20:.2f} MiB)")
        for name, samples in times.items():
            print(f"  {name:45s} median {statistics.median(samples) * 1e3:7.2f} ms per forward + backward")
    finally:
        dtorch.shutdown()


if __name__ == "__main__":
    main()
