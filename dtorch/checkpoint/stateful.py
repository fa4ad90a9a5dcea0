"""Objects in a checkpoint state that have state_dict() and load_state_dict() (torch's Stateful:
modules, optimizers, LR schedulers, data-loader positions, your own classes). As
torch.distributed.checkpoint does, save writes what state_dict() returns, and load fills what
state_dict() returns and hands it to load_state_dict; the object stays where it was in the state.
Here at any depth of the state's dicts and lists, not only at its top.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .options import Options
from .state_tree import is_distributed

__all__ = ["is_stateful", "Slot", "swapped", "restore", "module_state_dict"]


def is_stateful(value) -> bool:
    if isinstance(value, (Mapping, list, tuple, type, torch.Tensor)) or is_distributed(value):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class Slot(NamedTuple):
    container: object    # the dict or list holding the object
    name: object         # its key or index there
    owner: object        # the object


@contextmanager
def swapped(state, options: Options):
    """For the time of the block, each Stateful object in `state`'s dicts and lists is replaced, in
    place, by its state_dict(); then put back, whatever happens. Yields the slots."""
    slots = _slots(state)
    try:
        for slot in slots:
            slot.container[slot.name] = _state_dict(slot.owner, options)
        yield slots
    finally:
        for slot in slots:
            slot.container[slot.name] = slot.owner


def restore(slots: list, options: Options) -> None:
    """Each object's load_state_dict(), with what its slot holds now (the loaded state dict)."""
    for slot in slots:
        loaded = slot.container[slot.name]
        if isinstance(slot.owner, torch.nn.Module):
            # the load checked every key already; frozen parameters left out keep their values
            slot.owner.load_state_dict(loaded, strict=options.strict and not options.ignore_frozen_params)
        else:
            slot.owner.load_state_dict(loaded)


def module_state_dict(module: torch.nn.Module, options: Options) -> dict:
    """module.state_dict(), without the frozen parameters (requires_grad=False) with
    ignore_frozen_params, as torch's get_model_state_dict leaves them out."""
    state = module.state_dict()
    if options.ignore_frozen_params:
        frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
        state = type(state)([(key, value) for key, value in state.items() if key not in frozen])
    return state


def _state_dict(owner, options: Options):
    return module_state_dict(owner, options) if isinstance(owner, torch.nn.Module) else owner.state_dict()


def _slots(node) -> list[Slot]:
    if not isinstance(node, (Mapping, list)):
        return []
    names = list(node.keys()) if isinstance(node, Mapping) else range(len(node))
    slots = []
    for name in names:
        value = node[name]
        slots += [Slot(node, name, value)] if is_stateful(value) else _slots(value)
    return slots
