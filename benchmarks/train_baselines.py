"""The multi-controller side of benchmark 10: one training step (forward, backward,
torch.optim.AdamW step, zero_grad) of transformers' LlamaForCausalLM, written the way a
torch.distributed user writes it, in one group of 4 Gloo processes:

  DDP     DistributedDataParallel over the 4 ranks, each a quarter of the batch
  FSDP2   torch.distributed.fsdp.fully_shard on each decoder layer, then on the root
  TP      parallelize_module with benchmark 8's Megatron plan on ranks 0 and 1 (a (2, 2) mesh's
          "tp" dim); ranks 2 and 3 wait in a barrier meanwhile, so 2 processes compute, as
          dtorch's tp2 runs on a pool of 2

Each layout builds its own model from the same seed after measuring the idle resident set,
resets the peak-memory mark after the warm-up steps, and reports per-step times (a barrier
before each), the idle resident set, the peak during the timed steps and the host's steal
meanwhile (steal.py).
"""
from __future__ import annotations

from .process_memory import peak_mib, reset_peak, rss_mib
from .steal import Meter
from .timing import repeat, stopwatch

__all__ = ["train_rank", "one_process", "tiny_fields", "TP_RANKS"]

TP_RANKS = 2


def train_rank(rank: int, world: int, fields: dict, batch: int, seq: int, reps: int, warmup: int,
               skip: tuple = ()) -> dict:
    """{layout: {"samples": [...], "idle_mib": x, "peak_mib": y}} for this rank (TP: ranks 0, 1 only),
    for every layout but those in `skip`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    ids = _batch(fields, batch, seq)
    import transformers  # noqa: F401 -- before the first idle measurement: the library is not the model
    fsdp_mesh = init_device_mesh("cpu", (world,))
    builds = {name: build for name, build in {"DDP": _ddp, "FSDP2": lambda config: _fsdp2(config, fsdp_mesh)}.items()
              if name not in skip}
    own_rows = ids.chunk(world)[rank]
    results = {name: _warmed(build, fields, own_rows, reps, warmup) for name, build in builds.items()}
    tp_mesh = init_device_mesh("cpu", (world // TP_RANKS, TP_RANKS), mesh_dim_names=("rest", "tp"))["tp"]
    if rank < TP_RANKS:
        tp_group = tp_mesh.get_group()
        results["TP"] = _warmed(lambda config: _tp(config, tp_mesh), fields, ids, reps, warmup,
                                barrier=lambda: dist.barrier(tp_group))
    dist.barrier()   # ranks 2 and 3 sleep here while 0 and 1 run TP
    return results


def one_process(rank: int, world: int, fields: dict, batch: int, seq: int, reps: int, warmup: int) -> dict:
    """transformers' model and torch.optim.AdamW in one process (world 1): the 1-worker row's
    reference, in a process started like every other timed one (one thread, the same malloc
    settings: a process that frees large buffers to the OS pays page faults a reused heap does not)."""
    return _warmed(_model, fields, _batch(fields, batch, seq), reps, warmup, barrier=lambda: None)


def tiny_fields(fields: dict) -> dict:
    """A tiny Llama of the same shape of code: a layout trains it first, so that what a process
    loads on its first step of a layout (modules, allocator arenas) is not counted as the layout's
    memory."""
    return dict(fields, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def _warmed(build, fields: dict, ids, reps: int, warmup: int, barrier=None) -> dict:
    """_measure the layout `build(fields)` makes, after training a tiny one the same way (so what
    a process loads on its first step of a layout is not counted as the layout's memory)."""
    tiny = tiny_fields(fields)
    tiny_ids = ids.remainder(tiny["vocab_size"])
    _measure(lambda: build(tiny), tiny_ids, 0, warmup, barrier)
    return _measure(lambda: build(fields), ids, reps, warmup, barrier)


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


def _measure(build, ids, reps: int, warmup: int, barrier=None) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    idle = rss_mib()
    model = build()
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
    reset_peak()
    meter = Meter()
    samples = repeat(once, reps, warmup=0)
    result = {"samples": samples, "idle_mib": idle, "peak_mib": peak_mib(), "steal": meter.share()}
    model = optimizer = None   # frees both; `once` closes over the names, so they are rebound, not deleted
    gc.collect()   # the next layout starts from this layout's memory given back
    return result
