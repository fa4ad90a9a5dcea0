"""torch's sampling functions, drawn from dtorch's random stream: `torch.multinomial`,
`torch.bernoulli` (and `x.bernoulli(p)`), and the in-place refills `x.bernoulli_(p)`,
`x.exponential_()`, `x.log_normal_()`, `x.cauchy_()` and `x.geometric_(p)`.

Each transforms `rand` / `randn` (dtorch/dtensor/factories.py), as `x.normal_()` and `x.uniform_()` do:
the same values on every layout for one `dtorch.manual_seed`, inside dtorch.compile too (a
replay draws afresh). The distributions are torch's; the values are not torch's generator's.
tests/test_random_composites.py checks the distributions, the layout independence and the errors.

multinomial without replacement takes the `num_samples` largest keys `log(u) / p` per row, which
orders categories as drawing them one by one without replacement would (Efraimidis and
Spirakis). With replacement, each draw counts the cumulative probabilities at or below `u *
total`. Unlike torch, a row with fewer positive probabilities than `num_samples` (without
replacement) is not refused: that needs reading the values; its extra picks have probability 0.
"""
from __future__ import annotations

import math

import torch

from ..dtensor.api import register_methods, register_torch_spellings
from ..spec.placements import Replicate, Shard
from ..dtensor.factories import rand, rand_like, randn_like
from ..dtensor.inplace import assign
from ..dtensor.tensor import DTensor, call_op

__all__ = ["multinomial", "bernoulli"]


def _float(like: DTensor) -> torch.dtype:
    return like.dtype if like.dtype.is_floating_point else torch.float32


def _uniform(like: DTensor, generator) -> DTensor:
    """U[0, 1) shaped and laid out as `like` (Partial dims Replicate), in a floating dtype."""
    return rand_like(like, dtype=_float(like), generator=generator)


def multinomial(input: DTensor, num_samples: int, replacement: bool = False, *, generator=None,
                out=None) -> DTensor:
    _check_multinomial(input, num_samples, replacement, out)
    probs = input if input.ndim == 2 else input.unsqueeze(0)
    rows, categories = probs.shape
    # the draws split by rows as the probabilities do, never by their category dim
    by_rows = [p if p == Shard(0) else Replicate() for p in probs.placements]
    if replacement:
        cumulative = probs.double().cumsum(-1)
        targets = rand(rows, num_samples, generator=generator, dtype=cumulative.dtype, device_mesh=probs.device_mesh,
                       placements=by_rows) * cumulative[:, -1:]
        below = call_op("le", (cumulative.unsqueeze(1), targets.unsqueeze(-1)), {})   # (rows, draws, categories)
        picks = below.sum(-1).clamp(max=categories - 1)
    else:
        keys = rand(rows, categories, generator=generator, dtype=probs.dtype, device_mesh=probs.device_mesh,
                    placements=by_rows).log() / probs
        picks = keys.topk(num_samples, dim=-1).indices
    return picks if input.ndim == 2 else picks.squeeze(0)


def _check_multinomial(input: DTensor, num_samples: int, replacement: bool, out) -> None:
    if out is not None:
        raise TypeError("multinomial(..., out=...) is not supported by dtorch: use the returned tensor")
    if input.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not input.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {input.dtype}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > input.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")


def bernoulli(input: DTensor, p=None, *, generator=None, out=None) -> DTensor:
    """torch.bernoulli(probs) and x.bernoulli(p): 1 with probability `p` (else the input's own
    values), in the input's dtype."""
    if out is not None:
        raise TypeError("bernoulli(..., out=...) is not supported by dtorch: use the returned tensor")
    return _bernoulli_draw(input, input if p is None else p, generator)


def _bernoulli_draw(like: DTensor, p, generator) -> DTensor:
    return call_op("lt", (_uniform(like, generator), p), {}).to(like.dtype)


# --- in-place refills -----------------------------------------------------------------------------------
def _bernoulli_(self, p=0.5, *, generator=None):
    return assign(self, _bernoulli_draw(self, p, generator), "x.bernoulli_")


def _exponential_(self, lambd=1.0, *, generator=None):
    return assign(self, -(-_uniform(self, generator)).log1p() / lambd, "x.exponential_")


def _log_normal_(self, mean=1.0, std=2.0, *, generator=None):
    return assign(self, (randn_like(self, generator=generator) * std + mean).exp(), "x.log_normal_")


def _cauchy_(self, median=0.0, sigma=1.0, *, generator=None):
    turn = (_uniform(self, generator) - 0.5) * math.pi
    return assign(self, turn.tan() * sigma + median, "x.cauchy_")


def _geometric_(self, p, *, generator=None):
    """The number of trials up to the first success: at least 1."""
    failures = (-_uniform(self, generator)).log1p() / math.log1p(-p)
    return assign(self, failures.ceil().clamp(min=1), "x.geometric_", cast_any=True)


register_methods({"bernoulli_": _bernoulli_, "exponential_": _exponential_, "log_normal_": _log_normal_,
                  "cauchy_": _cauchy_, "geometric_": _geometric_})

register_torch_spellings({"multinomial": multinomial, "bernoulli": bernoulli})
