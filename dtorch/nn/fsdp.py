"""fully_shard: FSDP2's fully_shard for dtorch modules.

Each parameter a fully-sharded module manages is kept sharded over one mesh dim ("fsdp"): on
dim 0, or on the first dim the other mesh dims (tp) leave whole, so that gathering it is a single
all-gather. The module's forward runs on gathered copies: a pre-forward hook all-gathers every
managed parameter (an ordinary recorded redistribute) and puts the copy in its place, a forward
hook puts the sharded Parameter back and drops the copy. Backward needs no hook: the gradient of
an all-gather is a reduce-scatter (autograd/rules.py), so each gradient arrives already sharded
like its Parameter, and an optimizer updates only the shards.

As in torch, a module manages the parameters of its subtree that no nested fully-sharded module
manages: shard the blocks first (`fully_shard(layer)` for each layer), then the root.
"""
from __future__ import annotations

from ..distributed_spec import Replicate, Shard
from ..errors import MeshError, user_site
from .module import Module
from .parameter import Parameter

__all__ = ["fully_shard", "is_fully_sharded"]


def fully_shard(module: Module, mesh_dim: str | int = "fsdp", *, reshard_after_forward: bool = True) -> Module:
    """Shard `module`'s parameters over `mesh_dim` and gather them around its forward. Returns the
    module. A parameter whose mesh lacks `mesh_dim` (another pipeline stage) is left alone."""
    managed, sharded = [], {}   # (by id: a tied Parameter is sharded once and stays tied)
    lacking, found = set(), False   # the meshes without `mesh_dim`; whether any parameter had it
    for owner, name, param in _unmanaged(module):
        mesh = param.device_mesh
        if mesh_dim not in (mesh.mesh_dim_names or ()) and not isinstance(mesh_dim, int):
            lacking.add(mesh)
            continue
        found = True
        dim = mesh.dim_index(mesh_dim)
        if id(param) not in sharded:
            if mesh.shape[dim] == 1 or param.placements[dim] != Replicate():
                continue
            placements = list(param.placements)
            placements[dim] = Shard(_free_tensor_dim(param, dim))
            sharded[id(param)] = Parameter(param.redistribute(placements=placements), param.requires_grad)
        owner._parameters[name] = sharded[id(param)]
        managed.append((owner, name, dim))
    if lacking and not found:
        raise MeshError(f"fully_shard at {user_site()}: no parameter of {type(module).__name__} is on a mesh with a "
                        f"dim named {mesh_dim!r} (their meshes: {', '.join(map(repr, lacking))}); pass one of "
                        "their dim names")
    module._fsdp_managed = managed
    module._fsdp_gathered = {}
    module.register_forward_pre_hook(_gather)
    if reshard_after_forward:
        module.register_forward_hook(_reshard)
    return module


def is_fully_sharded(module: Module) -> bool:
    return hasattr(module, "_fsdp_managed")


def _unmanaged(module: Module):
    """(owner, name, parameter) of the subtree, skipping nested fully-sharded modules."""
    for name, param in module._parameters.items():
        if param is not None:
            yield module, name, param
    for child in module.children():
        if not is_fully_sharded(child):
            yield from _unmanaged(child)


def _free_tensor_dim(param, mesh_dim: int) -> int:
    """Dim 0, unless another mesh dim shards it (tp's column-parallel weights): then the first
    dim no other mesh dim shards, so the fsdp gather stays one all-gather."""
    taken = {p.dim for m, p in enumerate(param.placements) if m != mesh_dim and isinstance(p, Shard)}
    return next((d for d in range(param.ndim) if d not in taken), 0)


def _gather(module: Module, args):
    copies = {}
    for owner, name, dim in module._fsdp_managed:
        sharded = owner._parameters[name]
        if id(sharded) not in copies:
            placements = list(sharded.placements)
            placements[dim] = Replicate()
            copies[id(sharded)] = sharded.redistribute(placements=placements)
        module._fsdp_gathered[(id(owner), name)] = sharded
        owner._parameters[name] = copies[id(sharded)]   # forward reads the gathered copy (a plain DTensor)


def _reshard(module: Module, args, output):
    for owner, name, _ in module._fsdp_managed:
        sharded = module._fsdp_gathered.pop((id(owner), name), None)
        if sharded is not None:
            owner._parameters[name] = sharded
