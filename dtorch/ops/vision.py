"""PURE: torch.nn.functional ops of vision models, on (N, C, H, W) images (pools, convolutions
and interpolate also take one unbatched (C, H, W) image); conv1d/3d and conv_transpose1d/2d/3d on
(N, C, L) and (N, C, D, H, W). One table: op -> its row.

Every op here reads windows of neighbouring pixels (or, for the norms, statistics over them), so
a shard of H or W is refused: its windows would need the neighbouring ranks' rows (a halo
exchange), which dtorch does not do. Outside strict mode the refusal makes dtorch move the input
to a layout the rule accepts (usually a shard of N or C); in strict mode it names that move.
  conv2d            S(N) with weight and bias R -> S(N); weight S(0) (out-channels) with input R
                    -> S(C), bias S(0); input S(C) with weight S(1) (in-channels, groups=1) ->
                    P(sum), bias P(sum) (added once in the sum, as linear's row-parallel bias);
                    groups > 1: input S(C) with weight S(0) when every rank holds whole groups of
                    both; P(sum|avg) input or weight with the rest R (bias P(sum) beside P(sum))
  conv1d, conv3d    as conv2d, one rule for any number of spatial dims
  conv_transpose1d/2d/3d
                    as conv2d with the weight's channel dims swapped (it is (in, out / groups, k...)):
                    out-channels are weight S(1) (bias S(0)), in-channels input S(C) with weight
                    S(0) -> P(sum); groups > 1: input S(C), weight S(0) on whole groups whose
                    output channels are whole groups too
  max_pool2d, avg_pool2d, adaptive_avg_pool2d, adaptive_max_pool2d, interpolate
                    S(N) or S(C) pass; averages and bilinear-type modes are linear (P(sum|avg)
                    pass), max pools distribute over P(max), nearest copies any Partial
  group_norm        S(N) passes; S(C) when every rank's channels are whole groups (weight, bias
                    S(0)); never a Partial input (a norm is not linear)
  batch_norm        eval mode (running statistics): a per-channel affine map, so S(N|H|W) pass
                    and S(C) takes the per-channel tensors S(0). Training mode: the op itself
                    (batch statistics) needs them whole on each rank, so S(N|H|W) is refused,
                    and it cannot update running_mean/var in place. F.batch_norm (torch's
                    spelling or dtorch.nn.functional's) computes batch statistics across ranks
                    from batch_norm_moments (a P(sum) over a sharded batch) and rebinds the
                    running statistics in place; batch_norm_with_running_stats returns them
                    (ops/vision_norm.py, which holds the norms' rows).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..spec.placements import Partial, Shard, local_region
from .partial_laws import Laws, partial_output
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, R, RuleRejected, TensorSlot, unshard_fix

__all__ = ["VISION", "image_dims", "refuse_spatial", "whole_groups", "present_groups"]


# --- shared: which dims are batch, channel, spatial -------------------------------------------------
def image_dims(call: Call, spatial_count: int | None = 2) -> tuple[int | None, int, tuple]:
    """(batch dim or None, channel dim, spatial dims) of input 0: the last `spatial_count` dims
    are spatial and the one before is the channel (None: every dim after 1, as interpolate)."""
    ndim = len(call.inputs[0].shape)
    if spatial_count is None:
        return 0, 1, tuple(range(2, ndim))
    channel = ndim - spatial_count - 1
    return (0 if channel == 1 else None), channel, tuple(range(channel + 1, ndim))


def refuse_spatial(call: Call, p, spatial: tuple, legal: str, what: str = "windows") -> None:
    if isinstance(p, Shard) and p.dim in spatial:
        raise RuleRejected(f"{call.op} reads {what} across sharded spatial dim {p.dim}, which would need the "
                           f"neighbouring ranks' rows (a halo exchange, not supported); "
                           f"{unshard_fix(call, p)}", legal)


def whole_groups(call: Call, index: int, dim: int, group_size: int) -> list | None:
    """Per mesh coordinate, (first group, group count) of input `index`'s block along `dim`, or
    None when some block is not a whole number of groups (nested shards included)."""
    spec = call.inputs[index]
    return _blocks_in_groups(spec.shape, spec.mesh, spec.placements, dim, group_size)


def _blocks_in_groups(shape, mesh, placements, dim: int, group_size: int) -> list | None:
    """whole_groups of a tensor of `shape` placed so on `mesh`."""
    found = []
    for coordinate in itertools.product(*map(range, mesh.shape)):
        offset, size = local_region(shape, mesh, placements, coordinate)
        if offset[dim] % group_size or size[dim] % group_size:
            return None
        found.append((offset[dim] // group_size, size[dim] // group_size))
    return found


def present_groups(params: tuple, *groups: tuple):
    """Laws.linear for ops with optional tensors (bias=None): each group of positions the op is
    jointly linear in, less the positions the call leaves out (conv2d without a bias is linear
    in its weight alone, so a P(sum) weight passes)."""
    def linear(call: Call) -> tuple:
        given = {i for i, name in enumerate(params) if type(call.param(i, name)) is TensorSlot}
        return tuple([tuple([i for i in group if i in given]) for group in groups])
    linear.__doc__ = "linear in " + " or ".join("(" + ", ".join(params[i] for i in g) + ")" for g in groups) + \
        " (those given): P(avg); P(sum) where every given one of a group is P(sum) and nothing is added"
    return linear


def _empty_block(input) -> bool:
    return input.numel() == 0 and input.device.type != "meta"


def _zeros_like_result(fn, input, *args, **kwargs):
    """fn's result on an empty block (torch refuses some: a pool of 0 channels): zeros shaped as
    fn's result on a block of size 1 in the empty dims, with those dims back to 0."""
    probe = torch.empty([max(s, 1) for s in input.shape], dtype=input.dtype, device="meta")
    result = fn(probe, *args, **kwargs)
    empty = [d for d, s in enumerate(input.shape) if s == 0]

    def shaped(r):
        return torch.zeros([0 if d in empty else s for d, s in enumerate(r.shape)], dtype=r.dtype,
                           device=input.device)
    return tuple([shaped(r) for r in result]) if isinstance(result, tuple) else shaped(result)


