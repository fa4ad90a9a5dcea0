"""PURE: torch.nn.functional's losses, family "nn". One table: loss -> its row (torch's function,
rule, local hook); each worker runs torch's own function on its shards, so values, gradients and
torch's own input checks (a BCE probability outside [0, 1], a class index out of range) are
torch's.

  cross_entropy, nll_loss  shards on batch (and spatial) dims, class dim R; reduction 'none' keeps
                           the shards, 'sum' gives P(sum); 'mean' over a sharded batch with class
                           targets needs the count of targets that are not ignore_index, which no
                           rank knows alone, so it is refused (the planner gathers instead)
  pointwise losses         mse, l1, smooth_l1, huber, binary_cross_entropy(_with_logits), kl_div:
                           inputs sharded alike, weights broadcast as in a pointwise op; 'none'
                           keeps the shards, 'sum' gives P(sum), and so does 'mean' (and kl_div's
                           'batchmean'): each rank sums its elements and divides by the global count
                           (loss_mean_as_partial_sum). A weighted mean of mse, l1 or huber divides
                           by the weights' sum, which no rank knows alone: refused when sharded.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ..spec.placements import Partial, Shard
from .nn import letters_decision
from .partial_laws import Laws, partial_output
from .pointwise import shard_decision
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, RuleRejected

__all__ = ["LOSSES"]

# Where each loss takes (size_average, reduce, reduction) positionally; None: no such parameter.
_REDUCTION_AT = {"cross_entropy": (3, 5, 6), "nll_loss": (3, 5, 6), "mse_loss": (2, 3, 4), "l1_loss": (2, 3, 4),
                 "smooth_l1_loss": (2, 3, 4), "huber_loss": (None, None, 2), "binary_cross_entropy": (3, 4, 5),
                 "binary_cross_entropy_with_logits": (3, 4, 5), "kl_div": (2, 3, 4)}
# Losses whose weighted 'mean' divides by the weights' sum (torch's, for these three).
_WEIGHT_DIVIDES = {"mse_loss": 5, "l1_loss": 5, "huber_loss": 4}   # the weight's position


def _reduction(call: Call) -> str:
    size_average_at, reduce_at, reduction_at = _REDUCTION_AT[call.op]
    size_average = None if size_average_at is None else call.param(size_average_at, "size_average")
    reduce = None if reduce_at is None else call.param(reduce_at, "reduce")
    if size_average is not None or reduce is not None:   # torch's deprecated spelling
        return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return call.param(reduction_at, "reduction", "mean")


# --- cross_entropy and nll_loss: a class dim ---------------------------------------------------------
def _cross_entropy_laws(call: Call) -> Laws:
    """The loss is -sum t' w log softmax(x) with t' = (1 - eps) t + eps / C: linear in the weight
    (unless 'mean' divides by the targets' weights) and affine in probability targets."""
    class_targets = not call.inputs[1].dtype.is_floating_point
    weight = () if class_targets and _reduction(call) == "mean" else ((2,),)
    target = () if class_targets else ((1,),)
    return Laws(params=("input", "target", "weight"), linear=weight + target,
                affine=bool(call.param(7, "label_smoothing", 0.0)) and not class_targets)


def _nll_laws(call: Call) -> Laws:
    """The loss is -w[t] x[t]: linear in the input (a 'mean' divides by the targets' weights, a
    constant of the input), linear in the weight unless 'mean' divides by it, and decreasing in
    the input element by element ('none', no weight of either sign)."""
    params = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    mean = _reduction(call) == "mean"
    elementwise = _reduction(call) == "none" and call.param(2, "weight") is None
    return Laws(params=params, linear=((0,),) + (() if mean else ((2,),)), monotone=(-1,) if elementwise else ())


def _cross_entropy_rule(call: Call, placements) -> Decision:
    """Batch and spatial dims may be sharded (input and target alike); the class dim is whole.
    'mean' over a sharded batch of class targets is refused (its count of targets that are not
    ignore_index is data no rank knows alone): the planner gathers, or write reduction='sum'."""
    if any(isinstance(p, Partial) for p in placements):
        laws = _nll_laws(call) if call.op == "nll_loss" else _cross_entropy_laws(call)
        out = partial_output(call, placements, laws)
        if out is None:
            raise RuleRejected(f"{call.op} does not commute with these Partial inputs",
                               "input R with a P(sum|avg) weight or probability target")
        return Decision(placements, (out,))
    x, target = call.inputs[:2]
    rank = len(x.shape)
    letters = "c" if rank == 1 else "nc" + "ghijk"[:rank - 2]
    target_letters = letters if target.dtype.is_floating_point else letters.replace("c", "")
    terms = [letters, target_letters] + ["c"] * (len(call.inputs) - 2)
    reduction = _reduction(call)
    out = letters.replace("c", "") if reduction == "none" else ""
    legal = "S on the batch or spatial dims of input and target alike (class dim R, weight R); " \
            "reduction 'none' or 'sum', or 'mean' with probability targets"
    decision = letters_decision(call, placements, ",".join(terms) + "->" + out, "c", legal)
    if reduction == "mean" and decision.outputs[0].is_partial() and not target.dtype.is_floating_point:
        raise RuleRejected("reduction='mean' over a sharded batch divides by the count of targets that "
                           "are not ignore_index, which no rank knows alone; use reduction='sum' and divide",
                           legal)
    return decision


def _class_count(call: Call) -> int:
    shape = call.inputs[0].shape
    return math.prod(shape) // shape[1 if len(shape) > 1 else 0]


# --- pointwise losses ------------------------------------------------------------------------------
# Each loss's parameters, and where its `weight` sits: the loss is linear in it, except in a 'mean'
# that divides by the weights' sum (mse, l1, huber).
_POINTWISE_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                     "binary_cross_entropy_with_logits", "kl_div")
# torch's signatures, read once (the kernel below binds a call's arguments to them on every call)
_SIGNATURES = {name: inspect.signature(getattr(F, name)) for name in ("cross_entropy", "nll_loss") + _POINTWISE_LOSSES}
_PARAMS = {name: tuple(_SIGNATURES[name].parameters) for name in _POINTWISE_LOSSES}


