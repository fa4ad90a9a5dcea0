"""torch.autocast on DTensors: `with torch.autocast("cuda", dtype=torch.bfloat16): loss = model(x)`.

torch decides autocast's casts per ATen op in its dispatcher, on the process that runs the op;
dtorch's ops run on the workers, which never see the controller's autocast state. So the
controller applies torch's policy itself, at the op's call: while autocast is on for the mesh's
device type ("cpu" or "cuda", torch.is_autocast_enabled), an op on torch's lower-precision list
gets its floating-point DTensor arguments cast to the autocast dtype, and an op on its float32 list
gets them cast to float32 (float64 is never cast, as in torch). The casts are ordinary recorded
`to` ops, so backward casts each gradient back, as autocast's do. Ops on neither list run in their
inputs' dtypes; torch's promote list needs nothing here (cat, stack and the pointwise ops promote).

The lists are torch's (aten/src/ATen/autocast_mode.cpp, torch 2.13), under the names the ops
reach dtorch with (F.cross_entropy, not aten's cross_entropy_loss); a name dtorch has no op
for never comes here. The cost on the op path is one set lookup per op (`AUTOCAST_OPS`), and
the autocast query only for the ops listed.
"""
from __future__ import annotations

import torch

__all__ = ["AUTOCAST_OPS", "autocast_args", "autocast_state"]

_LOWER = {
    "cpu": frozenset("""conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear matmul conv_tbc
        conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention""".split()),
    "cuda": frozenset("""conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d prelu addmm
        addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
        lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention""".split()),
}
_FLOAT32 = {
    "cpu": frozenset("""avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist trace
        view_as_complex cholesky inverse pinverse max_pool3d mse_loss cosine_embedding_loss nll_loss
        hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy l1_loss huber_loss margin_ranking_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss kl_div multilabel_margin_loss
        binary_cross_entropy_with_logits""".split()),
    "cuda": frozenset("""acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
        layer_norm group_norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss hinge_embedding_loss
        kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist
        renorm logsumexp prod softmax log_softmax cumprod cumsum sum norm cross_entropy""".split()),
}
AUTOCAST_OPS = frozenset().union(*_LOWER.values(), *_FLOAT32.values())


def autocast_args(name: str, args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) with torch.autocast's casts applied for op `name` (in AUTOCAST_OPS), or as
    given when autocast is off for the arguments' device type."""
    device_type = _device_type(args)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return args, kwargs
    if name in _LOWER.get(device_type, ()):
        target = torch.get_autocast_dtype(device_type)
    elif name in _FLOAT32.get(device_type, ()):
        target = torch.float32
    else:
        return args, kwargs
    cast = _caster(target)
    return tuple([cast(a) for a in args]), {key: cast(value) for key, value in kwargs.items()}


def _device_type(args: tuple):
    for arg in args:
        meta = getattr(arg, "_meta", None)
        if meta is not None:
            return meta.mesh.device_type
        if isinstance(arg, (list, tuple)):   # cat's and einsum's operand lists
            found = _device_type(arg)
            if found is not None:
                return found
    return None


def _caster(target: torch.dtype):
    def cast(value):
        if isinstance(value, (list, tuple)):
            return type(value)([cast(v) for v in value])
        dtype = getattr(getattr(value, "_meta", None), "dtype", None)
        if dtype is None or not dtype.is_floating_point or dtype in (torch.float64, target):
            return value
        return value.to(target)
    return cast


def autocast_state() -> tuple:
    """Which dtype autocast casts to on each device type, None where it is off: part of a
    dtorch.compile signature, since a capture records the casts."""
    return tuple([torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
                 for device in _LOWER])
