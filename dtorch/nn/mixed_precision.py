"""mixed_precision: compute in a low-precision dtype with full-precision master weights.

`mixed_precision(model, torch.bfloat16)` keeps every parameter (and so its gradient and the
optimizer's state) in its own dtype, float32 say, and runs each module's forward on copies cast to
bfloat16: a forward pre-hook casts the parameters the module owns directly (a recorded `to`, so
backward casts their gradients back to float32 before they accumulate), and its floating-point
DTensor arguments, as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does: a float32 batch
meets bfloat16 weights in one dtype (torch's kernels refuse two). The forward hook puts the
Parameters back. Floating-point activations follow the weights' dtype; code that wants float32
(a loss, a norm's statistics) casts explicitly, as dtorch.models.llama does.

It composes with fully_shard: applied after it, each cast happens on the gathered copy (the
gather and the reduce-scatter of gradients stay in float32). FSDP2's own switch,
`fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`, casts inside
the gather instead, so the all-gather moves the low-precision bytes (dtorch/nn/fsdp.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensor import DTensor
from .module import Module

__all__ = ["mixed_precision", "MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch.distributed.fsdp.MixedPrecisionPolicy's fields, for `fully_shard(mp_policy=...)`
    (which takes torch's own class as well): `param_dtype`, the dtype parameters are gathered
    and computed in; `reduce_dtype`, the gradients' reduce-scatter's (default: param_dtype);
    `output_dtype`, what a fully-sharded module's floating-point outputs are cast to;
    `cast_forward_inputs`, whether its floating-point inputs are cast to param_dtype."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def mixed_precision(module: Module, param_dtype: torch.dtype = torch.bfloat16) -> Module:
    """Run `module`'s forward (every submodule's) with its floating-point parameters cast to
    `param_dtype`; the parameters themselves keep their dtype. Returns the module."""
    if not param_dtype.is_floating_point:
        raise ValueError(f"mixed_precision: param_dtype must be a floating-point dtype, not {param_dtype}")
    for sub in module.modules():
        if any(p is not None and p.dtype.is_floating_point for p in sub._parameters.values()):
            sub._mixed_precision = (param_dtype, {})
            sub.register_forward_pre_hook(_cast)
            sub.register_forward_hook(_restore, prepend=True)   # before fully_shard's hook puts shards back
    return module


def _cast(module: Module, args):
    dtype, saved = module._mixed_precision
    for name, param in module._parameters.items():
        if param is not None and param.dtype.is_floating_point and param.dtype != dtype:
            saved[name] = param
            module._parameters[name] = param.to(dtype)
    if any(_cast_input(a, dtype) for a in args):
        return tuple(a.to(dtype) if _cast_input(a, dtype) else a for a in args)
    return None


def _cast_input(value, dtype: torch.dtype) -> bool:
    return isinstance(value, DTensor) and value.dtype.is_floating_point and value.dtype != dtype


def _restore(module: Module, args, output):
    _, saved = module._mixed_precision
    for name, param in saved.items():
        module._parameters[name] = param
    saved.clear()
