"""In-place ops and item assignment, functional underneath (docs/reference/inplace.md).

`x.add_(y)` computes `x.add(y)` as an ordinary op and rebinds the Python object x to the new
symbol (the old id is released once; the temporary never frees the new one). The result takes
torch's in-place semantics: cast to x's dtype, x's shape (broadcasting may not grow it), and x's
placements (redistributed back if the op's rule chose others), so x's layout never changes under
the user. `x[index] = value` is the `setitem` op (dtorch/ops/assignment.py), rebound the same way.

Aliasing (dtorch/dtensor/aliasing.py holds the bookkeeping): when x changes, the live views made from it
are re-derived from its new value, and when a view changes, the change is written back into its
base (through every view step up to the storage root) before the root's other views are
re-derived: torch's semantics. What cannot be followed raises AliasingError at the in-place call,
before anything changes: a write through `expand`, and a write through a view whose root is gone
while another view of that root still lives.

The in-place methods themselves (x.add_, x.fill_, x.normal_, x += y, ...) are installed by
dtorch/dtensor/inplace_methods.py; the shape changes (x.t_(), x.unsqueeze_()) and detach_ are here,
beside the aliasing they change.
"""
from __future__ import annotations

import contextlib

import torch

from . import compile_capture as capturing
from . import aliasing
from ..spec.placements import Replicate
from ..errors import CompileError, DTorchError, ShapeError, user_site
from .factories import tensor as upload
from ..ops import REGISTRY
from ..ops.indexing import WHOLE, AdvancedIndex, canonical_index
from ..ops.tensor_meta import is_local_tensor
from .recording import Leaf, is_grad_enabled
from ..runtime.protocol import RequireGrad, SetGrads
from . import api
from .tensor import DTensor, call_op

__all__ = ["AliasingError", "assign", "VIEW_METHODS"]


class AliasingError(DTorchError, RuntimeError):
    """An in-place change dtorch cannot carry to every tensor that shares its values in torch."""


# --- rebinding ------------------------------------------------------------------------------------
def assign(target: DTensor, result: DTensor, op: str, cast_any: bool = False) -> DTensor:
    """`target` takes `result`'s values in place; `result` must be a fresh symbol (it is consumed)."""
    result = _conform(target, result, op, cast_any)
    node = aliasing.node_of(target)
    if node is None:    # the common case: no views, not a view
        _rebind(target, result)
    else:
        _write(node, result, op)
    return target


def _conform(target: DTensor, result: DTensor, op: str, cast_any: bool = False) -> DTensor:
    if tuple(result.shape) != tuple(target.shape):
        raise ShapeError(f"{op} at {user_site()}: output with shape {list(target.shape)} doesn't match the "
                         f"broadcast shape {list(result.shape)} (an in-place op keeps its tensor's shape)")
    if result.dtype != target.dtype:
        if not (cast_any or torch.can_cast(result.dtype, target.dtype)):
            raise ShapeError(f"{op} at {user_site()}: result type {_dtype(result.dtype)} can't be cast to the "
                             f"desired output type {_dtype(target.dtype)}")
        result = result.to(target.dtype)
    if result.device_mesh != target.device_mesh or result.placements != target.placements:
        result = result.redistribute(target.device_mesh, target.placements)
    return result


def _dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(dtype, str(dtype))


def _rebind(target: DTensor, result: DTensor, release_old: bool = True) -> None:
    """target takes result's id (and its autograd history). A leaf that requires grad stays that
    leaf, as in torch: changed under no_grad only, its gradient still bound to it on the workers.
    `release_old` False: another object carries target's old id now (_become_view)."""
    if result is target:
        return
    leaf = target._node if type(target._node) is Leaf else None
    if leaf is not None and result._node is not None:
        raise _leaf_changed("a leaf Variable")
    old, controller = target._id, target._controller
    capture = capturing.active()
    if capture is not None:   # dtorch.compile: a replay rebinds (or rebinds from) this tensor too
        capture.rebind(target, old)
    target._id, target._meta, target._seq = result._id, result._meta, result._seq
    result._controller = None          # the temporary must not free the id target now holds
    if release_old:
        controller.release(old)
    if leaf is None:
        target._node = result._node
        return
    controller.submit(RequireGrad, (target._id,), True)
    if leaf.grad is not None:
        controller.submit(SetGrads, (target._id,), (leaf.grad._id,))


