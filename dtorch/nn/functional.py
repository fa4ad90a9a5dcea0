"""torch.nn.functional names over dtorch ops. Each is one registry op (rules in dtorch/ops/:
pointwise, reduction, matrix, nn); `torch.nn.functional.<name>(dtensor)` reaches the same op
through __torch_function__, except dropout, which needs dtorch's random stream (below)."""
from __future__ import annotations

from ..runtime import session
from ..inplace import assign
from ..tensor import call_op

__all__ = ["relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "softplus", "softmax",
           "log_softmax", "linear", "layer_norm", "rms_norm", "embedding", "dropout", "pad",
           "scaled_dot_product_attention", "cross_entropy", "mse_loss"]


def _forward(name: str):
    """A function that passes its arguments to op `name` as given (torch's own signature)."""
    def function(*args, **kwargs):
        return call_op(name, args, kwargs)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"torch.nn.functional.{name} on DTensors (op {name!r})."
    return function


# relu, silu, leaky_relu and elu take torch's `inplace` flag as given: dtorch has no in-place ops
# yet, so the dispatch refuses inplace=True (by keyword or by position) instead of ignoring it.
relu, silu, leaky_relu, elu = map(_forward, ("relu", "silu", "leaky_relu", "elu"))


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
scaled_dot_product_attention = _forward("scaled_dot_product_attention")
cross_entropy, mse_loss = map(_forward, ("cross_entropy", "mse_loss"))
