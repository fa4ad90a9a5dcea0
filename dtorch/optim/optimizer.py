"""The optimizer base: torch.optim.Optimizer's bookkeeping (param_groups, state, hooks, what
torch's lr schedulers read and write) over DTensor parameters, with one OptimizerStep command
per param group and mesh per step. The update itself runs on the workers
(runtime/worker/optim_kernels.py): state lives there, sharded like its parameter, and the controller
holds only symbols for it and each parameter's step count.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..dtensor import compile_capture as capturing
from ..dtensor import frontend_state
from ..autograd import reduce_gradients
from ..autograd.engine import clear_grads
from ..runtime.controller import profiling, session
from ..runtime.worker.optim_kernels import state_names
from ..runtime.protocol import OptimizerStep
from ..dtensor.tensor import DTensor
from .grads import by_mesh, update_grads
from .state import OptimizerStateDict, buffer_meta, pack_state, unpack_state

__all__ = ["Optimizer"]


class Optimizer(torch.optim.Optimizer):
    """Subclasses set `kind` (the worker's update: a torch.optim class name, optim_kernels.STATE_NAMES)
    and the group's hyperparameters as plain numbers: `hyper_names` (the keywords of torch's
    functional update that a group gives as they are), or their own `hyper(group)`. A subclass of
    torch's Optimizer, so that torch.optim.lr_scheduler accepts it; a changed group["lr"] is used
    from the next step."""
    kind = ""
    hyper_names: tuple = ()

    def __init__(self, params, defaults: dict):
        name = f"dtorch.optim.{type(self).__name__}"
        for flag in ("capturable", "differentiable"):
            if defaults.get(flag):
                raise ValueError(f"{name}: {flag}=True is not supported; the workers run torch's update on their "
                                 "shards without autograd (choose the path with foreach= or fused=)")
        if defaults.get("fused") and defaults.get("foreach"):
            raise RuntimeError(f"{name}: `fused` and `foreach` cannot be `True` together.")
        super().__init__(params, defaults)

    def hyper(self, group: dict) -> dict:
        return {name: _plain(group[name]) for name in self.hyper_names} | self.path(group)

    @staticmethod
    def path(group: dict) -> dict:
        """Which of torch's implementations the workers run: foreach / fused as the user set them.
        foreach None (left to torch's default) stays None: eager runs the single-tensor path, as
        torch does on CPU, and a fused graph (dtorch.compile(backend="inductor")) torch's foreach
        kernels (runtime/worker/fusion.py)."""
        return {"foreach": None if group.get("foreach") is None else bool(group["foreach"]),
                "fused": bool(group.get("fused"))}

    def add_param_group(self, param_group: dict) -> None:
        """torch's checks, for DTensors (torch's own refuses anything but a torch.Tensor)."""
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, DTensor) else list(params)
        for p in params:
            if not isinstance(p, DTensor):
                raise TypeError(f"dtorch.optim.{type(self).__name__} optimizes DTensors (dtorch.nn.Parameter), got "
                                f"{type(p).__name__}: a torch tensor belongs in a torch.optim optimizer")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("optimizer contains a parameter group with duplicate parameters")
        held = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in held for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        group = {**self.defaults, **param_group, "params": params}
        if group.get("fused"):
            _check_fused(f"dtorch.optim.{type(self).__name__}", params)
        self.param_groups.append(group)

    def step(self, closure=None):
        """One OptimizerStep per param group and mesh; parameters without a grad are skipped.
        Returns at once; a worker failure is raised at the next read of a parameter or state."""
        frontend_state.refuse_inside_checkpoint(f"{type(self).__name__}.step")
        with profiling.span(f"{type(self).__name__}.step", "optimizer"):
            return self._step_groups(closure)

    def _step_groups(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reduce_gradients([p for group in self.param_groups for p in group["params"]])   # one all-reduce per bucket
        capture = capturing.active()
        for index, group in enumerate(self.param_groups):
            hyper = self.hyper(group)
            if capture is not None:
                self._guard_group(capture, index, group, hyper)
            with_grads = [p for p in group["params"] if getattr(p, "grad", None) is not None]
            for mesh_params in by_mesh(with_grads).values():
                self._step_on_mesh(hyper, mesh_params, group)
        return loss

    def _guard_group(self, capture, index: int, group: dict, hyper: dict) -> None:
        """dtorch.compile: a replay sends the group's numbers as they are then (an lr scheduler's
        lr, OneCycleLR's betas: _capture_step), so only what shapes the step captures again: a
        flag (amsgrad, nesterov, foreach...), a number that decides which buffers exist
        (momentum 0 or not), or the group itself replaced (load_state_dict)."""
        shape = _structure(self.kind, hyper)

        def holds() -> bool:
            return (index < len(self.param_groups) and self.param_groups[index] is group
                    and _structure(self.kind, self.hyper(group)) == shape)

        def why() -> str:
            where = f"{type(self).__name__}'s param group {index}"
            if index >= len(self.param_groups) or self.param_groups[index] is not group:
                return f"{where} was replaced (load_state_dict, or param_groups changed)"
            now = self.hyper(group)
            changed = [k for k in hyper if now.get(k) != hyper[k]]
            flags = [k for k in changed if not _is_number(hyper[k])] or changed   # else a number that adds a buffer
            said = ", ".join(f"{k} ({hyper[k]!r} -> {now.get(k)!r})" for k in flags)
            return f"{where} changed what its step keeps or runs: {said}"
        capture.guard(holds, why)

    def _step_on_mesh(self, hyper: dict, params: list, group: dict) -> None:
        controller = session.controller()
        names = state_names(self.kind, hyper)
        grads = [_grad_like(p, self.kind) for p in params]   # held until submitted (a Free may follow)
        states = [self.state[p] if names else {} for p in params]   # torch keeps no state for plain SGD
        fresh = tuple([int(not all(isinstance(s.get(n), DTensor) for n in names)) for s in states])
        buffer_ids = [controller.new_ids(len(names)) if new else tuple([controller.reference(s[n]).id for n in names])
                      for s, new in zip(states, fresh)]
        seq = controller.submit(OptimizerStep, controller.define_mesh(params[0].device_mesh), self.kind, hyper,
                                tuple([controller.reference(p).id for p in params]),
                                tuple([controller.reference(g).id for g in grads]),
                                tuple([i for ids in buffer_ids for i in ids]),
                                tuple([s.get("step", 0) for s in states]),
                                fresh)
        capture = capturing.active()
        if capture is not None:
            self._capture_step(capture, seq, states, names, group)
        for p, state, ids, new in zip(params, states, buffer_ids, fresh):
            if new:   # torch's lazy state, made by the step (optim_kernels.initial_fill)
                state.update({name: DTensor(i, buffer_meta(name, p), seq, controller) for name, i in zip(names, ids)})
            for written in [p] + [state[name] for name in names]:
                written._seq = seq   # a read after a failed step raises that step's RemoteError
            self._record_step(state)

    def _capture_step(self, capture, seq: int, states: list, names, group: dict) -> None:
        """dtorch.compile: a replay steps the same state buffers (a fresh optimizer's first step
        makes them, so the next call captures again), advances the step counts as this did, and
        takes the group's hyperparameters as they are at the replay."""
        buffers = [tuple([s.get(n) for n in names]) for s in states]
        capture.guard(lambda: all(s.get(n) is b for s, held in zip(states, buffers) for n, b in zip(names, held)),
                      lambda: f"{type(self).__name__}'s state buffers are not the ones the capture stepped"
                              + (" (its first step made them)" if any(b is None for held in buffers for b in held)
                                 else " (load_state_dict, or the state was cleared)"))
        captured = states[0].get("step", 0)

        def shift() -> int:
            now = states[0].get("step", 0)
            for state in states:
                self._record_step(state)
            return now - captured
        capture.optimizer_step(seq, shift, lambda: self.hyper(group))

    def _record_step(self, state: dict) -> None:
        """What torch keeps beside the buffers: Adam's step count (an int here: state_dict() gives
        torch's 0-d tensor)."""
        if self.kind != "SGD":
            state["step"] = state.get("step", 0) + 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """One SetGrads command; set_to_none=False zeroes each grad in place on the workers, one command
        per mesh."""
        params = [p for group in self.param_groups for p in group["params"] if getattr(p, "grad", None) is not None]
        if set_to_none:
            clear_grads(params)
            return
        update_grads("zero_grad", [p.grad for p in params])

    def state_dict(self) -> dict:
        """torch's layout: {"state": {index: {...}}, "param_groups": [{..., "params": [index]}]},
        the buffers as the live DTensors (torch, too, gives its tensors, not copies), "step" as
        torch's 0-d float32 tensor. An OptimizerStateDict: a dict that also knows each index's
        parameter, so that dtorch.checkpoint.load can fill a fresh optimizer's state_dict()."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: pack_state(values) for p, values in self.state.items() if id(p) in index}
        parameters = {index[id(p)]: p for group in self.param_groups for p in group["params"]}
        return OptimizerStateDict(state, groups, parameters)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state_dict of this optimizer or of another one with the same group sizes, whatever
        its layout: each buffer (a DTensor with any mesh and placements, or a torch tensor) is
        redistributed to its parameter's mesh and placements and cast to its dtype, as a copy."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.param_groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        by_index = {i: p for g, s in zip(self.param_groups, saved_groups) for i, p in zip(s["params"], g["params"])}
        state = defaultdict(dict)
        for i, values in state_dict["state"].items():
            if i in by_index:
                state[by_index[i]] = unpack_state(values, by_index[i], type(self).__name__)
        self.param_groups = [{**s, "params": g["params"]} for g, s in zip(self.param_groups, saved_groups)]
        self.state = state


def _grad_like(p: DTensor, what: str) -> DTensor:
    """p.grad on p's mesh and placements (autograd gives exactly those; a grad set by hand may
    need a redistribute, an ordinary command)."""
    grad = p.grad
    if not isinstance(grad, DTensor):
        raise TypeError(f"dtorch.optim.{what}: a parameter's grad must be a DTensor, got {type(grad).__name__}")
    if tuple(grad.shape) != tuple(p.shape):
        raise ValueError(f"dtorch.optim.{what}: grad of shape {tuple(grad.shape)} for a parameter of shape "
                         f"{tuple(p.shape)}")
    if grad.dtype != p.dtype:   # torch refuses such a grad when it is assigned
        raise TypeError(f"dtorch.optim.{what}: a grad of dtype {grad.dtype} for a parameter of dtype {p.dtype}; "
                        "the gradient must match the parameter's dtype")
    if grad.device_mesh != p.device_mesh or grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def _structure(kind: str, hyper: dict) -> tuple:
    """What of a group's hyperparameters shapes its step: the buffers it keeps, and every flag
    and setting that is not a number. The numbers (lr, betas, eps, weight_decay, momentum...)
    are a compiled step's inputs."""
    return state_names(kind, hyper), tuple([(k, v) for k, v in hyper.items() if not _is_number(v)])


def _is_number(value) -> bool:
    if type(value) is tuple:
        return all(type(v) is float for v in value)
    return type(value) is float


def _plain(value):
    """A hyperparameter as the wire carries it: a bool stays one, betas a tuple of floats, any other
    number (a 1-element tensor lr too) a float."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (tuple, list)):
        return tuple([float(v) for v in value])
    return float(value)


def _check_fused(name: str, params: list) -> None:
    """torch's fused kernels take floating-point tensors only (checked here, at the user's call)."""
    for p in params:
        if not p.dtype.is_floating_point:
            raise RuntimeError(f"{name}: `fused=True` requires all the params to be floating point Tensors, got a "
                               f"{p.dtype} parameter of shape {tuple(p.shape)}")
