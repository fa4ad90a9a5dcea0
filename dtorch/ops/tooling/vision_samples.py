"""PURE: sample calls of the vision ops, (N, C, H, W) images; uneven sizes leave N and C
remainders (and empty 4-way shards). Merged into samples.py's table."""
from __future__ import annotations

import torch

from .sample_making import Make, Sample

__all__ = ["VISION"]


def _image(m: Make, channels=(4, 3)):
    n, c, h, w = m.shape((4, channels[0], 8, 8), (5, channels[1], 7, 7))
    return m.x(n, c, h, w)


_SPATIAL = {1: ((8,), (7,)), 2: ((8, 8), (7, 7)), 3: ((4, 4, 6), (5, 4, 6))}   # even, uneven


def _conv(spatial_count: int, transposed: bool = False):
    """conv{n}d or conv_transpose{n}d: with and without a bias, strided, dilated, in groups (by
    keyword, and depthwise by position) and on one unbatched image."""
    def build(m: Make):
        # float64: the sweep's P(sum) inputs on two mesh dims are random contributions ~10x the value,
        # and a 27-54 term contraction of them in float32 rounds past its atol on outputs near zero
        f64 = lambda *shape: m.x(*shape, dtype=torch.float64)  # noqa: E731

        def weight(in_per_group, out_per_group, groups, kernel):   # torch's layout for each kind
            return f64(in_per_group * groups, out_per_group, *kernel) if transposed else \
                f64(out_per_group * groups, in_per_group, *kernel)
        spatial = m.shape(*_SPATIAL[spatial_count])
        (n, c), out = m.shape((4, 4), (5, 3)), m.shape((8,), (5,))[0]
        x = f64(n, c, *spatial)
        grouped = f64(n, m.shape((4,), (6,))[0], *spatial)
        groups, per_group_out = grouped.shape[1] // 2, 1 if transposed else 4   # groups of 2 input channels
        cube, wide = (3,) * spatial_count, (2,) + (3,) * (spatial_count - 1)
        strided = {"stride": 2, "padding": 1, "output_padding": 1} if transposed else {"stride": 2, "padding": 1}
        dilated = ({"stride": 2, "dilation": 2, "output_padding": 1} if transposed
                   else {"padding": "same", "dilation": 2})
        return [Sample((x, weight(c, out, 1, cube), f64(out)), {}),
                Sample((x, weight(c, out, 1, cube)), strided),
                Sample((x, weight(c, out, 1, wide), f64(out)), dilated),
                Sample((grouped, weight(2, per_group_out, groups, cube), f64(per_group_out * groups)),
                       {"groups": groups, "padding": 1}),
                # depthwise, 2 outputs per channel; groups by position (after dilation or output_padding)
                Sample((x, weight(1, 2, c, cube), f64(2 * c), 1, 1, 0 if transposed else 1, c), {}),
                Sample((x[0], weight(c, out, 1, cube)), {"stride": (1,) * (spatial_count - 1) + (2,)})]
    return build


def _pools(*variants, exact=False):
    """(args after the image, kwargs) variants; the last one on an unbatched (C, H, W) image."""
    def build(m: Make):
        x = _image(m)
        images = [x] * (len(variants) - 1) + [x[0]]
        return [Sample((image,) + tuple(args), dict(kwargs), exact) for image, (args, kwargs) in zip(images, variants)]
    return build


def _interpolate(m: Make):
    x = _image(m)
    return [Sample((x,), {"scale_factor": 2}, True),
            Sample((x,), {"size": (5, 4), "mode": "bilinear", "align_corners": False}),
            Sample((x, (9, 3), None, "bilinear", True), {}),
            Sample((x[:, :, 0],), {"scale_factor": 1.5, "mode": "nearest-exact"}, True)]


def _group_norm(m: Make):
    x = _image(m, channels=(4, 6))
    c = x.shape[1]
    return [Sample((x, c // 2, m.x(c), m.x(c)), {}), Sample((x, 1), {"eps": 1e-3}),
            Sample((x[:, :, 0], c // 2, m.x(c)), {})]


def _per_channel(m: Make, c: int) -> tuple:
    return m.x(c), m.x(c, positive=True), m.x(c), m.x(c)    # running mean, running var, weight, bias


def _batch_norm(m: Make):
    x = _image(m)
    mean, var, weight, bias = _per_channel(m, x.shape[1])
    return [Sample((x, mean, var, weight, bias), {}), Sample((x, mean, var), {"eps": 1e-3}),
            Sample((x, None, None, weight, bias, True), {}), Sample((x[:, :, 0, 0], mean, var, weight), {})]


def _batch_norm_moments(m: Make):
    x = _image(m)
    return [Sample((x,), {}), Sample((x[:, :, 0],), {})]


def _batch_norm_from_moments(m: Make):
    from ..vision_norm import batch_norm_moments
    x = _image(m)
    mean, var, weight, bias = _per_channel(m, x.shape[1])
    moments = batch_norm_moments(x)
    return [Sample((x, moments, mean, var, weight, bias, 0.1, 1e-5), {}), Sample((x, moments), {"momentum": 0.5})]


VISION = {
    **{f"conv{n}d": _conv(n) for n in (1, 2, 3)}, **{f"conv_transpose{n}d": _conv(n, True) for n in (1, 2, 3)},
    "interpolate": _interpolate, "group_norm": _group_norm, "batch_norm": _batch_norm,
    "batch_norm_moments": _batch_norm_moments, "batch_norm_from_moments": _batch_norm_from_moments,
    "max_pool2d": _pools(((2,), {}), ((3, 2, 1), {"ceil_mode": True}), ((2,), {"return_indices": True}),
                         ((3,), {"stride": 1}), exact=True),
    "avg_pool2d": _pools(((2,), {}), ((3, 2, 1, True, False), {}), ((2,), {"divisor_override": 3}), ((3,), {})),
    "max_pool2d_with_indices": _pools(((3, 2, 1), {"ceil_mode": True}), ((2,), {})),
    "adaptive_max_pool2d_with_indices": _pools((((3, 2),), {}), ((1,), {})),
    "adaptive_avg_pool2d": _pools(((1,), {}), (((3, 2),), {}), ((2,), {})),
    "adaptive_max_pool2d": _pools(((1,), {}), (((3, 2), True), {}), ((2,), {}), exact=True),
}
