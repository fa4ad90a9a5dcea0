"""An optimizer's per-parameter state in and out of torch's state_dict layout: buffers stay
DTensors; "step" is an int on the controller and torch's 0-d float32 tensor in a state_dict."""
from __future__ import annotations

import torch

from ..spec.placements import Replicate
from ..dtensor.factories import full, tensor as upload
from ..ops.tensor_meta import is_local_tensor, tensor_meta
from ..runtime.worker.optim_kernels import SCALAR_STATE, initial_fill, state_names
from ..dtensor.tensor import DTensor, call_op

__all__ = ["pack_state", "unpack_state", "init_state", "buffer_meta", "OptimizerStateDict"]


class OptimizerStateDict(dict):
    """What a dtorch optimizer's state_dict() returns: torch's dict ("state", "param_groups"), which
    also knows `parameters`, the parameter behind each state key (the index in the groups'
    "params"), those without state yet included. dtorch.checkpoint.load builds a fresh optimizer's
    state from a checkpoint with it, each buffer on its parameter's mesh and placements."""

    def __init__(self, state: dict, param_groups: list, parameters: dict):
        super().__init__(state=state, param_groups=param_groups)
        self.parameters = parameters


def buffer_layout(name: str, param: DTensor) -> tuple:
    """(shape, placements) of a buffer of `param`: sharded like it, but for a one-number state
    (NAdam's mu_product), 0-d and Replicate on its mesh."""
    if name in SCALAR_STATE:
        return (), [Replicate()] * param.device_mesh.ndim
    return tuple(param.shape), list(param.placements)


def buffer_meta(name: str, param: DTensor):
    """The meta of a buffer a step makes: of the parameter's dtype, a one-number state of torch's
    scalar dtype (float32)."""
    shape, placements = buffer_layout(name, param)
    return tensor_meta(shape, torch.float32 if name in SCALAR_STATE else param.dtype, param.device_mesh, placements)


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
            state[name] = _placed_like(value, param, name, f"{optimizer}.load_state_dict: state {name!r}")
        else:
            state[name] = value
    return state


def _placed_like(value, param: DTensor, name: str, what: str) -> DTensor:
    shape, placements = buffer_layout(name, param)
    if tuple(value.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {shape} for its parameter of shape "
                         f"{tuple(param.shape)}")
    # as torch casts every floating state but the step to its parameter's dtype (a mu_product too)
    dtype = param.dtype if value.dtype.is_floating_point and param.dtype.is_floating_point else value.dtype
    if is_local_tensor(value):   # a torch.optim state_dict: uploaded as the param's shards,
        # from a copy: an upload sends the tensor's own memory later, and torch may step it meanwhile
        return upload(value.detach().to(dtype, copy=True), device_mesh=param.device_mesh, placements=placements)
    placed = value.redistribute(param.device_mesh, placements)
    # Steps update the buffer in place, so it must share no storage with the saved one (a
    # redistribute may hand back the same tensor, or a slice of it): a cast or a clone copies.
    return placed.to(dtype) if placed.dtype != dtype else call_op("clone", (placed,), {})


def init_state(optimizer):
    """Give each parameter without state the buffers its first step would make (torch's initial
    values: zeros, Adagrad's initial_accumulator_value, NAdam's mu_product 1; on the parameter's
    mesh and placements) and step 0, without a step. A fresh
    optimizer's state_dict() then names every buffer a saved one has, so it is a target
    dtorch.checkpoint.load can fill (torch.distributed.checkpoint takes a step with lr 0 for this).
    The state then equals a fresh one exactly, but SGD's momentum_buffer: it starts at zeros, so
    with dampening a first step without a load in between differs from torch's (which copies the
    grad). Returns `optimizer`."""
    for group in optimizer.param_groups:
        hyper = optimizer.hyper(group)
        names = state_names(optimizer.kind, hyper)
        for param in group["params"]:
            state = optimizer.state[param]
            if not names or all(isinstance(state.get(name), DTensor) for name in names):
                continue
            for name in names:
                meta = buffer_meta(name, param)
                state[name] = full(meta.shape, initial_fill(optimizer.kind, name, hyper), dtype=meta.dtype,
                                   device_mesh=meta.mesh, placements=meta.placements)
            if optimizer.kind != "SGD":
                state["step"] = 0
    return optimizer
