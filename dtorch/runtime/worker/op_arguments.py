"""How a worker reads a RunOp's arguments: the tensor references in them (in the order dispatch
numbered them), the rank-local stand-ins (ShardRegion, PeerGroup) each rank replaces with its own
value, the inputs an op records against for backward, and whether an op is plain enough to run
inline (Worker._ran_inline).

These run for every op, so they stay module-level functions over frozensets, imported by name
into worker.py and worker/moves.py: no attribute lookup or method call more per op than before
they moved here from worker.py.
"""
from __future__ import annotations

import torch

from ...spec.placements import PeerGroup, ShardRegion
from .. import protocol as wire
from .backward import run_recorded
from ..protocol import TensorRef

__all__ = ["RANK_LOCAL", "SCALAR_TYPES", "grad_inputs", "input_ids", "is_flat", "map_refs", "recorded_inline",
           "refs_in_order"]


def recorded_inline(kernel, args: list, kwargs: dict, regather: bool):
    """A plain op that records for backward (RunOp.grad): its inputs that require grad are among
    its top-level arguments, since its kwargs are scalars. Grad mode is switched in C, without
    torch.enable_grad()'s Python context."""
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    previous = _is_grad_enabled()
    _set_grad_enabled(True)
    try:
        return run_recorded(kernel, inputs, args, kwargs, regather)
    finally:
        _set_grad_enabled(previous)


_set_grad_enabled, _is_grad_enabled = torch._C._set_grad_enabled, torch.is_grad_enabled


def grad_inputs(args, kwargs) -> list:
    """The op's local input tensors that require grad, depth-first."""
    found = []
    _collect_grad(args, found)
    if kwargs:
        _collect_grad(kwargs.values(), found)
    return found


def _collect_grad(values, found: list) -> None:
    # One call per container, not per element: a recorded op's arguments are mostly scalars and
    # shape lists, and a call for each cost 1.5-2.5 us more per op in a micro-benchmark.
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        elif type(value) in _SEQUENCES:
            _collect_grad(value, found)
        elif type(value) is dict:
            _collect_grad(value.values(), found)


def is_flat(args) -> bool:
    return _CONTAINERS.isdisjoint(map(type, args))   # in C: this runs for every op


_CONTAINERS = frozenset((tuple, list, dict))
_SEQUENCES = frozenset((tuple, list))
SCALAR_TYPES = frozenset((int, float, bool, str, type(None)))   # kwargs values a plain op may take inline


RANK_LOCAL = (ShardRegion, PeerGroup)   # argument types each rank replaces with its own value


def refs_in_order(command: wire.RunOp) -> list:
    """The command's tensor references, numbered as dispatch numbers them (args, then kwargs)."""
    found = []
    map_refs((command.args, command.kwargs), found.append, lambda value: value)
    return found


def input_ids(command) -> list:
    """The ids a RunOp or a Redistribute reads."""
    if type(command) is wire.Redistribute:
        return [command.src_id]
    return [ref.id for ref in refs_in_order(command)]


def map_refs(value, fn, place):
    """Replace each TensorRef with fn(ref), depth-first (the order dispatch numbered the tensors
    in), and each ShardRegion or PeerGroup with place(value): the wire's stand-ins for rank-local
    values."""
    if type(value) is TensorRef:
        return fn(value)
    if type(value) in (tuple, list):
        return [map_refs(v, fn, place) for v in value]
    if type(value) is dict:
        return {k: map_refs(v, fn, place) for k, v in value.items()}
    if type(value) in RANK_LOCAL:
        return place(value)
    return value
