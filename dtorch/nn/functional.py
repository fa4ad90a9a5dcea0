"""torch.nn.functional names over dtorch ops. Each is one registry op (rules in dtorch/ops/:
pointwise, reduction, matrix, nn, vision); `torch.nn.functional.<name>(dtensor)` reaches the same op
through __torch_function__, except dropout, which needs dtorch's random stream (below, and
scaled_dot_product_attention with dropout_p > 0 for the same reason), batch_norm in training
mode, whose batch statistics dtorch computes across ranks (below), and cross_entropy / nll_loss,
whose mean over a sharded batch is a sum over a count and whose sharded class dim is never
gathered (at the end)."""
from __future__ import annotations

import math

import torch
from torch.nn._reduction import legacy_get_string

from ..spec.placements import Replicate, Shard
from ..errors import UnsupportedOpError
from ..dtensor.factories import arange, upload_replicated
from ..runtime.controller import session
from ..dtensor.inplace import assign
from ..dtensor.recording import no_grad
from ..dtensor.op_issue import with_local_tensors_uploaded
from ..dtensor import api
from ..dtensor.tensor import DTensor, call_op

__all__ = ["relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "softplus", "softmax",
           "log_softmax", "linear", "layer_norm", "rms_norm", "embedding", "dropout", "pad",
           "scaled_dot_product_attention", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
           "huber_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
           "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "max_pool2d",
           "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "interpolate",
           "group_norm", "batch_norm", "batch_norm_with_running_stats"]


def _forward(name: str):
    """A function that passes its arguments to op `name` as given (torch's own signature)."""
    def function(*args, **kwargs):
        return call_op(name, args, kwargs)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"torch.nn.functional.{name} on DTensors (op {name!r})."
    return function


def _with_inplace(name: str, position: int):
    """torch's `inplace` flag (by keyword or at `position`): the op runs out of place and the
    input is rebound to its result (dtorch/dtensor/inplace.py)."""
    def function(*args, **kwargs):
        inplace = kwargs.pop("inplace", False)
        if len(args) > position:
            inplace, args = args[position], args[:position] + args[position + 1:]
        result = call_op(name, args, kwargs)
        return assign(args[0], result, f"{name}(inplace=True)") if inplace else result
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"torch.nn.functional.{name} on DTensors (op {name!r}); inplace=True rebinds the input."
    return function


relu, silu = _with_inplace("relu", 1), _with_inplace("silu", 1)
leaky_relu, elu = _with_inplace("leaky_relu", 2), _with_inplace("elu", 2)


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """The mask is a pure function of (dtorch.manual_seed, call order, global element index):
    the same on every layout, so a run reproduces under any placements."""
    if not training or p == 0:
        result = call_op("dropout", (input, p, False, False, 0, 0), {})
    else:
        seed, counter = session.next_random()
        result = call_op("dropout", (input, p, True, False, seed, counter), {})
    return assign(input, result, "dropout(inplace=True)") if inplace else result


gelu, sigmoid, tanh, softplus = map(_forward, ("gelu", "sigmoid", "tanh", "softplus"))
softmax, log_softmax, linear = map(_forward, ("softmax", "log_softmax", "linear"))
layer_norm, rms_norm, embedding, pad = map(_forward, ("layer_norm", "rms_norm", "embedding", "pad"))
mse_loss, l1_loss = map(_forward, ("mse_loss", "l1_loss"))
smooth_l1_loss, huber_loss, kl_div = map(_forward, ("smooth_l1_loss", "huber_loss", "kl_div"))
binary_cross_entropy = _forward("binary_cross_entropy")
binary_cross_entropy_with_logits = _forward("binary_cross_entropy_with_logits")
conv1d, conv2d, conv3d = map(_forward, ("conv1d", "conv2d", "conv3d"))
conv_transpose1d, conv_transpose2d, conv_transpose3d = map(_forward, ("conv_transpose1d", "conv_transpose2d",
                                                                       "conv_transpose3d"))
max_pool2d, avg_pool2d = map(_forward, ("max_pool2d", "avg_pool2d"))
adaptive_avg_pool2d, adaptive_max_pool2d = map(_forward, ("adaptive_avg_pool2d", "adaptive_max_pool2d"))
interpolate, group_norm = map(_forward, ("interpolate", "group_norm"))


def scaled_dot_product_attention(*args, **kwargs):
    """torch.nn.functional.scaled_dot_product_attention on DTensors (op 'scaled_dot_product_attention').
    With dropout_p > 0 it is torch's math form written out (softmax(q k^T * scale + mask), dropped,
    times v), the dropout drawn from dtorch's stream like F.dropout: the op's kernel would draw
    torch's random numbers on each worker, different on every layout."""
    dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    if not dropout_p:
        return call_op("scaled_dot_product_attention", args, kwargs)
    return _attention_with_dropout(*args, **kwargs)


