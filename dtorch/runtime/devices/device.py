"""What a worker's device means to the command loop: where tensors live, how a command's kernels
are enqueued, how bytes reach the host for a read, and which communicator moves data.

CPU runs everything synchronously, so every host copy is ready at once and communication is done
when it returns. CUDA (runtime/devices/cuda.py) enqueues kernels on a compute stream and whole
redistributes on a communication stream: `communicate` hands back the result with an event, and
the worker makes the compute stream `wait` on it only when a later command reads that result, so
independent compute overlaps. Importing runtime/devices/cuda.py touches neither CUDA nor cupy: only
making a CudaDevice does, so the CPU path never imports cupy.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from .comm import GlooCommunicator
from .cuda import CudaDevice
from .host_copy import HostCopy
from .shared_gpu import SharedGpuCommunicator

__all__ = ["CpuDevice", "make_device"]

# Tests only (tests/test_share_gpu.py): CPU workers take shared-GPU mode's communicator, so the
# worker's whole use of it (the bucket path, regroup, close, a failed backward) runs without a GPU.
STAGED_ON_CPU_VARIABLE = "DTORCH_TEST_STAGED_COMMUNICATOR"
SMALL_READ_BYTES = 1 << 16   # pyzmq copies a frame this small anyway (its zero-copy threshold)
_NUMPY_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool))


class CpuDevice:
    kind = "cpu"

    def __init__(self, name: str = "cpu"):
        self.torch_device = torch.device("cpu")

    def communicator(self, store_address: str, rank: int, hostname: str,
                     timeout_s: float) -> GlooCommunicator | SharedGpuCommunicator:
        if os.environ.get(STAGED_ON_CPU_VARIABLE) == "1":   # tests only: see the constant
            return SharedGpuCommunicator(store_address, rank, hostname, timeout_s)
        return GlooCommunicator(store_address, rank, hostname, timeout_s)

    _NO_STREAM = contextlib.nullcontext()

    def compute(self):
        """Context in which a command's kernels run (a CUDA stream on GPUs)."""
        return self._NO_STREAM

    def communicate(self, work, inputs: tuple):
        """Run `work()` (a redistribute or transfer reading `inputs`): (its result, the event
        that marks it done, or None when it is done already)."""
        return work(), None

    def wait(self, done, tensor: torch.Tensor) -> None:
        """Order the compute stream after `done` before it reads `tensor` (never called on CPU,
        whose `communicate` returns no event)."""

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """A snapshot, as on CUDA: the reply's bytes leave zero-copy on zmq's thread while this
        worker runs on, and an in-place update (an optimizer step) must not reach them."""
        return HostCopy(tensor.clone(memory_format=torch.contiguous_format))

    def small_bytes(self, tensor: torch.Tensor) -> bytes | None:
        """A small tensor's bytes, copied now, so that a read sends them at once: one copy instead
        of a clone and a frame view (7 torch calls, ~8 us of a read's worker time hot, several
        times that on a machine that just woke). A contiguous tensor's come straight from its
        address (ctypes.string_at: 1.8 us hot, against 3.2 us through numpy). None for a large
        tensor, which leaves zero-copy from a snapshot (to_host), or a strided one of a dtype
        numpy lacks (bfloat16)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > SMALL_READ_BYTES:
            return None
        if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):   # (lazy bits: not in the bytes)
            # its bytes where they lie, any dtype: one call, no numpy view
            return ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        if tensor.dtype not in _NUMPY_DTYPES:
            return None
        return tensor.detach().resolve_conj().resolve_neg().numpy().tobytes()

    def from_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def fence(self) -> HostCopy:
        """Ready when everything issued so far has run: at once on CPU."""
        return HostCopy(None)

    def close(self) -> None:
        pass


def make_device(name: str, share_gpu: bool = False) -> CpuDevice | CudaDevice:
    """share_gpu: shared-GPU mode for a CUDA worker (runtime/devices/shared_gpu.py)."""
    if name.startswith("cuda"):
        return CudaDevice(name, share_gpu)
    return CpuDevice(name)
