"""The multi-controller side of benchmark 10: one training step (forward, backward,
torch.optim.AdamW step, zero_grad) of transformers' LlamaForCausalLM, written the way a
torch.distributed user writes it, in one group of 4 Gloo processes:

  DDP     DistributedDataParallel over the 4 ranks, each a quarter of the batch
  FSDP2   torch.distributed.fsdp.fully_shard on each decoder layer, then on the root
  TP      parallelize_module with benchmark 8's Megatron plan on ranks 0 and 1 (a (2, 2) mesh's
          "tp" dim); ranks 2 and 3 wait in a barrier meanwhile, so 2 processes compute, as
          dtorch's tp2 runs on a pool of 2

Each layout builds its own model from the same seed, resets the peak-memory mark after
building it and running the warm-up steps, and reports per-step times (a barrier before each),
the resident set before the timed steps and the peak during them.
"""
from __future__ import annotations

from .process_memory import peak_mib, reset_peak, rss_mib
from .timing import repeat, stopwatch

__all__ = ["train_rank", "TP_RANKS"]

TP_RANKS = 2


def train_rank(rank: int, world: int, fields: dict, batch: int, seq: int, reps: int, warmup: int) -> dict:
    """{layout: {"samples": [...], "rss_mib": x, "peak_mib": y}} for this rank (TP: ranks 0, 1 only)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    ids = _batch(fields, batch, seq)
    own_rows = ids.chunk(world)[rank]
    results = {"DDP": _measure(_ddp(fields), own_rows, reps, warmup),
               "FSDP2": _measure(_fsdp2(fields, init_device_mesh("cpu", (world,))), own_rows, reps, warmup)}
    tp_mesh = init_device_mesh("cpu", (world // TP_RANKS, TP_RANKS), mesh_dim_names=("rest", "tp"))["tp"]
    if rank < TP_RANKS:
        tp_group = tp_mesh.get_group()
        results["TP"] = _measure(_tp(fields, tp_mesh), ids, reps, warmup, barrier=lambda: dist.barrier(tp_group))
    dist.barrier()   # ranks 2 and 3 sleep here while 0 and 1 run TP
    return results


def _batch(fields: dict, batch: int, seq: int):
    import torch
    return torch.randint(0, fields["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))


def _model(fields: dict):
    import torch
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))


def _ddp(fields: dict):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(_model(fields))


def _fsdp2(fields: dict, mesh):
    from torch.distributed.fsdp import fully_shard
    model = _model(fields)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _tp(fields: dict, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from .llama_forward import TP_PLAN
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(_model(fields), mesh, {k: styles[v]() for k, v in TP_PLAN.items()})


def _measure(model, ids, reps: int, warmup: int, barrier=None) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    barrier = barrier or dist.barrier

    def once() -> float:
        barrier()
        elapsed = stopwatch()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return elapsed()
    repeat(once, warmup, warmup=0)
    rss = rss_mib()
    reset_peak()
    samples = repeat(once, reps, warmup=0)
    result = {"samples": samples, "rss_mib": rss, "peak_mib": peak_mib()}
    del model, optimizer
    gc.collect()   # the next layout starts from this layout's memory given back
    return result
