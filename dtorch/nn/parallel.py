"""parallelize_module and its styles, as torch.distributed.tensor.parallel spells them, for dtorch
modules (a torch model of the user's own is made one first: dtorch/nn/distribute.py). A style
works on ONE mesh dim of the module's mesh (the tensor-parallel one): it redistributes the
module's parameters there and installs forward hooks that move the inputs and outputs there.
Other mesh dims (dp, ...) keep their placements.

    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    parallelize_module(model, mesh, {"layers.*.attn.q_proj": ColwiseParallel(),
                                     "layers.*.attn.o_proj": RowwiseParallel()}, tp_dim="tp")

torch users pass the tp sub-mesh, `mesh["tp"]`; dtorch accepts that too and maps it back to the
module's mesh dim of that name. Plan keys match module names one dotted atom at a time with
fnmatch ("layers.*.mlp" matches "layers.3.mlp", never "layers.3.x.mlp"); a key that matches no
module raises instead of being ignored. `use_local_output` is accepted and has no effect: a
single controller has no local tensors to hand back.
"""
from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import torch

from ..distributed_spec import DeviceMesh, Placement, Replicate, Shard
from ..errors import MeshError
from ..tensor import DTensor
from ._layout import move_mesh_dim
from .distribute import distribute_module, holds_local_tensors
from .embedding import Embedding
from .linear import Linear
from .module import Module
from .parameter import Parameter

__all__ = ["parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput"]


def _on(tensor, mesh_dim: int, placement: Placement | None):
    """Move `tensor` to `placement` on `mesh_dim`; Shard(-1) counts from the tensor's own dims."""
    if placement is not None and isinstance(tensor, DTensor) and isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim % tensor.ndim)
    return move_mesh_dim(tensor, mesh_dim, placement)


def _shard_parameter(module: torch.nn.Module, name: str, mesh_dim: int, placement: Placement) -> None:
    param = module._parameters.get(name)
    if param is not None:
        moved = _on(param, mesh_dim, placement)
        if moved is not param:
            module._parameters[name] = Parameter(moved, param.requires_grad)


class ParallelStyle:
    """How one module is parallelized over one mesh dim: `apply(module, mesh_dim)`."""

    def apply(self, module: torch.nn.Module, mesh_dim: int) -> None:
        raise NotImplementedError

    @staticmethod
    def move_inputs(module, mesh_dim: int, placements: Sequence[Placement | None]) -> None:
        def hook(_module, args):
            return tuple(_on(a, mesh_dim, p) for a, p in zip(args, placements)) + tuple(args[len(placements):])
        module.register_forward_pre_hook(hook)

    @staticmethod
    def move_output(module, mesh_dim: int, placement: Placement | None) -> None:
        if placement is not None:
            module.register_forward_hook(lambda _module, _args, output: _on(output, mesh_dim, placement))


def _needs(module, kinds: tuple, style: str) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(sorted({k.__name__ for k in kinds}))
        raise TypeError(f"{style} applies to {names} modules (dtorch.nn's or torch.nn's), not {type(module).__name__}")


class _TensorParallel(ParallelStyle):
    """Colwise and Rowwise are data: the placement of each parameter on the tp mesh dim, the input
    placement forward needs, per module kind; and the default output placement."""
    LINEAR: dict = {}
    EMBEDDING: dict = {}
    INPUT: dict = {}          # module kind -> the input's placement on tp
    OUTPUT: Placement = Replicate()

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        self.input_layouts, self.output_layouts = input_layouts, output_layouts

    def apply(self, module, mesh_dim: int) -> None:
        # torch's own layers too, once distribute_module has made them dtorch modules
        _needs(module, (Linear, Embedding, torch.nn.Linear, torch.nn.Embedding), type(self).__name__)
        kind = Linear if isinstance(module, (Linear, torch.nn.Linear)) else Embedding
        for name, placement in (self.LINEAR if kind is Linear else self.EMBEDDING).items():
            _shard_parameter(module, name, mesh_dim, placement)
        self.move_inputs(module, mesh_dim, [self.INPUT[kind]])
        self.move_output(module, mesh_dim, self.output_layouts or self.OUTPUT)


class ColwiseParallel(_TensorParallel):
    """Linear: weight and bias S(0); Embedding: weight S(1). Input R, output S(-1) (or output_layouts)."""
    LINEAR, EMBEDDING = {"weight": Shard(0), "bias": Shard(0)}, {"weight": Shard(1)}
    INPUT, OUTPUT = {Linear: Replicate(), Embedding: Replicate()}, Shard(-1)


class RowwiseParallel(_TensorParallel):
    """Linear: weight S(1), bias R, input S(-1); Embedding: weight S(0), input R. Output R (the
    partial sums all-reduced) or output_layouts (Shard(1) for sequence parallel: a reduce-scatter)."""
    LINEAR, EMBEDDING = {"weight": Shard(1), "bias": Replicate()}, {"weight": Shard(0)}
    INPUT, OUTPUT = {Linear: Shard(-1), Embedding: Replicate()}, Replicate()


