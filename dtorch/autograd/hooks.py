"""Tensor hooks on leaves: `p.register_hook(fn)` and `p.register_post_accumulate_grad_hook(fn)`.

The workers run backward with torch's engine, where no controller Python can run; a leaf's
hook needs none. A leaf with hooks gets this backward's gradient apart, in a fresh accumulator
instead of its `.grad` (and outside the data-parallel buckets), and once the Backward command is
issued the controller calls its hooks on that DTensor: their ops queue behind the backward, as
any op's would, nothing waits. `.grad` then becomes the old gradient plus what the hooks
returned. autograd.grad() runs them on the gradient it returns, as torch does. Post-accumulate
hooks run after the whole backward, with the leaf, its `.grad` complete (optimizer-in-backward).

A hook on an intermediate would change the gradient flowing on inside the workers' backward:
refused, with what to write instead. Handles are torch's RemovableHandle.
"""
from __future__ import annotations

from collections import OrderedDict

from torch.utils.hooks import RemovableHandle

from ..errors import UnsupportedOpError, user_site
from ..dtensor.recording import Leaf, no_grad
from ..dtensor import api
from ..dtensor.tensor import DTensor

__all__ = ["register_hook", "register_post_accumulate_grad_hook", "has_hooks", "run_hooks", "run_post_hooks"]


def register_hook(self: DTensor, hook) -> RemovableHandle:
    """hook(grad) -> a new gradient or None, called with each gradient computed for this leaf."""
    leaf = _leaf(self, "register_hook", "hooks on intermediate tensors run inside backward, which the workers run "
                 "with torch's engine: register it on a leaf (a parameter, or an input with requires_grad=True), or "
                 "call x.retain_grad() and use x.grad after backward")
    if leaf.hooks is None:
        leaf.hooks = OrderedDict()   # (a plain dict cannot be weakly referenced, as the handle does)
    handle = RemovableHandle(leaf.hooks)
    leaf.hooks[handle.id] = hook
    return handle


def register_post_accumulate_grad_hook(self: DTensor, hook) -> RemovableHandle:
    """hook(tensor) -> None, called after a backward has accumulated this leaf's gradient."""
    if self._node is not None and type(self._node) is not Leaf:
        raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
    leaf = _leaf(self, "register_post_accumulate_grad_hook", "")
    if leaf.post_hooks is None:
        leaf.post_hooks = OrderedDict()
    handle = RemovableHandle(leaf.post_hooks)
    leaf.post_hooks[handle.id] = hook
    return handle


def _leaf(tensor: DTensor, method: str, intermediate: str) -> Leaf:
    if tensor._node is None:
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    if type(tensor._node) is not Leaf:
        raise UnsupportedOpError(f"x.{method} at {user_site()} on an intermediate tensor: {intermediate}")
    return tensor._node


def has_hooks(tensor: DTensor) -> bool:
    """A leaf with hooks (an intermediate's node has no hooks slot: it can hold none)."""
    return bool(getattr(tensor._node, "hooks", None))


def run_hooks(tensor: DTensor, grad: DTensor) -> DTensor:
    """The leaf's hooks, in registration order, each on what the one before returned."""
    with no_grad():
        for hook in list(tensor._node.hooks.values()):
            result = hook(grad)
            if result is None:
                continue
            if not isinstance(result, DTensor):
                raise TypeError(f"backward hook {_name(hook)} returned {type(result).__name__}: return a DTensor, "
                                "or None to keep the gradient")
            if tuple(result.shape) != tuple(grad.shape):
                raise RuntimeError(f"hook {_name(hook)} has changed the size of value: {tuple(grad.shape)} -> "
                                   f"{tuple(result.shape)}")
            if result.dtype != grad.dtype:
                raise RuntimeError(f"hook {_name(hook)} has changed the type of value (was {grad.dtype} got "
                                   f"{result.dtype})")
            grad = result
    return grad


def run_post_hooks(tensors) -> None:
    """After a backward: each reached leaf's post-accumulate hooks, once, in creation order."""
    hooked = {id(t._node): t for t in tensors if type(t._node) is Leaf and t._node.post_hooks}
    for tensor in sorted(hooked.values(), key=lambda t: t._id):
        with no_grad():
            for hook in list(tensor._node.post_hooks.values()):
                hook(tensor)


def _name(hook) -> str:
    return repr(getattr(hook, "__name__", hook))


api.register_methods({"register_hook": register_hook,
                      "register_post_accumulate_grad_hook": register_post_accumulate_grad_hook})
