"""What generate(do_sample=True) draws the next token from: transformers' sampling warpers, in
its order (temperature, top-k, top-p), on the last position's logits, then one draw per sequence
with torch.multinomial on dtorch's random stream (dtorch/torch_api/random_draws.py). The tokens are the
same on every layout for one dtorch.manual_seed; they are not transformers' tokens for the same
seed (the generators differ), though the distribution they come from is (tests/test_sampling.py).
With the vocabulary sharded (tp), top-k and top-p sort it whole, as the sort op's rule says: one
row of the vocabulary per sequence, once per token."""
from __future__ import annotations

import torch

from ..dtensor.tensor import DTensor

__all__ = ["sampling_scores", "sample_next"]


def sampling_scores(scores: DTensor, temperature: float = 1.0, top_k: int | None = 50,
                    top_p: float = 1.0) -> DTensor:
    """(batch, vocab) scores with transformers' warpers applied: the tokens top-k or top-p leave
    out get -inf. top_k None or 0, and top_p 1.0, filter nothing."""
    _check(temperature, top_k, top_p)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1)   # ascending: the tail to drop comes first
        drop_sorted = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False           # the most likely token always stays
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores


def sample_next(scores: DTensor, temperature: float = 1.0, top_k: int | None = 50, top_p: float = 1.0,
                generator=None) -> DTensor:
    """(batch,) tokens drawn from softmax(sampling_scores(scores, ...))."""
    probs = sampling_scores(scores.float(), temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _check(temperature: float, top_k, top_p: float) -> None:
    """transformers' own refusals, in its words."""
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"`temperature` (={temperature}) has to be a strictly positive float, otherwise your next "
                         "token scores will be invalid.")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"`top_k` has to be a strictly positive integer, but is {top_k}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1.0):
        raise ValueError(f"`top_p` has to be a float > 0 and < 1, but is {top_p}")
