"""PURE: shape and view ops. They move values without combining them, so every rule is a map from
input dims to output dims: S(d) -> S(where d goes), R -> R, and a Partial passes unchanged (the
reduction over ranks commutes with any rearrangement of elements).

  reshape family   view, reshape, flatten, unflatten, squeeze, unsqueeze: input and output dims
                   pair up in groups of equal product (`reshape_groups`). A shard survives only on
                   the first (outermost) input dim of its group, and only when every rank's block
                   is a whole run of first-output-dim slices of the result (checked on every rank
                   with the workers' own chunk arithmetic): (8,6) S(0) -> (48,) S(0) on 4 ranks,
                   (48,) S(0) -> (8,6) S(0); but (7,6) S(0) -> (42,) is refused.
  permutations     transpose, permute: S(d) follows d.
  broadcasts       expand (S on an expanded size-1 dim refused), repeat (S on a repeated dim
                   refused), repeat_interleave (int repeats; S on the repeated dim only where
                   every block repeats into a whole block of the result).
  identity         contiguous, clone.
  joins            cat: S(d) off the cat dim (R inputs sliced to match), all-R, or all the same
                   Partial; S(d) on the cat dim too where one input alone has elements along it;
                   a (0,) input, which torch's cat skips, in any placement. stack: the same,
                   S(d) shifted past the new dim.
  splits           split, chunk, unbind: S(d) off the split dim; one placement for every piece.
  diagonals        diagonal: S(d) off dim1 and dim2, renumbered (the two go, the diagonal comes
                   last); diag_embed: S(d) off the last dim, renumbered around the new dim1, dim2;
                   diag: R or Partial (each of its dims is a diagonal's). A sharded dim1 / dim2
                   would put a row's diagonal element on another rank.
  windows          unfold (x.unfold(dimension, size, step)): S(d) off `dimension` (the windows'
                   trailing dim is new); a sharded `dimension` would cut windows at shard edges.
  Both are views, as in torch (dtorch/dtensor/aliasing.py): a write to `x.diagonal()` reaches x through
  diagonal_scatter (input S(d) off dim1 and dim2 with src sharded on d's diagonal dim, R, a Partial
  pair); a write through `x.unfold(...)` is refused (docs/reference/inplace.md).
"""
from __future__ import annotations

import itertools
import math

import torch

from ..spec.placements import Partial, Shard, local_region
from .registry import OpRow, kernel, register_family
from .rules import (Call, Decision, R, RuleRejected, common_shard_dim, follow_rule, normalize_dim, off_dim,
                    unshard_fix)
from .tensor_meta import parse_shape, shape_argument

__all__ = ["VIEW", "reshape_groups", "join_rule"]


# --- reshape family ----------------------------------------------------------------------------
def reshape_groups(in_shape, out_shape) -> list[tuple[tuple, tuple]]:
    """Pair runs of input dims with runs of output dims of equal product, in order. A size-1 dim
    that starts a run stands alone (paired with nothing); an empty tensor is one group."""
    if math.prod(in_shape) == 0:
        return [(tuple(range(len(in_shape))), tuple(range(len(out_shape))))]
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i, j = 0, 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            groups.append(((i,), ()))
            i += 1
        elif j < len(out_shape) and out_shape[j] == 1:
            groups.append(((), (j,)))
            j += 1
        else:
            ins, outs, have, want = [i], [j], in_shape[i], out_shape[j]
            i, j = i + 1, j + 1
            while have != want:
                if have < want:
                    ins, have, i = ins + [i], have * in_shape[i], i + 1
                else:
                    outs, want, j = outs + [j], want * out_shape[j], j + 1
            groups.append((tuple(ins), tuple(outs)))
    return groups


_RESHAPE_LEGAL = ("R; any Partial; S(d) on the outermost dim of a merged or split group when every "
                  "shard is a whole number of the result's rows along that group")


def _group_of(call: Call, dim: int) -> tuple[tuple, tuple, int, int]:
    """The group holding input dim `dim`, with the element counts one step of its first input
    dim and one step of its first output dim stand for."""
    in_shape, out_shape = call.inputs[0].shape, call.out_shape
    ins, outs = next(group for group in reshape_groups(in_shape, out_shape) if dim in group[0])
    return ins, outs, math.prod(in_shape[k] for k in ins[1:]), math.prod(out_shape[k] for k in outs[1:])


