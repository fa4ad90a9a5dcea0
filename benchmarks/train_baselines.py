"""The multi-controller side of benchmark 10: one training step (forward, backward,
torch.optim.AdamW step, zero_grad) of transformers' LlamaForCausalLM, written the way a
torch.distributed user writes it, in one group of 4 Gloo processes:

  DDP     DistributedDataParallel over the 4 ranks, each a quarter of the batch
  FSDP2   torch.distributed.fsdp.fully_shard on each decoder layer, then on the root
  TP      parallelize_module with benchmark 8's Megatron plan on ranks 0 and 1 (a (2, 2) mesh's
          "tp" dim); ranks 2 and 3 wait in a barrier meanwhile, so 2 processes compute, as
          dtorch's tp2 runs on a pool of 2

and each of them again with torch.compile (`compile_backend`, "inductor" in the published run):

  DDP + torch.compile     torch.compile(DDP(model)) (DDP's optimizer splits the graph at its buckets)
  FSDP2 + torch.compile   each decoder layer torch.compile'd, then fully_shard per layer and root
                          (torchtitan's order)
  TP + torch.compile      torch.compile(parallelize_module(model))

Each layout builds its own model from the same seed after measuring the idle resident set,
resets the peak-memory mark after the warm-up steps, and reports per-step times (a barrier
before each), the idle resident set, the peak during the timed steps and the host's steal
meanwhile (steal.py). A compiled layout also reports its first step's time, compile included,
cold (this process's compile caches empty: TORCHINDUCTOR_CACHE_DIR a fresh folder; the tiny
model compiled before it loads the compiler) and warm (the same model built again after
torch._dynamo.reset(), the caches kept), beside the step time.
"""
from __future__ import annotations

from .process_memory import peak_mib, reset_peak, rss_mib
from .steal import Meter
from .timing import repeat, stopwatch

__all__ = ["train_rank", "one_process", "tiny_fields", "TP_RANKS", "COMPILED"]

TP_RANKS = 2
COMPILED = " + torch.compile"   # a compiled layout's key: its eager layout's, then this


def train_rank(rank: int, world: int, fields: dict, batch: int, seq: int, reps: int, warmup: int,
               skip: tuple = (), compile_backend: str | None = None) -> dict:
    """{layout: {"samples": [...], "idle_mib": x, "peak_mib": y}} for this rank (TP: ranks 0, 1 only),
    for every layout but those in `skip`; with `compile_backend`, each again torch.compile'd
    (keys "DDP + torch.compile", ...), with "cold_s" and "warm_s", its first step's times."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-rank{rank}-")   # cold: empty
    ids = _batch(fields, batch, seq)
    import transformers  # noqa: F401 -- before the first idle measurement: the library is not the model
    fsdp_mesh = init_device_mesh("cpu", (world,))
    builds = {"DDP": _ddp, "FSDP2": lambda config, compiled=None: _fsdp2(config, fsdp_mesh, compiled)}
    own_rows = ids.chunk(world)[rank]
    results = {}
    for name, build in builds.items():
        for backend in (None, compile_backend) if compile_backend else (None,):
            key = name + (COMPILED if backend else "")
            if key not in skip:
                results[key] = _warmed(_compiled_build(build, backend), fields, own_rows, reps, warmup, backend=backend)
    tp_mesh = init_device_mesh("cpu", (world // TP_RANKS, TP_RANKS), mesh_dim_names=("rest", "tp"))["tp"]
    if rank < TP_RANKS:
        tp_group = tp_mesh.get_group()
        for backend in (None, compile_backend) if compile_backend else (None,):
            key = "TP" + (COMPILED if backend else "")
            if key not in skip:
                results[key] = _warmed(_compiled_build(lambda config, compiled=None: _tp(config, tp_mesh, compiled),
                                                       backend), fields, ids, reps, warmup,
                                       barrier=lambda: dist.barrier(tp_group), backend=backend)
    dist.barrier()   # ranks 2 and 3 sleep here while 0 and 1 run TP
    return results


def _compiled_build(build, backend: str | None):
    """`build` as a function of the config alone, its model torch.compile'd with `backend` (None: eager)."""
    if backend is None:
        return build
    import torch
    compile_with = lambda module: torch.compile(module, backend=backend)   # noqa: E731
    if build is _ddp:
        return lambda config: compile_with(_ddp(config))
    return lambda config: build(config, compile_with)


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


def _warmed(build, fields: dict, ids, reps: int, warmup: int, barrier=None, backend: str | None = None) -> dict:
    """_measure the layout `build(fields)` makes, after training a tiny one the same way (so what
    a process loads on its first step of a layout is not counted as the layout's memory). A
    compiled layout (`backend`) is built a second time after torch._dynamo.reset(): its first
    step is the warm compile's."""
    tiny = tiny_fields(fields)
    tiny_ids = ids.remainder(tiny["vocab_size"])
    _measure(lambda: build(tiny), tiny_ids, 0, warmup, barrier)
    result = _measure(lambda: build(fields), ids, reps, warmup, barrier)
    if backend is not None:
        import torch
        torch._dynamo.reset()   # forget the compiled code; the on-disk caches stay
        result["cold_s"] = result.pop("first_s")
        result["warm_s"] = _measure(lambda: build(fields), ids, 0, 1, barrier)["first_s"]
    return result


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


def _fsdp2(fields: dict, mesh, compile_with=None):
    from torch.distributed.fsdp import fully_shard
    model = _model(fields)
    layers = model.model.layers
    if compile_with is not None:   # each block compiled, then sharded: torchtitan's order
        for index, layer in enumerate(layers):
            layers.register_module(str(index), compile_with(layer))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _tp(fields: dict, mesh, compile_with=None):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from .llama_forward import TP_PLAN
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = parallelize_module(_model(fields), mesh, {k: styles[v]() for k, v in TP_PLAN.items()})
    return model if compile_with is None else compile_with(model)


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
    first = repeat(once, warmup, warmup=0)
    reset_peak()
    meter = Meter()
    samples = repeat(once, reps, warmup=0)
    result = {"samples": samples, "idle_mib": idle, "peak_mib": peak_mib(), "steal": meter.share(),
              "first_s": first[0] if first else None}
    model = optimizer = None   # frees both; `once` closes over the names, so they are rebound, not deleted
    gc.collect()   # the next layout starts from this layout's memory given back
    return result
