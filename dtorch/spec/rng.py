"""PURE (torch only): counter-based random numbers. Element i of a random tensor is a pure function
of (seed, call counter, i), where i is the element's index in the GLOBAL tensor.

So a tensor's values depend only on the seed, the sequence of random calls, the global shape and
the dtype — never on the mesh or the placements — and each worker generates only its own shard.
The hash is a 32-bit integer mixer (lowbias32 by Chris Wellons) evaluated with int64 torch ops;
products wrap, and only their low 32 bits are kept, which wrapping leaves exact.

It sits below both of its users, the random factories a worker runs (runtime/worker/kernels.py) and
dropout's kernel (ops/nn.py), so the rule layer never imports the runtime.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

__all__ = ["global_indices", "uniform", "normal", "integers", "Generator"]

_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _key(seed: int, counter: int, stream: int) -> int:
    """Fold seed, call counter and stream into one 32-bit key (plain Python ints)."""
    key = 0x9E3779B9
    for part in (seed & _MASK, seed >> 32 & _MASK, counter & _MASK, counter >> 32 & _MASK, stream):
        key = int(_mix(torch.tensor(key ^ part, dtype=torch.int64)))
    return key


def global_indices(global_shape: Sequence[int], offset: Sequence[int], shape: Sequence[int],
                   device=None) -> torch.Tensor:
    """Row-major index into the global tensor of every element of the block at `offset`."""
    index = torch.zeros(tuple(shape), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        positions = torch.arange(offset[dim], offset[dim] + shape[dim], dtype=torch.int64, device=device)
        index += (positions * stride).view(view)
        stride *= global_shape[dim]
    return index


def _bits(index: torch.Tensor, seed: int, counter: int, stream: int) -> torch.Tensor:
    """32 random bits per element, as int64 in [0, 2**32)."""
    low, high = index & _MASK, index >> 32
    return _mix(_mix(low ^ _key(seed, counter, stream)) ^ high)


def uniform(index, seed, counter, dtype: torch.dtype, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """U[low, high) with 53 random bits per element, computed in float64 then cast."""
    top = _bits(index, seed, counter, 0) >> 5       # 27 bits
    bottom = _bits(index, seed, counter, 1) >> 6    # 26 bits
    unit = (top * 67108864 + bottom).to(torch.float64) * (1.0 / 9007199254740992.0)
    values = (low + (high - low) * unit).to(dtype)
    # Rounding to a short dtype can reach `high`; torch.rand never returns it.
    return torch.minimum(values, torch.nextafter(torch.tensor(high, dtype=dtype),
                                                 torch.tensor(low, dtype=dtype)).to(values.device))


def normal(index, seed, counter, dtype: torch.dtype, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """N(mean, std^2) by Box-Muller over two independent 32-bit streams."""
    u1 = (_bits(index, seed, counter, 2).to(torch.float64) + 1.0) * (1.0 / 4294967296.0)   # (0, 1]
    u2 = _bits(index, seed, counter, 3).to(torch.float64) * (1.0 / 4294967296.0)          # [0, 1)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return (mean + std * z).to(dtype)


def integers(index, seed, counter, dtype: torch.dtype, low: int, high: int) -> torch.Tensor:
    """Uniform integers in [low, high) from 63 random bits (bias below 2**-30 for spans < 2**33)."""
    bits = ((_bits(index, seed, counter, 4) >> 1) << 32) | _bits(index, seed, counter, 5)
    return (low + torch.remainder(bits, high - low)).to(dtype)


def rng_state_values(state, call: str) -> tuple[int, int]:
    """(seed, counter) of a state from get_rng_state / Generator.get_state; a state of torch's
    own generator (a uint8 tensor of its Mersenne Twister) is refused with what to pass."""
    values = state.tolist() if isinstance(state, torch.Tensor) else state
    if (isinstance(state, torch.Tensor) and state.dtype != torch.int64) or not (
            isinstance(values, (list, tuple)) and len(values) == 2 and all(type(v) is int for v in values)
            and values[1] >= 0):
        kind = f"a {state.dtype} tensor of {state.numel()} elements" if isinstance(state, torch.Tensor) else repr(state)
        raise TypeError(f"{call} takes what dtorch.get_rng_state() / Generator.get_state() return ([seed, calls], "
                        f"int64), not {kind}: torch's own generator state does not describe dtorch's stream")
    return values[0], values[1]


class Generator:
    """A random stream of its own (dtorch.Generator().manual_seed(s), passed as generator= to the
    random factories), like torch.Generator: it neither reads nor advances the global stream of
    dtorch.manual_seed. Each call it serves takes the next counter of this stream, so the values
    still depend only on (seed, call order, global shape, dtype), never on the layout. The same
    seed gives the same values as dtorch.manual_seed(seed) does, as with torch's generators."""

    DEFAULT_SEED = 67280421310721    # torch.Generator().initial_seed()

    def __init__(self, device=None):
        self._seed, self._counter, self._lock = self.DEFAULT_SEED, 0, threading.Lock()

    def manual_seed(self, seed: int) -> Generator:
        with self._lock:
            self._seed, self._counter = int(seed), 0
        return self

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> torch.Tensor:
        """As torch.Generator.get_state: [seed, calls so far] (int64), for set_state."""
        with self._lock:
            return torch.tensor([self._seed, self._counter], dtype=torch.int64)

    def set_state(self, new_state) -> Generator:
        seed, counter = rng_state_values(new_state, "Generator.set_state")
        with self._lock:
            self._seed, self._counter = seed, counter
        return self

    def next_call(self) -> tuple[int, int]:
        """(seed, counter) for one random call, the same pair the global stream sends."""
        with self._lock:
            counter, self._counter = self._counter, self._counter + 1
            return self._seed, counter

    def __repr__(self) -> str:
        return f"dtorch.Generator(seed={self._seed}, calls={self._counter})"
