"""distribute_module: the user's own torch.nn.Module (torch's layers, or any class of theirs) moved
onto a mesh in place, as torch.distributed.tensor.distribute_module spells it.

Each submodule that is not already a dtorch module becomes one: its class is swapped for a
subclass of dtorch.nn.Module and its own class (`DistributedLinear(dtorch.nn.Module, torch.nn.Linear)`,
made once per class, as FSDP2's fully_shard swaps classes), so torch's forward runs unchanged on
DTensor parameters, and registration, `to`, `load_state_dict` and the parallel styles work as
on dtorch's own layers. Then `partition_fn(name, submodule, mesh)` lays out what it wants, and
every parameter and buffer still in this process is uploaded Replicate (each worker receives
its copy once; a tensor tied to two places stays one DTensor).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..spec.placements import DeviceMesh
from ..dtensor.factories import upload_replicated
from ..dtensor.tensor import DTensor
from .module import Module
from .parameter import Parameter

__all__ = ["distribute_module", "holds_local_tensors"]

_DISTRIBUTED_CLASSES: dict = {}


def distribute_module(module: torch.nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable | None = None, input_fn: Callable | None = None,
                      output_fn: Callable | None = None) -> torch.nn.Module:
    """Move `module`'s parameters and buffers onto `device_mesh`, in place; returns `module`.

    partition_fn(name, submodule, mesh): called for every submodule, to place its parameters
    (`submodule.weight = dtorch.nn.Parameter(dtorch.distribute_tensor(w, mesh, [Shard(0)]))`);
    whatever it leaves as a torch tensor is replicated. input_fn(module, inputs, mesh) and
    output_fn(module, outputs, mesh) become a forward pre-hook and a forward hook, as in torch
    (typically to move plain torch inputs onto the mesh with dtorch.distribute_tensor)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"distribute_module takes a torch.nn.Module, not {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError("distribute_module needs device_mesh= (a single controller has no current mesh): "
                        f"dtorch.init_device_mesh(...), got {device_mesh!r}")
    submodules = list(module.named_modules())
    for _, submodule in submodules:
        _adopt(submodule)
    uploaded: dict = {}   # id(torch tensor) -> (it, its DTensor): tied tensors stay tied
    for name, submodule in submodules:
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_the_rest(submodule, device_mesh, uploaded)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def holds_local_tensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of `module` (or its submodules) is a torch tensor here."""
    return any(_is_local(t) for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values()))


def _is_local(value) -> bool:
    """A torch tensor of this process (a DTensor is asked first: it may pass isinstance torch.Tensor)."""
    return not isinstance(value, DTensor) and isinstance(value, torch.Tensor)


def _adopt(module: torch.nn.Module) -> None:
    """Make `module` a dtorch.nn.Module of its own kind (its class swapped, its state kept)."""
    if isinstance(module, Module):
        return
    cls = type(module)
    adopted = _DISTRIBUTED_CLASSES.get(cls)
    if adopted is None:
        adopted = _DISTRIBUTED_CLASSES[cls] = type(f"Distributed{cls.__name__}", (Module, cls), {
            "__module__": cls.__module__, "__doc__": cls.__doc__})
    module.__class__ = adopted


def _replicate_the_rest(module: torch.nn.Module, mesh: DeviceMesh, uploaded: dict) -> None:
    for members, make in ((module._parameters, _parameter), (module._buffers, _buffer)):
        for name, value in list(members.items()):
            if _is_local(value):
                if id(value) not in uploaded:
                    uploaded[id(value)] = (value, make(value, mesh))
                members[name] = uploaded[id(value)][1]


def _parameter(value: torch.Tensor, mesh: DeviceMesh) -> Parameter:
    return Parameter(_buffer(value, mesh), value.requires_grad)


def _buffer(value: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return upload_replicated(value.detach(), mesh)
