"""PURE: the normalizations of vision models (family "vision", docs under ops/vision.py's rules):
group_norm, batch_norm, and the two ops from which dtorch.nn.functional builds batch norm's
training mode across ranks:

  batch_norm_moments(input) -> (2, C) float64 [sum, sum of squares] per channel (every dim but 1).
      A shard of N/H/W gives P(sum) (each rank sums its pixels); S(C) gives S(1).
  batch_norm_from_moments(input, moments, running_mean, running_var, weight, bias, momentum, eps)
      -> (output, new running_mean, new running_var): normalizes with the batch statistics the
      whole-batch moments give (biased variance) and returns torch's running-statistics update
      (momentum * batch + (1 - momentum) * running, unbiased variance). Without running
      statistics the last two outputs are the batch mean and unbiased variance. Needs the
      moments whole (R, or S(1) beside S(C) input): reduce their P(sum) first.

torch's F.batch_norm(training=True) updates running_mean/var in place. The registry op has no
in-place outputs, so it refuses that form: F.batch_norm (torch's or dtorch.nn.functional's) runs
batch_norm_from_moments and rebinds the running statistics to the new ones (dtorch/dtensor/inplace.py),
and dtorch.nn.functional.batch_norm_with_running_stats returns them instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec.placements import Partial, Shard
from ..errors import UnsupportedOpError
from .partial_laws import Laws, partial_output
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, R, RuleRejected, TensorSlot, unshard_fix
from .vision import present_groups, refuse_spatial, whole_groups

__all__ = ["VISION_NORM"]


def _slots(call: Call, params: tuple) -> dict:
    """{parameter name: tensor input index} for the tensor parameters the call passes."""
    found = {}
    for position, name in enumerate(params):
        value = call.param(position, name)
        if type(value) is TensorSlot:
            found[name] = value.index
    return found


def _empty_block(input) -> bool:
    return input.numel() == 0 and input.device.type != "meta"


# --- group_norm -------------------------------------------------------------------------------------
_GROUP_PARAMS = ("input", "num_groups", "weight", "bias")
_GROUP_LAWS = Laws(params=_GROUP_PARAMS, linear=present_groups(_GROUP_PARAMS, (2, 3)), monotone=(0, 0, 0, 1))
_GROUP_LEGAL = ("input S(N) with weight, bias R; input S(C) with weight, bias S(0) when every rank holds whole "
                "groups; weight, bias Partial (linear) with input R; never S(H|W)")


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """F.group_norm, also on an empty shard (torch refuses 0 channels)."""
    return torch.zeros_like(input) if _empty_block(input) else F.group_norm(input, num_groups, weight, bias, eps)


@kernel("group_norm_channel_shard")
def group_norm_channel_shard(input, num_groups, weight=None, bias=None, eps=1e-5, *, group_channels):
    """A rank holding whole groups normalizes them as a group norm of fewer groups."""
    if _empty_block(input):
        return torch.zeros_like(input)
    return F.group_norm(input, input.shape[1] // group_channels, weight, bias, eps)


def _group_norm_rule(call: Call, placements) -> Decision:
    """S(N) passes; S(C) on whole groups (weight, bias S(0)); S(H|W) refused; no Partial input"""
    if any(isinstance(p, Partial) for p in placements):
        out = partial_output(call, placements, _GROUP_LAWS)
        if out is None:
            raise RuleRejected("group_norm is not linear in its input; only weight and bias may be Partial",
                               _GROUP_LEGAL)
        return Decision(placements, (out,))
    x, params = placements[0], placements[1:]
    refuse_spatial(call, x, tuple(range(2, len(call.inputs[0].shape))), _GROUP_LEGAL, "group statistics")
    if x == Shard(1):
        groups = call.param(1, "num_groups")
        if any(p not in (R, Shard(0)) for p in params) or \
                whole_groups(call, 0, 1, call.inputs[0].shape[1] // groups) is None:
            raise RuleRejected(f"some rank's channels of input {call.inputs[0].describe()} are not whole groups "
                               f"of the {groups}; {unshard_fix(call, x)}", _GROUP_LEGAL)
        return Decision((x,) + (Shard(0),) * len(params), (x,))
    if any(not p.is_replicate() for p in params):
        raise RuleRejected("weight and bias span the channels: R unless the input is S(1)", _GROUP_LEGAL)
    return Decision(placements, (x,))


def _group_norm_local(call: Call, required):
    if Shard(1) in required[0]:
        return "group_norm_channel_shard", {"group_channels": call.inputs[0].shape[1] // call.param(1, "num_groups")}
    return "group_norm", {}


# --- batch_norm ---------------------------------------------------------------------------------------
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-5):
    """F.batch_norm, also on an empty shard (torch's training mode refuses 0 channels)."""
    if _empty_block(input):
        return torch.zeros_like(input)
    return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


_BATCH_PARAMS = ("input", "running_mean", "running_var", "weight", "bias")
_BATCH_LEGAL = ("input S(N|H|W) (eval mode) or R with the per-channel tensors R; input S(C) with them S(0); "
                "P(avg) input (eval); weight, bias P(sum|avg) with the rest R")


def _batch_norm_laws(call: Call, training: bool) -> Laws:
    """eval: (x - mean) / sqrt(var + eps) * weight + bias is linear in (x, mean) jointly (plus
    the bias), rising in x without a weight (whose sign is unknown), linear in (weight, bias);
    training: only the last"""
    rising = 0 if "weight" in _slots(call, _BATCH_PARAMS) else 1
    if training:
        return Laws(params=_BATCH_PARAMS, linear=present_groups(_BATCH_PARAMS, (3, 4)), monotone=(0, 0, 0, 0, 1))
    # arithmetic: a P(max) input and a P(max) mean on two mesh dims would meet as -inf - -inf
    return Laws(params=_BATCH_PARAMS, linear=present_groups(_BATCH_PARAMS, (0, 1), (3, 4)),
                monotone=(rising, -rising, 0, 0, 1), arithmetic=True)


def _batch_norm_rule(call: Call, placements) -> Decision:
    """eval: S(N|H|W) pass, S(C) with the per-channel tensors S(0); training (batch statistics):
    S(N|H|W) refused, and running statistics refused (torch updates them in place)"""
    training, slots = call.param(5, "training", False), _slots(call, _BATCH_PARAMS)
    if training and ("running_mean" in slots or "running_var" in slots):
        raise UnsupportedOpError(
            "batch_norm(training=True) with running_mean/running_var updates them in place, which the op "
            "itself cannot: call torch.nn.functional.batch_norm (or dtorch.nn.functional's), which does, or "
            "dtorch.nn.functional.batch_norm_with_running_stats(input, running_mean, running_var, weight, bias, "
            "training=True, momentum=..., eps=...), which returns (output, new_running_mean, new_running_var); "
            "both compute the batch statistics across ranks")
    if any(isinstance(p, Partial) for p in placements):
        # a P(sum) input or mean would add the bias once per rank
        centred_sum = "bias" in slots and any(placements[slots[name]] == Partial("sum")
                                              for name in ("input", "running_mean") if name in slots)
        out = None if centred_sum else partial_output(call, placements, _batch_norm_laws(call, training))
        if out is None:
            raise RuleRejected(f"batch_norm does not commute with the reduction of "
                               f"({', '.join(map(repr, placements))})", _BATCH_LEGAL)
        return Decision(placements, (out,))
    return _per_channel_decision(call, placements, "batch statistics" if training else None, _BATCH_LEGAL)


def _per_channel_decision(call: Call, placements, spans: str | None, legal: str, outputs: int = 1) -> Decision:
    """Input 0 is (N, C, ...), the others per-channel (1-D, or (2, C) moments): S(C) of the input
    goes with S(channel dim) of the others; otherwise they are R. `spans`: what the op computes
    over every dim but C (a shard of one is then refused)."""
    x, others = placements[0], placements[1:]
    channel_dims = [len(spec.shape) - 1 for spec in call.inputs[1:]]
    if spans and isinstance(x, Shard) and x.dim != 1:
        raise RuleRejected(f"{call.op} computes {spans} over dim {x.dim}, which is sharded; "
                           "dtorch.nn.functional.batch_norm_with_running_stats computes them across ranks",
                           legal)
    if x == Shard(1) or any(isinstance(p, Shard) for p in others):
        if x not in (R, Shard(1)) or any(p not in (R, Shard(d)) for p, d in zip(others, channel_dims)):
            raise RuleRejected(f"the channels are split: input S(1) with the per-channel tensors S(0) (given "
                               f"{', '.join(map(repr, placements))})", legal)
        return Decision((Shard(1),) + tuple([Shard(d) for d in channel_dims]),
                        (Shard(1),) + (Shard(0),) * (outputs - 1))
    if any(not p.is_replicate() for p in others):
        raise RuleRejected("the per-channel tensors must be R unless the input's channels are split", legal)
    return Decision(placements, (x,) + (R,) * (outputs - 1))


def batch_norm_moments(input):
    """[sum, sum of squares] per channel (dim 1) over every other dim, in float64 (a variance from
    them subtracts two close numbers)."""
    dims = [d for d in range(input.dim()) if d != 1]
    x = input if input.element_size() >= 4 else input.float()
    return torch.stack([x.sum(dims, dtype=torch.float64), x.square().sum(dims, dtype=torch.float64)])


def _moments_rule(call: Call, placements) -> Decision:
    """S(C) -> S(1); S of any other dim -> P(sum) (a sum over it); no Partial input (squares)"""
    (x,) = placements
    if isinstance(x, Partial):
        raise RuleRejected(f"a sum of squares does not commute with the reduction of {x!r}; "
                           f"{unshard_fix(call, x)}", "S(d), R")
    if isinstance(x, Shard):
        return Decision(placements, (Shard(1) if x.dim == 1 else Partial("sum"),))
    return Decision(placements, (R,))


def batch_norm_from_moments(input, moments, running_mean=None, running_var=None, weight=None, bias=None,
                            momentum=0.1, eps=1e-5, *, count=None):
    """Normalize with the batch statistics of the whole-batch `moments`; return (output, new
    running_mean, new running_var). `count` (the kernel's): elements per channel in the whole batch."""
    if count is None:
        count = input.numel() // max(input.shape[1], 1)
        if count <= 1:   # torch's own check: an unbiased variance of one value is undefined
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{list(input.shape)}")
    mean = moments[0] / count
    variance = (moments[1] / count - mean * mean).clamp_min(0)
    scale = torch.rsqrt(variance + eps)
    scale = scale if weight is None else scale * weight
    shift = -mean * scale if bias is None else bias - mean * scale
    shape = [1, -1] + [1] * (input.dim() - 2)
    out = input * scale.to(input.dtype).reshape(shape) + shift.to(input.dtype).reshape(shape)
    unbiased = variance * (count / (count - 1))
    return out, _updated(running_mean, mean, momentum, input.dtype), _updated(running_var, unbiased, momentum,
                                                                               input.dtype)


def _updated(running, batch, momentum, dtype):
    if running is None:
        return batch.to(dtype)
    return (running * (1 - momentum) + batch * momentum).to(running.dtype)


def _from_moments_rule(call: Call, placements) -> Decision:
    """moments whole (R) beside S(N|H|W) or R input; S(C) input with moments S(1) and the
    per-channel tensors S(0); outputs: the input's placement, then the statistics' (R or S(0))"""
    legal = "input S(d) or R with moments and per-channel tensors R; input S(1) with moments S(1), others S(0)"
    if any(isinstance(p, Partial) for p in placements):
        raise RuleRejected("the moments must be whole: reduce a P(sum) with moments.redistribute("
                           "placements=[Replicate()...]) first; no other Partial input either", legal)
    return _per_channel_decision(call, placements, None, legal, outputs=3)


def _from_moments_local(call: Call, required):
    shape = call.inputs[0].shape
    count = 1
    for d, size in enumerate(shape):
        count *= size if d != 1 else 1
    return "batch_norm_from_moments", {"count": count}


def _row(torch_fn, rule, local=None) -> OpRow:
    return OpRow(torch_fn, rule, local, method=False, doc=(rule.__doc__ or "").strip())


VISION_NORM = {
    "group_norm": _row(group_norm, _group_norm_rule, _group_norm_local),
    "batch_norm": _row(batch_norm, _batch_norm_rule),
    "batch_norm_moments": _row(batch_norm_moments, _moments_rule),
    "batch_norm_from_moments": _row(batch_norm_from_moments, _from_moments_rule, _from_moments_local),
}
register_family("vision", VISION_NORM)
