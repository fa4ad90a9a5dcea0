"""Which GPU each new CUDA worker pins, decided on the controller, and the checks that make a bad
"cuda" mesh fail at the user's call; the worker side of a GPU is runtime/devices/cuda.py.

Local workers take the lowest GPUs that torch on this host sees (CUDA_VISIBLE_DEVICES applies)
and no live worker holds; slot i of a hostfile host runs on cuda:i, checked by the worker itself,
since the controller cannot see other hosts' GPUs and may have none.

Shared-GPU mode (dtorch.init(share_gpu=True) or DTORCH_SHARE_GPU=1) is a test and development
mode: several workers share a GPU (round-robin over the visible ones) and their collectives run
over Gloo through host memory (runtime/devices/shared_gpu.py), since NCCL refuses two ranks on one
device. Without it, more CUDA workers than GPUs is an error that names the setting, never a
silent fallback.

This module must import on machines without a GPU or cupy: it only asks torch how many GPUs it
sees, and importlib whether cupy is installed.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ...errors import MeshError, StartupError

__all__ = ["check_available", "assign_devices", "free_gpus", "visible_gpus", "cupy_package",
           "cupy_missing_message", "share_gpu_setting", "shared_gpus", "communicator_name", "ENV_SHARE_GPU"]

DEVICE_TYPES = ("cpu", "cuda")
ENV_SHARE_GPU = "DTORCH_SHARE_GPU"
SHARE_GPU_HINT = (f"to test on fewer GPUs, dtorch.init(share_gpu=True) or {ENV_SHARE_GPU}=1 lets workers "
                  "share a GPU with collectives over Gloo (a test and development mode, not for speed)")


def share_gpu_setting(given: bool | None) -> bool:
    """Whether CUDA workers share GPUs: `given` (dtorch.init's share_gpu), else DTORCH_SHARE_GPU
    ("1" or "0"; unset: no)."""
    if given is not None:
        if not isinstance(given, bool):
            raise ValueError(f"share_gpu={given!r}: expected True or False")
        return given
    text = os.environ.get(ENV_SHARE_GPU, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{ENV_SHARE_GPU}={text!r}: expected 1 (workers share GPUs) or 0")
    return text == "1"


def communicator_name(device: str, share_gpu: bool) -> str:
    """What moves a worker's mesh collectives (dtorch.workers() shows it): "gloo" on CPU, "nccl"
    between GPUs, "gloo-shared-gpu" for a CUDA worker in shared-GPU mode."""
    if not device.startswith("cuda"):
        return "gloo"
    return "gloo-shared-gpu" if share_gpu else "nccl"


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
    if getattr(controller, "share_gpu", False):
        visible_gpus()   # any GPU will do; no cupy: Gloo moves the data
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
    if _is_remote(spawner):   # (shared: the worker wraps the slot around its host's GPUs)
        return [f"cuda:{spawner.local_rank(rank)}" for rank in ranks]
    if getattr(controller, "share_gpu", False):
        return [f"cuda:{index}" for index in shared_gpus(visible_gpus(), ranks)]
    return [f"cuda:{index}" for index in free_gpus(visible_gpus(), _taken_gpus(controller), len(ranks))]


def free_gpus(visible: int, taken: set[int], needed: int) -> list[int]:
    """The `needed` lowest GPU indices not in `taken`, or a MeshError that says what is missing."""
    free = [index for index in range(visible) if index not in taken]
    if needed > len(free):
        held = f", {len(taken)} of them already run a worker" if taken else ""
        raise MeshError(f"a 'cuda' mesh needs {needed} more worker(s), one per GPU, but torch on this "
                        f"host sees {visible} GPU(s){held}: use a smaller mesh, run workers on "
                        f"more hosts with dtorch-launch --hostfile, or, {SHARE_GPU_HINT}")
    return free[:needed]


def shared_gpus(visible: int, ranks) -> list[int]:
    """Shared-GPU mode: rank r runs on GPU r mod `visible`, so workers spread over every GPU
    and a replaced rank lands where it was."""
    return [rank % visible for rank in ranks]


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
