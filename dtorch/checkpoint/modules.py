"""`module.load_state_dict(path)`: a dtorch.nn Module loaded from a checkpoint file or directory,
each worker reading its own slices. Installed into dtorch.nn as its path loader (nn is the layer
below: it cannot import this one)."""
from __future__ import annotations

import os

from ..nn.module import IncompatibleKeys, describe_incompatible, loadable_tensors, put_tensor, tie_groups
from .loading import load_state_dict
from .safetensors_header import read_checkpoint

__all__ = ["load_module"]


def load_module(module, path: str | os.PathLike, strict: bool = True, progress: bool | None = None,
                via_controller: bool = False) -> IncompatibleKeys:
    """Load `module`'s parameters and persistent buffers from a safetensors checkpoint. A tied
    tensor loads once, from whichever of its names the checkpoint has. Key checks happen before
    anything is sent, as in Module.load_state_dict."""
    stored = set(read_checkpoint(os.fspath(path)))        # headers only
    targets = loadable_tensors(module)
    groups = tie_groups(targets)
    chosen = {key: next((n for n in names if n in stored), names[0]) for key, names in groups.items()}
    known = set(targets)
    keys = IncompatibleKeys([n for key, n in chosen.items() if n not in stored], sorted(stored - known))
    if strict and (keys.missing_keys or keys.unexpected_keys):
        raise RuntimeError(describe_incompatible(type(module).__name__, keys))
    wanted = {n: targets[n] for n in chosen.values() if n in stored}
    loaded = load_state_dict(wanted, path, strict=False, progress=progress, via_controller=via_controller)
    for name, value in loaded.items():
        put_tensor(module, groups[id(targets[name])], value)
    return keys
