"""PURE: what every sample table builds with: a Sample (one torch call on whole tensors) and
Make, the seeded source of random inputs sized for an even or an uneven split."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Sample", "Make"]


class Sample(NamedTuple):
    args: tuple
    kwargs: dict
    exact: bool = False     # correctly rounded per element: a shard's bits equal the whole's


class Make:
    """Random inputs from one seeded generator, sized for an even or an uneven split."""

    def __init__(self, uneven: bool, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.uneven = uneven

    def shape(self, even, uneven=None):
        return tuple(uneven) if self.uneven and uneven is not None else tuple(even)

    def x(self, *shape, positive=False, nonzero=False, zeros=False, dtype=torch.float32):
        value = torch.randn(shape, generator=self.g)
        if positive or nonzero:
            value = value.sign() * (value.abs() + 0.25) if nonzero else value.abs() + 0.25
        if zeros:   # exact zeros, so that a count of nonzeros or a cast to bool is not constant
            value = torch.where(value.abs() < 0.4, 0.0, value)
        return value.to(dtype)

    def ints(self, *shape, low=-6, high=6, dtype=torch.int64):
        return torch.randint(low, high, shape, generator=self.g, dtype=dtype)

    def bools(self, *shape, density=0.5):
        return torch.rand(shape, generator=self.g) < density

    def distinct(self, *shape):
        """Distinct integer values as floats: exact through any rearrangement, one right answer
        for sort and topk."""
        return torch.randperm(math.prod(shape), generator=self.g).reshape(shape).to(torch.float32)

    def permutations(self, *shape):
        """A permutation of range(shape[1]) per row: unique scatter positions, valid gather ones."""
        return torch.rand(shape, generator=self.g).argsort(dim=1)