def _leaf_changed(what: str) -> RuntimeError:
    return RuntimeError(f"at {user_site()}: {what} that requires grad is being used in an in-place operation "
                        "(change it under dtorch.no_grad(), as in torch)")


# dtensor/tensor.py's inplace=True seam
api.register_method("_assign", lambda self, result, op: assign(self, result, op))


def _set_data(self: DTensor, value) -> None:
    """`p.data = t`, torch's: p takes t's values, shape, dtype and layout, shared with t as torch
    shares t's storage (p becomes a view of t: a change to either reaches the other, through
    dtorch/dtensor/aliasing.py), and keeps its identity: a leaf stays that leaf, with requires_grad and
    .grad (dropped if t's dtype or shape no longer fits it). Views made of p before keep p's old
    values, as torch's keep the old storage."""
    if not isinstance(value, DTensor):
        raise TypeError(f"Variable data has to be a tensor, but got {type(value).__name__}")
    if not self.is_leaf:
        raise RuntimeError(f"at {user_site()}: p.data = t on a tensor with autograd history is not supported by "
                           "dtorch; set it on a leaf, or on p.detach()")
    if value is self:
        return
    with aliasing.tracking_paused():
        alias = call_op("detach", (value,), {})
    leaf = self._node
    if leaf is not None and leaf.grad is not None and (leaf.grad.dtype, leaf.grad.shape) != (alias.dtype, alias.shape):
        leaf.grad = leaf.bound = None   # torch keeps a .grad that no longer fits; the workers cannot hold one
    aliasing.forget(self)
    _rebind(self, alias)
    aliasing.note_view("detach", (value,), {}, self)


api.register_method("data", DTensor.data.setter(_set_data), over_class_body=True)


# --- in-place view ops: x.transpose_(0, 1), x.t_(), x.unsqueeze_(0), x.squeeze_() ---------------
def _become_view(self: DTensor, method: str, args: tuple, kwargs: dict) -> DTensor:
    """x becomes a view of its own old value, as torch changes x's shape and strides over the same
    storage: the views made of x before keep sharing values with it (v = x[0]; x.t_(); x.add_(1)
    changes v), through a hidden DTensor that carries x's old id (aliasing.hand_over). Where x
    is no view and has none, x simply takes the new tensor (its later in-place ops then write
    back into nothing). A leaf that
    requires grad is refused unless under no_grad, as in torch; then its .grad, of the old shape,
    is dropped (torch keeps one that no backward can accumulate into)."""
    leaf = self._node if type(self._node) is Leaf else None
    if leaf is not None and is_grad_enabled():
        raise _leaf_changed("a leaf Variable")
    capture = capturing.active()
    if capture is not None and self._id <= capture.start_id:
        raise CompileError(f"x.{method}() at {user_site()}, inside compiled {capture.name}, changes the shape of a "
                           f"tensor from before the call: a replay cannot repeat it. Write x = x.{method[:-1]}(...) "
                           "inside, or call it outside the compiled function")
    shared = _shares_values(self)
    with contextlib.nullcontext() if shared else aliasing.tracking_paused():
        view = getattr(DTensor, method[:-1])(self, *args, **kwargs)   # tracked as a view of x if shared
    if view is self:   # x.t_() of a 0-D or 1-D tensor, as torch: nothing changes
        return self
    if leaf is not None and leaf.grad is not None and leaf.grad.shape != view.shape:
        leaf.grad = leaf.bound = None
    if not shared:   # nothing else sees x's values: x simply takes the new tensor
        aliasing.forget(self)
        _rebind(self, view)
        return self
    holder = DTensor(self._id, self._meta, self._seq, self._controller)
    holder._node = None if leaf is not None else self._node   # the leaf stays with x
    aliasing.hand_over(self, holder, view)
    _rebind(self, view, release_old=False)
    return self


def _shares_values(tensor: DTensor) -> bool:
    """Is `tensor` a view, or has it a live view? (else a change to it reaches nothing else)"""
    node = aliasing.node_of(tensor)
    return node is not None and (node.parent is not None or any(_has_live(c) for c in list(node.children.values())))


