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
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from ..distributed_spec import Replicate

__all__ = ["STATE_NAMES", "state_names", "optimizer_step", "local_norm_share", "update_grads"]

# The buffers each kind keeps per parameter, in the order OptimizerStep.state_ids lists them.
# Kinds are torch.optim class names, so that a worker error names the optimizer.
STATE_NAMES = {"SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq")}


def state_names(kind: str, hyper: dict) -> tuple:
    """The buffers of one parameter under these hyperparameters (SGD without momentum keeps none,
    amsgrad keeps a third)."""
    if kind == "SGD":
        return STATE_NAMES[kind] if hyper["momentum"] != 0 else ()
    return STATE_NAMES[kind] + (("max_exp_avg_sq",) if hyper["amsgrad"] else ())


def optimizer_step(kind: str, hyper: dict, params: list, grads: list, states: list, steps: tuple,
                   fresh: tuple) -> list:
    """Update `params` in place; returns each parameter's buffers (new ones included), in
    state_names order. `states[i]` holds param i's buffers, or None where `fresh[i]`."""
    with torch.no_grad():
        if kind == "SGD":
            return _sgd(hyper, params, grads, states, fresh)
        if kind in ("Adam", "AdamW"):
            return _adam(kind, hyper, params, grads, states, steps, fresh)
    raise ValueError(f"unknown optimizer kind {kind!r}")


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
    """torch's implementation switch as dtorch.optim's Optimizer.path sent it (both False: the
    single-tensor path)."""
    return {"foreach": hyper.get("foreach", False), "fused": hyper.get("fused", False)}


def _adam(kind: str, hyper: dict, params: list, grads: list, states: list, steps: tuple, fresh: tuple) -> list:
    amsgrad = hyper["amsgrad"]
    count = 3 if amsgrad else 2
    states = [[torch.zeros_like(p, memory_format=torch.preserve_format) for _ in range(count)] if new else state
              for p, state, new in zip(params, states, fresh)]
    # torch keeps the step as a 0-d float tensor and adds 1 inside the update (the fused kernel
    # reads it on the parameter's device)
    path = _path(hyper)
    step_tensors = [torch.tensor(float(step), dtype=torch.float32, device=p.device if path["fused"] else None)
                    for p, step in zip(params, steps)]
    beta1, beta2 = hyper["betas"]
    adam(params, grads, [s[0] for s in states], [s[1] for s in states], [s[2] for s in states] if amsgrad else [],
         step_tensors, **path, has_complex=any(torch.is_complex(p) for p in params),
         decoupled_weight_decay=hyper["decoupled_weight_decay"], amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=hyper["lr"],
         weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=hyper["maximize"])
    return states


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
