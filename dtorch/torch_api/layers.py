"""torch.nn.functional layers composed of dtorch's ops: channel dropout (`dropout1d/2d/3d`),
`alpha_dropout` and `feature_alpha_dropout`, `instance_norm`, `local_response_norm`, the 1-D pools
(`max_pool1d`, `avg_pool1d`, `adaptive_avg_pool1d`, `adaptive_max_pool1d`: the 2-D ops on a
height-1 image), `torch.cdist` and `bilinear`.

The dropouts draw their masks from dtorch's random stream as F.dropout does (a pure function of
dtorch.manual_seed, the call order and the global index), so a run reproduces under any
placements, but the masks differ from torch's own generator's. Everything else follows torch's
formula, so values and gradients agree with torch's. They reach dtorch through
__torch_function__ (dtensor/api.py's TORCH_FUNCTIONS), as dtorch/torch_api/compositions.py's do;
tests/test_composites_nn.py checks each against torch.
"""
from __future__ import annotations

import math

from ..dtensor.api import register_torch_spellings
from ..spec.placements import Replicate, Shard
from ..dtensor.factories import ones
from ..dtensor.inplace import assign
from ..dtensor.recording import no_grad
from ..runtime.controller import session
from ..dtensor.tensor import DTensor, call_op

__all__ = ["dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "instance_norm",
           "local_response_norm", "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d", "cdist",
           "bilinear"]


# --- dropout -------------------------------------------------------------------------------------------
_SELU_ALPHA = 1.7580993408473766   # ATen's alpha (SELU's alpha times its scale)


def _noise(input: DTensor, p: float, per_channel: bool) -> DTensor:
    """ATen's noise: 1 / (1 - p) where an element (or a whole (N, C) channel) is kept, else 0,
    in input's dtype: dtorch's dropout of ones. A channel's noise is (N, C, 1, ...), laid out like
    input on N and C."""
    shape = tuple(input.shape[:2]) + (1,) * (input.ndim - 2) if per_channel else tuple(input.shape)
    layout = [Replicate() if placement.is_partial() or (per_channel and not _on_batch_or_channel(placement))
              else placement for placement in input.placements]
    ones_ = ones(*shape, dtype=input.dtype, device_mesh=input.device_mesh, placements=layout)
    seed, counter = session.next_random()
    return call_op("dropout", (ones_, p, True, False, seed, counter), {})


def _on_batch_or_channel(placement) -> bool:
    return isinstance(placement, Shard) and placement.dim < 2


