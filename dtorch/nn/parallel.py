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

torch's own style objects (torch.distributed.tensor.parallel.ColwiseParallel() ...) are accepted
wherever dtorch's are: each is read through its public attributes into dtorch's style of the same
name (`from_torch_style`), and torch's placements become dtorch's. Colwise and Rowwise also take
transformers' Conv1D (GPT-2's projections), which torch refuses: a Linear whose weight is stored
transposed, (in, out).
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping, Sequence

import torch

from ..spec.placements import DeviceMesh, Partial, Placement, Replicate, Shard
from ..errors import MeshError, PlacementError
from ..dtensor.tensor import DTensor
from ._layout import move_mesh_dim
from .distribute import distribute_module, holds_local_tensors
from .embedding import Embedding
from .linear import Linear
from .module import Module
from .parameter import Parameter

__all__ = ["parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "from_torch_style",
           "loss_parallel"]


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
            return tuple([_on(a, mesh_dim, p) for a, p in zip(args, placements)]) + tuple(args[len(placements):])
        module.register_forward_pre_hook(hook)

    @staticmethod
    def move_output(module, mesh_dim: int, placement: Placement | None) -> None:
        if placement is not None:
            module.register_forward_hook(lambda _module, _args, output: _on(output, mesh_dim, placement))


def _is_conv1d(module) -> bool:
    """transformers' Conv1D: y = x @ W + b with W (in, out) and `nf` outputs. Known by its class
    name and shape, so dtorch never imports transformers."""
    weight = module._parameters.get("weight")
    return (any(c.__name__ == "Conv1D" for c in type(module).__mro__) and isinstance(getattr(module, "nf", None), int)
            and weight is not None and weight.ndim == 2 and weight.shape[1] == module.nf)


def _kind(module, style: str) -> str:
    """Which table of a tensor-parallel style applies: 'linear', 'conv1d' or 'embedding'."""
    if isinstance(module, (Linear, torch.nn.Linear)):   # torch's own too, made dtorch modules first
        return "linear"
    if isinstance(module, (Embedding, torch.nn.Embedding)):
        return "embedding"
    if _is_conv1d(module):
        return "conv1d"
    raise TypeError(f"{style} applies to Embedding or Linear modules (dtorch.nn's or torch.nn's) or transformers' "
                    f"Conv1D, not {type(module).__name__}; for another module write a PrepareModuleInput/Output "
                    "plan, or lay out its parameters with distribute_module(model, mesh, partition_fn)")


class _TensorParallel(ParallelStyle):
    """Colwise and Rowwise are data: per module kind, the placement of each parameter on the tp
    mesh dim and the input placement forward needs; and the default output placement."""
    PARAMETERS: dict = {}     # kind -> {parameter name: placement on tp}
    INPUT: dict = {}          # kind -> the input's placement on tp
    OUTPUT: Placement = Replicate()

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        self.input_layouts, self.output_layouts = _placement(input_layouts), _placement(output_layouts)

    def apply(self, module, mesh_dim: int) -> None:
        kind = _kind(module, type(self).__name__)
        for name, placement in self.PARAMETERS[kind].items():
            _shard_parameter(module, name, mesh_dim, placement)
        self.move_inputs(module, mesh_dim, [self.INPUT[kind]])
        self.move_output(module, mesh_dim, self.output_layouts or self.OUTPUT)


class ColwiseParallel(_TensorParallel):
    """The output features split: Linear W (out, in) and b S(0); Conv1D W (in, out) S(1), b S(0);
    Embedding W S(1). Input R, output S(-1) (or output_layouts)."""
    PARAMETERS = {"linear": {"weight": Shard(0), "bias": Shard(0)},
                  "conv1d": {"weight": Shard(1), "bias": Shard(0)},
                  "embedding": {"weight": Shard(1)}}
    INPUT, OUTPUT = {"linear": Replicate(), "conv1d": Replicate(), "embedding": Replicate()}, Shard(-1)