def _empty_safe(fn):
    """A one-image op that also runs on an empty shard (N or C of 0 on an uneven split)."""
    def run(input, *args, **kwargs):
        if _empty_block(input):
            return _zeros_like_result(fn, input, *args, **kwargs)
        return fn(input, *args, **kwargs)
    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# --- convolutions ---------------------------------------------------------------------------------
# conv1d/2d/3d and conv_transpose1d/2d/3d share one rule over any number of spatial dims: only
# which weight dim holds the in- and out-channels differs (a transposed conv's weight is
# (in, out / groups, k...), a conv's (out, in / groups, k...)).
class _ConvForm(NamedTuple):
    out_dim: int        # the weight's out-channel dim
    in_dim: int         # the weight's in-channel dim
    legal: str


_SPATIAL_SHARDS = {1: "S(L)", 2: "S(H) or S(W)", 3: "S(D), S(H) or S(W)"}
_CONV_PARAMS = ("input", "weight", "bias")
_CONV_LAWS = Laws(params=_CONV_PARAMS, linear=present_groups(_CONV_PARAMS, (0, 2), (1, 2)), monotone=(0, 0, 1))


def _conv_form(spatial_count: int, transposed: bool) -> _ConvForm:
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    return _ConvForm(out_dim, in_dim, (
        f"input S(N) with weight, bias R; weight S({out_dim}), bias S(0) with input R (groups=1); input S(C) "
        f"with weight S({in_dim}) (groups=1) -> P(sum), bias P(sum); groups > 1: input S(C), weight S(0), bias "
        f"S(0) on whole groups; a P(sum|avg) input or weight with the rest R; never {_SPATIAL_SHARDS[spatial_count]}"))


_EMPTY_SAFE = (", also on empty shards: an empty in-channel block contributes zeros (plus its share of a P(sum) "
               "bias), where torch would return no out-channels at all.")


def _convolution(torch_fn):
    """torch_fn (F.conv1d/2d/3d) with torch's signature, also on empty shards."""
    def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if _empty_block(input) or _empty_block(weight):
            return _empty_conv(torch_fn, input, weight, bias, weight.shape[0], stride=stride, padding=padding,
                               dilation=dilation)
        return torch_fn(input, weight, bias, stride, padding, dilation, groups)
    conv.__name__ = conv.__qualname__ = torch_fn.__name__
    conv.__doc__ = f"F.{torch_fn.__name__}{_EMPTY_SAFE}"
    return conv


