"""PURE: ring attention, the local kernel of scaled_dot_product_attention when the keys' sequence
dim is sharded (context parallel): q, k and v are all S(sequence) on one mesh dim.

Each rank keeps its query block and passes its key/value block around the ring of that mesh
dim: after n - 1 passes every query block has met every key block. Each meeting gives a partial
attention (the output over those keys and the log-sum-exp of its scores); partials merge with
the numerically stable rule out = sum_b exp(lse_b - lse) out_b, lse = logaddexp over blocks. A
causal mask compares global positions (torch's top-left alignment), so a key block entirely in
a query block's future is skipped (it still travels on). Nothing is ever gathered: memory per
rank is one extra key/value block.

The peers object (a resolved distributed_spec.PeerGroup) supplies the ring: `index`, `size`,
`blocks` (every member's (offset, shape) of q, k and v) and `pass_along`. On a worker it is
backed by the communicator; in the rule simulator, by queues between threads.
"""
from __future__ import annotations

import math

import torch

from .registry import kernel

__all__ = ["ring_attention"]

_SEQ = -2   # q (..., L, E), k (..., S, E), v (..., S, Ev): the sequence is the second-to-last dim


@kernel("ring_attention", peers=True)
def ring_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, peers, dtype, standin=False):
    """torch's scaled_dot_product_attention signature; `peers` is the cp ring. With standin
    (this rank's inputs failed), zeros stand in so the ring still completes for the others."""
    q_blocks, k_blocks, v_blocks = peers.blocks
    me, n = peers.index, peers.size
    if standin:
        query, key, value = (torch.zeros(blocks[me][1], dtype=dtype) for blocks in (q_blocks, k_blocks, v_blocks))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q_start = q_blocks[me][0][_SEQ]
    q_positions = torch.arange(q_start, q_start + query.shape[_SEQ], device=query.device)
    out = lse = None
    held_key, held_value = key, value
    for step in range(n):
        source = (me - step) % n                 # whose key/value block this rank holds now
        k_start = k_blocks[source][0][_SEQ]
        if not (is_causal and k_start > q_start + query.shape[_SEQ] - 1):   # not wholly in the future
            block_out, block_lse = _attend(query, held_key, held_value, scale, enable_gqa,
                                           q_positions if is_causal else None, k_start)
            out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
        if step < n - 1:
            held_key, held_value = _pass(peers, held_key, held_value, k_blocks, v_blocks, (source - 1) % n)
    if out is None:   # every key lay in the future: only possible for an empty query block
        out = torch.zeros(*query.shape[:-1], value.shape[-1], dtype=query.dtype, device=query.device)
    return out.to(query.dtype)


def _attend(q, k, v, scale: float, gqa: bool, q_positions, k_start: int):
    """(softmax(q k^T) v, logsumexp of the scores) for one key block, in float32."""
    if gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if q_positions is not None:
        k_positions = torch.arange(k_start, k_start + k.shape[_SEQ], device=k.device)
        scores = scores.masked_fill(q_positions[:, None] < k_positions[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)   # a fully masked row: all zero
    return torch.matmul(weights, v.float()), lse


def _merge(out, lse, block_out, block_lse):
    total = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(total)
    old = torch.where(finite, torch.exp(lse - total), 0.0).unsqueeze(-1)
    new = torch.where(finite, torch.exp(block_lse - total), 0.0).unsqueeze(-1)
    return out * old + block_out * new, total


def _pass(peers, key, value, k_blocks, v_blocks, arriving: int):
    """Send the held key/value block on; receive the one that `arriving`'s block now is (one
    message per step: keys and values flattened together)."""
    payload = torch.cat([key.reshape(-1), value.reshape(-1)])
    k_shape, v_shape = k_blocks[arriving][1], v_blocks[arriving][1]
    k_numel = math.prod(k_shape)
    received = peers.pass_along(payload.contiguous(), k_numel + math.prod(v_shape))
    return received[:k_numel].reshape(k_shape), received[k_numel:].reshape(v_shape)