class RowwiseParallel(_TensorParallel):
    """The input features split: Linear W S(1), Conv1D W S(0), bias R, input S(-1); Embedding W S(0),
    input R. Output R (the partial sums all-reduced) or output_layouts (Shard(1) for sequence
    parallel: a reduce-scatter)."""
    PARAMETERS = {"linear": {"weight": Shard(1), "bias": Replicate()},
                  "conv1d": {"weight": Shard(0), "bias": Replicate()},
                  "embedding": {"weight": Shard(0)}}
    INPUT, OUTPUT = {"linear": Shard(-1), "conv1d": Shard(-1), "embedding": Replicate()}, Replicate()


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
        self.desired = [_placement(p) for p in _as_list(desired_input_layouts)]
        self.desired_kwargs = {k: _placement(p) for k, p in (desired_input_kwarg_layouts or {}).items()}

    def apply(self, module, mesh_dim: int) -> None:
        desired, desired_kwargs = self.desired, self.desired_kwargs

        def hook(_module, args, kwargs):
            args = tuple([_on(a, mesh_dim, p) for a, p in zip(args, desired)]) + tuple(args[len(desired):])
            kwargs = {k: _on(v, mesh_dim, desired_kwargs.get(k)) for k, v in kwargs.items()}
            return args, kwargs
        module.register_forward_pre_hook(hook, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Move the output (or each output of a tuple) to `desired_output_layouts` on the mesh dim."""

    def __init__(self, *, output_layouts=None, desired_output_layouts=None, use_local_output: bool = True):
        self.desired = [_placement(p) for p in _as_list(desired_output_layouts)]

    def apply(self, module, mesh_dim: int) -> None:
        desired = self.desired

        def hook(_module, _args, output):
            if isinstance(output, (tuple, list)):
                return type(output)([_on(o, mesh_dim, p) for o, p in zip(output, desired)])
            return _on(output, mesh_dim, desired[0] if desired else None)
        module.register_forward_hook(hook)


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module, with both signatures' arguments."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts=None,
                 desired_output_layouts=None, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            desired_input_layouts=desired_input_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts)
        self.prepare_module_output = PrepareModuleOutput(desired_output_layouts=desired_output_layouts)

    def apply(self, module, mesh_dim: int) -> None:
        self.prepare_module_input.apply(module, mesh_dim)
        self.prepare_module_output.apply(module, mesh_dim)


def _as_list(layouts) -> list:
    if layouts is None:
        return []
    return list(layouts) if isinstance(layouts, (tuple, list)) else [layouts]


# --- torch's vocabulary ------------------------------------------------------------------------
_TORCH_PLACEMENTS = {"Shard": lambda p: Shard(p.dim), "Replicate": lambda p: Replicate(),
                     "Partial": lambda p: Partial(p.reduce_op)}


def _placement(placement):
    """dtorch's placement for torch's (torch.distributed.tensor's Shard, Replicate, Partial);
    dtorch's own and None pass as they are."""
    if placement is None or isinstance(placement, Placement):
        return placement
    name = type(placement).__name__
    if type(placement).__module__.startswith("torch.distributed") and name in _TORCH_PLACEMENTS:
        return _TORCH_PLACEMENTS[name](placement)
    raise PlacementError(f"parallel style layout {placement!r} ({type(placement).__module__}.{name}): a style takes "
                         "Shard(d), Replicate() or Partial() (dtorch's, or torch.distributed.tensor's), or None")


def _first(layouts):
    return layouts[0] if isinstance(layouts, (tuple, list)) else layouts


# torch style class -> the dtorch style made from its public attributes (torch keeps layouts as tuples)
_TORCH_STYLES = {
    "ColwiseParallel": lambda s: ColwiseParallel(input_layouts=_first(s.input_layouts),
                                                 output_layouts=_first(s.output_layouts)),
    "RowwiseParallel": lambda s: RowwiseParallel(input_layouts=_first(s.input_layouts),
                                                 output_layouts=_first(s.output_layouts)),
    "SequenceParallel": lambda s: SequenceParallel(sequence_dim=_first(s.sequence_sharding).dim),
    "PrepareModuleInput": lambda s: PrepareModuleInput(
        desired_input_layouts=s.desired_input_layouts, desired_input_kwarg_layouts=s.desired_input_kwarg_layouts),
    "PrepareModuleOutput": lambda s: PrepareModuleOutput(desired_output_layouts=s.desired_output_layouts),
    "PrepareModuleInputOutput": lambda s: _both(from_torch_style(s.prepare_module_input),
                                                from_torch_style(s.prepare_module_output)),
}


def _both(prepare_input: PrepareModuleInput, prepare_output: PrepareModuleOutput) -> PrepareModuleInputOutput:
    both = PrepareModuleInputOutput()
    both.prepare_module_input, both.prepare_module_output = prepare_input, prepare_output
    return both


def from_torch_style(style) -> ParallelStyle:
    """The dtorch style for `style`: dtorch's own as it is, torch's (torch.distributed.tensor.
    parallel's, or a subclass that keeps its `_apply`) read through its public attributes.
    A torch style with an `_apply` of its own runs torch's per-rank code, and is refused."""
    if isinstance(style, ParallelStyle):
        return style
    for cls in type(style).__mro__:
        if cls.__module__.startswith("torch.distributed.tensor.parallel") and cls.__name__ in _TORCH_STYLES:
            if type(style)._apply is not cls._apply:
                break
            return _TORCH_STYLES[cls.__name__](style)
    raise TypeError(f"parallelize_module: {type(style).__module__}.{type(style).__name__} is not a style dtorch "
                    "can run: it takes dtorch.nn's styles (a ParallelStyle with apply(module, mesh_dim)) and torch's "
                    f"{', '.join(_TORCH_STYLES)} as torch defines them; a torch style with its own _apply runs "
                    "per-rank code: write it as a dtorch.nn.ParallelStyle subclass")


@contextlib.contextmanager
def loss_parallel():
    """torch's `loss_parallel()` context, here a no-op: dtorch's F.cross_entropy and F.nll_loss on
    class-sharded logits never gather the classes, inside this context or outside it
    (docs/design/models.md, "Losses"). torch's own loss_parallel() is accepted as well."""
    yield


def parallelize_module(module: Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None, *,
                       tp_dim: int | str | None = None, src_data_rank: int | None = 0) -> Module:
    """Apply `parallelize_plan` (one style for `module` itself, or {name pattern: style}; dtorch's
    styles or torch's) over the tensor-parallel mesh dim; returns `module` (parallelized in place,
    as torch does). `src_data_rank` is accepted for torch's signature: the controller uploads."""
    if parallelize_plan is None:
        return module
    plan = parallelize_plan if isinstance(parallelize_plan, Mapping) else {"": parallelize_plan}
    names = dict(module.named_modules())
    steps = [(from_torch_style(style), _matched(pattern, names)) for pattern, style in plan.items()]  # checked first
    if holds_local_tensors(module):   # a torch model of the user's own: onto the mesh first, Replicate
        if device_mesh is None:
            raise MeshError("parallelize_module: the module's weights are torch tensors in this process; pass "
                            "device_mesh= (the whole mesh, with tp_dim=, to keep the other dims' workers)")
        distribute_module(module, device_mesh)
    mesh_dim = _resolve_mesh_dim(module, device_mesh, tp_dim)
    for style, matched in steps:
        for name in matched:
            style.apply(names[name], mesh_dim)
    return module


def _matched(pattern: str, names: dict) -> list[str]:
    matched = [name for name in names if _matches(pattern, name)]
    if not matched:
        near = ", ".join(sorted(n for n in names if n)[:8])
        raise ValueError(f"parallelize_module: plan key {pattern!r} matches no submodule; names look like: {near}")
    return matched


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