def _transposed(torch_fn):
    """torch_fn (F.conv_transpose1d/2d/3d) with torch's signature, also on empty shards."""
    def conv_transpose(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        if _empty_block(input) or _empty_block(weight):
            return _empty_conv(torch_fn, input, weight, bias, weight.shape[1] * groups, stride=stride,
                               padding=padding, output_padding=output_padding, dilation=dilation)
        return torch_fn(input, weight, bias, stride, padding, output_padding, groups, dilation)
    conv_transpose.__name__ = conv_transpose.__qualname__ = torch_fn.__name__
    conv_transpose.__doc__ = f"F.{torch_fn.__name__}{_EMPTY_SAFE}"
    return conv_transpose


def _empty_conv(torch_fn, input, weight, bias, out_channels: int, **geometry):
    """Zeros of the conv's shape (plus the bias): the spatial size from torch_fn on one meta
    pixel-channel, the channels from the weight."""
    spatial_count = weight.ndim - 2
    image = torch.empty((1, 1) + tuple(input.shape[-spatial_count:]), device="meta")
    window = torch.empty((1, 1) + tuple(weight.shape[2:]), device="meta")
    size = tuple(torch_fn(image, window, None, **geometry).shape[2:])
    out = torch.zeros(tuple(input.shape[:-spatial_count - 1]) + (out_channels,) + size, dtype=input.dtype,
                      device=input.device)
    return out if bias is None or bias.numel() == 0 else out + bias.reshape((-1,) + (1,) * spatial_count)


def _group_shard(conv):
    """A rank holding whole groups of input and output channels runs them as a smaller grouped
    conv (groups is the 7th argument of every conv and conv_transpose)."""
    def run(input, weight, *args, group_channels, **kwargs):
        groups = input.shape[1 - weight.ndim] // group_channels
        if len(args) > 4:
            args = args[:4] + (groups,) + args[5:]
        else:
            kwargs["groups"] = groups
        return conv(input, weight, *args, **kwargs)
    return run


def _conv_rule(form: _ConvForm):
    def rule(call: Call, placements) -> Decision:
        x, w = placements[:2]
        b = placements[2] if len(placements) > 2 else R
        batch, channel, spatial = image_dims(call, len(call.inputs[1].shape) - 2)
        refuse_spatial(call, x, spatial, form.legal)
        if isinstance(w, Shard) and w.dim >= 2:
            raise RuleRejected(f"{call.op} slides the whole kernel: the weight's window dim {w.dim} cannot be "
                               "split", form.legal)
        channels_split = x == Shard(channel) or isinstance(w, Shard) or isinstance(b, Shard)
        if channels_split and call.param(6, "groups", 1) > 1:
            return _conv_groups(call, placements, channel, call.param(6, "groups", 1), form)
        if x == Shard(channel) or w == Shard(form.in_dim):
            return _conv_in_channels(placements, channel, form)
        if channels_split:
            return _conv_out_channels(placements, channel, form)
        if any(isinstance(p, Partial) for p in placements):
            out = partial_output(call, placements, _CONV_LAWS)
            if out is None:
                raise RuleRejected(f"{call.op} is linear in input or weight (jointly with the bias), not in "
                                   f"({', '.join(map(repr, placements))})", form.legal)
            return Decision(placements, (out,))
        if batch is not None and x == Shard(batch):
            if not (w.is_replicate() and b.is_replicate()):
                raise RuleRejected("with the input split on its batch, every rank needs the whole weight and bias",
                                   form.legal)
            return Decision(placements, (x,))
        return Decision(placements, (R,))
    return rule


def _conv_in_channels(placements, channel: int, form: _ConvForm) -> Decision:
    """Input S(C) with the weight split on its in-channels: each rank convolves its channels,
    the sum over ranks is the conv."""
    x, w = placements[:2]
    if not (x in (R, Shard(channel)) and w in (R, Shard(form.in_dim))):
        raise RuleRejected(f"the in-channels are split ({x!r}, {w!r}): input S({channel}) and weight "
                           f"S({form.in_dim}) together", form.legal)
    if len(placements) > 2 and placements[2] != Partial("sum"):
        raise RuleRejected(f"the product is P(sum), so the bias must be P(sum) too (a {placements[2]!r} bias "
                           "would be added once per rank)", form.legal)
    return Decision((Shard(channel), Shard(form.in_dim)) + placements[2:], (Partial("sum"),))


def _conv_out_channels(placements, channel: int, form: _ConvForm) -> Decision:
    """Weight split on its out-channels (and bias S(0)): each rank computes its out-channels
    from the whole input."""
    x, w = placements[:2]
    bias = placements[2:]
    if not (x.is_replicate() and w in (R, Shard(form.out_dim)) and all(p in (R, Shard(0)) for p in bias)):
        needed = "weight and bias S(0) or R" if form.out_dim == 0 else \
            f"the weight S({form.out_dim}) or R and the bias S(0) or R"
        raise RuleRejected(f"with the out-channels split, the input must be R and {needed} "
                           f"(given {', '.join(map(repr, placements))})", form.legal)
    return Decision((x, Shard(form.out_dim)) + (Shard(0),) * len(bias), (Shard(channel),))


def _conv_groups(call: Call, placements, channel: int, groups: int, form: _ConvForm) -> Decision:
    """Input S(C) and weight S(0) on whole groups: each rank runs its groups. The weight's dim 0
    is its out-channels (conv) or its in-channels (conv_transpose); either way every rank's
    blocks of input channels, weight rows and output channels must be the same groups."""
    x, w = placements[:2]
    has_bias = len(placements) > 2
    b = placements[2] if has_bias else R
    if not (x == Shard(channel) and w == Shard(0) and b in (R, Shard(0))):
        raise RuleRejected(f"{call.op}(groups={groups}) splits channels only as input S({channel}) and weight S(0) "
                           "together, each rank holding whole groups of both", form.legal)
    weight = call.inputs[1]
    out_channels = call.out_shape[channel]
    in_groups = whole_groups(call, 0, channel, call.inputs[0].shape[channel] // groups)
    weight_groups = whole_groups(call, 1, 0, weight.shape[0] // groups)
    # the output's channels (and the bias) split where the weight's dim 0 does
    rows = tuple([p if p == Shard(0) else R for p in weight.placements])
    out_groups = _blocks_in_groups((out_channels,), weight.mesh, rows, 0, out_channels // groups)
    if in_groups is None or not in_groups == weight_groups == out_groups:
        raise RuleRejected(f"some rank's block of input channels or weight rows is not the same whole groups "
                           f"of the {groups}", form.legal)
    return Decision((x, w) + (Shard(0),) * has_bias, (Shard(channel),))


def _conv_local(call: Call, required):
    groups = call.param(6, "groups", 1)
    if groups > 1 and any(isinstance(p, Shard) for p in required[1]):
        channel = image_dims(call, len(call.inputs[1].shape) - 2)[1]
        return f"{call.op}_group_shard", {"group_channels": call.inputs[0].shape[channel] // groups}
    return call.op, {}


def _conv_rows() -> dict:
    rows = {}
    for spatial_count in (1, 2, 3):
        for name, wrap, transposed in ((f"conv{spatial_count}d", _convolution, False),
                                       (f"conv_transpose{spatial_count}d", _transposed, True)):
            conv, form = wrap(getattr(F, name)), _conv_form(spatial_count, transposed)
            kernel(f"{name}_group_shard")(_group_shard(conv))
            rows[name] = _row(conv, _conv_rule(form), form.legal, _conv_local)
    return rows


# --- pools and interpolate ------------------------------------------------------------------------
_POOL_LEGAL = "S(N) or S(C); R; the Partial forms the op keeps (see its row); never S(H) or S(W)"
_LINEAR, _MAXIMUM, _COPY = frozenset({"sum", "avg"}), frozenset({"max"}), frozenset({"sum", "avg", "max", "min"})


def _per_image_rule(partials_of, spatial_count: int | None = 2, global_reduce: str | None = None):
    """One image input whose N and C dims pass through; `partials_of(call)`: the Partial
    reductions the op commutes with (a window average is linear, a window max keeps max).
    `global_reduce`: an adaptive pool to one pixel over a sharded H or W is that Partial of the
    ranks' own pools (global pooling needs no halo)."""
    def rule(call: Call, placements) -> Decision:
        (p,) = placements
        batch, channel, spatial = image_dims(call, spatial_count)
        if global_reduce and isinstance(p, Shard) and p.dim in spatial and _global_pool(call):
            return Decision(placements, (Partial(global_reduce),))
        refuse_spatial(call, p, spatial, _POOL_LEGAL)
        if isinstance(p, Partial) and p.reduce_op not in partials_of(call):
            raise RuleRejected(f"{call.op} does not commute with the reduction of {p!r}; "
                               f"{unshard_fix(call, p)}", _POOL_LEGAL)
        return Decision(placements, (p,) * len(call.outputs))
    return rule


def _global_pool(call: Call) -> bool:
    """An adaptive pool to a single pixel, without indices (each rank's argmax is its own)."""
    return tuple(call.out_shape[-2:]) == (1, 1) and len(call.outputs) == 1


def _global_pool_local(kernel_name: str, divides: bool):
    """The partial kernel where H or W is sharded; an average divides by the whole image's pixels."""
    def local(call: Call, required):
        spatial = image_dims(call)[2]
        if not any(isinstance(p, Shard) and p.dim in spatial for p in required[0]):
            return call.op, {}
        shape = call.inputs[0].shape
        return kernel_name, ({"count": shape[spatial[0]] * shape[spatial[1]]} if divides else {})
    return local


@kernel("global_avg_pool_partial")
def global_avg_pool_partial(input, output_size, *, count):
    """This rank's share of a global average: its pixels' sum over the whole image's count."""
    return input.sum((-2, -1), keepdim=True) / count


@kernel("global_max_pool_partial")
def global_max_pool_partial(input, output_size, return_indices=False):
    """This rank's max over its pixels; -inf where it holds none (the identity of a max)."""
    if input.shape[-1] == 0 or input.shape[-2] == 0:
        return torch.full(tuple(input.shape[:-2]) + (1, 1), -torch.inf, dtype=input.dtype, device=input.device)
    return input.amax((-2, -1), keepdim=True)


def _max_pool_partials(return_indices_at: int):
    def partials(call: Call):
        return frozenset() if call.param(return_indices_at, "return_indices", False) else _MAXIMUM
    partials.__doc__ = "S(N|C) pass; P(max) passes (without return_indices: each rank's argmax differs)"
    return partials


def _interpolate_partials(call: Call):
    """nearest modes copy pixels (any Partial passes); the others are linear (P(sum|avg))"""
    return _COPY if call.param(3, "mode", "nearest") in ("nearest", "nearest-exact") else _LINEAR


def _linear_partials(call: Call):
    return _LINEAR


def _no_partials(call: Call):
    return frozenset()


def _row(torch_fn, rule, doc: str, local=None) -> OpRow:
    return OpRow(torch_fn, rule, local, method=False, doc=doc)


_PER_IMAGE_DOC = "S(N) or S(C) pass, S(H|W) refused (halo); "
VISION = {
    **_conv_rows(),
    "max_pool2d": _row(_empty_safe(F.max_pool2d), _per_image_rule(_max_pool_partials(6)),
                       _PER_IMAGE_DOC + "P(max) passes unless return_indices"),
    "adaptive_max_pool2d": _row(_empty_safe(F.adaptive_max_pool2d), _per_image_rule(_max_pool_partials(2),
                                global_reduce="max"),
                                _PER_IMAGE_DOC + "P(max) passes unless return_indices; to one pixel, S(H|W) -> "
                                "P(max)", _global_pool_local("global_max_pool_partial", False)),
    # torch's F.max_pool2d(..., return_indices=True) reaches __torch_function__ under these names
    "max_pool2d_with_indices": _row(_empty_safe(F.max_pool2d_with_indices), _per_image_rule(_no_partials),
                                    _PER_IMAGE_DOC + "no Partial (each rank's argmax differs)"),
    "adaptive_max_pool2d_with_indices": _row(_empty_safe(F.adaptive_max_pool2d_with_indices),
                                             _per_image_rule(_no_partials),
                                             _PER_IMAGE_DOC + "no Partial (each rank's argmax differs)"),
    "avg_pool2d": _row(_empty_safe(F.avg_pool2d), _per_image_rule(_linear_partials),
                       _PER_IMAGE_DOC + "linear: P(sum|avg) pass"),
    "adaptive_avg_pool2d": _row(_empty_safe(F.adaptive_avg_pool2d), _per_image_rule(_linear_partials,
                                global_reduce="sum"),
                                _PER_IMAGE_DOC + "linear: P(sum|avg) pass; to one pixel (global pooling), S(H|W) "
                                "-> P(sum)", _global_pool_local("global_avg_pool_partial", True)),
    "interpolate": _row(_empty_safe(F.interpolate), _per_image_rule(_interpolate_partials, None),
                        "S(N) or S(C) pass, S of a spatial dim refused (halo); nearest modes pass any "
                        "Partial, the other modes are linear: P(sum|avg)"),
}
register_family("vision", VISION)