def _dropped(input, p: float, training: bool, inplace: bool, per_channel: bool, alpha: bool, name: str):
    """ATen's _dropout_impl: kept elements scaled by 1 / (1 - p); alpha dropout instead keeps
    SELU's mean and variance, dropped elements set to -alpha' and an affine correction applied."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        result = input * 0.0
    elif alpha:
        keep = (_noise(input, p, per_channel) != 0).to(input.dtype)
        a = 1.0 / math.sqrt((_SELU_ALPHA ** 2 * p + 1) * (1 - p))
        result = input * (keep * a) + ((keep - 1) * (_SELU_ALPHA * a) + _SELU_ALPHA * a * p)
    else:
        result = input * _noise(input, p, per_channel)
    return assign(input, result, f"{name}(inplace=True)") if inplace else result


def _channel_dropout(name: str, unbatched_rank: int):
    """dropout1d/2d/3d: an input of `unbatched_rank` dims is one sample (a batch dim is added
    and removed again, as torch does); dropout2d takes 3-D input as (N, C, L), as torch does."""
    def channel_dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
        if input.ndim != unbatched_rank or not training or p == 0:
            return _dropped(input, p, training, inplace, True, False, name)
        result = _dropped(input.unsqueeze(0), p, training, False, True, False, name).squeeze(0)
        return assign(input, result, f"{name}(inplace=True)") if inplace else result
    channel_dropout.__name__ = channel_dropout.__qualname__ = name
    return channel_dropout


dropout1d, dropout2d, dropout3d = _channel_dropout("dropout1d", 2), _channel_dropout("dropout2d", None), \
    _channel_dropout("dropout3d", 4)


def alpha_dropout(input, p: float = 0.5, training: bool = False, inplace: bool = False):
    return _dropped(input, p, training, inplace, False, True, "alpha_dropout")


def feature_alpha_dropout(input, p: float = 0.5, training: bool = False, inplace: bool = False):
    return _dropped(input, p, training, inplace, True, True, "feature_alpha_dropout")


# --- normalization ---------------------------------------------------------------------------------------
def _per_channel(value: DTensor, rank: int) -> DTensor:
    """A (C,) tensor shaped (C, 1, ...) to broadcast over an (N, C, *) input of `rank` dims."""
    return value.reshape((value.shape[0],) + (1,) * (rank - 2))


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> DTensor:
    """Each (n, c) slice normalized by its own mean and biased variance (use_input_stats), or by
    the running statistics. With use_input_stats, running_mean / running_var are updated in place
    as ATen does: by the batch's average of the slices' means and unbiased variances."""
    rank = input.ndim
    if use_input_stats:
        spatial = tuple(range(2, rank))
        mean = input.mean(spatial, keepdim=True)
        centered = input - mean
        var = (centered * centered).mean(spatial, keepdim=True)
        out = centered * (var + eps).rsqrt()
        _update_running(running_mean, running_var, mean, var, input, momentum)
    else:
        out = (input - _per_channel(running_mean, rank)) * (_per_channel(running_var, rank) + eps).rsqrt()
    if weight is not None:
        out = out * _per_channel(weight, rank)
    return out + _per_channel(bias, rank) if bias is not None else out


def _update_running(running_mean, running_var, mean, var, input, momentum: float) -> None:
    count = math.prod(input.shape[2:])
    with no_grad():
        for running, batch in ((running_mean, mean), (running_var, var * (count / max(count - 1, 1)))):
            if running is not None:
                new = running * (1 - momentum) + batch.detach().reshape(tuple(input.shape[:2])).mean(0) * momentum
                assign(running, new, "instance_norm(use_input_stats=True)")


def local_response_norm(input, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> DTensor:
    """x / (k + alpha / size * (sum of x^2 over `size` neighbouring channels))^beta, the window
    zero-padded by size // 2 before and (size - 1) // 2 after (torch's avg_pool form)."""
    if input.ndim < 3:
        raise ValueError(f"Expected 3D or higher dimensionality input (got {input.ndim} dimensions)")
    if input.numel() == 0:
        return input
    channels = input.shape[1]
    squares = call_op("pad", (input * input, (0, 0) * (input.ndim - 2) + (size // 2, (size - 1) // 2)), {})
    window = squares.narrow(1, 0, channels)
    for offset in range(1, size):
        window = window + squares.narrow(1, offset, channels)
    return input / (window * (alpha / size) + k) ** beta


# --- 1-D pools: the 2-D op on a height-1 image ----------------------------------------------------------
def _one(value, default=None):
    """A 1-D pool's int-or-1-tuple argument as an int (None or () for `default`)."""
    if value is None or (isinstance(value, (tuple, list)) and not value):
        return default
    return value if isinstance(value, int) else tuple(value)[0]


def _squeezed(result):
    return tuple([r.squeeze(-2) for r in result]) if isinstance(result, tuple) else result.squeeze(-2)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
    kernel = _one(kernel_size)
    op = "max_pool2d_with_indices" if return_indices else "max_pool2d"
    return _squeezed(call_op(op, (input.unsqueeze(-2), (1, kernel), (1, _one(stride, kernel)), (0, _one(padding)),
                                  (1, _one(dilation)), ceil_mode), {}))


def max_pool1d_with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                            return_indices: bool = True):
    return max_pool1d(input, kernel_size, stride, padding, dilation, ceil_mode, True)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True):
    kernel = _one(kernel_size)
    return _squeezed(call_op("avg_pool2d", (input.unsqueeze(-2), (1, kernel), (1, _one(stride, kernel)),
                                            (0, _one(padding)), ceil_mode, count_include_pad), {}))


def adaptive_avg_pool1d(input, output_size):
    return _squeezed(call_op("adaptive_avg_pool2d", (input.unsqueeze(-2), (1, _one(output_size))), {}))


def adaptive_max_pool1d(input, output_size, return_indices: bool = False):
    op = "adaptive_max_pool2d_with_indices" if return_indices else "adaptive_max_pool2d"
    return _squeezed(call_op(op, (input.unsqueeze(-2), (1, _one(output_size))), {}))


def adaptive_max_pool1d_with_indices(input, output_size, return_indices: bool = True):
    return adaptive_max_pool1d(input, output_size, True)


# --- distances and bilinear forms ------------------------------------------------------------------------
def cdist(x1, x2, p: float = 2.0, compute_mode=None) -> DTensor:
    """The p-norm of every row difference, (*, P, M) and (*, R, M) -> (*, P, R): torch's direct
    form (its matmul form for p=2, chosen by compute_mode, agrees to rounding). It holds the
    (*, P, R, M) differences, which torch's own kernel does not."""
    if x1.ndim < 2 or x2.ndim < 2:
        raise RuntimeError(f"cdist only supports at least 2D tensors, X1 got: {x1.ndim}D")
    if x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(f"X1 and X2 must have the same number of columns. X1: {x1.shape[-1]} X2: {x2.shape[-1]}")
    return (x1.unsqueeze(-2) - x2.unsqueeze(-3)).norm(p, -1)


def bilinear(input1, input2, weight, bias=None) -> DTensor:
    """y_o = x1^T W_o x2 + b_o: x1 times W laid out (in1, out * in2), then the dot with x2."""
    out_features, in1, in2 = weight.shape
    lead = tuple(input1.shape[:-1])
    spread = call_op("matmul", (input1, weight.permute(1, 0, 2).reshape(in1, out_features * in2)), {})
    result = (spread.reshape(lead + (out_features, in2)) * input2.unsqueeze(-2)).sum(-1)
    return result + bias if bias is not None else result


# --- torch.<name>: ATen's parameters under F.<name>'s name -----------------------------------------------
def _instance_norm_either(input, *rest, **kwargs):
    """F.instance_norm passes all but input by keyword; torch.instance_norm takes ATen's order."""
    if not rest:
        return instance_norm(input, **kwargs)
    named = dict(zip(("weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum", "eps",
                      "cudnn_enabled"), rest), **kwargs)
    named.pop("cudnn_enabled", None)
    return instance_norm(input, **named)


def _adaptive_max_pool1d_either(input, output_size, **kwargs):
    """F.adaptive_max_pool1d passes return_indices; torch.adaptive_max_pool1d returns the indices too."""
    return adaptive_max_pool1d(input, output_size, kwargs.get("return_indices", True))


# --- installation ---------------------------------------------------------------------------------------
_FUNCTIONS = {
    "dropout1d": dropout1d, "dropout2d": dropout2d, "dropout3d": dropout3d, "alpha_dropout": alpha_dropout,
    "feature_alpha_dropout": feature_alpha_dropout, "instance_norm": _instance_norm_either,
    "local_response_norm": local_response_norm, "max_pool1d": max_pool1d,
    "max_pool1d_with_indices": max_pool1d_with_indices, "avg_pool1d": avg_pool1d,
    "adaptive_avg_pool1d": adaptive_avg_pool1d, "adaptive_max_pool1d": _adaptive_max_pool1d_either,
    "adaptive_max_pool1d_with_indices": adaptive_max_pool1d_with_indices, "cdist": cdist, "bilinear": bilinear,
}


register_torch_spellings(_FUNCTIONS)
