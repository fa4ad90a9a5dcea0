"""PURE: ring attention, the local kernel of scaled_dot_product_attention when the keys' sequence
dim is sharded (context parallel): q, k and v are all S(sequence) on one mesh dim.

Each rank keeps its query block and passes its key/value block around the ring of that mesh
dim: after n - 1 passes every query block has met every key block. Each meeting gives a partial
attention (the output over those keys and the log-sum-exp of its scores); partials merge with
the numerically stable rule out = sum_b exp(lse_b - lse) out_b, lse = logaddexp over blocks. A
causal mask compares global positions (torch's top-left alignment), so a key block entirely in
a query block's future is skipped (it still travels on). Nothing is ever gathered: memory per
rank is one extra key/value block.

The peers object (a resolved placements.PeerGroup) supplies the ring: `index`, `size`,
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
    (this rank's inputs failed), zeros stand in so the ring still completes for the others.
    Recorded for backward (grad mode on, an input requiring grad) it is an autograd Function
    whose backward runs the ring again (_ring_backward)."""
    q_blocks, k_blocks, v_blocks = peers.blocks
    if standin:
        query, key, value = (torch.zeros(blocks[peers.index][1], dtype=dtype)
                             for blocks in (q_blocks, k_blocks, v_blocks))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _RingAttention.apply(query, key, value, is_causal, scale, enable_gqa, peers)
    return _ring_forward(query, key, value, is_causal, scale, enable_gqa, peers)[0]


def _ring_forward(query, key, value, is_causal, scale, enable_gqa, peers):
    """(output in the query's dtype, output in float32, log-sum-exp of each query row's scores)."""
    q_blocks, k_blocks, v_blocks = peers.blocks
    me, n = peers.index, peers.size
    q_start = q_blocks[me][0][_SEQ]
    q_positions = torch.arange(q_start, q_start + query.shape[_SEQ], device=query.device)
    out = lse = None
    held_key, held_value = key, value
    for step in range(n):
        source = (me - step) % n                 # whose key/value block this rank holds now
        k_start = k_blocks[source][0][_SEQ]
        if not _in_future(is_causal, k_start, q_start, query):
            block_out, block_lse = _attend(query, held_key, held_value, scale, enable_gqa,
                                           q_positions if is_causal else None, k_start)
            out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
        if step < n - 1:
            held_key, held_value = _pass(peers, (held_key, held_value), _shapes(k_blocks, v_blocks, (source - 1) % n))
    if out is None:   # every key lay in the future: only possible for an empty query block
        out = torch.zeros(*query.shape[:-1], value.shape[-1], dtype=torch.float32, device=query.device)
        lse = torch.full(query.shape[:-1], float("-inf"), device=query.device)
    return out.to(query.dtype), out, lse


def _in_future(is_causal: bool, k_start: int, q_start: int, query) -> bool:
    """A causal key block wholly after the query block's last position: it meets no query."""
    return is_causal and k_start > q_start + query.shape[_SEQ] - 1


def _shapes(k_blocks, v_blocks, index: int) -> tuple:
    return k_blocks[index][1], v_blocks[index][1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, enable_gqa, peers):
        out, out_float, lse = _ring_forward(query, key, value, is_causal, scale, enable_gqa, peers)
        ctx.save_for_backward(query, key, value, out_float, lse)
        ctx.settings = (is_causal, scale, enable_gqa, peers)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _ring_backward(*ctx.saved_tensors, grad_out, *ctx.settings) + (None,) * 4


def _ring_backward(query, key, value, out, lse, grad_out, is_causal, scale, enable_gqa, peers):
    """Flash attention's backward around the ring: the key/value blocks travel again, each with
    the gradient accumulated for it so far; every rank adds its queries' part, and one last pass
    brings each block's gradient home to its owner."""
    q_blocks, k_blocks, v_blocks = peers.blocks
    me, n = peers.index, peers.size
    q_start = q_blocks[me][0][_SEQ]
    q_positions = torch.arange(q_start, q_start + query.shape[_SEQ], device=query.device) if is_causal else None
    grad_out = grad_out.float()
    delta = (grad_out * out).sum(-1)             # rowwise <dO, O>: softmax's backward term
    grad_q = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    held = (key, value, torch.zeros(key.shape, device=key.device), torch.zeros(value.shape, device=value.device))
    for step in range(n):
        source = (me - step) % n
        held_key, held_value, grad_key, grad_value = held
        if not _in_future(is_causal, k_blocks[source][0][_SEQ], q_start, query):
            dq, dk, dv = _block_grads(query, held_key, held_value, grad_out, lse, delta, scale, enable_gqa,
                                      q_positions, k_blocks[source][0][_SEQ])
            grad_q, grad_key, grad_value = grad_q + dq, grad_key + dk, grad_value + dv
        if step < n - 1:
            k_shape, v_shape = _shapes(k_blocks, v_blocks, (source - 1) % n)
            held = _pass(peers, (held_key, held_value, grad_key, grad_value), (k_shape, v_shape, k_shape, v_shape))
        elif n > 1:   # the block held last belongs to the next rank: its gradient goes home
            grad_key, grad_value = _pass(peers, (grad_key, grad_value), _shapes(k_blocks, v_blocks, me))
    return grad_q.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _block_grads(q, k, v, grad_out, lse, delta, scale: float, gqa: bool, q_positions, k_start: int):
    """One key block's part of dq, and that block's dk, dv, from the global log-sum-exp."""
    groups = q.shape[-3] // k.shape[-3] if gqa and k.shape[-3] != q.shape[-3] else 1
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    k, v = k.float(), v.float()
    scores = torch.matmul(q.float(), k.transpose(-2, -1)) * scale
    if q_positions is not None:
        k_positions = torch.arange(k_start, k_start + k.shape[_SEQ], device=k.device)
        scores = scores.masked_fill(q_positions[:, None] < k_positions[None, :], float("-inf"))
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    grad_v = torch.matmul(weights.transpose(-2, -1), grad_out)
    grad_scores = weights * (torch.matmul(grad_out, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q.float()) * scale
    if groups > 1:   # the repeated heads' parts add up on the head they copied
        grad_k = grad_k.unflatten(-3, (-1, groups)).sum(-3)
        grad_v = grad_v.unflatten(-3, (-1, groups)).sum(-3)
    return grad_q, grad_k, grad_v


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


def _pass(peers, tensors: tuple, arriving_shapes: tuple) -> tuple:
    """Send the held tensors on (one message: flattened together, in float32 when they differ);
    receive the previous member's, shaped `arriving_shapes`."""
    dtype = tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else torch.float32
    payload = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    sizes = [math.prod(shape) for shape in arriving_shapes]
    received = peers.pass_along(payload.contiguous(), sum(sizes))
    return tuple([part.reshape(shape).to(t.dtype) for part, shape, t in
                 zip(received.split(sizes), arriving_shapes, tensors)])