def _detach_(self: DTensor) -> DTensor:
    """torch's: x leaves the graph that made it (a leaf stops requiring grad); a view refuses."""
    node = aliasing.node_of(self)
    if node is not None and node.parent is not None and aliasing.aliases(node) and node.step[0] != "detach":
        raise RuntimeError(f"at {user_site()}: Can't detach views in-place. Use detach() instead.")
    if type(self._node) is Leaf:
        return self.requires_grad_(False)
    self._node = None
    return self


def _view_method(method: str):
    def inplace_view(self, *args, **kwargs):
        return _become_view(self, method, args, kwargs)
    inplace_view.__name__ = method
    inplace_view.__doc__ = f"x.{method}(...): x becomes x.{method[:-1]}(...), sharing values with its views as in torch"
    return inplace_view


VIEW_METHODS = {name: _view_method(name) for name in
                ("transpose_", "swapdims_", "swapaxes_", "t_", "unsqueeze_", "squeeze_")}


# --- aliasing: write up to the storage root, then re-derive its views ------------------------------
def _write(node: aliasing.Node, result: DTensor, op: str) -> None:
    path = _storage_path(node, op)
    if result._node is not None and any(type(getattr(n.obj(), "_node", None)) is Leaf for n in path[1:]):
        raise _leaf_changed("a view of a leaf Variable")   # before the view changes alone
    with aliasing.tracking_paused():
        values = _current_values(path)
        values[node] = result
        for child, parent in zip(path, path[1:]):
            values[parent] = _conform_meta(parent, _write_back(values[parent], child.step, values[child]), op)
        for n in path:
            if n.obj() is not None:
                _rebind(n.obj(), values[n])
                values[n] = n.obj()
        _refresh(path[-1], values, set(path))


def _storage_path(node: aliasing.Node, op: str) -> list:
    """node, its parent, ... up to the highest ancestor it aliases (the storage root), checked
    before anything changes."""
    path = [node]
    while path[-1].parent is not None and aliasing.aliases(path[-1]):
        if path[-1].step[0] == "expand":
            raise AliasingError(f"{op} at {user_site()} writes through an expand: several elements share one "
                                "memory location in torch (torch refuses it too); clone() the expanded tensor first")
        if path[-1].step[0] == "unfold":   # (overlapping windows share elements, and torch refuses those)
            raise AliasingError(f"{op} at {user_site()} writes through x.unfold(...)'s windows, which dtorch does not "
                                "write back into x; clone() the windows first, or change x itself")
        path.append(path[-1].parent)
    top = path[-1]
    if top.obj() is None:   # the root is gone: fine unless another view of it still lives
        other = _live_view(top, skip=path[0])
        if other is not None:
            raise AliasingError(
                f"{op} at {user_site()} changes a view whose base tensor is gone while another view of that "
                f"base, {other!r}, still lives: in torch both share memory and dtorch can no longer update the "
                "other one. Keep the base alive (and change it, or the view, with it alive), or clone() the view first")
        aliasing.detach(node)
        return [node]
    return path


def _live_view(node: aliasing.Node, skip: aliasing.Node):
    for child in list(node.children.values()):
        if child is skip or not aliasing.aliases(child):
            continue
        found = child.obj()
        if found is None:
            found = _live_view(child, skip)
        if found is not None:
            return found
    return None


def _current_values(path: list) -> dict:
    """Each node of the path as a DTensor: a live one is its object, a ghost is derived from above."""
    values = {path[-1]: path[-1].obj()}
    for child, parent in reversed(list(zip(path, path[1:]))):
        values[child] = child.obj() if child.obj() is not None else _derive(values[parent], child.step)
    return values


def _refresh(node: aliasing.Node, values: dict, written: set) -> None:
    """Re-derive every live view below `node` (except the written path, already current)."""
    for child in list(node.children.values()):
        if not aliasing.aliases(child):
            continue
        if child not in written:
            if not _has_live(child):
                continue
            values[child] = _conform_meta(child, _derive(values[node], child.step), "re-deriving a view")
            if child.obj() is not None:
                _rebind(child.obj(), values[child])
                values[child] = child.obj()
        _refresh(child, values, written)


