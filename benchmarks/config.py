"""The three sizes of the suite. Each benchmark reads only the fields it needs.

quick  -- the default: a few minutes on a 2-core laptop, enough repetitions for a stable median.
full   -- longer chains, more repetitions, the larger redistribute sizes.
smoke  -- a handful of iterations so tests/test_benchmarks_smoke.py proves every path runs; its
          world sizes are chosen so the 4-worker pool restarts only once (starting workers
          dominates its run time).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Suite", "QUICK", "FULL", "SMOKE", "PRESETS"]

MIB = 1 << 20


@dataclass(frozen=True)
class Suite:
    name: str
    chain_ops: int                  # elementwise ops per chain (each `z * a + b` line is two)
    chain_shapes: tuple             # global shapes the chain runs on
    reps: int                       # timed repetitions of one chain
    collective_reps: int            # timed repetitions of one redistribute / MLP step (cheap, noisy)
    end_to_end_worlds: tuple        # worker counts for the end-to-end chain
    fetch_reads: int                # timed reads of a ready (1,) tensor
    fetch_worlds: tuple             # worker counts for the read (a read waits on every rank)
    redistribute_bytes: tuple       # float32 tensor sizes for the redistribute benchmark
    redistribute_worlds: tuple
    mlp_layers: int
    mlp_hidden: int
    mlp_batch: int
    process_timeout_s: float        # a baseline process group that runs longer is killed
    redistribute_burst: int = 4     # redistributes issued back to back per timed sample (one synchronize)
    llama_layers: int = 4           # the Llama of benchmark 8 (hidden size, layers, tokens per sequence)
    llama_hidden: int = 256
    llama_seq: int = 64
    worker_start_worlds: tuple = (4, 16, 64)   # pool sizes benchmark 9 starts both ways
    train_layers: int = 4           # the Llama of benchmark 10 (one training step: ~0.1-0.4 s on 2 cores)
    train_hidden: int = 256
    train_seq: int = 64
    train_batch: int = 8            # divisible by 4 (dp4, fsdp4) and by every microbatch count
    train_reps: int = 5             # timed steps per layout
    train_world: int = 4            # dp and fsdp size against DDP and FSDP2 over as many processes
    train_fsdp_sizes: tuple = (2, 4)   # beside the 1-worker run (an fsdp of 1): peak memory by fsdp size
    train_microbatches: tuple = (1, 2, 4)   # pp2's microbatch counts: the bubble
    train_compile_backend: str | None = "inductor"   # the torch.compile baselines' backend; None: none
    relay_ops: int = 400            # benchmark 11: elementwise ops whose PUB bytes are counted
    relay_slots: int = 4            # workers per host of its many-workers layouts
    relay_round_trips: int = 2000   # its reply-hop round trips
    scale_worlds: tuple = (1, 4, 16, 64)    # benchmark 12: controller CPU per op by world size
    scale_ops: int = 2000                   # its program: this many small ops and one read
    scale_idle_s: float = 3.0               # seconds of idle pool measured for its heartbeat row
    fused_ops: int = 100            # benchmark 13: the chain's ops, fused by dtorch.compile(backend="inductor")
    fused_calls: int = 200          # calls per sample, through the final read
    fused_rounds: int = 3           # samples per row, the rows in turns
    fused_worlds: tuple = (1, 4)    # worker counts (each: a cold session, then a warm one)


QUICK = Suite(
    name="quick", chain_ops=10_000, chain_shapes=((1,), (64, 128)), reps=5, collective_reps=20,
    end_to_end_worlds=(1, 2, 4, 8), fetch_reads=300, fetch_worlds=(1, 4),
    redistribute_bytes=(1 * MIB, 16 * MIB), redistribute_worlds=(2, 4),
    mlp_layers=3, mlp_hidden=512, mlp_batch=64, process_timeout_s=300,
)

FULL = replace(
    QUICK, name="full", chain_ops=50_000, reps=15, collective_reps=50, fetch_reads=2_000,
    redistribute_bytes=(1 * MIB, 16 * MIB, 64 * MIB), mlp_hidden=1024, mlp_batch=256,
    process_timeout_s=900, train_reps=15, scale_ops=10_000,
)

SMOKE = replace(
    QUICK, name="smoke", chain_ops=40, reps=2, collective_reps=2, end_to_end_worlds=(2,),
    fetch_reads=5, fetch_worlds=(4,), redistribute_bytes=(64 * 1024,), redistribute_worlds=(4,),
    redistribute_burst=2,
    mlp_layers=1, mlp_hidden=64, mlp_batch=8, process_timeout_s=60, llama_layers=1, llama_hidden=64, llama_seq=8,
    worker_start_worlds=(2,), train_layers=2, train_hidden=64, train_seq=8, train_batch=4, train_reps=2,
    train_world=2, train_fsdp_sizes=(), train_microbatches=(2,),
    train_compile_backend="eager", relay_ops=40, relay_slots=2, relay_round_trips=200,
    scale_worlds=(1, 2), scale_ops=40, scale_idle_s=0.3,
    fused_ops=10, fused_calls=3, fused_rounds=1, fused_worlds=(1,),
)

PRESETS = {suite.name: suite for suite in (QUICK, FULL, SMOKE)}
