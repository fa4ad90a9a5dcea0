"""CUDA workers: which GPU each new worker pins, the checks that make a bad "cuda" mesh fail at
the user's call, and CudaDevice, the worker-side seam (runtime/devices.py) on a GPU.

A worker enqueues every command's kernels on its own compute stream, and each redistribute or
transfer as a whole (its packing, NCCL collectives from runtime/nccl.py, and unpacking) on a
communication stream. The two are ordered with CUDA events, never with a device-wide synchronize:
the communication stream waits for the compute work issued before it, and the compute stream waits
for a communication's event only when a later command reads its result. Compute that does not need
the result runs meanwhile. Reads copy to pinned host memory asynchronously: the command loop polls
the copy's event and replies when it completes.

This module must import on machines without a GPU or cupy: nothing here touches CUDA or cupy at
import time, and the controller-side checks only ask torch how many GPUs it sees.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import MeshError, StartupError
from .devices import HostCopy

__all__ = ["CudaDevice", "check_available", "assign_devices", "free_gpus", "cupy_package"]

DEVICE_TYPES = ("cpu", "cuda")


# --- controller side: checks at the call, and device assignment --------------------------------
def cupy_package(cuda_version: str | None) -> str:
    """The cupy wheel built for this CUDA major version ("13.0" -> "cupy-cuda13x")."""
    major = (cuda_version or "12").split(".")[0]
    return f"cupy-cuda{major}x"


def cupy_missing_message(cuda_version: str | None) -> str:
    package = cupy_package(cuda_version)
    extra = {"cupy-cuda12x": "cuda", "cupy-cuda13x": "cuda13"}.get(package)
    also = f" (or: pip install 'dtorch[{extra}]')" if extra else ""
    return (f"'cuda' meshes use cupy's NCCL for collectives, and cupy is not installed: "
            f"pip install {package}{also}; it matches this torch's CUDA {cuda_version or 'version'}")


def check_available(device_type: str, extra: int, controller, spawner=None) -> None:
    """Raise at the user's call when `extra` more `device_type` workers cannot start.

    Workers started from a hostfile run on other hosts, whose GPUs this process cannot see (the
    controller may have none): there each worker checks its own GPU when it starts."""
    if device_type not in DEVICE_TYPES:
        hint = (" (pass 'cuda': each worker pins its own GPU, slot i of a host -> cuda:i)"
                if device_type.startswith("cuda:") else "")
        raise MeshError(f"device_type {device_type!r} is not supported: dtorch builds 'cpu' and "
                        f"'cuda' meshes{hint}")
    if device_type == "cpu" or _is_remote(spawner):
        return
    free_gpus(visible_gpus(), _taken_gpus(controller), extra)
    if importlib.util.find_spec("cupy") is None:
        raise StartupError(cupy_missing_message(torch.version.cuda))


def assign_devices(device_type: str, ranks, controller, spawner=None) -> list[str]:
    """The device each new worker pins: slot i of a hostfile host runs on cuda:i; local workers
    take the lowest GPUs that no live worker of this session holds."""
    check_available(device_type, len(ranks), controller, spawner)
    if device_type == "cpu":
        return ["cpu"] * len(ranks)
    if _is_remote(spawner):
        return [f"cuda:{spawner.local_rank(rank)}" for rank in ranks]
    return [f"cuda:{index}" for index in free_gpus(visible_gpus(), _taken_gpus(controller), len(ranks))]


def free_gpus(visible: int, taken: set[int], needed: int) -> list[int]:
    """The `needed` lowest GPU indices not in `taken`, or a MeshError that says what is missing."""
    free = [index for index in range(visible) if index not in taken]
    if needed > len(free):
        held = f", {len(taken)} of them already run a worker" if taken else ""
        raise MeshError(f"a 'cuda' mesh needs {needed} more worker(s), one per GPU, but torch on this "
                        f"host sees {visible} GPU(s){held}: use a smaller mesh, or run workers on "
                        "more hosts with dtorch-launch --hostfile")
    return free[:needed]


def visible_gpus() -> int:
    """torch.cuda.device_count(), or a MeshError saying why torch sees no GPU."""
    if torch.version.cuda is None:
        raise MeshError(f"no CUDA device visible to torch: torch {torch.__version__} is a CPU-only "
                        "build. Install a CUDA build of torch, use 'cpu' meshes, or start workers on "
                        "GPU hosts with dtorch-launch --hostfile")
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else " (no driver or no GPU)"
        raise MeshError(f"no CUDA device visible to torch {torch.__version__} (CUDA "
                        f"{torch.version.cuda}){why}")
    return count


def _is_remote(spawner) -> bool:
    return getattr(spawner, "local_rank", None) is not None


def _taken_gpus(controller) -> set[int]:
    return {int(w.device.split(":")[1]) for w in controller.workers.values()
            if w.device.startswith("cuda:") and w.lost is None}


# --- worker side --------------------------------------------------------------------------------
class CudaDevice:
    """One GPU, pinned for the life of the worker, with a compute and a communication stream."""

    kind = "cuda"

    def __init__(self, name: str):
        index = torch.device(name).index or 0
        count = torch.cuda.device_count()
        if count == 0:
            raise StartupError(f"this worker was assigned {name}, but torch {torch.__version__} on this "
                               f"host sees no GPU (CUDA {torch.version.cuda}): run 'cuda' meshes on GPU hosts")
        if index >= count:
            raise StartupError(f"this worker was assigned {name}, but torch on this host sees "
                               f"{count} GPU(s): give the host at most {count} slots in the hostfile")
        from .nccl import import_nccl
        import_nccl()  # fail at start, naming the cupy package, not at the first collective
        torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
        self.compute_stream = torch.cuda.Stream(self.torch_device)
        self.comm_stream = torch.cuda.Stream(self.torch_device)

    def communicator(self, store_address: str, rank: int, hostname: str, timeout_s: float):
        from .nccl import NcclCommunicator
        return NcclCommunicator(store_address, rank, hostname, timeout_s, device=self)

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
