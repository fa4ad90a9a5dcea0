"""Where a data-parallel training step's time goes: benchmark 10's Llama on dp4, dtorch against
DDP, wall time and CPU time (user, system) per step of every process, from /proc.

    python -m benchmarks.dp_step_cpu            # ~30 s on a quiet 2-core machine
    python -m benchmarks.dp_step_cpu --steps 2  # does it run? (the tests)
    python -m benchmarks.dp_step_cpu --glibc-defaults   # every process with glibc's own malloc
                                                # settings instead of benchmark 10's (below)

Rows:
  dtorch dp4                 loss.backward() reduces the gradients inside the backward (buckets)
  dtorch dp4, no_sync        the same step with the reduction deferred to the optimizer's read
                             (dtorch.autograd.no_sync(): the path before the buckets), alternated
                             step by step with the row above, so both see the same machine
  dtorch dp4, losses kept    as the first row, keeping every step's loss DTensor (and with it
                             the step's autograd graph on every worker), as benchmark 10 once did
  dtorch dp4, fused AdamW    as the first row with dtorch.optim.AdamW(fused=True): torch's fused
                             kernel on the workers (alternated with the rows above)
  torch DDP, 4 procs         each rank's CPU over the same number of steps (torch's default AdamW,
                             the single-tensor path on CPU), then with fused=True
  torch.cat into a new / a kept buffer   the bucket flattening's cost in a process started with
                             the benchmarks' malloc setting (a fresh 14 MiB buffer pays its page faults)

Each row ends with the host's steal over its steps (benchmarks/steal.py): on a shared VM a row
with steal is slow for reasons outside the machine, and rows compare only at similar steal.

Every process starts with MALLOC_MMAP_THRESHOLD_ as in benchmark 10 (process_memory.py). On a
2-core machine the step is bound by the CPU of all processes together: compare the sums.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import replace

from .config import QUICK
from .llama_forward import config_fields
from .local_ranks import run_ranks
from .process_memory import returned_buffers, stat_fields
from .steal import Meter, describe
from .train_baselines import _batch, _ddp

STEPS = 10
WARMUP = 3


def cpu_seconds(pid: int | str = "self") -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = stat_fields(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _fields() -> dict:
    suite = QUICK
    return config_fields(replace(suite, llama_layers=suite.train_layers, llama_hidden=suite.train_hidden,
                                 llama_seq=suite.train_seq))


def _dtorch(fields: dict) -> dict:
    import torch
    import transformers
    import dtorch
    from dtorch.models import LlamaForCausalLM
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    ids = _batch(fields, QUICK.train_batch, QUICK.train_seq)
    dtorch.init(num_workers=4)
    try:
        mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])
        model = LlamaForCausalLM(reference.config, device_mesh=mesh)
        model.load_state_dict(reference.state_dict())
        default = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        fused = dtorch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        pids = [worker["pid"] for worker in dtorch.workers()]

        kept = []

        def step(variant: str) -> float:
            start = time.perf_counter()
            loss = model(ids, labels=ids).loss
            with dtorch.autograd.no_sync() if variant == "no_sync" else contextlib.nullcontext():
                loss.backward()
            optimizer = fused if variant == "fused AdamW" else default
            optimizer.step()
            optimizer.zero_grad()
            dtorch.synchronize()
            if variant == "losses kept":
                kept.append(loss)
            return time.perf_counter() - start
        variants = ("", "no_sync", "fused AdamW", "losses kept")
        for variant in variants[:3] * WARMUP:
            step(variant)
        rows = {}
        for variant in variants[:3] * 2 + variants[3:]:   # alternated; the kept graphs last, once
            before, meter = [cpu_seconds(pid) for pid in pids] + [cpu_seconds()], Meter()
            walls = sorted(step(variant) for _ in range(STEPS))
            after = [cpu_seconds(pid) for pid in pids] + [cpu_seconds()]
            kept.clear()
            name = f"dtorch dp4, {variant}" if variant else "dtorch dp4"
            rows.setdefault(name, []).append((walls[len(walls) // 2], _per_step(before, after), meter.share()))
        return rows
    finally:
        dtorch.shutdown()


def _per_step(before: list, after: list) -> list:
    return [((a[0] - b[0]) / STEPS, (a[1] - b[1]) / STEPS) for a, b in zip(after, before)]


def _ddp_rank(rank: int, world: int, fields: dict, fused: bool) -> dict:
    import torch
    import torch.distributed as dist
    ids = _batch(fields, QUICK.train_batch, QUICK.train_seq).chunk(world)[rank]
    model = _ddp(fields)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    walls = []
    for index in range(WARMUP + STEPS):
        if index == WARMUP:
            before, meter = cpu_seconds(), Meter()
        dist.barrier()
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        walls.append(time.perf_counter() - start)
    after = cpu_seconds()
    return {"wall": sorted(walls[WARMUP:])[STEPS // 2], "cpu": _per_step([before], [after])[0],
            "steal": meter.share()}


def _cat_rank(rank: int, world: int) -> dict:
    """torch.cat of a bucket's worth of gradients (14 MiB) into a new buffer and into a kept one."""
    import torch
    pieces = [torch.randn(n) for n in [1024 * 256] * 2 + [256 * 256] * 16 + [256 * 682] * 12 + [256] * 9]
    kept = torch.empty(sum(p.numel() for p in pieces))
    timings = {}
    for name, run in (("new", lambda: torch.cat(pieces)), ("kept", lambda: torch.cat(pieces, out=kept))):
        run()
        start = time.perf_counter()
        for _ in range(30):
            run()
        timings[name] = (time.perf_counter() - start) / 30
    return timings


def main() -> None:
    global STEPS, WARMUP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per row")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="start every process without benchmark 10's MALLOC_MMAP_THRESHOLD_")
    options = parser.parse_args()
    STEPS = options.steps
    WARMUP = min(WARMUP, STEPS)
    fields = _fields()
    with contextlib.nullcontext() if options.glibc_defaults else returned_buffers():
        ours = _dtorch(fields)
        ddp = {fused: run_ranks(_ddp_rank, 4, (fields, fused), 600) for fused in (False, True)}
        (cat,) = run_ranks(_cat_rank, 1, (), 120)
    print(f"{'variant':24s} {'step (median)':>14s}   CPU per step: user + system, per process (ms)")
    for name, runs in ours.items():
        for wall, cpu, stolen in runs:
            workers = ", ".join(f"{u * 1e3:.0f}+{s * 1e3:.0f}" for u, s in cpu[:-1])
            controller = cpu[-1]
            print(f"{name:24s} {wall * 1e3:11.1f} ms   workers {workers}; controller "
                  f"{controller[0] * 1e3:.0f}+{controller[1] * 1e3:.0f}; {describe(stolen)}")
    for fused, runs in ddp.items():
        ranks = ", ".join(f"{r['cpu'][0] * 1e3:.0f}+{r['cpu'][1] * 1e3:.0f}" for r in runs)
        name = "torch DDP, fused AdamW" if fused else "torch DDP, 4 procs"
        print(f"{name:24s} {max(r['wall'] for r in runs) * 1e3:11.1f} ms   ranks {ranks}; {describe(runs[0]['steal'])}")
    print(f"torch.cat of 14 MiB of gradients: into a new buffer {cat['new'] * 1e3:.2f} ms, "
          f"into a kept one {cat['kept'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
