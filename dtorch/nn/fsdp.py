"""fully_shard: FSDP2's fully_shard for dtorch modules.

Each parameter a fully-sharded module manages is kept sharded over one mesh dim ("fsdp"): on
dim 0, or on the first dim the other mesh dims (tp) leave whole. The module's forward runs on
gathered copies: a pre-forward hook gathers every managed parameter and puts the copy in its
place, a forward hook puts the sharded Parameter back and drops the copy.

The gather is ONE command and one all-gather per module (per mesh and dtype among its
parameters: runtime/worker/fsdp_gather.py), as FSDP2 gathers a module's parameters into one flat buffer,
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

import contextlib
import weakref

from ..spec.placements import PeerGroup, Replicate, Shard, ShardRegion
from ..errors import MeshError, user_site
from ..ops.tensor_meta import tensor_meta
from ..dtensor.recording import OpNode, is_grad_enabled
from ..runtime.controller import profiling, session
from ..runtime.protocol import RunOp
from ..dtensor.op_issue import note_capture_inputs
from ..dtensor.tensor import DTensor
from .mixed_precision import cast_floating, check_policy, compute_dtype, reduce_dtype_of
from .module import Module
from .parameter import Parameter
from . import fsdp_prefetch as prefetch

__all__ = ["fully_shard", "is_fully_sharded", "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"]

set_modules_to_forward_prefetch = prefetch.set_modules_to_forward_prefetch
set_modules_to_backward_prefetch = prefetch.set_modules_to_backward_prefetch


def fully_shard(module: Module, mesh_dim: str | int = "fsdp", *, reshard_after_forward: bool = True,
                mp_policy=None) -> Module:
    """Shard `module`'s parameters over `mesh_dim` and gather them around its forward. Returns the
    module. A parameter whose mesh lacks `mesh_dim` (another pipeline stage) is left alone.
    `reshard_after_forward=False` keeps the gathered copies that backward needs until backward,
    instead of gathering them again there (more memory, one all-gather less per step).
    `mp_policy`: FSDP2's MixedPrecisionPolicy (dtorch.nn.MixedPrecisionPolicy, or torch's own):
    floating-point parameters are gathered in `param_dtype` (the cast rides in the gather's copy,
    so the all-gather moves half the bytes for bfloat16), gradients reduce-scattered in
    `reduce_dtype` (default: `param_dtype`) and kept in the parameter's dtype; floating-point
    inputs cast to `param_dtype` (`cast_forward_inputs`), outputs to `output_dtype` if set."""
    policy = check_policy(mp_policy)
    managed, whole, sharded = [], [], {}   # (by id: a tied Parameter is sharded once and stays tied)
    lacking, found = set(), False   # the meshes without `mesh_dim`; whether any parameter had it
    for owner, name, param in _unmanaged(module):
        mesh = param.device_mesh
        if mesh_dim not in (mesh.mesh_dim_names or ()) and not isinstance(mesh_dim, int):
            lacking.add(mesh)
            continue
        found = True
        dim = mesh.dim_index(mesh_dim)
        if id(param) not in sharded:
            if mesh.shape[dim] == 1 or param.ndim == 0:   # (a 0-D parameter, a learnable scale: no dim to shard)
                whole.append((owner, name))   # not sharded, but cast by a policy all the same
                continue
            if param.placements[dim] != Replicate():
                continue
            sharded[id(param)] = _shard_once(param, dim)
        owner._parameters[name] = sharded[id(param)]
        managed.append((owner, name, dim))
    if lacking and not found:
        raise MeshError(f"fully_shard at {user_site()}: no parameter of {type(module).__name__} is on a mesh with a "
                        f"dim named {mesh_dim!r} (their meshes: {', '.join(map(repr, lacking))}); pass one of "
                        "their dim names")
    module._fsdp_managed, module._fsdp_whole = managed, whole
    module._fsdp_gathered = {}   # (id(owner), name) -> (owner, name, the Parameter), while forward runs
    module._fsdp_regather, module._fsdp_policy = reshard_after_forward, policy
    module._fsdp_prefetched = {}   # group key -> (the begun all-gather's buffer, its members' ids): prefetch.py
    module._fsdp_forward_prefetch = None   # set_modules_to_forward_prefetch's list; None: the learned order
    module._fsdp_backward_prefetch = True   # set_modules_to_backward_prefetch: begin the previous group's regather
    module.register_forward_pre_hook(_gather)
    if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
        module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    # the Parameters go back even when forward raises: optimizers and state_dict hold them
    module.register_forward_hook(_reshard, always_call=True)
    return module


def is_fully_sharded(module: Module) -> bool:
    return hasattr(module, "_fsdp_managed")


# Each Parameter an earlier fully_shard call replaced, by id, with its sharded Parameter: a
# Parameter two separately sharded modules share (b.weight = a.weight, then fully_shard(a) and
# fully_shard(b)) must become ONE sharded Parameter, or the tie silently breaks (two parameters,
# each with a part of the gradient). The weak reference drops the entry with the original.
_SHARDED_BEFORE: dict[int, tuple] = {}


def _shard_once(param: Parameter, dim: int) -> Parameter:
    """`param` as a Parameter sharded over mesh dim `dim`: the one made the first time."""
    known = _SHARDED_BEFORE.get(id(param))
    if known is not None and known[0]() is param:
        earlier = known[1]
        if not isinstance(earlier.placements[dim], Shard):
            raise MeshError(f"fully_shard at {user_site()}: a parameter shared with a module fully_shard'ed "
                            f"earlier is sharded over another mesh dim there ({earlier.placements}); shard "
                            "the modules that share it over the same dim, or shard their common parent")
        return earlier
    placements = list(param.placements)
    placements[dim] = Shard(_free_tensor_dim(param, dim))
    made = Parameter(param.redistribute(placements=placements), param.requires_grad)
    key = id(param)
    _SHARDED_BEFORE[key] = (weakref.ref(param, lambda _: _SHARDED_BEFORE.pop(key, None)), made)
    return made


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


# --- the hooks around forward -------------------------------------------------------------------------
def _gather(module: Module, args):
    """Put each managed parameter's gathered copy in its place: one gather per group of
    parameters that share a mesh, fsdp dim, dtype and requires_grad (its all-gather begun
    earlier where a prefetch did, prefetch.py); then begin the next module's."""
    root = prefetch.entering(module)
    policy = module._fsdp_policy
    groups, copies = {}, {}
    for owner, name, dim in module._fsdp_managed:
        sharded = owner._parameters[name]
        module._fsdp_gathered[(id(owner), name)] = (owner, name, sharded)
        if id(sharded) in copies:
            continue
        if _nested(sharded.placements, dim):   # (a 1-D tp-sharded bias) an ordinary redistribute
            copies[id(sharded)] = _gather_alone(sharded, dim, policy)
            continue
        group = groups.setdefault((sharded.device_mesh, dim, sharded.dtype, sharded.requires_grad), {})
        group[id(sharded)] = sharded   # a tied Parameter is gathered once
    begun, module._fsdp_prefetched = ({} if module._fsdp_in_region else module._fsdp_prefetched), {}
    for key, members in groups.items():
        mesh, dim, dtype, _ = key
        started = begun.get(key)
        regather = (module._fsdp_regather, module._fsdp_backward_prefetch)
        gathered = gather_group(list(members.values()), mesh, dim, regather,
                                compute_dtype(policy, dtype), reduce_dtype_of(policy, dtype),
                                started[0] if started is not None and started[1] == tuple(members) else None)
        copies.update(zip(members, gathered))
    for owner, name, _ in module._fsdp_managed:   # forward reads the gathered copies (plain DTensors)
        owner._parameters[name] = copies[id(module._fsdp_gathered[(id(owner), name)][2])]
    for owner, name in module._fsdp_whole:   # parameters left whole: only the policy's cast
        param = owner._parameters[name]
        if compute_dtype(policy, param.dtype) != param.dtype:
            module._fsdp_gathered[(id(owner), name)] = (owner, name, param)
            if id(param) not in copies:   # (a tied one is cast once)
                copies[id(param)] = param.to(compute_dtype(policy, param.dtype))
            owner._parameters[name] = copies[id(param)]
    for target in prefetch.targets(module, root):
        _begin_gather(target)
        root._fsdp_begun_now.append(target)