def _blocks_stay_whole(call: Call, dim: int, out_dim: int, in_inner: int, out_inner: int) -> bool:
    """On every rank, does the block of input dim `dim` cover exactly the elements of the block of
    `out_dim` that S(out_dim) gives it (in row-major order)? Nested shards included."""
    spec = call.inputs[0]
    mesh = spec.mesh
    out_placements = [Shard(out_dim) if p == Shard(dim) else R for p in spec.placements]
    for coordinate in itertools.product(*map(range, mesh.shape)):
        in_offset, in_size = local_region(spec.shape, mesh, spec.placements, coordinate)
        out_offset, out_size = local_region(call.out_shape, mesh, out_placements, coordinate)
        if (in_offset[dim] * in_inner != out_offset[out_dim] * out_inner
                or in_size[dim] * in_inner != out_size[out_dim] * out_inner):
            return False
    return True


def _reshape_out_dim(call: Call, dim: int) -> int:
    ins, outs, in_inner, out_inner = _group_of(call, dim)
    fix = unshard_fix(call, Shard(dim))
    if math.prod(call.inputs[0].shape) == 0:
        raise RuleRejected(f"S({dim}) of an empty tensor has no shard layout in the result; {fix}",
                           _RESHAPE_LEGAL)
    if not outs:
        raise RuleRejected(f"S({dim}) is on a size-1 dim the result drops; {fix}", _RESHAPE_LEGAL)
    if dim != ins[0]:
        raise RuleRejected(f"S({dim}) is an inner dim of the merged dims {list(ins)}, so its shards "
                           f"are not contiguous in the result; {fix}", _RESHAPE_LEGAL)
    if not _blocks_stay_whole(call, dim, outs[0], in_inner, out_inner):
        raise RuleRejected(f"the S({dim}) shards of shape {tuple(call.inputs[0].shape)} do not fall on "
                           f"S({outs[0]}) shard boundaries of shape {tuple(call.out_shape)}; {fix}",
                           _RESHAPE_LEGAL)
    return outs[0]


def _reshape_local(call: Call, placements_nd):
    """Each rank reshapes its block. A sharded group's first output dim is sized from the local
    input (the command is the same on every rank): local * in_inner // out_inner."""
    sizes = list(call.out_shape)
    for p in placements_nd[0]:
        if isinstance(p, Shard):
            ins, outs, in_inner, out_inner = _group_of(call, p.dim)
            sizes[outs[0]] = (p.dim, in_inner, out_inner)
    return "reshape_local", {"view_sizes": tuple(sizes)}


