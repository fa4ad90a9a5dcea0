"""torch.nn.MultiheadAttention on DTensors: torch's F.multi_head_attention_forward (which the module,
and TransformerEncoderLayer / TransformerDecoderLayer through it, call) written over dtorch ops.

torch's own function is one Python body behind a __torch_function__ check, so a DTensor reaches
dtorch with the whole call; this is that body, step for step (the same in-projection, masks,
scaling and out-projection, so results equal torch's to float rounding). Attention without
weights is one scaled_dot_product_attention (with dropout in training, dtorch.nn.functional's
math form); `need_weights=True` (the module's default) computes the weights explicitly, as torch
does. Masks given as torch tensors are uploaded Replicate on the query's mesh (pass DTensors to
upload them once). Dropout draws from dtorch's stream (dtorch.nn.functional.dropout), so it
equals no torch run's mask; the options torch keeps for old code (add_bias_kv, add_zero_attn,
static_k / static_v) are refused.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..dtensor import api
from . import functional as F

__all__ = ["multi_head_attention_forward"]


def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                 training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                 v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False):
    """torch.nn.functional.multi_head_attention_forward on DTensors (sequence-first inputs)."""
    _refuse_legacy(bias_k, bias_v, add_zero_attn, static_k, static_v)
    batched = query.ndim == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != embed_dim_to_check or embed_dim % num_heads:
        raise AssertionError(f"multi_head_attention_forward: embedding dim {embed_dim}, expected "
                             f"{embed_dim_to_check}, divisible by num_heads {num_heads}")
    head_dim = embed_dim // num_heads
    key_padding_mask = _additive(key_padding_mask, query)
    attn_mask = _additive(attn_mask, query)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None   # the hint alone, as torch: sdpa's causal form
    elif key_padding_mask is not None:
        is_causal = False  # the merged mask is no longer causal
    if use_separate_proj_weight:
        biases = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = (F.linear(x, w, b) for x, w, b in zip((query, key, value),
                                                         (q_proj_weight, k_proj_weight, v_proj_weight), biases))
    else:
        q, k, v = _in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)
    if attn_mask is not None and attn_mask.ndim == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q, k, v = (t.view(t.shape[0], bsz * num_heads, head_dim).transpose(0, 1) for t in (q, k, v))
    if key_padding_mask is not None:
        padding = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1) \
            .reshape(bsz * num_heads, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout_p = dropout_p if training else 0.0
    if need_weights:
        weights = F.attention_weights(q, k, attn_mask, dropout_p)
        output = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len, bsz, embed_dim)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        weights = weights.mean(dim=1) if average_attn_weights else weights
    else:
        if attn_mask is not None:   # (1, L, S) -> (1, 1, L, S); (bsz * heads, L, S) -> (bsz, heads, L, S)
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else \
                attn_mask.view(bsz, num_heads, -1, src_len)
        q, k, v = (t.reshape(bsz, num_heads, t.shape[1], head_dim) for t in (q, k, v))
        output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)   # (dropout: F's math form)
        output, weights = output.permute(2, 0, 1, 3).flatten(2), None
    # (tgt_len, bsz, embed_dim) throughout, where torch flattens the first two: the same rows, and
    # a batch shard stays one (merging the sequence into it would gather the batch)
    output = F.linear(output, out_proj_weight, out_proj_bias)
    if not batched:
        output = output.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return output, weights


def _in_projection_packed(query, key, value, weight, bias):
    """torch's packed in-projection: one linear for self-attention, split after."""
    embed_dim = query.shape[-1]
    if query is key and key is value:
        return F.linear(query, weight, bias).split(embed_dim, dim=-1)
    weights = weight.chunk(3)
    biases = (None,) * 3 if bias is None else bias.chunk(3)
    return tuple([F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases)])


def _additive(mask, query):
    """A mask as torch's _canonical_mask leaves it (float, -inf where a bool mask is True), on the
    query's mesh: a torch tensor mask is uploaded Replicate."""
    if mask is None:
        return None
    mask = F.on_mesh_of(query, mask)
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=query.dtype).masked_fill(mask, float("-inf"))
    if not mask.dtype.is_floating_point:
        raise TypeError(f"multi_head_attention_forward: only bool and floating masks are supported, got {mask.dtype}")
    return mask


def _refuse_legacy(bias_k, bias_v, add_zero_attn, static_k, static_v) -> None:
    given = [name for name, on in (("add_bias_kv=True (bias_k, bias_v)", bias_k is not None or bias_v is not None),
                                   ("add_zero_attn=True", add_zero_attn),
                                   ("static_k / static_v", static_k is not None or static_v is not None)) if on]
    if given:
        raise UnsupportedOpError(f"multi_head_attention_forward with {', '.join(given)} is not supported by dtorch: "
                                 "build MultiheadAttention without it, or write the attention with "
                                 "F.scaled_dot_product_attention")


api.register_function("multi_head_attention_forward", multi_head_attention_forward)
