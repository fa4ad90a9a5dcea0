"""dtorch: one ordinary Python process drives a whole cluster of PyTorch devices with a global view.

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])
    x = dtorch.randn(256, 128, device_mesh=mesh, placements=[Shard(0)])
    z = x + x                     # returns at once
    t = z.to_torch()              # or: await z.fetch()
"""
from __future__ import annotations

import torch as _torch

from .spec import placements as _placements
from .spec.placements import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from .errors import (DependencyError, DTorchError, MeshError, PlacementError, RemoteError, SessionEndedError,
                     ShapeError, StartupError, UnreadFailureWarning, UnsupportedOpError, WorkerLostError)
from .errors import CompileError, LocalTensorError, LostTensorError
from .dtensor.factories import (arange, distribute_tensor, empty, empty_like, eye, full, full_like, linspace,
                                ones, ones_like, rand, rand_like, randint, randn, randn_like, tensor, zeros,
                                zeros_like)
from .dtensor.factories import Tensor
from .spec.rng import Generator
from .ops.dispatch import is_strict, set_strict
from .runtime.controller import session as _session
from .runtime.controller.reads import Future
from .dtensor.sync_debug import (BlockingReadError, BlockingReadWarning, get_sync_debug_mode,
                                 set_sync_debug_mode)
from .dtensor import sync_debug as _sync_debug
from .dtensor import frontend_state as _frontend_state
from .dtensor.tensor import DTensor, call_op
from .dtensor import inplace as _inplace  # noqa: F401  (installs x[i] = v, p.data = t, the shape changes)
from .dtensor import inplace_methods as _inplace_methods  # noqa: F401  (installs x.add_, x.fill_, x += y, ...)
from .dtensor.inplace import AliasingError
from .dtensor import indexing as _advanced_indexing  # noqa: F401  (x[t], x[t] = v, index_put)
from .torch_api import methods as _torch_methods  # noqa: F401  (x.t(), x.flip(0), torch.tril(x), ...)
from .torch_api import compositions as _composites  # noqa: F401  (torch.tile(x), x.diff(), F.normalize(x), ...)
from .torch_api import losses as _composite_losses  # noqa: F401  (F.poisson_nll_loss, F.soft_margin_loss, ...)
from .torch_api import layers as _composite_layers  # noqa: F401  (F.dropout2d, F.instance_norm, torch.cdist, ...)
from .torch_api import foreach as _composite_foreach  # noqa: F401  (torch._foreach_mul_(list, 0.9), ...)
from .torch_api import order as _composite_order  # noqa: F401  (torch.argsort, torch.quantile, ...)
from .torch_api import random_draws as _composite_random  # noqa: F401  (torch.multinomial, x.bernoulli_(p), ...)
from .torch_api import stats as _composite_stats  # noqa: F401  (torch.cov, torch.histc, torch.take, ...)
from .torch_api import data_dependent as _composite_data_dependent  # noqa: F401  (torch.nonzero, x.unique(), ...)
from . import autograd
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from . import nn
from .nn import distribute_module
from . import optim
from . import utils
from . import checkpoint
from . import models
# The context manager takes the package's name: dtorch.profile(...) records, while
# `from dtorch.profile import summarize, plot` still reaches the package (sys.modules).
from .profile import profile
from .compile import RecaptureWarning, compile  # noqa: A001  (dtorch.compile, like torch.compile)

from .dtensor.tensor import refuse_the_rest as _refuse_the_rest
_refuse_the_rest()   # last: every module above has installed its DTensor methods

# init_device_mesh (pure layer) starts workers through the runtime: the one seam, installed here
_placements.set_worker_starter(_session.acquire_workers)

init = _session.init
init_async = _session.init_async
shutdown = _session.shutdown
workers = _session.workers
replace_lost_workers = _session.replace_lost_workers
manual_seed = _session.manual_seed
initial_seed, get_rng_state, set_rng_state = _session.initial_seed, _session.get_rng_state, _session.set_rng_state


def stats() -> dict:
    """Counters on the controller: commands_sent, messages_sent, bytes_sent, bytes_received, and
    redistributes_inserted (moves dtorch added before ops whose placements did not line up),
    local_tensors_uploaded (torch tensors given to an op beside DTensors, uploaded Replicate),
    checkpoint_tensors_loaded and checkpoint_bytes_via_controller (dtorch.checkpoint: tensor bytes
    the controller read itself, 0 unless via_controller=True), checkpoint_tensors_saved and
    checkpoint_bytes_saved (dtorch.checkpoint.save: written by the workers, so
    checkpoint_bytes_saved_via_controller is always 0), and reads_spun (blocking reads whose
    thread spun for the reply before it slept: the workers were idle, or the last two replies came
    quickly; dtorch/runtime/controller/reply_receiving.py, READ_SPIN_S), blocking_reads (reads that waited on
    the workers: to_torch(), item(), bool(x), ...) and implicit_reads (those of them that dtorch or
    torch made on the caller's behalf; dtorch.set_sync_debug_mode names their lines)."""
    controller = _session.controller()
    return {**controller.stats(), **_frontend_state.counts(controller), **_sync_debug.read_counts()}


def synchronize(timeout: float | None = None) -> None:
    """Wait until every worker has run everything issued so far; raise unreported remote errors."""
    _session.controller().synchronize(timeout)


# dtypes are torch's own objects: dtorch.float32 is torch.float32
float32, float64, float16, bfloat16 = _torch.float32, _torch.float64, _torch.float16, _torch.bfloat16
int8, int16, int32, int64, uint8 = _torch.int8, _torch.int16, _torch.int32, _torch.int64, _torch.uint8
bool = _torch.bool
# as in DTorch, torch's type objects under dtorch's name: dtorch.device is torch.device
device, dtype, finfo, iinfo = _torch.device, _torch.dtype, _torch.finfo, _torch.iinfo


def _op_function(name: str):
    def function(*args, **kwargs):
        return call_op(name, args, kwargs)
    function.__name__ = name
    return function


from .ops import REGISTRY as _REGISTRY  # noqa: E402
for _name in _REGISTRY:
    if _name not in globals():
        globals()[_name] = _op_function(_name)

__all__ = [
    "DTensor", "DeviceMesh", "Shard", "Replicate", "Partial", "init_device_mesh", "Future",
    "init", "init_async", "shutdown", "workers", "replace_lost_workers", "stats", "synchronize", "manual_seed",
    "initial_seed", "get_rng_state", "set_rng_state",
    "set_strict", "is_strict", "set_sync_debug_mode", "get_sync_debug_mode", "BlockingReadError", "BlockingReadWarning",
    "autograd", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "zeros", "ones", "empty", "full",
    "rand", "randn", "randint", "arange", "linspace", "eye", "tensor", "distribute_tensor", "distribute_module",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "Tensor", "Generator",
    "DTorchError", "ShapeError", "PlacementError", "MeshError", "UnsupportedOpError", "RemoteError", "DependencyError",
    "WorkerLostError", "LostTensorError", "LocalTensorError", "AliasingError", "StartupError", "SessionEndedError",
    "UnreadFailureWarning",
    "nn", "optim", "utils", "checkpoint", "models", "profile", "compile", "CompileError", "RecaptureWarning",
] + sorted(n for n in _REGISTRY if n in globals())
