"""An optimizer's per-parameter state in and out of torch's state_dict layout: buffers stay
DTensors; "step" is an int on the controller and torch's 0-d float32 tensor in a state_dict."""
from __future__ import annotations

import torch

from ..factories import tensor as upload, zeros
from ..runtime.optim_kernels import state_names
from ..tensor import DTensor, call_op

__all__ = ["pack_state", "unpack_state", "init_state"]


def pack_state(values: dict) -> dict:
    """The state of one parameter as torch.optim's state_dict() shows it."""
    if "step" not in values:
        return dict(values)
    return {"step": torch.tensor(float(values["step"]), dtype=torch.float32),   # first, as in torch
            **{name: value for name, value in values.items() if name != "step"}}


def unpack_state(values: dict, param: DTensor, optimizer: str) -> dict:
    """The state of `param` from a state_dict's entry: every buffer a copy of its own, on the
    parameter's mesh and placements, of its dtype where floating (as torch casts to the param's)."""
    state = {}
    for name, value in values.items():
        if name == "step":
            state[name] = int(value.item() if isinstance(value, torch.Tensor) else value)
        elif isinstance(value, (DTensor, torch.Tensor)):
            state[name] = _placed_like(value, param, f"{optimizer}.load_state_dict: state {name!r}")
        else:
            state[name] = value
    return state


def _placed_like(value, param: DTensor, what: str) -> DTensor:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, its parameter {tuple(param.shape)}")
    dtype = param.dtype if value.dtype.is_floating_point and param.dtype.is_floating_point else value.dtype
    if isinstance(value, torch.Tensor):   # a torch.optim state_dict: uploaded as the param's shards,
        # from a copy: an upload sends the tensor's own memory later, and torch may step it meanwhile
        return upload(value.detach().to(dtype, copy=True), device_mesh=param.device_mesh, placements=param.placements)
    placed = value.redistribute(param.device_mesh, param.placements)
    # Steps update the buffer in place, so it must share no storage with the saved one (a
    # redistribute may hand back the same tensor, or a slice of it): a cast or a clone copies.
    return placed.to(dtype) if placed.dtype != dtype else call_op("clone", (placed,), {})


def init_state(optimizer):
    """Give each parameter without state the buffers its first step would make (zeros, on the
    parameter's mesh and placements; Adam's step 0), without a step. A fresh optimizer's
    state_dict() then names every buffer a saved one has, so it is a target dtorch.checkpoint.load
    can fill (torch.distributed.checkpoint takes a step with lr 0 for this). Adam's state then equals
    a fresh one exactly; SGD's momentum_buffer starts at zeros, so with dampening a first step
    without a load in between differs from torch's (which copies the grad). Returns `optimizer`."""
    for group in optimizer.param_groups:
        names = state_names(optimizer.kind, optimizer.hyper(group))
        for param in group["params"]:
            state = optimizer.state[param]
            if not names or all(isinstance(state.get(name), DTensor) for name in names):
                continue
            for name in names:
                state[name] = zeros(*param.shape, dtype=param.dtype, device_mesh=param.device_mesh,
                                    placements=param.placements)
            if optimizer.kind != "SGD":
                state["step"] = 0
    return optimizer
