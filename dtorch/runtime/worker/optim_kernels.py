"""What a worker runs for dtorch.optim and dtorch.nn.utils: torch.optim's own functional updates
over its local shards, and the local share of a global gradient norm.

The updates are elementwise, so running torch's single-tensor path (foreach=False, what
torch.optim picks for CPU tensors) on each shard gives, element for element, the bits torch gives
on the whole tensor; so does `foreach=True`. `fused=True` runs torch's fused kernel (one pass
over each tensor, ~4x faster on CPU), equal to it on the whole tensor within rounding: its vector
body and scalar tail round differently, and a shard moves elements between them. Every update
is in place: the workers' parameter is an autograd leaf.
"""
from __future__ import annotations

import math

import torch
from torch.optim.adadelta import adadelta
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamax import adamax
from torch.optim.nadam import nadam
from torch.optim.radam import radam
from torch.optim.rmsprop import rmsprop
from torch.optim.sgd import sgd

from ...spec.placements import Replicate

__all__ = ["STATE_NAMES", "SCALAR_STATE", "state_names", "initial_fill", "optimizer_step", "local_norm_share",
           "update_grads"]

# The buffers each kind keeps per parameter, in the order OptimizerStep.state_ids lists them
# (torch.optim's own order, so that state_dict() lists them as torch does). Kinds are
# torch.optim class names, so that a worker error names the optimizer.
STATE_NAMES = {
    "SGD": ("momentum_buffer",),
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "Adagrad": ("sum",),
    "Adadelta": ("square_avg", "acc_delta"),
    "Adamax": ("exp_avg", "exp_inf"),
    "NAdam": ("mu_product", "exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
}

# Buffers torch keeps only under some options (the others are always kept).
_KEPT_WHEN = {
    ("SGD", "momentum_buffer"): lambda hyper: hyper["momentum"] != 0,
    ("Adam", "max_exp_avg_sq"): lambda hyper: hyper["amsgrad"],
    ("AdamW", "max_exp_avg_sq"): lambda hyper: hyper["amsgrad"],
    ("RMSprop", "momentum_buffer"): lambda hyper: hyper["momentum"] > 0,
    ("RMSprop", "grad_avg"): lambda hyper: hyper["centered"],
}

# One number per parameter rather than a tensor like it: torch's 0-d float32 ("scalar dtype")
# tensor, whole on every rank (Replicate), as every shard's update reads the same value.
SCALAR_STATE = frozenset({"mu_product"})


def state_names(kind: str, hyper: dict) -> tuple:
    """The buffers of one parameter under these hyperparameters (SGD without momentum keeps none,
    amsgrad keeps a third, RMSprop's momentum and centered one more each)."""
    return tuple([name for name in STATE_NAMES[kind] if _KEPT_WHEN.get((kind, name), lambda hyper: True)(hyper)])


def initial_fill(kind: str, name: str, hyper: dict) -> float:
    """The value a fresh buffer holds before its first update, as torch.optim makes it: zeros,
    but Adagrad's sum (initial_accumulator_value) and NAdam's mu_product (1)."""
    if name == "mu_product":
        return 1.0
    return float(hyper["initial_accumulator_value"]) if kind == "Adagrad" else 0.0


def optimizer_step(kind: str, hyper: dict, params: list, grads: list, states: list, steps: tuple,
                   fresh: tuple) -> list:
    """Update `params` in place; returns each parameter's buffers (new ones included), in
    state_names order. `states[i]` holds param i's buffers, or None where `fresh[i]`."""
    with torch.no_grad():
        if kind == "SGD":
            return _sgd(hyper, params, grads, states, fresh)
        if kind not in _UPDATES:
            raise ValueError(f"unknown optimizer kind {kind!r}")
        names = state_names(kind, hyper)
        states = [[_fresh_buffer(kind, name, hyper, p) for name in names] if new else state
                  for p, state, new in zip(params, states, fresh)]
        buffers = {name: [state[i] for state in states] for i, name in enumerate(names)}
        _UPDATES[kind](hyper, params, grads, buffers, _step_tensors(params, steps, _path(hyper)["fused"]),
                       has_complex=any(torch.is_complex(p) for p in params))
        return states


def _fresh_buffer(kind: str, name: str, hyper: dict, param: torch.Tensor) -> torch.Tensor:
    fill = initial_fill(kind, name, hyper)
    if name in SCALAR_STATE:   # on the parameter's device (torch's CPU home would not move over NCCL)
        return torch.full((), fill, dtype=torch.float32, device=param.device)
    if torch.is_complex(param):   # torch fills both halves (Adagrad's complex(value, value))
        fill = complex(fill, fill)
    return torch.full_like(param, fill, memory_format=torch.preserve_format)


def _step_tensors(params: list, steps: tuple, fused: bool) -> list:
    """torch keeps the step as a 0-d float tensor and adds 1 inside the update (the fused kernels
    read it on the parameter's device)."""
    return [torch.tensor(float(step), dtype=torch.float32, device=p.device if fused else None)
            for p, step in zip(params, steps)]


def _sgd(hyper: dict, params: list, grads: list, states: list, fresh: tuple) -> list:
    with_momentum = hyper["momentum"] != 0
    buffers = [None if new or not with_momentum else state[0] for state, new in zip(states, fresh)]
    options = dict(weight_decay=hyper["weight_decay"], momentum=hyper["momentum"], lr=hyper["lr"],
                   dampening=hyper["dampening"], nesterov=hyper["nesterov"], maximize=hyper["maximize"])
    # torch's fused kernel treats the buffers as all new or all kept: one call for each kind
    path = _path(hyper)
    for chosen in _fresh_and_kept(fresh) if path["fused"] else [range(len(params))]:
        picked = [buffers[i] for i in chosen]
        sgd([params[i] for i in chosen], [grads[i] for i in chosen], picked, **path, **options)
        for i, buffer in zip(chosen, picked):
            buffers[i] = buffer
    return [[buffer] if with_momentum else [] for buffer in buffers]   # torch made the fresh ones


def _fresh_and_kept(fresh: tuple) -> list:
    """The indices of the parameters without buffers yet, and of those with: each list if not empty."""
    made = [i for i, new in enumerate(fresh) if new]
    kept = [i for i, new in enumerate(fresh) if not new]
    return [chosen for chosen in (made, kept) if chosen]


def _path(hyper: dict) -> dict:
    """torch's implementation switch as dtorch.optim's Optimizer.path sent it (both False, or
    foreach None: the single-tensor path)."""
    return {"foreach": bool(hyper.get("foreach")), "fused": hyper.get("fused", False)}


def _options(hyper: dict, *names: str) -> dict:
    """The keywords of torch's functional update that the group's hyperparameters give as they are."""
    return {name: hyper[name] for name in names}


def _betas(hyper: dict) -> dict:
    beta1, beta2 = hyper["betas"]
    return {"beta1": beta1, "beta2": beta2}


# One function per kind: torch's functional update over this rank's shards, `buffers` the
# parameters' buffers by name (a list each, in parameter order), `steps` their 0-d step tensors.
def _adam(hyper, params, grads, buffers, steps, has_complex):
    adam(params, grads, buffers["exp_avg"], buffers["exp_avg_sq"], buffers.get("max_exp_avg_sq", []), steps,
         **_path(hyper), has_complex=has_complex, **_betas(hyper),
         **_options(hyper, "decoupled_weight_decay", "amsgrad", "lr", "weight_decay", "eps", "maximize"))


def _rmsprop(hyper, params, grads, buffers, steps, has_complex):
    rmsprop(params, grads, buffers["square_avg"], buffers.get("grad_avg", []), buffers.get("momentum_buffer", []),
            steps, foreach=_path(hyper)["foreach"], has_complex=has_complex,
            **_options(hyper, "maximize", "lr", "alpha", "eps", "weight_decay", "momentum", "centered"))


def _adagrad(hyper, params, grads, buffers, steps, has_complex):
    adagrad(params, grads, buffers["sum"], steps, **_path(hyper), has_complex=has_complex,
            **_options(hyper, "lr", "weight_decay", "lr_decay", "eps", "maximize"))


def _adadelta(hyper, params, grads, buffers, steps, has_complex):
    adadelta(params, grads, buffers["square_avg"], buffers["acc_delta"], steps, foreach=_path(hyper)["foreach"],
             has_complex=has_complex, **_options(hyper, "lr", "rho", "eps", "weight_decay", "maximize"))


def _adamax(hyper, params, grads, buffers, steps, has_complex):
    adamax(params, grads, buffers["exp_avg"], buffers["exp_inf"], steps, foreach=_path(hyper)["foreach"],
           has_complex=has_complex, **_betas(hyper), **_options(hyper, "maximize", "eps", "lr", "weight_decay"))


def _nadam(hyper, params, grads, buffers, steps, has_complex):
    nadam(params, grads, buffers["exp_avg"], buffers["exp_avg_sq"], buffers["mu_product"], steps,
          foreach=_path(hyper)["foreach"], has_complex=has_complex, **_betas(hyper),
          **_options(hyper, "decoupled_weight_decay", "maximize", "lr", "weight_decay", "momentum_decay", "eps"))


def _radam(hyper, params, grads, buffers, steps, has_complex):
    radam(params, grads, buffers["exp_avg"], buffers["exp_avg_sq"], steps, foreach=_path(hyper)["foreach"],
          has_complex=has_complex, **_betas(hyper),
          **_options(hyper, "decoupled_weight_decay", "maximize", "lr", "weight_decay", "eps"))


_UPDATES = {"Adam": _adam, "AdamW": _adam, "RMSprop": _rmsprop, "Adagrad": _adagrad, "Adadelta": _adadelta,
            "Adamax": _adamax, "NAdam": _nadam, "RAdam": _radam}


def local_norm_share(grads: list, placements: list, coordinate: tuple, norm_type: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """This rank's share of the norm over all `grads`, 0-d, of `dtype`: summed over ranks (a
    finite norm_type: sum |g|^p) or maxed / minned (+-inf) it gives the global value. A sum counts
    a Replicate copy on one rank only (coordinate 0 of that mesh dim); max and min need not."""
    device = grads[0].device if grads else None
    with torch.no_grad():
        if math.isinf(norm_type):
            pick = torch.amax if norm_type > 0 else torch.amin
            empty = torch.tensor(0.0 if norm_type > 0 else math.inf, dtype=torch.float64, device=device)
            values = [pick(g.abs()).double() for g in grads if g.numel()]
            return (pick(torch.stack(values)) if values else empty).to(dtype)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for grad, layout in zip(grads, placements):
            if _counts_here(layout, coordinate) and grad.numel():
                total += torch.linalg.vector_norm(grad.double(), norm_type) ** norm_type
        return total.to(dtype)


def _counts_here(placements, coordinate) -> bool:
    return all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))


def update_grads(kind: str, grads: list, factor: torch.Tensor | None, bound: float) -> None:
    """In place, as torch does; kinds are the user's call, so that a worker error names it."""
    with torch.no_grad():
        for grad in grads:
            if kind == "clip_grad_norm_":
                grad.mul_(factor)
            elif kind == "clip_grad_value_":
                grad.clamp_(min=-bound, max=bound)
            elif kind == "zero_grad":
                grad.zero_()
            else:
                raise ValueError(f"unknown gradient update {kind!r}")