def _has_live(node: aliasing.Node) -> bool:
    return node.obj() is not None or any(_has_live(c) for c in list(node.children.values()))


def _conform_meta(node: aliasing.Node, value: DTensor, op: str) -> DTensor:
    """A re-derived value in the node's own dtype and placements (its layout never changes)."""
    meta = node.meta
    if value.dtype != meta.dtype:
        value = value.to(meta.dtype)
    if value.placements != meta.placements:
        value = value.redistribute(meta.mesh, meta.placements)
    return value


def _derive(base: DTensor, step) -> DTensor:
    name, rest, kwargs, index = step
    out = call_op(name, (base,) + tuple(rest), kwargs)
    return out if index is None else out[index]


# --- writing a view's new value back into its base, per view op -------------------------------------
def _write_back(base: DTensor, step, value: DTensor) -> DTensor:
    name, rest, kwargs, index = step
    if name in _REGION_STEPS:
        return call_op("setitem", (base, _REGION_STEPS[name](base, rest, kwargs, index), value), {})
    if name == "transpose":
        dim0, dim1 = _params(rest, kwargs, ("dim0", "dim1"))
        return call_op("transpose", (value, dim0, dim1), {})
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest or kwargs["dims"]
        inverse = sorted(range(len(dims)), key=lambda i: dims[i] % len(dims))
        return call_op("permute", (value, tuple(inverse)), {})
    if name == "diagonal":
        offset, dim1, dim2 = _params(rest, kwargs, ("offset", "dim1", "dim2"), (0, 0, 1))
        return call_op("diagonal_scatter", (base, value, offset, dim1, dim2), {})
    if name in ("contiguous", "detach"):   # the same elements: the view's value is the base's
        return call_op("clone", (value,), {})
    return call_op("reshape", (value, tuple(base.shape)), {})   # the reshape family keeps element order


def _params(rest: tuple, kwargs: dict, names: tuple, defaults: tuple = ()) -> list:
    values = list(rest) + [None] * (len(names) - len(rest))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
        elif values[i] is None and i >= len(names) - len(defaults):
            values[i] = defaults[i - (len(names) - len(defaults))]
    return values


def _along(base: DTensor, dim: int, item) -> tuple:
    dim %= base.ndim
    return (WHOLE,) * dim + (item,) + (WHOLE,) * (base.ndim - dim - 1)


def _narrow_index(base, rest, kwargs, index):
    dim, start, length = _params(rest, kwargs, ("dim", "start", "length"))
    dim %= base.ndim
    start += base.shape[dim] if start < 0 else 0
    return _along(base, dim, (start, start + length, 1))


_REGION_STEPS = {
    "getitem": lambda base, rest, kwargs, index: rest[0],
    "narrow": _narrow_index,
}


def _pieces(name):
    def index_of(base, rest, kwargs, index):
        pieces = REGISTRY[name].torch_fn(base._meta.meta(), *rest, **kwargs)
        dim = _params(rest, kwargs, ("dim",) if name == "unbind" else ("_", "dim"), (0,))[-1] % base.ndim
        if name == "unbind":
            return _along(base, dim, index)
        start = sum(piece.shape[dim] for piece in pieces[:index])
        return _along(base, dim, (start, start + pieces[index].shape[dim], 1))
    return index_of


_REGION_STEPS.update({name: _pieces(name) for name in ("split", "chunk", "unbind")})


# --- item assignment ----------------------------------------------------------------------------------
def _setitem(self: DTensor, index, value) -> None:
    try:
        canonical = canonical_index(index, self._meta.shape)
    except AdvancedIndex:   # index tensors, lists, masks: dtorch/dtensor/indexing.py
        return self._advanced_setitem(index, value)
    if is_local_tensor(value):   # an explicit upload: the only way local data enters
        value = upload(value, device_mesh=self.device_mesh, placements=[Replicate()] * self.device_mesh.ndim)
    result = call_op("setitem", (self, canonical, value), {})
    assign(self, result, "x[index] = value")


api.register_method("__setitem__", _setitem)
