"""CudaDevice: the worker-side seam (runtime/devices/device.py) on a GPU. Which GPU a worker gets is
decided on the controller (runtime/devices/gpu_assignment.py); this worker pins it for its whole life.

A worker enqueues every command's kernels on its own compute stream, and each redistribute or
transfer as a whole (its packing, NCCL collectives from runtime/devices/nccl.py, and unpacking) on a
communication stream. The two are ordered with CUDA events, never with a device-wide synchronize:
the communication stream waits for the compute work issued before it, and the compute stream waits
for a communication's event only when a later command reads its result. Compute that does not need
the result runs meanwhile. Reads copy to pinned host memory asynchronously: the command loop polls
the copy's event and replies when it completes.

This module must import on machines without a GPU or cupy: nothing here touches CUDA or cupy
until a CudaDevice is made (nccl.import_nccl is the one place cupy is imported).
"""
from __future__ import annotations

import torch

from ...errors import StartupError
from .host_copy import HostCopy
from .nccl import NcclCommunicator, import_nccl
from .shared_gpu import SharedGpuCommunicator

__all__ = ["CudaDevice"]


class CudaDevice:
    """One GPU, pinned for the life of the worker, with a compute and a communication stream."""

    kind = "cuda"

    def __init__(self, name: str, share_gpu: bool = False):
        """share_gpu: shared-GPU mode (runtime/devices/shared_gpu.py): other workers may pin the
        same GPU, a hostfile slot wraps around this host's GPUs, and no cupy is needed."""
        self.share_gpu = share_gpu
        index = torch.device(name).index or 0
        count = torch.cuda.device_count()
        if count == 0:
            raise StartupError(f"this worker was assigned {name}, but torch {torch.__version__} on this "
                               f"host sees no GPU (CUDA {torch.version.cuda}): run 'cuda' meshes on GPU hosts")
        if share_gpu:
            index %= count
        if index >= count:
            raise StartupError(f"this worker was assigned {name}, but torch on this host sees "
                               f"{count} GPU(s): give the host at most {count} slots in the hostfile")
        if not share_gpu:
            import_nccl()  # fail at start, naming the cupy package, not at the first collective
        torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
        self.compute_stream = torch.cuda.Stream(self.torch_device)
        self.comm_stream = torch.cuda.Stream(self.torch_device)

    def communicator(self, store_address: str, rank: int, hostname: str,
                     timeout_s: float) -> NcclCommunicator | SharedGpuCommunicator:
        """The one difference shared-GPU mode makes: the communicator (never a fallback: the
        user asked for the mode, gpu_assignment.share_gpu_setting)."""
        kind = SharedGpuCommunicator if self.share_gpu else NcclCommunicator
        return kind(store_address, rank, hostname, timeout_s, device=self)

    def compute(self):
        return torch.cuda.stream(self.compute_stream)

    def communicate(self, work, inputs: tuple):
        """Run `work()` on the communication stream after the compute work issued so far.

        Inputs are recorded on the communication stream: if the controller frees one while the
        collective still reads it, the caching allocator holds the block until the stream passes."""
        issued = torch.cuda.Event()
        issued.record(self.compute_stream)
        self.comm_stream.wait_event(issued)
        for tensor in inputs:
            if tensor.is_cuda:
                tensor.record_stream(self.comm_stream)
        with torch.cuda.stream(self.comm_stream):
            result = work()
        done = torch.cuda.Event()
        done.record(self.comm_stream)
        return result, done

    def wait(self, done, tensor: torch.Tensor) -> None:
        """The compute stream reads `tensor` (made on the communication stream) after `done`;
        recording it there keeps its block from reuse until compute is done with it too."""
        self.compute_stream.wait_event(done)
        if tensor.is_cuda:
            tensor.record_stream(self.compute_stream)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start a copy into pinned memory on the compute stream; ready when its event is."""
        with torch.cuda.stream(self.compute_stream):
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.compute_stream)
        return HostCopy(pinned, copied)

    def small_bytes(self, tensor: torch.Tensor) -> None:
        """Never: a read waits for its device-to-host copy without stalling the loop (to_host)."""
        return None

    def from_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Pinned staging (the caller's buffer may go at once), then an asynchronous upload. The
        caching host allocator keeps the staging block until the copy's stream passes it."""
        staging = tensor.pin_memory()
        with torch.cuda.stream(self.compute_stream):
            return staging.to(self.torch_device, non_blocking=True)

    def fence(self) -> HostCopy:
        """Ready when everything enqueued so far, on both streams, has run (what a Sync's reply
        promises); the compute stream joins the communication stream's work here."""
        communicated = torch.cuda.Event()
        communicated.record(self.comm_stream)
        self.compute_stream.wait_event(communicated)
        fenced = torch.cuda.Event()
        fenced.record(self.compute_stream)
        return HostCopy(None, fenced)

    def close(self) -> None:
        # No synchronize: after a communicator abort the streams may never drain, and the
        # process is about to exit, which releases the GPU anyway.
        pass