def _pointwise_loss_laws(call: Call) -> Laws:
    """Linear in `weight` (unless a 'mean' divides by it); binary cross entropy with logits is affine
    in its target and pos_weight; kl_div is affine in its input and, element by element ('none'),
    decreasing in it (targets are probabilities)."""
    params = _PARAMS[call.op]
    linear, affine = [], []
    if "weight" in params and not (call.op in _WEIGHT_DIVIDES and _reduction(call) == "mean"):
        linear.append((params.index("weight"),))
    if call.op == "binary_cross_entropy_with_logits":   # (the other checks that each rank's target is in [0, 1])
        affine += [params.index("target"), params.index("pos_weight")]
    if call.op == "kl_div":
        affine.append(0)
    linear += [(position,) for position in affine]
    elementwise = call.op == "kl_div" and _reduction(call) == "none"
    return Laws(params=params, linear=tuple(linear), affine=tuple(affine), monotone=(-1,) if elementwise else ())


def _pointwise_loss_rule(call: Call, placements) -> Decision:
    """Elementwise, then reduced: inputs sharded alike; 'sum', 'mean' (and 'batchmean') give P(sum),
    each rank dividing its sum by the global count."""
    legal = "inputs sharded alike (or R; a weight broadcast like a pointwise op's input); Partial only on a weight"
    if any(isinstance(p, Partial) for p in placements):
        out = partial_output(call, placements, _pointwise_loss_laws(call))
        if out is None:
            raise RuleRejected(f"{call.op} is not linear in these Partial inputs", legal)
        return Decision(placements, (out,))
    reduction = _reduction(call)
    if reduction == "none":
        return shard_decision(call, placements)
    whole = torch.broadcast_shapes(*[spec.shape for spec in call.inputs])
    decision = shard_decision(call._replace(outputs=((tuple(whole), call.outputs[0][1]),)), placements)
    if not isinstance(decision.outputs[0], Shard):
        return decision
    if reduction == "mean" and call.op in _WEIGHT_DIVIDES and \
            call.param(_WEIGHT_DIVIDES[call.op], "weight") is not None:
        raise RuleRejected(f"{call.op}'s weighted mean divides by the weights' sum, which no rank knows alone; "
                           "use reduction='sum' and divide by weight.sum()", legal)
    return Decision(decision.inputs, (Partial("sum"),))


def _element_count(call: Call) -> int:
    if _reduction(call) == "batchmean":   # kl_div: per batch element
        return call.inputs[0].shape[0] if call.inputs[0].shape else 1
    return math.prod(torch.broadcast_shapes(*[spec.shape for spec in call.inputs]))


# --- 'mean' over shards: a local sum over the global count ------------------------------------------
def _mean_as_partial_sum(count_of):
    """A loss's 'mean' over sharded elements: each rank sums and divides by the global count."""
    def local(call: Call, required):
        if _reduction(call) not in ("mean", "batchmean") or not any(isinstance(p, Shard) for p in required[0]):
            return call.op, {}
        return "loss_mean_as_partial_sum", {"loss": call.op, "count": count_of(call)}
    return local


@kernel("loss_mean_as_partial_sum")
def loss_mean_as_partial_sum(*args, loss, count, **kwargs):
    """torch's loss with reduction='sum' on this rank's shard, over the global count."""
    bound = _SIGNATURES[loss].bind(*args, **kwargs)
    for legacy in ("size_average", "reduce"):
        bound.arguments.pop(legacy, None)
    bound.arguments["reduction"] = "sum"
    return LOSSES[loss].torch_fn(*bound.args, **bound.kwargs) / count


def _row(torch_fn, rule, count_of) -> OpRow:
    """A loss: a function of dtorch.nn.functional (never a method); its rule's docstring is its doc."""
    return OpRow(torch_fn, rule, _mean_as_partial_sum(count_of), method=False, doc=(rule.__doc__ or "").strip())


LOSSES = {
    "cross_entropy": _row(F.cross_entropy, _cross_entropy_rule, _class_count),
    "nll_loss": _row(F.nll_loss, _cross_entropy_rule, _class_count),
    **{name: _row(getattr(F, name), _pointwise_loss_rule, _element_count) for name in _POINTWISE_LOSSES},
}
register_family("nn", LOSSES)
