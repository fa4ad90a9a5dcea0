"""torch.nn.functional losses composed of dtorch's ops: `poisson_nll_loss`, `gaussian_nll_loss`,
`hinge_embedding_loss`, `multi_margin_loss`, `multilabel_soft_margin_loss`, `soft_margin_loss`.

Each follows torch's own formula (ATen's Loss.cpp and torch/nn/functional.py), so values and
gradients agree with torch's; placement rules, automatic redistributes and autograd are those of
the ops used. They reach dtorch through __torch_function__ (dtensor/api.py's TORCH_FUNCTIONS), as
dtorch/torch_api/compositions.py's do. tests/test_composites_nn.py checks each against torch.
"""
from __future__ import annotations

import math

from ..dtensor.api import register_torch_spellings
from .compositions import reduced_loss
from ..spec.placements import Replicate
from ..dtensor.factories import arange, full_like
from ..dtensor.op_issue import with_local_tensors_uploaded
from ..dtensor.tensor import DTensor, call_op

__all__ = ["poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss", "multi_margin_loss",
           "multilabel_soft_margin_loss", "soft_margin_loss"]


def _where(condition, chosen, other):
    return call_op("where", (condition, chosen, other), {})


def poisson_nll_loss(input, target, log_input: bool = True, full: bool = False, size_average=None,
                     eps: float = 1e-8, reduce=None, reduction: str = "mean") -> DTensor:
    """exp(x) - t x (log_input), else x - t log(x + eps); full adds Stirling's term
    t log t - t + log(2 pi t) / 2 where t > 1 (ATen's poisson_nll_loss)."""
    if log_input:
        losses = input.exp() - target * input
    else:
        losses = input - target * (input + eps).log()
    if full:
        stirling = target * target.log() - target + 0.5 * (2 * math.pi * target).log()
        losses = losses + stirling.masked_fill(target <= 1, 0.0)
    return reduced_loss(losses, size_average, reduce, reduction)


def _homoscedastic(input, var):
    """torch's shape check of gaussian_nll_loss's var: input's shape, input's shape less the
    last dim (then unsqueezed), or input's rank with one dim of size 1."""
    if tuple(var.shape) == tuple(input.shape):
        return var
    if tuple(input.shape[:-1]) == tuple(var.shape):
        return var.unsqueeze(-1)
    if input.ndim == var.ndim and sum(v for i, v in zip(input.shape, var.shape) if i != v) == 1:
        return var
    raise ValueError("var is of incorrect size")


def gaussian_nll_loss(input, target, var, full: bool = False, eps: float = 1e-6, reduction: str = "mean") -> DTensor:
    """(log(max(var, eps)) + (x - t)^2 / max(var, eps)) / 2, plus log(2 pi) / 2 if full. torch
    clamps var under no_grad, so the gradient reaches var unclamped: here the clamp is added as a
    detached difference. torch's check that no var entry is negative would read var back on
    every call (a blocking read); dtorch skips it, so a negative var is clamped to eps."""
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = full_like(input, float(var))
    else:
        var = _homoscedastic(input, var)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var + (var.clamp_min(eps) - var).detach()
    losses = 0.5 * (var.log() + (input - target) ** 2 / var)
    if full:
        losses = losses + 0.5 * math.log(2 * math.pi)
    return reduced_loss(losses, None, None, reduction)


def hinge_embedding_loss(input, target, margin: float = 1.0, size_average=None, reduce=None,
                         reduction: str = "mean") -> DTensor:
    """x where target != -1, plus max(margin - x, 0) where target != 1 (ATen's form)."""
    beyond_margin = _where(target != 1, (margin - input).clamp_min(0), 0.0)
    return reduced_loss(beyond_margin + _where(target != -1, input, 0.0), size_average, reduce, reduction)


def multi_margin_loss(input, target, p: int = 1, margin: float = 1.0, weight=None, size_average=None,
                      reduce=None, reduction: str = "mean") -> DTensor:
    """sum over j != y of w[y] max(0, margin - x[y] + x[j])^p, over the class count C, for each
    row of (N, C) (or one (C,) row) with class y."""
    if p not in (1, 2):
        raise ValueError("only p == 1 and p == 2 supported")
    if weight is not None and weight.ndim != 1:
        raise ValueError("weight must be one-dimensional")
    row = input.ndim <= 1
    scores = input.reshape(1, -1) if row else input
    classes = target.reshape(-1, 1)
    chosen = scores.gather(1, classes)
    gaps = (margin - chosen + scores).clamp_min(0)
    if p == 2:
        gaps = gaps * gaps
    if weight is not None:
        gaps = gaps * weight.index_select(0, classes.reshape(-1)).unsqueeze(1)
    mesh = scores.device_mesh
    others = arange(scores.shape[1], device_mesh=mesh, placements=[Replicate()] * mesh.ndim) != classes
    losses = _where(others, gaps, 0.0).sum(1) / scores.shape[1]
    return reduced_loss(losses.reshape(()) if row else losses, size_average, reduce, reduction)


def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None,
                                reduction: str = "mean") -> DTensor:
    """-(t logsigmoid(x) + (1 - t) logsigmoid(-x)), weighted, averaged over the class dim (the last)."""
    losses = -(target * call_op("logsigmoid", (input,), {}) + (1 - target) * call_op("logsigmoid", (-input,), {}))
    if weight is not None:
        losses = losses * weight
    class_dim = input.ndim - 1
    return reduced_loss(losses.sum(class_dim) / input.shape[class_dim], size_average, reduce, reduction)


def soft_margin_loss(input, target, size_average=None, reduce=None, reduction: str = "mean") -> DTensor:
    """log(1 + exp(-t x)) (ATen's form)."""
    return reduced_loss((-input * target).exp().log1p(), size_average, reduce, reduction)


_ATEN_REDUCTIONS = ("none", "mean", "sum")   # at::Reduction's enum


def _or_aten_form(functional, aten_parameters: tuple):
    """torch.<name> (ATen's parameters, all positional, the reduction an int) shares its name with
    F.<name>, which reaches __torch_function__ with only input and target positional: more
    positional arguments, or an int reduction, are ATen's."""
    def either(input, target, *rest, **kwargs):
        named = {**dict(zip(aten_parameters, rest)), **kwargs}
        if isinstance(named.get("reduction"), int):
            named["reduction"] = _ATEN_REDUCTIONS[named["reduction"]]
        return functional(input, target, **named)
    either.__name__ = either.__qualname__ = functional.__name__
    return either


_FUNCTIONS = {
    "poisson_nll_loss": _or_aten_form(poisson_nll_loss, ("log_input", "full", "eps", "reduction")),
    "gaussian_nll_loss": gaussian_nll_loss,
    "hinge_embedding_loss": _or_aten_form(hinge_embedding_loss, ("margin", "reduction")),
    "multi_margin_loss": multi_margin_loss,
    "multilabel_soft_margin_loss": multilabel_soft_margin_loss, "soft_margin_loss": soft_margin_loss,
}


# a plain torch target, var or weight beside DTensor inputs is uploaded once per call, as for an op
register_torch_spellings({name: with_local_tensors_uploaded(function) for name, function in _FUNCTIONS.items()})
