"""A fresh optimizer's state_dict() as a load target, without a template optimizer and without
dtorch.optim.init_state. A dtorch optimizer's state_dict() (an OptimizerStateDict) knows the
parameter behind each state key, state or not; for each parameter the checkpoint holds buffers
of, the buffers it lacks become TensorTargets on the parameter's mesh and placements (a 0-d one,
such as NAdam's mu_product: Replicate), of the parameter's dtype where both are floating (as
torch's load_state_dict casts), whatever layout they were saved from. Nothing is allocated before
the load reads them (torch.distributed.checkpoint's get_state_dict takes a step with zero grads
and lr 0 instead). The step count and any other plain entry come back as saved.

The saved param_groups replace the target's, as torch's load_state_dict takes the saved groups'
settings; their sizes are checked first. Every problem is one CheckpointError before anything is
issued, and a failed load leaves the state dicts as they were.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

from ..optim.state import OptimizerStateDict
from ..spec.placements import Replicate
from .matching import TensorTarget
from .safetensors_header import CheckpointError
from .state_tree import key_of

__all__ = ["optimizer_targets", "saved_value"]


@contextmanager
def optimizer_targets(state, index):
    """Plan the missing state of every OptimizerStateDict in `state` from `index` (a read
    checkpoint), in place; undone if the block raises."""
    undo: list = []
    try:
        problems: list = []
        for path, state_dict in _optimizer_state_dicts(state, ()):
            _plan(state_dict, key_of(path), index, undo, problems)
        if problems:
            raise CheckpointError(f"cannot load the checkpoint {index.directory}; nothing was loaded:\n  "
                                  + "\n  ".join(problems[:12]))
        yield
    except BaseException:
        for container, name, old in reversed(undo):
            container[name] = old
        raise


def _optimizer_state_dicts(node, path: tuple):
    if isinstance(node, OptimizerStateDict):
        yield path, node
    elif isinstance(node, (Mapping, list)):
        for name, value in (node.items() if isinstance(node, Mapping) else enumerate(node)):
            yield from _optimizer_state_dicts(value, path + (name,))


def _plan(state_dict: OptimizerStateDict, key: str, index, undo: list, problems: list) -> None:
    prefix = f"{key}.state." if key else "state."
    by_name = {str(name): name for name in state_dict.parameters}
    planned: dict = {}
    for saved_key in [k for keys in (index.tensors, index.values) for k in keys if k.startswith(prefix)]:
        param_key, _, name = saved_key[len(prefix):].rpartition(".")
        if param_key not in by_name:
            continue   # not this optimizer's parameter: reported as unexpected by the load's key check
        state_key = by_name[param_key]
        if name not in state_dict["state"].get(state_key, {}):
            parameter = state_dict.parameters[state_key]
            planned.setdefault(state_key, {})[name] = _target(saved_key, name, parameter, index, problems)
    if planned:
        old = state_dict["state"]
        undo.append((state_dict, "state", old))
        state_dict["state"] = {**old, **{k: {**old.get(k, {}), **entries} for k, entries in planned.items()}}
    groups_key = f"{key}.param_groups" if key else "param_groups"
    groups = saved_value(index, groups_key)
    if groups is None:
        return
    sizes = [len(group.get("params", ())) for group in groups if isinstance(group, Mapping)]
    wanted = [len(group["params"]) for group in state_dict["param_groups"]]
    if sizes != wanted:
        problems.append(f"{groups_key!r}: the checkpoint's optimizer has {len(sizes)} parameter group(s) of "
                        f"{sizes} parameters, this one {len(wanted)} of {wanted}; build the optimizer as it was saved")
        return
    undo.append((state_dict, "param_groups", state_dict["param_groups"]))
    state_dict["param_groups"] = groups


def _target(saved_key: str, name: str, parameter, index, problems: list):
    """What one saved state entry loads into: a TensorTarget, or None for a plain value."""
    saved = index.tensors.get(saved_key)
    if name == "step" or saved is None:
        return None
    mesh, shape = parameter.device_mesh, tuple(saved.shape)
    if shape == tuple(parameter.shape):
        placements = tuple(parameter.placements)
    elif shape == ():
        placements = (Replicate(),) * mesh.ndim
    else:
        problems.append(f"{saved_key!r}: shape {list(shape)} in the checkpoint, but its parameter has shape "
                        f"{list(parameter.shape)} (a different model, or parameters in another order?)")
        return None
    floating = saved.dtype.is_floating_point and parameter.dtype.is_floating_point
    return TensorTarget(shape, parameter.dtype if floating else saved.dtype, mesh, placements)


def saved_value(index, key: str):
    """The plain value saved at `key`: whole (dtorch's format), or put together from the entries
    below it (torch's, which saves `[{"lr": ...}]` as "key.0.lr", ...); None where there is none."""
    if key in index.values:
        return index.values[key]
    below = [k for k in index.values if k.startswith(key + ".")]
    if not below:
        return None
    root: dict = {}
    for k in below:
        path = index.paths[k]
        depth = next((m for m in range(1, len(path)) if key_of(path[:m]) == key), None)
        if depth is None:
            continue
        node, parts = root, path[depth:]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = index.values[k]
    return _as_lists(root)


def _as_lists(node):
    """Dicts keyed 0..n-1 by ints become lists, as torch's set_element makes them."""
    if not isinstance(node, dict):
        return node
    node = {k: _as_lists(v) for k, v in node.items()}
    if node and all(type(k) is int for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node
