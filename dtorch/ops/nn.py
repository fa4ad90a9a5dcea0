"""PURE: torch.nn.functional ops. One table: op -> its row (reference function, rule, local hook).

Most rules name each input's dims with letters and reuse the einsum derivation of matrix.py,
then forbid the letters the op mixes nonlinearly (a softmax's keys, a loss's classes):
  layer_norm / rms_norm   normalized (trailing) dims R; other dims' shards pass
  embedding               indices S(d) -> S(d); weight S(1) -> S(last); weight S(0) (vocabulary
                          split) -> P(sum), each rank looking up only the rows it holds
  dropout                 any placement: the mask is a pure function of (seed, counter, global
                          index), so it is the same on replicas and partial contributions
  scaled_dot_product_attention   shards on batch/head dims, on queries (not causal), on values'
                          features; q, k, v all sharded on their sequence: ring attention
                          (ops/ring_attention.py, key/value blocks passed around that mesh dim);
                          never on the contracted head dim
  losses                  in ops/losses.py (registered in this family)
  pad                     padded dims R; Partial passes where the fill value allows
Kernels that need where their shard sits in the global tensor take a `region` keyword: the rule
passes a ShardRegion(global shape, placements), and each worker substitutes its (offset, shape).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import rng
from ..spec.placements import Partial, PeerGroup, Shard, ShardRegion
from ..errors import UnsupportedOpError
from .matrix import einsum_decision
from . import ring_attention  # noqa: F401  (registers the ring kernel that _attention_local selects)
from .partial_laws import Laws, partial_output
from .registry import OpRow, kernel, register_family
from .rules import Call, Decision, R, RuleRejected

__all__ = ["NN", "letters_decision", "no_partial"]


def no_partial(call: Call, placements, legal: str) -> None:
    for p in placements:
        if isinstance(p, Partial):
            raise RuleRejected(f"{call.op} is not linear in an input that is {p!r}", legal)


def letters_decision(call: Call, placements, equation: str, forbidden: str, legal: str) -> Decision:
    """einsum_decision with no Partial input and no shard on a `forbidden` letter (one the op
    mixes nonlinearly) or on a letter whose sizes differ between inputs (grouped heads)."""
    no_partial(call, placements, legal)
    terms = equation.split("->")[0].split(",")
    for p, term in zip(placements, terms):
        if not isinstance(p, Shard):
            continue
        letter = term[p.dim]
        if letter in forbidden:
            raise RuleRejected(f"{call.op} mixes dim {p.dim} ({letter!r} of {term!r}) nonlinearly", legal)
        sizes = {spec.shape[t.index(letter)] for spec, t in zip(call.inputs, terms) if letter in t} - {1}
        if len(sizes) > 1:
            raise RuleRejected(f"dim {p.dim} has different sizes {sorted(sizes)} across inputs", legal)
    return einsum_decision(call, placements, equation)


# --- normalization ---------------------------------------------------------------------------------
# The output is norm(x) * weight + bias: linear in (weight, bias), rising in bias.
_NORM_LAWS = {"layer_norm": Laws(params=("input", "normalized_shape", "weight", "bias"), linear=((2, 3),),
                                 monotone=(0, 0, 0, 1)),
              "rms_norm": Laws(params=("input", "normalized_shape", "weight"), linear=((2,),))}


def _norm_rule(call: Call, placements) -> Decision:
    """Trailing len(normalized_shape) dims are normalized together: they must be whole."""
    legal = "R on the normalized dims, S on leading dims; weight and bias R (or Partial with x R)"
    if any(isinstance(p, Partial) for p in placements):
        out = partial_output(call, placements, _NORM_LAWS[call.op])
        if out is None:
            raise RuleRejected(f"{call.op} does not commute with these Partial inputs", legal)
        return Decision(placements, (out,))
    ndim, normalized = len(call.inputs[0].shape), len(call.param(1, "normalized_shape"))
    p = placements[0]
    if isinstance(p, Shard) and p.dim >= ndim - normalized:
        raise RuleRejected(f"{call.op} normalizes over sharded dim {p.dim}", legal)
    if any(not q.is_replicate() for q in placements[1:]):
        raise RuleRejected(f"{call.op}'s weight and bias span the normalized dims", legal)
    return Decision(placements, (p,))


# --- embedding ------------------------------------------------------------------------------------
def _embedding_rule(call: Call, placements) -> Decision:
    if call.param(3, "max_norm") is not None:
        raise UnsupportedOpError("embedding(max_norm=...) renormalizes the looked-up rows of the weight in place "
                                 "inside the lookup, which dtorch's embedding does not do: pass max_norm=None and "
                                 "renormalize first, e.g. under no_grad: w.mul_((max_norm / (w.norm(dim=1, "
                                 "keepdim=True) + 1e-7)).clamp(max=1)) (torch renormalizes only the rows the lookup "
                                 "reads)")
    indices, weight = placements
    legal = "indices S(d) with weight R; indices R with weight S(0), S(1) or any Partial"
    if isinstance(indices, Partial):
        raise RuleRejected("indices cannot be Partial", legal)
    if isinstance(indices, Shard):
        if not weight.is_replicate():
            raise RuleRejected("indices and weight are both split", legal)
        return Decision(placements, (indices,))
    if isinstance(weight, Partial):     # a lookup copies rows: it commutes with every reduction
        return Decision(placements, (weight,))
    if weight == Shard(1):
        return Decision(placements, (Shard(len(call.inputs[0].shape)),))
    if weight == Shard(0):
        return Decision(placements, (Partial("sum"),))
    return Decision(placements, (R,))


def _embedding_local(call: Call, required):
    if any(p == Shard(0) for p in required[1]):
        return "embedding_vocabulary_split", {"region": ShardRegion(call.inputs[1].shape, required[1]),
                                              "total_rows": call.inputs[1].shape[0]}
    return "embedding", {}


@kernel("embedding_vocabulary_split")
def embedding_vocabulary_split(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                               scale_grad_by_freq=False, sparse=False, *, region, total_rows):
    """Rows this rank holds are looked up; every other index yields zeros (summed later)."""
    (first, _), (rows, _) = region
    local = input - first
    outside = (local < 0) | (local >= rows)
    if rows == 0:
        return weight.new_zeros(tuple(input.shape) + (weight.shape[1],))
    # padding_idx changes only the gradient (its row gets none): the rank holding that row applies it
    if padding_idx is not None and padding_idx < 0:
        padding_idx += total_rows
    local_padding = padding_idx - first if padding_idx is not None and 0 <= padding_idx - first < rows else None
    found = F.embedding(local.masked_fill(outside, 0), weight, local_padding)
    return found.masked_fill(outside.unsqueeze(-1), 0)


# --- dropout ----------------------------------------------------------------------------------------
def dropout(input, p=0.5, training=True, inplace=False, seed=None, counter=None):
    """The reference (and meta function): the whole tensor as one block."""
    if not 0.0 <= p <= 1.0:   # torch's own check and words; the meta run makes it fail at the user's line
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    shape = tuple(input.shape)
    return _dropout_block(input, p, training, seed, counter, shape, ((0,) * len(shape), shape))


@kernel("dropout_counter")
def dropout_counter(input, p=0.5, training=True, inplace=False, seed=None, counter=None, *,
                    region, global_shape):
    return _dropout_block(input, p, training, seed, counter, global_shape, region)


def _dropout_block(input, p, training, seed, counter, global_shape, region):
    """Keep element i when uniform(seed, counter, global index i) >= p, scaled by 1 / (1 - p)."""
    if not training or p == 0:
        return input
    if p == 1 or input.device.type == "meta":
        return torch.zeros_like(input)
    offset, local = region
    index = rng.global_indices(global_shape, offset, local, input.device)
    keep = rng.uniform(index, seed, counter, torch.float64) >= p
    # where(), not a product with the mask: a dropped -inf (an empty shard's max) must give 0, not nan
    return torch.where(keep, input * (1.0 / (1.0 - p)), 0.0).to(input.dtype)


def _dropout_rule(call: Call, placements) -> Decision:
    if call.param(4, "seed") is None:
        raise UnsupportedOpError("dropout on a DTensor draws from dtorch's random stream, which the op "
                                 "itself does not: call torch.nn.functional.dropout (or dtorch.nn.functional's)")
    return Decision(placements, (placements[0],))


def _dropout_local(call: Call, required):
    return "dropout_counter", {"region": ShardRegion(call.inputs[0].shape, required[0]),
                               "global_shape": call.inputs[0].shape}


# --- attention --------------------------------------------------------------------------------------
def _attention_rule(call: Call, placements) -> Decision:
    """Shards on batch and head dims of q, k, v alike; on q's sequence (not causal) with k, v R; on
    v's features with q, k R; q, k, v all on their sequence: ring attention (causal or not, no mask)."""
    if call.param(4, "dropout_p", 0.0):
        raise UnsupportedOpError("scaled_dot_product_attention(dropout_p>0): the op itself would draw torch's "
                                 "random numbers on each worker; call torch.nn.functional.scaled_dot_product_attention "
                                 "(or dtorch.nn.functional's), which drops from dtorch's stream")
    ranks = [len(spec.shape) for spec in call.inputs]
    batch = _BATCH_LETTERS[:max(ranks[:3]) - 2]
    terms = [batch[len(batch) - (r - 2):] + tail for r, tail in zip(ranks, ("le", "se", "sf"))]
    if len(ranks) > 3:
        terms.append((batch + "ls")[len(batch) + 2 - ranks[3]:])
    value, others = placements[2], placements[:2] + placements[3:]
    if isinstance(value, Partial) and value.reduce_op in ("sum", "avg") and all(p.is_replicate() for p in others):
        return Decision(placements, (value,))   # softmax(q k) v is linear in v
    if _sequence_sharded(call, placements[1], 1):
        return _ring_decision(call, placements, ranks)
    causal = call.param(5, "is_causal", False)
    forbidden = "se" + ("l" if causal else "")
    legal = "S on batch/head dims of q, k, v alike; S on q's sequence dim (not causal) with k, v R; " \
            "S on v's feature dim with q, k R"
    return letters_decision(call, placements, ",".join(terms) + "->" + batch + "lf", forbidden, legal)


