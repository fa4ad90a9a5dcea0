"""The hand-written multi-controller version of benchmark 5: the classic Megatron MLP.

Four processes, rank = dp * TP + tp. Each holds its batch chunk (dp), a column block of W1 and a
row block of W2 (tp), computes relu(x @ W1) @ W2 locally and all-reduces the partial sums over
its tp group. Every rank draws the same weights from the same seed as the dtorch side.
"""
from __future__ import annotations

from .local_ranks import run_ranks

__all__ = ["make_weights", "reference_forward", "megatron_step_seconds", "DP", "TP"]

DP, TP = 2, 2


def make_weights(layers: int, hidden: int, batch: int):
    """(x, [(w1, w2), ...]) drawn from a fixed seed; scaled so activations stay O(1)."""
    import torch
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, hidden, generator=generator)
    scale = hidden ** -0.5
    weights = [(torch.randn(hidden, hidden, generator=generator) * scale,
                torch.randn(hidden, hidden, generator=generator) * scale) for _ in range(layers)]
    return x, weights


def reference_forward(x, weights):
    for w1, w2 in weights:
        x = (x @ w1).relu() @ w2
    return x


def megatron_step_seconds(layers: int, hidden: int, batch: int, reps: int, timeout_s: float) -> list[float]:
    """Seconds per forward step, the slowest rank's time for each repetition."""
    return run_ranks(_megatron_rank, DP * TP, (layers, hidden, batch, reps), timeout_s)[0]


def _megatron_rank(rank: int, world: int, layers: int, hidden: int, batch: int, reps: int):
    import torch
    import torch.distributed as dist
    dp, tp = divmod(rank, TP)
    tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
    x, weights = make_weights(layers, hidden, batch)
    x_local = x.chunk(DP, dim=0)[dp].contiguous()
    local_weights = [(w1.chunk(TP, dim=1)[tp].contiguous(), w2.chunk(TP, dim=0)[tp].contiguous())
                     for w1, w2 in weights]
    step = lambda: _forward(dist, x_local, local_weights, tp_groups[dp])  # noqa: E731
    samples = torch.tensor([_time_step(dist, step) for _ in range(reps + 1)][1:], dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return samples.tolist()


def _forward(dist, x, local_weights, tp_group):
    for w1_columns, w2_rows in local_weights:
        partial = (x @ w1_columns).relu() @ w2_rows
        dist.all_reduce(partial, group=tp_group)
        x = partial
    return x


def _time_step(dist, step) -> float:
    import time
    dist.barrier()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start
