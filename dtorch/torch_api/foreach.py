"""torch._foreach_* on lists of DTensors (EMA updates, hand-written optimizers): each is a loop of
the one-tensor op over the list, in place where torch's is (dtorch/dtensor/inplace.py), so every
element keeps its placements. torch hands a list holding a DTensor to __torch_function__ under
the function's own name (`_foreach_mul_`), which finds these in dtensor/api.py's TORCH_FUNCTIONS.

The second operand may be what torch takes: one scalar, a list of scalars, a list of tensors or
one tensor. In-place forms return the list and the others a tuple, as torch's do. tests/test_composites_nn.py checks
each against torch.
"""
from __future__ import annotations

import torch

from ..dtensor.api import register_torch_spellings
from ..dtensor.tensor import DTensor

__all__ = ["FOREACH", "group_by_device_and_dtype"]


def _each(other, count: int) -> list:
    return list(other) if isinstance(other, (list, tuple)) else [other] * count


def _binary(method: str, inplace: bool):
    """_foreach_<method>[_](self, other, *, alpha=...) as a loop of tensor.<method>[_]."""
    name = method + "_" if inplace else method

    def foreach(self, other, **kwargs):
        self = list(self)
        results = [getattr(t, name)(o, **kwargs) for t, o in zip(self, _each(other, len(self)))]
        return self if inplace else tuple(results)
    foreach.__name__ = foreach.__qualname__ = f"_foreach_{name}"
    return foreach


def _ternary(method: str, inplace: bool):
    """_foreach_<method>[_](self, tensors1, tensors2_or_weight, value...) as a loop (addcmul,
    addcdiv: `value`, a list of scalars or a 1-D tensor of them, read; lerp: one weight, or a list of weights)."""
    name = method + "_" if inplace else method

    def foreach(self, first, second, *rest, **kwargs):
        self = list(self)
        count = len(self)
        if method == "lerp":
            pieces = zip(self, first, _each(second, count))
            results = [getattr(t, name)(end, weight) for t, end, weight in pieces]
        else:
            value = rest[0] if rest else kwargs.pop("value", kwargs.pop("scalars", 1))
            if isinstance(value, (torch.Tensor, DTensor)):   # torch's `scalars` tensor: one per element
                value = value.tolist()
            pieces = zip(self, first, second, _each(value, count))
            results = [getattr(t, name)(a, b, value=v) for t, a, b, v in pieces]
        return self if inplace else tuple(results)
    foreach.__name__ = foreach.__qualname__ = f"_foreach_{name}"
    return foreach


def _foreach_copy_(self, src, non_blocking: bool = False):
    self = list(self)
    for t, s in zip(self, src):
        t.copy_(s)
    return self


def _foreach_zero_(self):
    self = list(self)
    for t in self:
        t.zero_()
    return self


def _foreach_norm(self, ord=2, dtype=None):
    """Each tensor's whole-tensor vector norm, a 0-d tensor each."""
    return tuple([(t if dtype is None else t.to(dtype)).norm(ord) for t in self])


FOREACH = {f"_foreach_{method}{'_' if inplace else ''}": build(method, inplace)
           for build, methods in ((_binary, ("add", "sub", "mul", "div")), (_ternary, ("addcmul", "addcdiv", "lerp")))
           for method in methods for inplace in (True, False)}
FOREACH.update(_foreach_copy_=_foreach_copy_, _foreach_zero_=_foreach_zero_, _foreach_norm=_foreach_norm)


register_torch_spellings(FOREACH)


# --- torch's grouping of foreach lists ------------------------------------------------------------
def group_by_device_and_dtype(tensorlistlist, with_indices: bool = False) -> dict:
    """torch.utils._foreach_utils._group_tensors_by_device_and_dtype for lists holding DTensors:
    {(device, dtype) of the first list's tensor: ([each list's tensors], [their indices])}. torch's
    is a C++ helper that refuses DTensors; swa_utils.AveragedModel.update_parameters (EMA) and
    torch's foreach optimizers call it before the _foreach_* functions above."""
    groups: dict = {}
    for index, tensor in enumerate(tensorlistlist[0]):
        lists, indices = groups.setdefault((tensor.device, tensor.dtype), ([[] for _ in tensorlistlist], []))
        for grouped, source in zip(lists, tensorlistlist):
            grouped.append(source[index])
        indices.append(index)
    return groups


def _install_grouping() -> None:
    import functools
    import importlib
    for module_name in ("torch.utils._foreach_utils", "torch.optim.swa_utils", "torch.optim.optimizer"):
        module = importlib.import_module(module_name)
        theirs = getattr(module, "_group_tensors_by_device_and_dtype", None)
        if theirs is None or getattr(theirs, "__wrapped_by_dtorch__", False):
            continue

        @functools.wraps(theirs)
        def either(tensorlistlist, with_indices: bool = False, theirs=theirs):
            if any(isinstance(t, DTensor) for t in tensorlistlist[0]):
                return group_by_device_and_dtype(tensorlistlist, with_indices)
            return theirs(tensorlistlist, with_indices)
        either.__wrapped_by_dtorch__ = True
        module._group_tensors_by_device_and_dtype = either


_install_grouping()
