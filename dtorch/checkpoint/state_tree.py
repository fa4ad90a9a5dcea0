"""A checkpoint state as keys: flattening nested dicts and lists into dotted keys, and putting
loaded leaves back in place. Two granularities, one per format:

- dtorch's ("dtorch"): a dict, list or tuple with a tensor somewhere below is walked into; any
  other subtree is one plain leaf, stored whole (`{"sched": {...}}` is one key, "sched");
- torch.distributed.checkpoint's ("dcp", its `traverse_state_dict`): every mapping is walked into
  (an empty one gives no key), a list only when it holds a mapping, a tensor or such a list, and a
  tuple never (`{"sched": {"last_epoch": 3}}` is "sched.last_epoch").

Keys join the path with dots, as both formats do ("optim.state.0.exp_avg"). Tensors here are
DTensors, TensorTargets (what a load should make) and torch tensors. No commands are sent from here.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..dtensor.tensor import DTensor
from .matching import TensorTarget
from .safetensors_header import CheckpointError

__all__ = ["Leaf", "flatten", "fill", "key_of", "is_distributed"]

_KEY_TYPES = (str, int)


class Leaf(NamedTuple):
    path: tuple          # the keys and list indices from the state's top to this leaf
    value: object        # a DTensor, a TensorTarget, or a plain value (with "dtorch": a subtree without tensors)


def key_of(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def is_distributed(value) -> bool:
    """A DTensor, or a TensorTarget: a leaf that loads onto a mesh."""
    return isinstance(value, (DTensor, TensorTarget))


def flatten(state, style: str = "dtorch") -> dict[str, Leaf]:
    """key -> Leaf, walking `state` as the format `style` does ("dtorch" or "dcp", above). Raises
    CheckpointError for two paths with one key, or a key that is not a str or int."""
    if not isinstance(state, (Mapping, list, tuple)):
        raise CheckpointError(f"a checkpoint state is a dict (or list) of DTensors and plain values, "
                              f"not a {type(state).__name__}")
    leaves: dict[str, Leaf] = {}
    for leaf in _children(state, (), style):
        key = key_of(leaf.path)
        if key in leaves:
            raise CheckpointError(f"two entries of the state have the key {key!r}: {list(leaves[key].path)} and "
                                  f"{list(leaf.path)}; rename one (keys are paths joined with dots)")
        leaves[key] = leaf
    return leaves


def _children(node, path: tuple, style: str) -> list[Leaf]:
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    leaves = []
    for name, value in items:
        if not isinstance(name, _KEY_TYPES) or isinstance(name, bool):
            raise CheckpointError(f"state key {name!r} at {key_of(path) or 'the top'}: keys must be str or int")
        leaves += _leaves(value, path + (name,), style)
    return leaves


def _leaves(node, path: tuple, style: str) -> list[Leaf]:
    if is_distributed(node) or isinstance(node, torch.Tensor):
        return [Leaf(path, node)]
    if style == "dcp":
        walked = isinstance(node, Mapping) or isinstance(node, list) and not _dcp_terminal(node)
        return _children(node, path, style) if walked else [Leaf(path, node)]
    if isinstance(node, (Mapping, list, tuple)):
        below = _children(node, path, style)
        if any(is_distributed(leaf.value) for leaf in below):
            return below
    return [Leaf(path, node)]


def _dcp_terminal(values: list) -> bool:
    """torch's _is_terminal for a list: nothing in it to walk into."""
    for entry in values:
        if isinstance(entry, Mapping) or isinstance(entry, list) and not _dcp_terminal(entry):
            return False
        if is_distributed(entry) or isinstance(entry, torch.Tensor):
            return False
    return True


def fill(state, loaded: dict):
    """`state` with each leaf whose key is in `loaded` replaced by its loaded value, in place for
    dicts and lists (a tuple is rebuilt, in place in its parent)."""
    return _filled(state, (), loaded, top=True)


def _filled(node, path: tuple, loaded: dict, top: bool = False):
    if not top and key_of(path) in loaded:
        return loaded[key_of(path)]
    if is_distributed(node) or not isinstance(node, (Mapping, list, tuple)):
        return node
    if isinstance(node, tuple):
        return tuple([_filled(value, path + (index,), loaded) for index, value in enumerate(node)])
    for name in list(node.keys() if isinstance(node, Mapping) else range(len(node))):
        node[name] = _filled(node[name], path + (name,), loaded)
    return node
