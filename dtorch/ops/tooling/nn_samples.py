"""PURE: sample calls of the nn ops: norms, embedding, dropout, attention, losses and pad. Merged
into samples.py's table."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .sample_helpers import matrix_shape
from .sample_making import Make, Sample

__all__ = ["NN"]


def _layer_norm(m: Make):
    n, a, d = m.shape((4, 4, 8), (3, 5, 6))
    return [Sample((m.x(n, a, d), [d], m.x(d), m.x(d)), {}), Sample((m.x(n, a, d), [a, d]), {"eps": 1e-3})]


def _rms_norm(m: Make):
    n, a, d = m.shape((4, 4, 8), (3, 5, 6))
    return [Sample((m.x(n, a, d), [d], m.x(d)), {}), Sample((m.x(n, a, d), [a, d]), {"eps": 1e-6})]


def _embedding(m: Make):
    vocab, width, n, a = m.shape((8, 4, 4, 4), (7, 5, 3, 5))
    return [Sample((m.ints(n, a, low=0, high=vocab), m.x(vocab, width)), {}, True),
            Sample((m.ints(n, low=0, high=vocab), m.x(vocab, width)), {"padding_idx": 0}, True)]


def _dropout(m: Make):
    x = m.x(*m.shape((8, 4, 4), (7, 5, 3)))
    return [Sample((x, 0.5, True, False, 1234, 7), {}, True), Sample((x, 0.25, False, False, 0, 0), {}, True)]


def _attention(m: Make):
    n, h, length, keys, e, f = m.shape((4, 4, 4, 4, 4, 4), (2, 3, 5, 6, 3, 2))
    q, k, v = m.x(n, h, length, e), m.x(n, h, keys, e), m.x(n, h, keys, f)
    return [Sample((q, k, v), {}), Sample((q, k, v), {"is_causal": True}),
            Sample((q, k, v, m.x(length, keys)), {})]


def _cross_entropy(m: Make):
    n, c, d = m.shape((8, 4, 4), (7, 5, 3))
    x, target = m.x(n, c), m.ints(n, low=0, high=c)
    ignored = target.clone()
    ignored[1] = -100
    probabilities = torch.softmax(m.x(n, c), 1)
    return [Sample((x, target), {"reduction": reduction}) for reduction in ("none", "sum", "mean")] + [
        Sample((x, ignored, m.x(c, positive=True)), {"reduction": "sum"}),
        Sample((x, probabilities), {"label_smoothing": 0.1}),
        Sample((m.x(n, c, d), m.ints(n, d, low=0, high=c)), {"reduction": "none"})]


def _nll_loss(m: Make):
    n, c, d = m.shape((8, 4, 4), (7, 5, 3))
    log_probabilities, target = torch.log_softmax(m.x(n, c), 1), m.ints(n, low=0, high=c)
    ignored = target.clone()
    ignored[1] = -100
    return [Sample((log_probabilities, target), {"reduction": reduction}) for reduction in ("none", "sum", "mean")] + [
        Sample((log_probabilities, ignored, m.x(c, positive=True)), {"reduction": "sum"}),
        Sample((torch.log_softmax(m.x(n, c, d), 1), m.ints(n, d, low=0, high=c)), {"reduction": "none"})]


def _pointwise_loss(*variants, probabilities=False, log_input=False, weight=None,
                    reductions=("none", "sum", "mean")):
    """A loss of two same-shape inputs, once per reduction and kwargs variant. probabilities:
    input and target in (0, 1); log_input: log-probabilities against probabilities (kl_div);
    weight "full" (shaped like the input, `weight=`) or "row" (its last dim, `pos_weight=`): one
    more call with it."""
    def build(m: Make):
        shape = matrix_shape(m)
        if log_input:
            x, target = torch.log_softmax(m.x(*shape), -1), torch.softmax(m.x(*shape), -1)
        elif probabilities:
            x, target = torch.sigmoid(m.x(*shape)), torch.rand(shape, generator=m.g)
        else:
            x, target = m.x(*shape), m.x(*shape)
        out = [Sample((x, target), dict(kw, reduction=r)) for r in reductions for kw in (variants or ({},))]
        if weight is not None:
            name = "pos_weight" if weight == "row" else "weight"
            made = m.x(*(shape if weight == "full" else shape[-1:]), positive=True)
            out.append(Sample((x, target), {"reduction": "sum", name: made}))
        return out
    return build


def _pad(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), (1, 2)), {}, True),
            Sample((m.x(*shape), (0, 0, 1, 1), "constant", 0.5), {}, True),
            Sample((m.x(2, *shape), (1, 1)), {"mode": "reflect"}, True)]


NN: dict[str, Callable] = {
    "layer_norm": _layer_norm, "rms_norm": _rms_norm, "embedding": _embedding, "dropout": _dropout,
    "scaled_dot_product_attention": _attention, "cross_entropy": _cross_entropy, "nll_loss": _nll_loss,
    "mse_loss": _pointwise_loss(weight="full"), "l1_loss": _pointwise_loss(weight="full"),
    "smooth_l1_loss": _pointwise_loss({}, {"beta": 0.5}), "huber_loss": _pointwise_loss({}, {"delta": 0.7}),
    "binary_cross_entropy": _pointwise_loss(probabilities=True, weight="full"),
    "binary_cross_entropy_with_logits": _pointwise_loss(weight="row"),
    "kl_div": _pointwise_loss(log_input=True, reductions=("none", "sum", "batchmean")),
    "pad": _pad,
}