def _attention_with_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    if enable_gqa:   # each key/value head serves a group of query heads
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    weights = attention_weights(query, key, attn_mask, dropout_p, is_causal, scale)
    return call_op("matmul", (weights, value), {})


def attention_weights(query, key, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None):
    """softmax(q k^T * scale + mask), dropped (dtorch's stream) if dropout_p: torch's math form of
    attention's weights. A bool mask keeps where True, a float one is added."""
    scores = call_op("matmul", (query, key.transpose(-2, -1)), {}) * (
        1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if is_causal:   # query i sees keys 0..i (torch's tril of ones), built on the workers
        mesh, whole = query.device_mesh, [Replicate()] * query.device_mesh.ndim
        rows = arange(query.shape[-2], device_mesh=mesh, placements=whole).unsqueeze(-1)
        scores = scores.masked_fill(rows < arange(key.shape[-2], device_mesh=mesh, placements=whole), float("-inf"))
    if attn_mask is not None:
        attn_mask = on_mesh_of(query, attn_mask)
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    weights = softmax(scores, dim=-1)
    return dropout(weights, dropout_p) if dropout_p else weights


def on_mesh_of(tensor, value):
    """`value` as a DTensor beside `tensor`: a torch tensor (a mask the controller holds) is
    uploaded Replicate on tensor's mesh, each call."""
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return value
    return upload_replicated(value, tensor.device_mesh)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5):
    """torch's F.batch_norm. In training mode the batch statistics are computed across ranks
    (an input sharded on its batch costs one all-reduce of 2 x C numbers, not a gather), and
    running_mean / running_var are updated in place as torch does (without autograd history;
    batch_norm_with_running_stats returns the new ones instead)."""
    if not training:
        return call_op("batch_norm", (input, running_mean, running_var, weight, bias, False, momentum, eps), {})
    out, mean, var = batch_norm_with_running_stats(input, running_mean, running_var, weight, bias, True, momentum, eps)
    with no_grad():
        for running, new in ((running_mean, mean), (running_var, var)):
            if running is not None:
                assign(running, new.detach(), "batch_norm(training=True)")
    return out


def batch_norm_with_running_stats(input, running_mean, running_var, weight=None, bias=None,
                                  training: bool = False, momentum: float = 0.1, eps: float = 1e-5):
    """F.batch_norm that returns (output, new_running_mean, new_running_var) instead of updating
    the running statistics in place (torch's training mode). In eval mode they come back as
    given. In training mode the output is normalized with the whole batch's mean and biased
    variance, computed across ranks: per-channel [sum, sum of squares] (P(sum) where the batch or
    pixels are sharded) are all-reduced explicitly (this works in strict mode too), and the new
    statistics are `momentum * batch + (1 - momentum) * running` with the unbiased variance, as
    torch. A None running statistic comes back None. momentum=None (torch's cumulative average)
    needs the module's num_batches_tracked: pass momentum=1 / num_batches_tracked instead."""
    if not training:
        out = call_op("batch_norm", (input, running_mean, running_var, weight, bias, False, momentum, eps), {})
        return out, running_mean, running_var
    if momentum is None:
        raise UnsupportedOpError("batch_norm_with_running_stats(momentum=None): a cumulative average needs the "
                                 "count of batches seen; pass momentum=1 / num_batches_tracked")
    moments = call_op("batch_norm_moments", (input,), {})
    if any(p.is_partial() for p in moments.placements):
        moments = moments.redistribute(placements=[Replicate() if p.is_partial() else p for p in moments.placements])
    out, mean, var = call_op("batch_norm_from_moments",
                             (input, moments, running_mean, running_var, weight, bias, momentum, eps), {})
    return out, (None if running_mean is None else mean), (None if running_var is None else var)


# --- cross_entropy and nll_loss: a mean over a sharded batch -----------------------------------------
# Their 'mean' of class targets divides by the count of targets that are not ignore_index (weighted
# by their class weights): data no rank knows alone, so the op's rule refuses a sharded batch and
# the planner would gather the whole input (batch x classes) onto every rank. Here the sum stays
# sharded and the denominator is computed alongside: one all-reduce of the two scalars instead.
# Both read their target's placements: a plain torch target or weight (transformers' labels) is
# uploaded first, as an op's would be (with_local_tensors_uploaded).
@with_local_tensors_uploaded
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """torch.nn.functional.cross_entropy on DTensors (op 'cross_entropy')."""
    return _class_loss("cross_entropy", input, target, weight, size_average, ignore_index, reduce, reduction,
                       {"label_smoothing": label_smoothing})


@with_local_tensors_uploaded
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    """torch.nn.functional.nll_loss on DTensors (op 'nll_loss')."""
    return _class_loss("nll_loss", input, target, weight, size_average, ignore_index, reduce, reduction, {})


