"""fully_shard's forward prefetch: which module's all-gather the controller begins while a module's
forward runs, so that the next group's gather overlaps this one's compute (FSDP2's
set_modules_to_forward_prefetch; docs/design/training.md, "Prefetch").

The controller decides, since it alone sees the order in which the modules' forwards run: the
workers see one command after another. Each outermost fully-sharded forward (the root's) notes
the order of the fully-sharded forwards inside it; in the next forward each module, once its own
gather is issued, begins the gather of the module that came after it last time. A prefetch is
begun and finished inside one root forward, so no optimizer step can change a shard between the
two; one left unfinished (the next module did not run this time) is dropped as the root's forward
ends. By default at most one group is held beyond those gathered without prefetch.

Not inside an activation-checkpointed region (dtorch.utils.checkpoint): the region runs its
commands again in backward, a prefetch's beginning among them, and keeps what it read from before
it, a prefetched buffer too, until then: a whole gathered group per region. So a module whose
forward ran inside a region last time is not prefetched, and a module inside one neither begins
a prefetch nor finishes one (its own gather runs whole, as without prefetch).
"""
from __future__ import annotations

from ..dtensor import frontend_state
from ..runtime.controller import session

__all__ = ["set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"]

# The fully-sharded modules whose forward runs now, outermost (the root) first.
_RUNNING: list = []


def set_modules_to_forward_prefetch(module, modules) -> None:
    """FSDP2's FSDPModule.set_modules_to_forward_prefetch: once `module`'s parameters are
    gathered in its forward, begin the all-gathers of `modules` (fully-sharded modules whose
    forward comes later in the same root forward), in place of the default, the module whose
    forward came next last time. An empty list turns prefetch off for `module`; None restores
    the default. Each module prefetched holds its gathered group until its forward: more
    memory for more overlap."""
    if modules is not None:
        modules = list(modules)
        for target in [module] + modules:
            if not hasattr(target, "_fsdp_managed"):   # fsdp.is_fully_sharded (fsdp imports this module)
                raise TypeError(f"set_modules_to_forward_prefetch: {type(target).__name__} is not fully "
                                "sharded; call fully_shard on it first")
    module._fsdp_forward_prefetch = modules


def set_modules_to_backward_prefetch(module, modules) -> None:
    """FSDP2's FSDPModule.set_modules_to_backward_prefetch, in its two common forms: None (the
    default), once backward gathers `module`'s parameters again, begin the gather of the module
    gathered before it in forward (whose backward comes next); [] turns that off. The order is
    the workers' own (runtime/worker/fsdp_gather.py: backward runs inside one command, with no
    controller between its nodes), so an explicit list of other modules is not taken."""
    if modules is not None and list(modules):
        raise NotImplementedError("set_modules_to_backward_prefetch takes None (the module gathered before it in "
                                  "forward, the default) or [] (none); the workers follow the forward order")
    module._fsdp_backward_prefetch = modules is None


def entering(module):
    """`module`'s forward begins: note it in its root's order. Returns the root."""
    root = _RUNNING[0] if _RUNNING else module
    if root is module:
        module._fsdp_order_now, module._fsdp_begun_now = [], []
    root._fsdp_order_now.append(module)
    _RUNNING.append(module)
    module._fsdp_in_region = in_checkpoint_region()
    return root


def in_checkpoint_region() -> bool:
    return frontend_state.of(session.controller()).checkpoint_depth > 0


def targets(module, root) -> list:
    """The modules whose gathers to begin now, after `module`'s own: the explicit list, or the
    module that followed it in the root's last forward; never one gathered or begun already."""
    if module._fsdp_in_region:
        return []
    chosen = module._fsdp_forward_prefetch
    if chosen is None:
        following = getattr(root, "_fsdp_following", {}).get(id(module))
        chosen = [] if following is None else [following]
    return [target for target in chosen if not (target._fsdp_prefetched or target in _RUNNING
                                                  or getattr(target, "_fsdp_in_region", False))]


def leaving(module) -> None:
    """`module`'s forward ended (or raised): the root's end keeps the order for next time and
    drops every prefetch that no forward finished."""
    if module in _RUNNING:
        _RUNNING.remove(module)
    if _RUNNING or not hasattr(module, "_fsdp_order_now"):
        return
    order = module._fsdp_order_now
    module._fsdp_following = {id(first): then for first, then in zip(order, order[1:])}
    for seen in order + module._fsdp_begun_now:   # begun for a module that did not run this time, too
        seen._fsdp_prefetched.clear()   # (their handles go, and with them the buffers on the workers)
    del module._fsdp_order_now, module._fsdp_begun_now
