"""Checkpoints: load safetensors files into DTensors, each worker reading only its own slice.

    targets = {"w": TensorTarget((4096, 4096), torch.bfloat16, mesh, [Shard(0)])}
    tensors = dtorch.checkpoint.load_tensors("model_dir", targets)

Sharded checkpoints of any state (DTensors, plain values, and objects with state_dict() /
load_state_dict(): a model, an optimizer, an LR scheduler), each worker writing and reading its own
blocks, loading back onto any layout, into fresh objects, as torch.distributed.checkpoint does:

    dtorch.checkpoint.save({"model": model, "optim": opt, "sched": sched, "step": 7}, "ckpt/")
    dtorch.checkpoint.load({"model": model, "optim": opt, "sched": sched, "step": 0}, "ckpt/")  # fills them
    python -m dtorch.checkpoint.convert ckpt/ full.pt                            # a plain torch state dict

`load` also reads a checkpoint torch.distributed.checkpoint saved, and torch reads dtorch's with
`dcp.load(state, storage_reader=DtorchStorageReader("ckpt/"))`. get_state_dict / set_state_dict
are torch's, for dtorch models and optimizers.

docs/design/checkpoint.md says what travels where, what a multi-host cluster needs, and how errors surface.
"""
from __future__ import annotations

from .loading import LoadedTensors, load_state_dict, load_tensors
from .matching import IncompatibleKeys, TensorTarget
from .modules import load_module
from .safetensors_header import CheckpointError, StoredTensor, read_checkpoint
from .saving import save
from .sharded_loading import load
from .state_dicts import (get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                          set_optimizer_state_dict, set_state_dict)
from ..nn.module import set_path_loader

set_path_loader(load_module)   # module.load_state_dict("dir/") lands here


def __getattr__(name: str):
    # imported on first use: `python -m dtorch.checkpoint.convert` runs convert as __main__, and
    # runpy warns when the package's import has already imported it under its own name
    if name == "to_torch_state_dict":
        from .convert import to_torch_state_dict
        return to_torch_state_dict
    # these import torch.distributed.checkpoint (seconds), so only when asked for
    if name == "DtorchStorageReader":
        from .torch_reader import DtorchStorageReader
        return DtorchStorageReader
    if name == "StateDictOptions":
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions
    raise AttributeError(f"module 'dtorch.checkpoint' has no attribute {name!r}")

__all__ = ["load_tensors", "load_state_dict", "load_module", "TensorTarget", "IncompatibleKeys", "LoadedTensors",
           "CheckpointError", "StoredTensor", "read_checkpoint", "save", "load", "to_torch_state_dict",
           "get_state_dict", "set_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "StateDictOptions", "DtorchStorageReader"]
