"""mixed_precision: compute in a low-precision dtype with full-precision master weights.

`mixed_precision(model, torch.bfloat16)` keeps every parameter (and so its gradient and the
optimizer's state) in its own dtype, float32 say, and runs each module's forward on copies cast to
bfloat16: a forward pre-hook casts the parameters the module owns directly (a recorded `to`, so
backward casts their gradients back to float32 before they accumulate), and the floating-point
tensors among its positional arguments (at any depth), as FSDP2's
MixedPrecisionPolicy(cast_forward_inputs=True) does: a float32 batch
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

from ..dtensor.tensor import DTensor
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
            # before fully_shard's hook puts shards back; even when forward raises (optimizers hold them)
            sub.register_forward_hook(_restore, prepend=True, always_call=True)
    return module


def _cast(module: Module, args):
    dtype, saved = module._mixed_precision
    for name, param in module._parameters.items():
        if param is not None and param.dtype.is_floating_point and param.dtype != dtype:
            saved[name] = param
            module._parameters[name] = param.to(dtype)
    return cast_floating(args, dtype)


def _restore(module: Module, args, output):
    _, saved = module._mixed_precision
    for name, param in saved.items():
        module._parameters[name] = param
    saved.clear()


# --- fully_shard's mp_policy ----------------------------------------------------------------------------
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def check_policy(policy):
    """`policy` if it is a MixedPrecisionPolicy (dtorch's or torch's: the fields are read) that
    casts anything, None for None or one that casts nothing; else the error fully_shard raises."""
    if policy is None:
        return None
    missing = [name for name in _POLICY_FIELDS if not hasattr(policy, name)]
    if missing:
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy (dtorch.nn.MixedPrecisionPolicy or "
                        f"torch.distributed.fsdp.MixedPrecisionPolicy), got {policy!r}, which has no "
                        f"{', '.join(missing)}")
    for name in _POLICY_FIELDS[:3]:
        dtype = getattr(policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"fully_shard: mp_policy.{name} must be a floating-point torch dtype or None, "
                             f"not {dtype!r}")
    if all(getattr(policy, name) is None for name in _POLICY_FIELDS[:3]):
        return None
    return policy


def compute_dtype(policy, dtype: torch.dtype) -> torch.dtype:
    """What a parameter of `dtype` is gathered and computed in: the policy's param_dtype for a
    floating-point one."""
    param_dtype = getattr(policy, "param_dtype", None)
    return param_dtype if param_dtype is not None and dtype.is_floating_point else dtype


def reduce_dtype_of(policy, dtype: torch.dtype) -> torch.dtype:
    """What its gradient is reduce-scattered in: reduce_dtype, else param_dtype (FSDP2's default)."""
    reduce_dtype = getattr(policy, "reduce_dtype", None)
    if reduce_dtype is not None and dtype.is_floating_point:
        return reduce_dtype
    return compute_dtype(policy, dtype)


def cast_floating(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it (DTensor or torch) cast to `dtype`, through
    tuples (named ones too), lists and dicts."""
    if isinstance(value, (DTensor, torch.Tensor)):
        return value.to(dtype) if value.dtype.is_floating_point and value.dtype != dtype else value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return type(value)([(k, cast_floating(v, dtype)) for k, v in value.items()])
    return value
