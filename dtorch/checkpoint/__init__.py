"""Checkpoints: load safetensors files into DTensors, each worker reading only its own slice.

    targets = {"w": TensorTarget((4096, 4096), torch.bfloat16, mesh, [Shard(0)])}
    tensors = dtorch.checkpoint.load_tensors("model_dir", targets)

docs/checkpoint.md says what travels where, what a multi-host cluster needs, and how errors surface.
"""
from __future__ import annotations

from .loading import LoadedTensors, load_state_dict, load_tensors
from .matching import IncompatibleKeys, TensorTarget
from .modules import load_module
from .safetensors_header import CheckpointError, StoredTensor, read_checkpoint
from ..nn.module import set_path_loader

set_path_loader(load_module)   # module.load_state_dict("dir/") lands here

__all__ = ["load_tensors", "load_state_dict", "load_module", "TensorTarget", "IncompatibleKeys", "LoadedTensors",
           "CheckpointError", "StoredTensor", "read_checkpoint"]