def _begin_gather(module: Module) -> None:
    """Begin the all-gather of each of `module`'s groups now; its own forward finishes them."""
    policy = module._fsdp_policy
    for key, members in param_groups(module).items():
        mesh, dim, dtype, _ = key
        handle = start_group(list(members.values()), mesh, dim, compute_dtype(policy, dtype))
        module._fsdp_prefetched[key] = (handle, tuple(members))


def param_groups(module: Module) -> dict:
    """{(mesh, fsdp dim, dtype, requires_grad): {id: sharded Parameter}}: what each of the
    module's grouped all-gathers gathers (a parameter _nested leaves out is redistributed alone)."""
    groups: dict = {}
    for owner, name, dim in module._fsdp_managed:
        sharded = owner._parameters[name]
        if not _nested(sharded.placements, dim):
            key = (sharded.device_mesh, dim, sharded.dtype, sharded.requires_grad)
            groups.setdefault(key, {})[id(sharded)] = sharded
    return groups


def _gather_alone(sharded, dim: int, policy):
    """An ordinary redistribute between casts to the policy's reduce dtype (the gradient's
    reduce-scatter runs in it) and its compute dtype; a cast to the same dtype is no op."""
    placements = list(sharded.placements)
    placements[dim] = Replicate()
    reduced_as = sharded.to(reduce_dtype_of(policy, sharded.dtype))
    return reduced_as.redistribute(placements=placements).to(compute_dtype(policy, sharded.dtype))


def _cast_inputs(module: Module, args, kwargs):
    """FSDP2's cast_forward_inputs: every floating-point tensor among the arguments, at any depth."""
    dtype = module._fsdp_policy.param_dtype
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)


