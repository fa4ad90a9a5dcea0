"""torch.distributed.checkpoint.state_dict's functions for dtorch models and optimizers:
get_state_dict / set_state_dict and their model and optimizer halves. The optimizer's state dict
is keyed by parameter name, as torch's is ({"state": {"layers.0.w": {...}}, "param_groups":
[{..., "params": ["layers.0.w", ...]}]}), so a checkpoint of it has the keys an FSDP2 / torchtitan
one has; several optimizers are merged into one, as torch merges them.

A fresh optimizer needs no step first (torch takes one with zero grads and lr 0): its state dict
knows each name's parameter, and dtorch.checkpoint.load makes the missing state from the
checkpoint, on each parameter's layout (optimizer_targets.py).
"""
from __future__ import annotations

from collections.abc import Iterable

from ..dtensor.tensor import DTensor
from ..nn.module import IncompatibleKeys
from ..optim.optimizer import Optimizer
from ..optim.state import OptimizerStateDict
from ..spec.placements import Replicate
from .options import Options, resolve
from .stateful import module_state_dict

__all__ = ["get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
           "set_optimizer_state_dict", "set_state_dict"]


def get_model_state_dict(model, *, submodules=None, options=None) -> dict:
    """model.state_dict() (name -> DTensor), as torch's: without frozen parameters with
    ignore_frozen_params, whole tensors with full_state_dict (torch tensors here with cpu_offload)."""
    settings = _settings("get", options, submodules)
    return _whole(module_state_dict(model, settings), settings)


def get_optimizer_state_dict(model, optimizers, *, submodules=None, options=None) -> OptimizerStateDict:
    """The optimizers' state dict keyed by `model`'s parameter names, merged (torch's layout)."""
    settings = _settings("get", options, submodules)
    name_of = _names(model)
    state, groups, parameters = {}, [], {}
    for optimizer in _optimizers(optimizers):
        saved = optimizer.state_dict()
        index_name = {index: _name(name_of, param, optimizer) for index, param in saved.parameters.items()}
        state.update({index_name[index]: _whole(values, settings) for index, values in saved["state"].items()})
        groups += [{**group, "params": [index_name[i] for i in group["params"]]} for group in saved["param_groups"]]
        parameters.update({index_name[index]: param for index, param in saved.parameters.items()})
    return OptimizerStateDict(state, groups, parameters)


def get_state_dict(model, optimizers, *, submodules=None, options=None) -> tuple[dict, OptimizerStateDict]:
    """(get_model_state_dict, get_optimizer_state_dict), as torch's get_state_dict."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model, model_state_dict: dict, *, options=None) -> IncompatibleKeys:
    """model.load_state_dict(model_state_dict, strict=options.strict): DTensors on any layout, or
    whole torch tensors (each worker is sent its own part)."""
    return model.load_state_dict(model_state_dict, strict=resolve("set", options).strict)


def set_optimizer_state_dict(model, optimizers, optim_state_dict: dict, *, options=None) -> None:
    """Give each optimizer its part of a state dict keyed by `model`'s parameter names (or by
    index, as one optimizer's own state_dict() is): each group takes the settings of the saved
    group that holds its parameters, each parameter the state saved under its name."""
    resolve("set", options)
    name_of = _names(model)
    saved_groups = optim_state_dict["param_groups"]
    optimizers = _optimizers(optimizers)
    if len(optimizers) == 1 and all(type(name) is int for group in saved_groups for name in group["params"]):
        optimizers[0].load_state_dict(optim_state_dict)   # one optimizer's own state_dict(), by index
        return
    for optimizer in optimizers:
        state, groups = {}, []
        for group in optimizer.param_groups:
            names = [_name(name_of, param, optimizer) for param in group["params"]]
            saved = next((g for g in saved_groups if names and names[0] in g["params"]), None)
            if saved is None or set(saved["params"]) != set(names):
                raise ValueError(f"set_optimizer_state_dict: no saved parameter group holds exactly {names[:3]}"
                                 f"{' ...' if len(names) > 3 else ''} (the group of {type(optimizer).__name__}); "
                                 "build the optimizer's groups as they were saved")
            first = sum(len(g["params"]) for g in groups)
            groups.append({**saved, "params": list(range(first, first + len(names)))})
            state.update({first + i: optim_state_dict["state"][name] for i, name in enumerate(names)
                          if name in optim_state_dict["state"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def set_state_dict(model, optimizers, *, model_state_dict: dict, optim_state_dict: dict,
                   options=None) -> IncompatibleKeys:
    """set_model_state_dict and set_optimizer_state_dict, as torch's set_state_dict; returns the
    model's IncompatibleKeys."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


def _settings(call: str, options, submodules) -> Options:
    if submodules is not None:
        raise ValueError("submodules= is not supported (torch deprecates it): call get_model_state_dict on the "
                         "submodule itself")
    return resolve(call, options)


def _optimizers(optimizers) -> list:
    found = list(optimizers) if isinstance(optimizers, Iterable) else [optimizers]
    for optimizer in found:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"a dtorch.optim optimizer expected, got {type(optimizer).__name__} (a torch.optim "
                            "optimizer's state is torch's: use torch.distributed.checkpoint.state_dict)")
    return found


def _names(model) -> dict:
    """id(parameter) -> its name in `model` (a tied parameter: its first name, as torch's)."""
    return {id(param): name for name, param in reversed(list(model.named_parameters(remove_duplicate=False)))}


def _name(name_of: dict, param, optimizer) -> str:
    if id(param) not in name_of:
        raise ValueError(f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that the model "
                         "does not have; pass the model whose parameters it optimizes")
    return name_of[id(param)]


def _whole(state: dict, settings: Options) -> dict:
    """With full_state_dict, each DTensor whole: a torch tensor here (cpu_offload), else Replicate."""
    if not settings.full_state_dict:
        return state
    return type(state)([(key, _whole_tensor(value, settings) if isinstance(value, DTensor) else value)
                        for key, value in state.items()])


def _whole_tensor(tensor: DTensor, settings: Options):
    if settings.cpu_offload:
        return tensor.to_torch()
    return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
