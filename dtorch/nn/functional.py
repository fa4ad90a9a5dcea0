"""torch.nn.functional names over dtorch ops. Each is one registry op (rules in dtorch/ops/:
pointwise, reduction, matrix, nn); `torch.nn.functional.<name>(dtensor)` reaches the same op
through __torch_function__, except dropout, which needs dtorch's random stream (below)."""
from __future__ import annotations

from ..runtime import session
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


# dtorch results are new symbols: `inplace=True` is accepted for torch parity and ignored.
def relu(input, inplace: bool = False):
    return call_op("relu", (input,), {})


def silu(input, inplace: bool = False):
    return call_op("silu", (input,), {})


def leaky_relu(input, negative_slope: float = 0.01, inplace: bool = False):
    return call_op("leaky_relu", (input, negative_slope), {})


def elu(input, alpha: float = 1.0, inplace: bool = False):
    return call_op("elu", (input, alpha), {})


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """The mask is a pure function of (dtorch.manual_seed, call order, global element index):
    the same on every layout, so a run reproduces under any placements."""
    if not training or p == 0:
        return call_op("dropout", (input, p, False, False, 0, 0), {})
    seed, counter = session.next_random()
    return call_op("dropout", (input, p, True, False, seed, counter), {})


gelu, sigmoid, tanh, softplus = map(_forward, ("gelu", "sigmoid", "tanh", "softplus"))
softmax, log_softmax, linear = map(_forward, ("softmax", "log_softmax", "linear"))
layer_norm, rms_norm, embedding, pad = map(_forward, ("layer_norm", "rms_norm", "embedding", "pad"))
scaled_dot_product_attention = _forward("scaled_dot_product_attention")
cross_entropy, mse_loss = map(_forward, ("cross_entropy", "mse_loss"))
