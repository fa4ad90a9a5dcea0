"""torch.nn.functional names over dtorch ops (the wider set arrives with the op-coverage work)."""
from ..tensor import call_op

__all__ = ["relu", "sigmoid", "tanh"]


def relu(input, inplace: bool = False):
    return call_op("relu", (input,), {})


def sigmoid(input):
    return call_op("sigmoid", (input,), {})


def tanh(input):
    return call_op("tanh", (input,), {})