@kernel("reshape_local")
def reshape_local(input, *args, view_sizes, **kwargs):
    shape = [s if isinstance(s, int) else input.shape[s[0]] * s[1] // s[2] for s in view_sizes]
    return input.reshape(shape)


# view is reshape here: dtorch symbols are immutable, so no one can observe whether storage is shared
def _reshape_spelled(op: str, keyword: str):
    """reshape(x, 4, 6), reshape(x, (4, 6)) and torch's keyword form reshape(x, shape=(4, 6))
    (view's keyword is size=)."""
    def reshape(input, *sizes, **given):
        return input.reshape(shape_argument(op, sizes, given, keyword))
    reshape.__name__ = op
    return reshape


RESHAPES = {
    "view": _reshape_spelled("view", "size"),
    "reshape": _reshape_spelled("reshape", "shape"),
    "flatten": torch.flatten,
    "unflatten": torch.unflatten,
    "squeeze": torch.squeeze,
    "unsqueeze": torch.unsqueeze,
}


# --- permutations, broadcasts, identities --------------------------------------------------------
def _dims_arg(call: Call) -> tuple:
    """permute(x, 1, 0), permute(x, (1, 0)) and permute(x, dims=(1, 0)) alike; also repeat's sizes
    (repeats=)."""
    return parse_shape(call.args[1:] or (call.kwargs.get("dims", call.kwargs.get("repeats")),))


def _transpose_out_dim(call: Call, dim: int) -> int:
    ndim = len(call.inputs[0].shape)
    a, b = (normalize_dim(call.param(k, name), ndim) for k, name in ((1, "dim0"), (2, "dim1")))
    return b if dim == a else a if dim == b else dim


def _permute_out_dim(call: Call, dim: int) -> int:
    ndim = len(call.inputs[0].shape)
    return [normalize_dim(d, ndim) for d in _dims_arg(call)].index(dim)


def _expand_out_dim(call: Call, dim: int) -> int:
    out_dim = dim + len(call.out_shape) - len(call.inputs[0].shape)
    if call.inputs[0].shape[dim] != call.out_shape[out_dim]:
        raise RuleRejected(f"S({dim}) is on a size-1 dim that expand broadcasts; "
                           f"{unshard_fix(call, Shard(dim))}", "S(d) on a dim expand keeps, R, Partial")
    return out_dim


def _expand_local(call: Call, placements_nd):
    """Sharded dims keep each rank's own size (-1); the command is the same on every rank."""
    lead = len(call.out_shape) - len(call.inputs[0].shape)
    sizes = list(call.out_shape)
    for p in placements_nd[0]:
        if isinstance(p, Shard):
            sizes[p.dim + lead] = -1
    return "expand_local", {"expand_sizes": tuple(sizes)}


@kernel("expand_local")
def expand_local(input, *args, expand_sizes, **kwargs):
    return input.expand(*expand_sizes)


def _repeat_out_dim(call: Call, dim: int) -> int:
    repeats = _dims_arg(call)
    out_dim = dim + len(repeats) - len(call.inputs[0].shape)
    if repeats[out_dim] != 1:
        raise RuleRejected(f"repeat tiles sharded dim {dim} {repeats[out_dim]} times, which interleaves "
                           f"shards; {unshard_fix(call, Shard(dim))}", "S(d) on a dim repeated once, R, Partial")
    return out_dim


_INTERLEAVE_LEGAL = ("S(d) off the repeated dim, S(dim) when every shard repeats into a whole shard of the "
                     "result, R, Partial")


def _repeat_interleave_out_dim(call: Call, dim: int) -> int:
    """Off the repeated dim a shard stays put. On it, rank k's block [a, b) becomes [a*r, b*r),
    a shard of the result only where the chunk sizes agree (every rank checked, shards nested)."""
    spec = call.inputs[0]
    along = call.param(2, "dim")
    if along is None and len(spec.shape) > 1:
        raise RuleRejected(f"repeat_interleave without dim flattens sharded dim {dim}; "
                           f"{unshard_fix(call, Shard(dim))}", _INTERLEAVE_LEGAL)
    along = normalize_dim(0 if along is None else along, len(spec.shape))
    if dim != along:
        return dim
    repeats = call.param(1, "repeats")
    fix = unshard_fix(call, Shard(dim))
    if call.kwargs.get("output_size") is not None:
        raise RuleRejected(f"output_size= is the whole result's size, not a shard's; {fix}", _INTERLEAVE_LEGAL)
    mesh = spec.mesh
    for coordinate in itertools.product(*map(range, mesh.shape)):
        in_offset, in_size = local_region(spec.shape, mesh, spec.placements, coordinate)
        out_offset, out_size = local_region(call.out_shape, mesh, spec.placements, coordinate)
        if (in_offset[dim] * repeats, in_size[dim] * repeats) != (out_offset[dim], out_size[dim]):
            raise RuleRejected(f"the S({dim}) shards of size {spec.shape[dim]} repeated {repeats} times do not "
                               f"fall on the result's shard boundaries; {fix}", _INTERLEAVE_LEGAL)
    return dim


def _repeat_interleave_rule(call: Call, placements) -> Decision:
    if len(call.inputs) > 1 or not isinstance(call.param(1, "repeats"), int):
        raise RuleRejected("repeats as a tensor makes the result's shape depend on its values; "
                           "pass an int", "an int repeats")
    return follow_rule(_repeat_interleave_out_dim, _INTERLEAVE_LEGAL)(call, placements)


# --- joins and splits ----------------------------------------------------------------------------
_JOIN_LEGAL = "S(d) off the joined dim on every input (R inputs are sliced), all R, or all the same Partial"


def join_rule(stack: bool):
    """cat (stack=False) and stack: inputs are the tensors of the list, in order. cat skips a
    tensor of shape (0,) whatever the others' shapes (torch's legacy empty: the seed of
    transformers' KV cache), so its placement binds nothing: it stays as given, each rank's piece
    is empty too. cat along a sharded dim is legal where only one input has elements along it."""
    def rule(call: Call, placements) -> Decision:
        skipped = () if stack else _skipped_by_cat(call)
        if skipped:
            return _beside_skipped(rule, call, placements, skipped)
        partials = {p for p in placements if isinstance(p, Partial)}
        if partials:
            if len(partials) == 1 and all(isinstance(p, Partial) for p in placements):
                return Decision(placements, (partials.pop(),))
            raise RuleRejected("mixing Partial and non-Partial inputs would count the others once per "
                               "rank", _JOIN_LEGAL)
        dim = common_shard_dim(placements, _JOIN_LEGAL)
        if dim is None:
            return Decision(placements, (R,))
        joined = normalize_dim(call.param(1, "dim", 0), len(call.out_shape))
        if not stack and dim == joined and sum(spec.shape[dim] > 0 for spec in call.inputs) > 1:
            raise RuleRejected(f"cat along sharded dim {dim} would interleave the inputs' shards; "
                               f"{unshard_fix(call, Shard(dim))} (for every input)", _JOIN_LEGAL)
        out_dim = dim + 1 if stack and dim >= joined else dim
        return Decision((Shard(dim),) * len(placements), (Shard(out_dim),))
    return rule


def _skipped_by_cat(call: Call) -> tuple:
    """The inputs of shape (0,) that torch.cat leaves out, unless all are (the result is one)."""
    skipped = tuple([i for i, spec in enumerate(call.inputs) if tuple(spec.shape) == (0,)])
    return () if len(skipped) == len(call.inputs) else skipped


def _beside_skipped(rule, call: Call, placements, skipped: tuple) -> Decision:
    """`rule`'s decision for the inputs cat joins, the skipped ones kept as given."""
    kept = [i for i in range(len(placements)) if i not in skipped]
    decision = rule(call._replace(inputs=tuple([call.inputs[i] for i in kept])), tuple([placements[i] for i in kept]))
    required = list(placements)
    for i, placement in zip(kept, decision.inputs):
        required[i] = placement
    return Decision(tuple(required), decision.outputs)


def _split(tensor, split_size_or_sections=None, dim=0, *, split_size=None):
    """torch.split's keyword is split_size_or_sections=, Tensor.split's split_size=."""
    return torch.split(tensor, split_size if split_size_or_sections is None else split_size_or_sections, dim)


# --- diagonals and windows -----------------------------------------------------------------------
_DIAGONAL_LEGAL = "S(d) off dim1 and dim2, R, Partial"
_EMBED_LEGAL = "S(d) off the last dim, R, Partial"
_WHY_DIAGONAL = "a diagonal pairs row i with column i + offset, which a shard splits across ranks"


def _dim_pair(call: Call, defaults: tuple, ndim: int, positions: tuple = (2, 3)) -> list:
    """diagonal's and diag_embed's dim1 and dim2 (arguments 2 and 3; diagonal_scatter's 3 and 4),
    in range(ndim)."""
    return [normalize_dim(call.param(k, name, d), ndim) for k, name, d in zip(positions, ("dim1", "dim2"), defaults)]


def _diagonal_out_dim(call: Call, dim: int, positions: tuple = (2, 3)) -> int:
    pair = _dim_pair(call, (0, 1), len(call.inputs[0].shape), positions)
    if dim in pair:
        raise RuleRejected(f"diagonal of sharded dim {dim}: {_WHY_DIAGONAL}; {unshard_fix(call, Shard(dim))}",
                           _DIAGONAL_LEGAL)
    return dim - sum(d < dim for d in pair)   # dim1 and dim2 leave; the diagonal goes last


def _diag_embed_out_dim(call: Call, dim: int) -> int:
    ndim = len(call.inputs[0].shape)
    if dim == ndim - 1:
        raise RuleRejected(f"diag_embed spreads sharded dim {dim} over two dims: {_WHY_DIAGONAL}; "
                           f"{unshard_fix(call, Shard(dim))}", _EMBED_LEGAL)
    pair = _dim_pair(call, (-2, -1), ndim + 1)
    return [d for d in range(ndim + 1) if d not in pair][dim]


def _diag_out_dim(call: Call, dim: int) -> int:
    raise RuleRejected(f"diag of sharded dim {dim}: {_WHY_DIAGONAL}; {unshard_fix(call, Shard(dim))}", "R, Partial")


def _unfold_out_dim(call: Call, dim: int) -> int:
    along = normalize_dim(call.param(1, "dimension"), len(call.inputs[0].shape))
    if dim == along:
        raise RuleRejected(f"unfold along sharded dim {dim}: windows would cross shard edges; "
                           f"{unshard_fix(call, Shard(dim))}", "S(d) off the unfolded dim, R, Partial")
    return dim   # the windows' dim is appended after every other


_SCATTER_DIMS = (3, 4)   # diagonal_scatter(input, src, offset, dim1, dim2)
_SCATTER_DIAGONAL_LEGAL = ("input S(d) off dim1 and dim2 with src S(d's dim in the diagonal), R sliced to match; "
                           "all R; input and src the same Partial, or R beside P(avg/max/min)")


def _diagonal_scatter_rule(call: Call, placements) -> Decision:
    """torch.diagonal_scatter(input, src, offset, dim1, dim2): input with its diagonal replaced by
    src (dtorch/dtensor/inplace.py writes `x.diagonal()`'s in-place changes back with it). A shard of a
    kept dim holds its rows of both; a Partial pair adds up to the whole when both are the same."""
    p, q = placements
    ndim = len(call.inputs[0].shape)
    kept = [d for d in range(ndim) if d not in _dim_pair(call, (0, 1), ndim, _SCATTER_DIMS)]
    if isinstance(p, Partial) or isinstance(q, Partial):
        partial = p if isinstance(p, Partial) else q
        # beside R, a mean, max or min of equal copies is the copy; a sum would count it per rank
        if p != q and not ((p.is_replicate() or q.is_replicate()) and partial.reduce_op != "sum"):
            raise RuleRejected(f"diagonal_scatter of a {p!r} input and a {q!r} src: a Partial passes beside the "
                               f"same Partial, or beside R unless it is P(sum)", _SCATTER_DIAGONAL_LEGAL)
        return Decision(placements, (partial,))
    if isinstance(q, Shard) and p.is_replicate():
        if q.dim >= len(kept):
            raise RuleRejected(f"diagonal_scatter of a src sharded on its diagonal (dim {q.dim}): {_WHY_DIAGONAL}",
                               _SCATTER_DIAGONAL_LEGAL)
        p = Shard(kept[q.dim])
    if isinstance(p, Shard):
        shard = Shard(_diagonal_out_dim(call, p.dim, _SCATTER_DIMS))
        return Decision((p, shard), (p,))
    return Decision(placements, (R,))


# --- the table ---------------------------------------------------------------------------------------
_SAME = lambda call, dim: dim  # noqa: E731
_SPLIT_LEGAL = "S(d) off the split dim, R, Partial"
VIEW = {
    **{name: OpRow(fn, follow_rule(_reshape_out_dim, _RESHAPE_LEGAL), local=_reshape_local)
       for name, fn in RESHAPES.items()},
    "transpose": OpRow(torch.transpose, follow_rule(_transpose_out_dim, "any")),
    "permute": OpRow(torch.Tensor.permute, follow_rule(_permute_out_dim, "any")),
    "expand": OpRow(torch.Tensor.expand, follow_rule(_expand_out_dim, "S(d) on a kept dim, R, Partial"),
                    local=_expand_local),
    "repeat": OpRow(torch.Tensor.repeat, follow_rule(_repeat_out_dim, "S(d) on a dim repeated once, R, Partial")),
    "repeat_interleave": OpRow(torch.repeat_interleave, _repeat_interleave_rule),
    "contiguous": OpRow(torch.Tensor.contiguous, follow_rule(_SAME, "any")),
    "clone": OpRow(torch.clone, follow_rule(_SAME, "any")),
    # the same values under a new id, sharing the workers' buffers (no copy): what
    # nn.Parameter(x) and state_dict() hand out, so that each symbol frees only its own id
    "detach": OpRow(torch.Tensor.detach, follow_rule(_SAME, "any")),
    "cat": OpRow(torch.cat, join_rule(stack=False), method=False),
    "stack": OpRow(torch.stack, join_rule(stack=True), method=False),
    "split": OpRow(_split, follow_rule(off_dim(2), _SPLIT_LEGAL)),
    "chunk": OpRow(torch.chunk, follow_rule(off_dim(2), _SPLIT_LEGAL)),
    "unbind": OpRow(torch.unbind, follow_rule(off_dim(1, drops=True), _SPLIT_LEGAL)),
    "diagonal": OpRow(torch.diagonal, follow_rule(_diagonal_out_dim, _DIAGONAL_LEGAL),
                      doc="S(d) off dim1 and dim2 (renumbered: the diagonal is the last dim), R, Partial; "
                          "a view, as in torch"),
    "diagonal_scatter": OpRow(torch.diagonal_scatter, _diagonal_scatter_rule, doc=_SCATTER_DIAGONAL_LEGAL),
    "diag_embed": OpRow(torch.diag_embed, follow_rule(_diag_embed_out_dim, _EMBED_LEGAL),
                        doc="S(d) off the last dim (renumbered around dim1, dim2), R, Partial"),
    "diag": OpRow(torch.diag, follow_rule(_diag_out_dim, "R, Partial"),
                  doc="R, Partial (both dims are the diagonal's)"),
    "unfold": OpRow(torch.Tensor.unfold, follow_rule(_unfold_out_dim, "S(d) off the unfolded dim, R, Partial"),
                    doc="x.unfold(dimension, size, step): S(d) off dimension, R, Partial; a view (writes through it "
                        "are refused)"),
}
register_family("view", VIEW)