def _reshard(module: Module, args, output):
    prefetch.leaving(module)
    for owner, name, param in module._fsdp_gathered.values():
        owner._parameters[name] = param
    module._fsdp_gathered.clear()
    output_dtype = getattr(module._fsdp_policy, "output_dtype", None)
    return None if output_dtype is None or output is None else cast_floating(output, output_dtype)


# --- the grouped gather -------------------------------------------------------------------------------
def _nested(placements, mesh_dim: int) -> bool:
    """Whether another mesh dim shards the tensor dim the fsdp dim does (a tensor with no free
    dim, _free_tensor_dim): its gather is not one all-gather of the local blocks."""
    dim = placements[mesh_dim].dim
    return any(isinstance(p, Shard) and p.dim == dim for m, p in enumerate(placements) if m != mesh_dim)


def gather_group(shards: list, mesh, mesh_dim: int, regather, dtype, reduce_dtype, started=None) -> list:
    """`shards` (each Shard(d) on `mesh_dim` of `mesh`, one dtype) gathered on that mesh dim by
    one RunOp of the grouped kernel (runtime/worker/fsdp_gather.py), as `dtype`; recorded for backward
    like any op, the gradients' reduce-scatter in `reduce_dtype`. `regather`: whether backward
    gathers again (or a pair: that, and whether that gather begins the previous group's, backward
    prefetch). `started`: start_group's handle when a prefetch began this all-gather already."""
    with _span(_GATHER):
        return _issue_gather(shards, mesh, mesh_dim, regather, dtype, reduce_dtype, started)


def start_group(shards: list, mesh, mesh_dim: int, dtype) -> DTensor:
    """Begin the all-gather gather_group would run (forward prefetch): a handle to the buffer it
    fills, for gather_group(started=) to finish. The handle is the runtime's, never the user's:
    its shape is what the buffer would hold on a mesh of the fsdp dim alone, since a tp-sharded
    member's block differs between ranks (nothing reads the handle but the group's gather)."""
    with _span(_PREFETCH):
        controller = session.controller()
        if controller.tap is not None:
            note_capture_inputs(tuple(shards), {})
        refs, _, kwargs = _gather_arguments(controller, shards, mesh, mesh_dim, dtype)
        (out_id,) = controller.new_ids(1)
        seq = controller.submit(RunOp, (out_id,), controller.define_mesh(mesh), _PREFETCH, "fsdp_start_gather",
                                tuple(refs), kwargs, (), False)
        length = sum(shard.numel() for shard in shards)
        return DTensor(out_id, tensor_meta((length,), dtype, mesh, [Replicate()] * mesh.ndim), seq, controller)


_GATHER = "fully_shard (all-gather)"   # the op errors and profiles name
_PREFETCH = "fully_shard (prefetched all-gather)"


def _span(name: str):
    """dtorch.profile's span for the command (a span like an op's), or nothing."""
    recorder = profiling.active
    return recorder.user_span(name, "op") if recorder is not None else contextlib.nullcontext()


def _gather_arguments(controller, shards: list, mesh, mesh_dim: int, dtype):
    """The grouped kernels' input references, the gathered tensors' specs, and their keywords."""
    refs, specs, blocks, dims = [], [], [], []
    for shard in shards:
        refs.append(controller.reference(shard))
        placements = list(shard.placements)
        dims.append(placements[mesh_dim].dim)
        placements[mesh_dim] = Replicate()
        specs.append(tensor_meta(shard.shape, dtype, mesh, placements))
        blocks.append(ShardRegion(tuple(shard.shape), placements))
    kwargs = {"peers": PeerGroup(mesh_dim), "blocks": blocks, "dims": dims, "dtype": dtype,
              "device": mesh.device_type}
    return refs, specs, kwargs


def _issue_gather(shards: list, mesh, mesh_dim: int, regather, dtype, reduce_dtype, started) -> list:
    controller = session.controller()
    if controller.tap is not None:
        note_capture_inputs(tuple(shards), {})
    refs, specs, kwargs = _gather_arguments(controller, shards, mesh, mesh_dim, dtype)
    grad = is_grad_enabled() and shards[0]._node is not None   # (a group shares requires_grad)
    regather, backward_prefetch = regather if isinstance(regather, tuple) else (regather, True)
    kwargs["regather"] = regather
    if not backward_prefetch:
        kwargs["backward_prefetch"] = False
    if reduce_dtype != dtype:
        kwargs["reduce_dtype"] = reduce_dtype
    if started is not None:   # its buffer, the last input: the kernel finishes the all-gather
        refs.append(controller.reference(started))
        kwargs["prefetched"] = True
    out_ids = controller.new_ids(len(shards))
    seq = controller.submit(RunOp, out_ids, controller.define_mesh(mesh), _GATHER, "fsdp_all_gather",
                            tuple(refs), kwargs, (), grad)
    gathered = [DTensor(out_id, spec, seq, controller) for out_id, spec in zip(out_ids, specs)]
    if grad:   # a node each, as a redistribute's: backward reaches only the parameters forward used
        for shard, copy in zip(shards, gathered):
            copy._node = OpNode((shard._node,), mesh)
    return gathered
