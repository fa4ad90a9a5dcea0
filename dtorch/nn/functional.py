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


def _with_inplace(name: str, position: int):
    """torch's `inplace` flag (by keyword or at `position`): the op runs out of place and the
    input is rebound to its result (dtorch/inplace.py)."""
    def function(*args, **kwargs):
        inplace = kwargs.pop("inplace", False)
        if len(args) > position:
            inplace, args = args[position], args[:position] + args[position + 1:]
        result = call_op(name, args, kwargs)
        return assign(args[0], result, f"{name}(inplace=True)") if inplace else result
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"torch.nn.functional.{name} on DTensors (op {name!r}); inplace=True rebinds the input."
    return function


relu, silu = _with_inplace("relu", 1), _with_inplace("silu", 1)
leaky_relu, elu = _with_inplace("leaky_relu", 2), _with_inplace("elu", 2)


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
