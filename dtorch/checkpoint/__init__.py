"""Checkpoints: load safetensors files into DTensors, each worker reading only its own slice.

    targets = {"w": TensorTarget((4096, 4096), torch.bfloat16, mesh, [Shard(0)])}
    tensors = dtorch.checkpoint.load_tensors("model_dir", targets)

Sharded checkpoints of any state (a model's, an optimizer's, plain values), each worker writing and
reading its own blocks, loading back onto any layout:

    dtorch.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, "ckpt/")
    state = dtorch.checkpoint.load({"model": model.state_dict(), "step": 0}, "ckpt/")   # fills it in place
    python -m dtorch.checkpoint.convert ckpt/ full.pt                            # a plain torch state dict

docs/design/checkpoint.md says what travels where, what a multi-host cluster needs, and how errors surface.
"""
from __future__ import annotations

from .loading import LoadedTensors, load_state_dict, load_tensors
from .matching import IncompatibleKeys, TensorTarget
from .modules import load_module
from .safetensors_header import CheckpointError, StoredTensor, read_checkpoint
from .saving import save
from .sharded_loading import load
from ..nn.module import set_path_loader

set_path_loader(load_module)   # module.load_state_dict("dir/") lands here


def __getattr__(name: str):
    # imported on first use: `python -m dtorch.checkpoint.convert` runs convert as __main__, and
    # runpy warns when the package's import has already imported it under its own name
    if name == "to_torch_state_dict":
        from .convert import to_torch_state_dict
        return to_torch_state_dict
    raise AttributeError(f"module 'dtorch.checkpoint' has no attribute {name!r}")

__all__ = ["load_tensors", "load_state_dict", "load_module", "TensorTarget", "IncompatibleKeys", "LoadedTensors",
           "CheckpointError", "StoredTensor", "read_checkpoint", "save", "load", "to_torch_state_dict"]