def _class_loss(name, input, target, weight, size_average, ignore_index, reduce, reduction, extra):
    if size_average is not None or reduce is not None:   # torch's deprecated spelling
        reduction = legacy_get_string(size_average, reduce, emit_warning=False)
    kwargs = dict(extra, ignore_index=ignore_index)
    if _classes_sharded(input, target, weight):
        losses = class_sharded_losses(input, target, 1, ignore_index, log_probabilities=name == "nll_loss", **extra)
        return _reduced_losses(losses, target, ignore_index, reduction)
    if reduction != "mean" or target.dtype.is_floating_point or not _batch_sharded(input, target):
        return call_op(name, (input, target, weight), dict(kwargs, reduction=reduction))
    total = call_op(name, (input, target, weight), dict(kwargs, reduction="sum"))
    return _ratio_of_sums(total, _targets_weight(input, target, weight, ignore_index))


def _batch_sharded(input, target) -> bool:
    return any(isinstance(p, Shard) for p in (*input.placements, *target.placements))


def _targets_weight(input, target, weight, ignore_index):
    """The mean's denominator: how many targets are not ignore_index, each counted by its class
    weight when there is one (torch's nll_loss)."""
    kept = target != ignore_index
    if weight is None:
        return kept.to(input.dtype).sum()
    classes = call_op("where", (kept, target, 0), {})
    per_target = call_op("embedding", (classes, weight.unsqueeze(1)), {}).squeeze(-1)
    return (per_target * kept.to(per_target.dtype)).sum()


# --- a sharded class dim (a vocabulary-parallel head): never gathered ------------------------------
# The op's rule needs all classes on a rank (a log_softmax over them), so the planner would gather
# the class dim: with a tp-sharded vocabulary, all (tokens x vocabulary) logits onto every rank.
# Built from the shards instead, the max, the sum of exponentials and the target's logit are
# reductions over the class dim: an all-reduce of one value per target for the max, and one of two
# values per target for the two sums.
def _classes_sharded(input, target, weight) -> bool:
    """Class-index targets without class weights, the class dim (1) sharded, nothing pending."""
    return (input.ndim >= 2 and weight is None and not target.dtype.is_floating_point
            and any(p.is_shard(1) for p in input.placements)
            and not any(p.is_partial() for p in (*input.placements, *target.placements)))


def class_sharded_losses(input, target, dim: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0,
                         log_probabilities: bool = False):
    """Each target's loss (0 where it is ignore_index): torch's cross_entropy of logits `input`
    over class dim `dim` (nll_loss of log-probabilities if `log_probabilities`), reduction
    'none', computed on a sharded class dim without gathering it. A target outside the classes
    is not detected (it would need a read): it counts as a zero logit's loss."""
    classes = input.shape[dim]
    index = arange(classes, device_mesh=input.device_mesh, placements=_laid_like_dim(input, dim))
    if dim < input.ndim - 1:   # laid along `dim`: (classes, 1, ...)
        index = index.view(classes, *[1] * (input.ndim - 1 - dim))
    hit = (index == target.unsqueeze(dim)).to(input.dtype)
    chosen = input
    if not log_probabilities:
        # the shift cancels out of the loss, so it carries no gradient (torch's logsumexp detaches it too)
        chosen = input - input.detach().amax(dim, keepdim=True).reduce_partials()
    # label smoothing: (1 - e) of the target's logit and e of the classes' mean, in one reduction
    mix = hit if not label_smoothing else hit * (1 - label_smoothing) + label_smoothing / classes
    sums = [(chosen * mix).sum(dim)] + ([] if log_probabilities else [chosen.exp().sum(dim)])
    # the sums over the class shards, all-reduced together (one collective forward, one backward)
    reduced = call_op("stack", (sums, -1), {}).reduce_partials().unbind(-1)
    kept = (target != ignore_index).to(input.dtype)
    return (-reduced[0] if log_probabilities else reduced[1].log() - reduced[0]) * kept


def _laid_like_dim(input, dim: int) -> list:
    """Placements of a (classes,) index vector sharded wherever `input`'s dim `dim` is."""
    return [Shard(0) if p.is_shard(dim) else Replicate() for p in input.placements]


def _reduced_losses(losses, target, ignore_index: int, reduction: str):
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction != "mean":
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return _ratio_of_sums(losses.sum(), (target != ignore_index).to(losses.dtype).sum())


def _ratio_of_sums(numerator, denominator):
    """numerator / denominator of two pending sums (0-d, P(sum) where the batch is sharded),
    all-reduced together: one collective, not two."""
    both = call_op("stack", ([numerator, denominator.to(numerator.dtype)],), {}).reduce_partials()
    return both[0] / both[1]


# torch.nn.functional's spellings reach these too: torch.nn.Dropout and torch.nn.BatchNorm2d (a
# module of the user's own, dtorch.nn.distribute_module) run on DTensors unchanged
api.register_functions(dict(cross_entropy=cross_entropy, nll_loss=nll_loss, dropout=dropout, batch_norm=batch_norm,
                            scaled_dot_product_attention=scaled_dot_product_attention))