class SequenceParallel(ParallelStyle):
    """Norms and dropout on a sequence-sharded activation: parameters R, input and output S(sequence_dim)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim

    def apply(self, module, mesh_dim: int) -> None:
        for name in list(module._parameters):
            _shard_parameter(module, name, mesh_dim, Replicate())
        self.move_inputs(module, mesh_dim, [Shard(self.sequence_dim)])
        self.move_output(module, mesh_dim, Shard(self.sequence_dim))


class PrepareModuleInput(ParallelStyle):
    """Move positional (and keyword) inputs to `desired_input_layouts` on the mesh dim; None skips one.
    `input_layouts` is accepted for torch's signature: a DTensor already knows its placements."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        self.desired = _as_list(desired_input_layouts)
        self.desired_kwargs = dict(desired_input_kwarg_layouts or {})

    def apply(self, module, mesh_dim: int) -> None:
        desired, desired_kwargs = self.desired, self.desired_kwargs

        def hook(_module, args, kwargs):
            args = tuple(_on(a, mesh_dim, p) for a, p in zip(args, desired)) + tuple(args[len(desired):])
            kwargs = {k: _on(v, mesh_dim, desired_kwargs.get(k)) for k, v in kwargs.items()}
            return args, kwargs
        module.register_forward_pre_hook(hook, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Move the output (or each output of a tuple) to `desired_output_layouts` on the mesh dim."""

    def __init__(self, *, output_layouts=None, desired_output_layouts=None, use_local_output: bool = True):
        self.desired = desired_output_layouts

    def apply(self, module, mesh_dim: int) -> None:
        desired = self.desired

        def hook(_module, _args, output):
            if isinstance(output, (tuple, list)):
                return type(output)(_on(o, mesh_dim, p) for o, p in zip(output, _as_list(desired)))
            return _on(output, mesh_dim, desired[0] if isinstance(desired, (tuple, list)) else desired)
        module.register_forward_hook(hook)


def _as_list(layouts) -> list:
    if layouts is None:
        return []
    return list(layouts) if isinstance(layouts, (tuple, list)) else [layouts]


def parallelize_module(module: Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None, *,
                       tp_dim: int | str | None = None) -> Module:
    """Apply `parallelize_plan` (one style for `module` itself, or {name pattern: style}) over
    the tensor-parallel mesh dim; returns `module` (parallelized in place, as torch does)."""
    if parallelize_plan is None:
        return module
    if holds_local_tensors(module):   # a torch model of the user's own: onto the mesh first, Replicate
        if device_mesh is None:
            raise MeshError("parallelize_module: the module's weights are torch tensors in this process; pass "
                            "device_mesh= (the whole mesh, with tp_dim=, to keep the other dims' workers)")
        distribute_module(module, device_mesh)
    mesh_dim = _resolve_mesh_dim(module, device_mesh, tp_dim)
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.apply(module, mesh_dim)
        return module
    names = dict(module.named_modules())
    for pattern, style in parallelize_plan.items():
        matched = [name for name in names if _matches(pattern, name)]
        if not matched:
            near = ", ".join(sorted(n for n in names if n)[:8])
            raise ValueError(f"parallelize_module: plan key {pattern!r} matches no submodule; names look like: {near}")
        for name in matched:
            style.apply(names[name], mesh_dim)
    return module


def _matches(pattern: str, name: str) -> bool:
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))


def _resolve_mesh_dim(module: Module, device_mesh: DeviceMesh | None, tp_dim) -> int:
    """The module's mesh dim to parallelize over. `device_mesh` may be the module's own mesh
    (then tp_dim, the only dim, or the dim named "tp") or torch's `mesh["tp"]` sub-mesh."""
    own = module.device_mesh if isinstance(module, Module) else None
    mesh = own or device_mesh
    if mesh is None:
        raise MeshError("parallelize_module: the module has no parameters and no device_mesh was given")
    if device_mesh is not None and own is not None and device_mesh != own:
        names = device_mesh.mesh_dim_names or ()
        if device_mesh.ndim == 1 and names and own.mesh_dim_names and names[0] in own.mesh_dim_names:
            tp_dim = names[0] if tp_dim is None else tp_dim
        else:
            raise MeshError(f"parallelize_module: the module lives on {own}, not on {device_mesh}; pass its "
                            "mesh (with tp_dim=) or a named 1-D sub-mesh of it such as mesh['tp']")
    if tp_dim is not None:
        return mesh.dim_index(tp_dim)
    if mesh.ndim == 1:
        return 0
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return mesh.mesh_dim_names.index("tp")
    raise MeshError(f"parallelize_module: {mesh} has several dims; say which with tp_dim= (a name or an index)")
