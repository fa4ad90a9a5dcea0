"""fully_shard: FSDP2's fully_shard for dtorch modules.

Each parameter a fully-sharded module manages is kept sharded over one mesh dim ("fsdp"): on
dim 0, or on the first dim the other mesh dims (tp) leave whole. The module's forward runs on
gathered copies: a pre-forward hook gathers every managed parameter and puts the copy in its
place, a forward hook puts the sharded Parameter back and drops the copy.

The gather is ONE command and one all-gather per module (per mesh and dtype among its
parameters: runtime/fsdp_gather.py), as FSDP2 gathers a module's parameters into one flat buffer,
not one collective per parameter: each collective costs a fixed latency, and a Llama block has
nine parameters. Backward needs no hook: the gather's dual is one reduce-scatter of all the
module's gradients, so each gradient arrives already sharded like its Parameter, and an
optimizer updates only the shards. A gathered copy that an op saves for backward is not kept:
backward gathers the module's parameters again (once, at the first op that needs them), unless
`reshard_after_forward=False`.

As in torch, a module manages the parameters of its subtree that no nested fully-sharded module
manages: shard the blocks first (`fully_shard(layer)` for each layer), then the root.
"""
from __future__ import annotations

from ..distributed_spec import PeerGroup, Replicate, Shard, ShardRegion
from ..errors import MeshError, user_site
from ..ops.tensor_meta import tensor_meta
from ..recording import is_grad_enabled, record_op
from ..runtime import session
from ..runtime.protocol import RunOp
from ..op_issue import note_capture_inputs
from ..tensor import DTensor
from .module import Module
from .parameter import Parameter

__all__ = ["fully_shard", "is_fully_sharded"]


def fully_shard(module: Module, mesh_dim: str | int = "fsdp", *, reshard_after_forward: bool = True) -> Module:
    """Shard `module`'s parameters over `mesh_dim` and gather them around its forward. Returns the
    module. A parameter whose mesh lacks `mesh_dim` (another pipeline stage) is left alone.
    `reshard_after_forward=False` keeps the gathered copies that backward needs until backward,
    instead of gathering them again there (more memory, one all-gather less per step)."""
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
    module._fsdp_regather = reshard_after_forward
    module.register_forward_pre_hook(_gather)
    module.register_forward_hook(_reshard)   # the Parameters go back either way: optimizers hold them
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
    """Put each managed parameter's gathered copy in its place: one gather per group of
    parameters that share a mesh, fsdp dim, dtype and requires_grad."""
    groups, copies = {}, {}
    for owner, name, dim in module._fsdp_managed:
        sharded = owner._parameters[name]
        module._fsdp_gathered[(id(owner), name)] = sharded
        if id(sharded) in copies:
            continue
        if _nested(sharded.placements, dim):   # (a 1-D tp-sharded bias) an ordinary redistribute
            placements = list(sharded.placements)
            placements[dim] = Replicate()
            copies[id(sharded)] = sharded.redistribute(placements=placements)
            continue
        group = groups.setdefault((sharded.device_mesh, dim, sharded.dtype, sharded.requires_grad), {})
        group[id(sharded)] = sharded   # a tied Parameter is gathered once
    for (mesh, dim, _, _), members in groups.items():
        gathered = gather_group(list(members.values()), mesh, dim, module._fsdp_regather)
        copies.update(zip(members, gathered))
    for owner, name, _ in module._fsdp_managed:   # forward reads the gathered copies (plain DTensors)
        owner._parameters[name] = copies[id(module._fsdp_gathered[(id(owner), name)])]


def _nested(placements, mesh_dim: int) -> bool:
    """Whether another mesh dim shards the tensor dim the fsdp dim does (a tensor with no free
    dim, _free_tensor_dim): its gather is not one all-gather of the local blocks."""
    dim = placements[mesh_dim].dim
    return any(isinstance(p, Shard) and p.dim == dim for m, p in enumerate(placements) if m != mesh_dim)


def gather_group(shards: list, mesh, mesh_dim: int, regather: bool = True) -> list:
    """`shards` (each Shard(d) on `mesh_dim` of `mesh`, one dtype) gathered on that mesh dim by
    one RunOp of the grouped kernel (runtime/fsdp_gather.py); recorded for backward like any op."""
    controller = session.controller()
    if controller.capture is not None:
        note_capture_inputs(tuple(shards), {})
    refs, specs, blocks, dims = [], [], [], []
    for shard in shards:
        refs.append(controller.reference(shard))
        placements = list(shard.placements)
        dims.append(placements[mesh_dim].dim)
        placements[mesh_dim] = Replicate()
        specs.append(tensor_meta(shard.shape, shard.dtype, mesh, placements))
        blocks.append(ShardRegion(tuple(shard.shape), placements))
    nodes = tuple(shard._node for shard in shards if shard._node is not None) if is_grad_enabled() else ()
    kwargs = {"peers": PeerGroup(mesh_dim), "blocks": blocks, "dims": dims, "dtype": shards[0].dtype,
              "device": mesh.device_type, "regather": regather}
    out_ids = controller.new_ids(len(shards))
    seq = controller.submit(RunOp, out_ids, controller.define_mesh(mesh), "fully_shard (all-gather)", "fsdp_all_gather",
                            tuple(refs), kwargs, (), bool(nodes))
    gathered = [DTensor(out_id, spec, seq, controller) for out_id, spec in zip(out_ids, specs)]
    if nodes:
        record_op(nodes, gathered, mesh)
    return gathered


def _reshard(module: Module, args, output):
    for owner, name, _ in module._fsdp_managed:
        sharded = module._fsdp_gathered.pop((id(owner), name), None)
        if sharded is not None:
            owner._parameters[name] = sharded
