"""The in-place methods of DTensor (docs/reference/inplace.md): `<op>_` for every registered non-view op
that torch.Tensor has an `<op>_` for (a new pointwise op gets its in-place form for free), the
ones composed of ops or refilled from dtorch's random stream (fill_, copy_, normal_,
tril_, fill_diagonal_, ...), the shape changes and detach_ (dtorch/dtensor/inplace.py), and `x += y`.
Each computes its value as ordinary ops and hands it to inplace.assign, which rebinds x and
keeps every tensor sharing its values current.
"""
from __future__ import annotations

import torch

from . import aliasing
from ..spec.placements import Replicate
from ..errors import user_site
from .factories import arange, full_like, rand_like, randn_like, tensor as upload
from .inplace import VIEW_METHODS, _dtype, _detach_, assign
from ..ops import REGISTRY
from ..ops.tensor_meta import is_local_tensor
from . import api
from .tensor import DTensor, call_op

__all__ = ["INPLACE_METHODS", "EXTRA_METHODS"]


# --- the in-place methods -------------------------------------------------------------------------------
# In-place forms torch allows only on some dtypes, whatever casting allows (float_power's result
# is always float64 or complex128, and torch writes it into nothing narrower).
_INPLACE_DTYPES = {"float_power": (torch.float64, torch.complex128)}


def _method(op_name: str):
    allowed = _INPLACE_DTYPES.get(op_name)   # (looked up once: x.add_ pays nothing for float_power_)

    def method(self, *args, **kwargs):
        if allowed is not None and self.dtype not in allowed:
            raise RuntimeError(f"at {user_site()}: the base given to {op_name}_ has dtype {_dtype(self.dtype)} but "
                               f"the operation's result requires dtype {_dtype(allowed[0])}")
        return assign(self, call_op(op_name, (self,) + args, kwargs), f"x.{op_name}_")
    method.__name__ = f"{op_name}_"
    method.__doc__ = f"x.{op_name}_(...): x = x.{op_name}(...) in place (x's dtype, shape and placements kept)"
    return method


def _composed(name: str):
    """x.<name>_ for a method dtorch composes of ops (dtorch/torch_api/methods.py: x.tril(1))."""
    def method(self, *args, **kwargs):
        return assign(self, getattr(DTensor, name)(self, *args, **kwargs), f"x.{name}_")
    method.__name__ = f"{name}_"
    method.__doc__ = f"x.{name}_(...): x = x.{name}(...) in place (x's dtype, shape and placements kept)"
    return method


def _fill_diagonal_(self, fill_value, wrap=False):
    """torch's: the main diagonal (every index equal) set to fill_value; `wrap` restarts it below
    a tall matrix's square every ncols + 1 rows, as torch steps through the flat storage. A mask
    made on the workers (no index is uploaded), then one masked_fill."""
    if self.ndim < 2:
        raise RuntimeError("dimensions must larger than 1")
    if self.ndim > 2 and len(set(self.shape)) != 1:
        raise RuntimeError("all dimensions of input must be of equal length")
    mesh = self.device_mesh
    positions = [arange(n, device_mesh=mesh).reshape([n if d == k else 1 for d in range(self.ndim)])
                 for k, n in enumerate(self.shape)]
    if wrap and self.ndim == 2:
        columns = self.shape[1]
        mask = (positions[0] * columns + positions[1]) % (columns + 1) == 0
    else:
        mask = positions[0] == positions[1]
        for other in positions[2:]:
            mask = mask & (positions[0] == other)
    return assign(self, call_op("masked_fill", (self, mask, fill_value), {}), "x.fill_diagonal_")


def _fill_(self, value):
    if isinstance(value, DTensor):
        return _copy_(self, value)
    made = full_like(self, value)
    return assign(self, made, "x.fill_")


def _zero_(self):
    return _fill_(self, 0)


def _copy_(self, src, non_blocking=False):
    if not isinstance(self, DTensor):
        # a torch tensor taking a DTensor's values (torch's load_state_dict of a dtorch model's
        # state_dict): a read, as src.to_torch() would be
        return self.copy_(src.to_torch(), non_blocking)
    if is_local_tensor(src):
        src = upload(src, device_mesh=self.device_mesh, placements=[Replicate()] * self.device_mesh.ndim)
    with aliasing.tracking_paused():
        fresh = (call_op("expand", (src, tuple(self.shape)), {}) if tuple(src.shape) != tuple(self.shape)
                 else call_op("clone", (src,), {}))
    return assign(self, fresh, "x.copy_", cast_any=True)


def _normal_(self, mean=0.0, std=1.0, *, generator=None):
    """Refilled from dtorch's random stream (factories.randn: the same values on every layout),
    so torch.nn.init's normal_, xavier_normal_, kaiming_normal_ work on DTensors."""
    drawn = randn_like(self, generator=generator)
    return assign(self, drawn * std + mean, "x.normal_")


def _uniform_(self, a=0.0, b=1.0, *, generator=None):
    """Refilled from dtorch's random stream (uniform_, xavier_uniform_, kaiming_uniform_, and
    trunc_normal_ with erfinv_)."""
    drawn = rand_like(self, generator=generator)
    return assign(self, drawn * (b - a) + a, "x.uniform_")


# (clamp_min_, clamp_max_ and lerp_ are derived from their registry ops, as every <op>_ below.)
EXTRA_METHODS = {"fill_": _fill_, "zero_": _zero_, "copy_": _copy_, "normal_": _normal_, "uniform_": _uniform_,
                 "tril_": _composed("tril"), "triu_": _composed("triu"), "fill_diagonal_": _fill_diagonal_,
                 "detach_": _detach_, **VIEW_METHODS}


def _derived_names() -> list[str]:
    """`<op>_` for every registered method op torch has an in-place form of, view ops aside
    (x.transpose_ or x.unsqueeze_ change x's shape, not its values)."""
    return sorted(name for name, op in REGISTRY.items()
                  if op.method and op.family != "view" and name not in aliasing.VIEW_OPS
                  and hasattr(torch.Tensor, name + "_"))


# `x += y` is in place in torch: another name for x (y = x; y += 1) sees the change. Without
# these, Python would fall back to `x = x + y` and leave the other names with stale values.
AUGMENTED_ASSIGNMENT = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
                        "__ifloordiv__": "floor_divide_", "__imod__": "remainder_", "__ipow__": "pow_",
                        "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_"}


def _augmented(method: str):
    def operator(self, other):
        return getattr(self, method)(other)
    operator.__name__ = method
    return operator


def _install() -> tuple:
    for name in _derived_names():
        if not api.in_class_body(name + "_"):
            api.register_method(name + "_", _method(name))
    for name, fn in EXTRA_METHODS.items():
        if not api.in_class_body(name):
            api.register_method(name, fn)
    for dunder, method in AUGMENTED_ASSIGNMENT.items():
        if api.has_method(method):
            api.register_method(dunder, _augmented(method))
    return tuple(sorted([n + "_" for n in _derived_names()] + list(EXTRA_METHODS)))


INPLACE_METHODS = _install()