_BATCH_LETTERS = "ABCDEFGHIJ"
_RING_LEGAL = "q, k and v all S(sequence) on the mesh dim (ring attention), with no attn_mask"


def _sequence_sharded(call: Call, placement, index: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == len(call.inputs[index].shape) - 2


def _ring_decision(call: Call, placements, ranks) -> Decision:
    """Keys sharded on their sequence: ring attention (ops/ring_attention.py), which needs the
    queries and values sharded the same way and no mask tensor (its blocks would have to travel too)."""
    if len(ranks) > 3:
        raise RuleRejected("ring attention takes no attn_mask tensor (use is_causal)", _RING_LEGAL)
    if sum(_sequence_sharded(call, p, 1) for p in call.inputs[1].placements) > 1:
        raise RuleRejected("the keys' sequence is sharded over two mesh dims; ring attention runs over one",
                           _RING_LEGAL + ", on one mesh dim only")
    if not (_sequence_sharded(call, placements[0], 0) and _sequence_sharded(call, placements[2], 2)):
        raise RuleRejected("keys sharded on their sequence need queries and values sharded on theirs "
                           "(ring attention)", _RING_LEGAL)
    return Decision(placements, (Shard(len(call.out_shape) - 2),))


def _attention_local(call: Call, required):
    """Ring attention where a mesh dim shards the keys' sequence; torch's kernel otherwise."""
    ring_dims = [d for d, p in enumerate(required[1]) if _sequence_sharded(call, p, 1)]
    if not ring_dims:
        return "scaled_dot_product_attention", {}
    layouts = [ShardRegion(spec.shape, placements) for spec, placements in zip(call.inputs[:3], required[:3])]
    return "ring_attention", {"peers": PeerGroup(ring_dims[0], layouts), "dtype": call.inputs[0].dtype}


# --- pad --------------------------------------------------------------------------------------------
def _pad_rule(call: Call, placements) -> Decision:
    amounts, ndim = call.param(1, "pad"), len(call.inputs[0].shape)
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(amounts) if amount}
    constant = call.param(2, "mode", "constant") == "constant"
    value = call.param(3, "value", None)
    p = placements[0]
    legal = "R on padded dims, S elsewhere; P(avg|max|min); P(sum) unless padding with a nonzero constant"
    if isinstance(p, Shard) and p.dim in padded:
        raise RuleRejected(f"dim {p.dim} is padded and sharded: its chunks would move", legal)
    if isinstance(p, Partial) and p.reduce_op == "sum" and constant and value:
        raise RuleRejected(f"the pad value {value} would be added once per rank", legal)
    return Decision(placements, (p,))


def _pad(input, pad, mode="constant", value=None):
    """F.pad, also on an empty shard (reflect/replicate refuse one even where padded dims are whole)."""
    if input.numel() == 0 and input.device.type != "meta":
        shape = list(input.shape)
        for i in range(len(pad) // 2):
            shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
        return input.new_zeros(shape)
    return F.pad(input, pad, mode, value)


def _row(torch_fn, rule, local=None, scalars_by_type: bool = False) -> OpRow:
    """An nn op: a function of dtorch.nn.functional (never a method); its rule's docstring is its doc."""
    return OpRow(torch_fn, rule, local, scalars_by_type, method=False, doc=(rule.__doc__ or "").strip())


NN = {
    "layer_norm": _row(F.layer_norm, _norm_rule),
    "rms_norm": _row(F.rms_norm, _norm_rule),
    "embedding": _row(F.embedding, _embedding_rule, _embedding_local),
    "dropout": _row(dropout, _dropout_rule, _dropout_local, scalars_by_type=True),   # seed, counter vary per call
    "scaled_dot_product_attention": _row(F.scaled_dot_product_attention, _attention_rule, _attention_local),
    "pad": _row(_pad, _pad_rule),
}
register_family("nn", NN)
