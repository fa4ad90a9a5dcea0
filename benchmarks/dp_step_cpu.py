"""Where a data-parallel training step's time goes: benchmark 10's Llama on dp4, dtorch against
DDP, wall time and CPU time (user, system) per step of every process, from /proc.

    python -m benchmarks.dp_step_cpu            # ~1.5 min on a quiet 2-core machine
    python -m benchmarks.dp_step_cpu --fused    # also the fused step and DDP + torch.compile (~4 min)
    python -m benchmarks.dp_step_cpu --rounds 4 # more turns of every row
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
  dtorch dp4, dtorch.compile step   the first row's step as one dtorch.compile'd function (benchmark
                             10's compiled row): one command per step, so the controller's CPU
                             per step all but vanishes; alternated with the rows above
  dtorch dp4, fused step     (--fused) the same step with backend="inductor" (benchmark 10's fused
                             row: the forward and loss one inductor-compiled run, AdamW on foreach
                             kernels)
  torch DDP, 4 procs         each rank's CPU over the same number of steps (torch's default AdamW,
                             the single-tensor path on CPU), then with fused=True, and (--fused)
                             a second DDP model under torch.compile (inductor) with the default
                             AdamW: the fused row's peer
  torch.cat into a new / a kept buffer   the bucket flattening's cost in a process started with
                             the benchmarks' malloc setting (a fresh 14 MiB buffer pays its page faults)

Every row is measured in turns (a round: each dtorch variant, then DDP, then DDP with fused AdamW,
STEPS steps each): DDP's 4 ranks start once and wait, blocked, while dtorch's rows run, and
dtorch's workers wait while DDP's run. Measured one after the other instead, the two sides saw
different machines: benchmark 10 read dp4 at 0.83x and 1.31x DDP on the same day. Each row ends
with the host's steal over its steps (benchmarks/steal.py): rows compare only at similar steal.

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
from .ddp_turns import DdpTurns
from .llama_forward import config_fields
from .llama_train import compiled_step
from .local_ranks import run_ranks
from .process_memory import returned_buffers, stat_fields
from .steal import Meter, describe
from .train_baselines import _batch

STEPS = 10
WARMUP = 3
ROUNDS = 2
VARIANT_NAMES = {"compiled": "dtorch.compile step", "fused": "fused step"}


def cpu_seconds(pid: int | str = "self") -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = stat_fields(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _fields() -> dict:
    suite = QUICK
    return config_fields(replace(suite, llama_layers=suite.train_layers, llama_hidden=suite.train_hidden,
                                 llama_seq=suite.train_seq))


DDP_ROWS = ("torch DDP, 4 procs", "torch DDP, fused AdamW", "torch DDP + torch.compile")   # DdpTurns' order


def _dtorch(fields: dict, ddp: DdpTurns, fused_rows: bool) -> dict:
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
        compiled = compiled_step(model, default)
        fused_step = compiled_step(model, default, backend="inductor")

        def step(variant: str) -> float:
            start = time.perf_counter()
            if variant in ("compiled", "fused"):
                (compiled if variant == "compiled" else fused_step)(model._upload(ids))
                dtorch.synchronize()
                return time.perf_counter() - start
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
        variants = ("", "no_sync", "fused AdamW", "compiled", *(("fused",) if fused_rows else ()), "losses kept")
        for variant in variants[:-1] * WARMUP:
            step(variant)
        ddp.turn(WARMUP)
        rows = {}
        for variant in [*variants[:-1], "DDP"] * ROUNDS + [variants[-1]]:   # in turns; the kept graphs last, once
            if variant == "DDP":
                for name, turn in zip(DDP_ROWS, ddp.turn(STEPS)):
                    rows.setdefault(name, []).append((sorted(turn.walls)[STEPS // 2], turn.cpu, turn.steal))
                continue
            before, meter = [cpu_seconds(pid) for pid in pids] + [cpu_seconds()], Meter()
            walls = sorted(step(variant) for _ in range(STEPS))
            after = [cpu_seconds(pid) for pid in pids] + [cpu_seconds()]
            kept.clear()
            name = f"dtorch dp4, {VARIANT_NAMES.get(variant, variant)}" if variant else "dtorch dp4"
            rows.setdefault(name, []).append((walls[len(walls) // 2], _per_step(before, after), meter.share()))
        return rows
    finally:
        dtorch.shutdown()


def _per_step(before: list, after: list) -> list:
    return [((a[0] - b[0]) / STEPS, (a[1] - b[1]) / STEPS) for a, b in zip(after, before)]


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


def _cpu_text(cpu: list) -> str:
    return ", ".join(f"{user * 1e3:.0f}+{system * 1e3:.0f}" for user, system in cpu)


def main() -> None:
    global STEPS, WARMUP, ROUNDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per row")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="turns of every row but 'losses kept'")
    parser.add_argument("--fused", action="store_true",
                        help="also the step under dtorch.compile(backend='inductor') and DDP + torch.compile")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="start every process without benchmark 10's MALLOC_MMAP_THRESHOLD_")
    options = parser.parse_args()
    STEPS, ROUNDS = options.steps, options.rounds
    WARMUP = min(WARMUP, STEPS)
    fields = _fields()
    with contextlib.nullcontext() if options.glibc_defaults else returned_buffers():
        ddp = DdpTurns(fields, _batch(fields, QUICK.train_batch, QUICK.train_seq), 4, fused=(False, True),
                       compile_backend="inductor" if options.fused else None)
        try:
            rows = _dtorch(fields, ddp, options.fused)
        finally:
            ddp.close()
        (cat,) = run_ranks(_cat_rank, 1, (), 120)
    print(f"{'variant':32s} {'step (median)':>14s}   CPU per step: user + system, per process (ms)")
    for name, runs in rows.items():
        for wall, cpu, stolen in runs:
            if name in DDP_ROWS:
                processes = "ranks " + _cpu_text(cpu)
            else:
                processes = f"workers {_cpu_text(cpu[:-1])}; controller {_cpu_text(cpu[-1:])}"
            print(f"{name:32s} {wall * 1e3:11.1f} ms   {processes}; {describe(stolen)}")
    print(f"torch.cat of 14 MiB of gradients: into a new buffer {cat['new'] * 1e3:.2f} ms, "
          f"into a kept one {cat['kept'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
