"""dtorch.nn.utils: gradient clipping over DTensor parameters, torch.nn.utils' names and results.
The norm is global (every shard of every parameter, a Replicate copy counted once): one GradNorm
command and one small all-reduce per mesh, then one UpdateGrads per mesh scales in place.

torch's own `torch.nn.utils.clip_grad_norm_` (nanoGPT's and most training loops' spelling) hands
the grads to a C++ helper that no __torch_function__ reaches, so it cannot take DTensors. Importing
dtorch wraps torch's three functions, and vector_to_parameters, which refuses a DTensor vec
(`_hand_dtensors_to_dtorch`): DTensor parameters go to the functions here, anything else to
torch's own, unchanged.
"""
from __future__ import annotations

import functools
import inspect
import math

import torch

from ..autograd import reduce_gradients
from ..optim.grads import total_norm, update_grads
from ..dtensor.recording import no_grad
from ..dtensor.tensor import DTensor, call_op

__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "vector_to_parameters"]


def _grads(parameters) -> list:
    params = [parameters] if isinstance(parameters, DTensor) else list(parameters)
    reduce_gradients(params)   # pending data-parallel gradients: one all-reduce per bucket
    return [p.grad for p in params if getattr(p, "grad", None) is not None]


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """The norm of all `tensors` (DTensors) together, a 0-d Replicate DTensor; torch.tensor(0.)
    for none, as torch. error_if_nonfinite reads the norm (one blocking read)."""
    tensors = [tensors] if isinstance(tensors, DTensor) else list(tensors)
    if not tensors:
        return torch.tensor(0.0)
    total = total_norm(tensors, norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None):
    """Scale every grad in place by min(1, max_norm / (total_norm + 1e-6)), as torch does;
    returns the total norm (0-d, Replicate). `foreach` is accepted and ignored."""
    grads = _grads(parameters)
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    if not grads:
        return total
    factor = call_op("clamp", (float(max_norm) / (total + 1e-6),), {"max": 1.0})
    update_grads("clip_grad_norm_", grads, factor)
    return total


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every grad in place to [-clip_value, clip_value]: one command per mesh."""
    grads = _grads(parameters)
    if grads:
        update_grads("clip_grad_value_", grads, bound=float(clip_value))


def vector_to_parameters(vec: DTensor, parameters) -> None:
    """Copy consecutive slices of the 1-D DTensor `vec` into `parameters`, in place and without
    autograd history: each slice reshaped to its parameter and moved to the parameter's mesh and
    placements, so every parameter keeps its layout (torch instead rebinds param.data to a view
    of vec). A torch.Tensor parameter receives the slice's values read back."""
    if vec.ndim != 1:
        raise RuntimeError(f"vector_to_parameters: vec must be 1-D, got shape {tuple(vec.shape)}")
    pointer = 0
    with no_grad():
        for param in parameters:
            piece = vec.narrow(0, pointer, param.numel()).reshape(tuple(param.shape))
            if isinstance(param, DTensor):
                param.copy_(piece.redistribute(param.device_mesh, param.placements))
            else:
                param.data.copy_(piece.to_torch())
            pointer += param.numel()


# --- torch.nn.utils' spellings ----------------------------------------------------------------------
def _hand_dtensors_to_dtorch(torch_function, ours):
    """torch_function, except that parameters (or tensors) holding a DTensor go to `ours`."""
    first = next(iter(inspect.signature(torch_function).parameters))

    @functools.wraps(torch_function)
    def either(*args, **kwargs):
        given = args[0] if args else kwargs.get(first)
        if isinstance(given, (torch.Tensor, DTensor)) or given is None:
            items = given
        else:   # an iterable, maybe a generator: read once, handed on as a list
            items = list(given)
            args, kwargs = ((items,) + args[1:], kwargs) if args else (args, {**kwargs, first: items})
        if isinstance(items, DTensor) or (isinstance(items, list) and any(isinstance(t, DTensor) for t in items)):
            return ours(*args, **kwargs)
        return torch_function(*args, **kwargs)
    either.__wrapped_by_dtorch__ = True
    return either


def _install_torch_spellings() -> None:
    from torch.nn.utils import clip_grad, convert_parameters
    for name, ours in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_),
                       ("get_total_norm", get_total_norm), ("vector_to_parameters", vector_to_parameters)):
        for module in (torch.nn.utils, clip_grad, convert_parameters):
            theirs = getattr(module, name, None)
            if theirs is not None and not getattr(theirs, "__wrapped_by_dtorch__", False):
                setattr(module, name, _hand_dtensors_to_dtorch(theirs, ours))


_install_torch_spellings()
