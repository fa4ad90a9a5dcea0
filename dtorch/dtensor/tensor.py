"""DTensor: a symbol on the controller (id, global shape, dtype, mesh, placements) — no data.

Every op returns at once with a new symbol; only reads (fetch, to_torch, item, tolist) wait on
workers. When a symbol is garbage-collected its buffers are freed on the workers (batched).
An op's call becomes a command in dtorch/dtensor/op_issue.py (call_op, re-exported here).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ..spec.placements import (DeviceMesh, Partial, Placement, Placements, Replicate, format_placements,
                               local_offset, local_shape)
from ..errors import MeshError, UnsupportedOpError, user_site
from ..ops.unsupported import NOTES, is_inplace_name, unsupported_method, unsupported_op
from ..ops.conversions import device_refusal, mesh_device, to_target
from ..ops.tensor_meta import TensorMeta, check_placements, shape_argument, tensor_meta
from . import api
from .op_issue import (call_op, install_op_methods, land_for_backward, note_capture_inputs, set_tensor_type,
                       torch_function)
from ..spec.redistribute import plan_redistribute, step_kind
from ..runtime.controller import profiling
from . import frontend_state
from .recording import Leaf, OpNode, is_grad_enabled
from ..runtime.protocol import Redistribute, RequireGrad, Transfer, dtype_name
from .sync_debug import note_blocking_read

__all__ = ["DTensor", "call_op", "new_symbol", "refuse_the_rest"]


# Donation: at the top of a method called on a temporary (`(a @ b).redistribute(...)`), the
# only references to `self` are the call's own; a tensor that a name, a container or another
# frame holds counts more. Calibrated on the running interpreter; where it cannot tell the two
# apart (borrowed references), -1: never donate.
class _RefProbe:
    def count(self, device_mesh=None, placements=None) -> int:
        return sys.getrefcount(self)


def _temporary_refs() -> int:
    held = _RefProbe()
    temporary = _RefProbe().count()
    return temporary if held.count() > temporary else -1


_TEMPORARY_REFS = _temporary_refs()


# What every DTensor wraps, as torch's DTensor wraps a meta-device tensor: it makes
# isinstance(x, torch.Tensor) and torch.is_tensor(x) true, and holds nothing. Its shape, dtype and
# device are never read: DTensor's own properties answer, and torch's functions and the
# torch.Tensor methods DTensor does not define reach __torch_function__ first.
_WRAPPED = torch.empty((), device="meta")
_make_subclass = torch.Tensor._make_subclass


class DTensor(torch.Tensor):
    # _node: None, or what autograd knows of this tensor (dtorch/dtensor/recording.py). A torch.Tensor
    # already takes weak references (dtorch/dtensor/aliasing.py tracks views weakly).
    __slots__ = ("_id", "_meta", "_seq", "_controller", "_node")

    def __new__(cls, *args, **kwargs):
        return _make_subclass(cls, _WRAPPED)

    def __init__(self, tensor_id: int, spec: TensorMeta, seq: int, controller):
        self._id, self._meta, self._seq, self._controller = tensor_id, spec, seq, controller
        self._node = None

    def __del__(self):
        controller = self._controller
        if controller is not None:
            controller.release(self._id, self._meta.block_bytes)

    # --- what the symbol knows -----------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._meta.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self._meta.shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._meta.shape)

    def dim(self) -> int:
        return self.ndim

    ndimension = dim
    is_meta = is_nested = is_sparse = is_quantized = False   # (torch.nn.init and torch.nn layers ask)

    def numel(self) -> int:
        return self.shape.numel()

    def __iter__(self):
        """As torch: the sub-tensors along dim 0 (x.unbind(0)), each a DTensor."""
        if not self._meta.shape:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __dir__(self):
        return object.__dir__(self)

    def set_(self, *args, **kwargs):
        """Refused with what to write. Defined here, not left to __torch_function__: torch's own
        Tensor.set_ does not consult it, and would silently swap the wrapped meta tensor."""
        raise unsupported_method("set_")

    def __len__(self) -> int:
        if not self._meta.shape:
            raise TypeError("len() of a 0-d DTensor")
        return self._meta.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._meta.mesh

    @property
    def placements(self) -> Placements:
        """A tuple that also equals a list: x.placements == [Shard(0)]."""
        return Placements(self._meta.placements)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of the shard that worker `rank` holds."""
        return local_shape(self._meta.shape, self.device_mesh, self.placements, rank)

    def local_offset(self, rank: int) -> tuple[int, ...]:
        """Where the shard of worker `rank` starts in the global tensor."""
        return local_offset(self._meta.shape, self.device_mesh, self.placements, rank)

    def __repr__(self) -> str:
        mesh = self.device_mesh
        names = f" {list(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
        return (f"DTensor(shape={tuple(self._meta.shape)}, dtype={str(self.dtype)[6:]}, "
                f"mesh={mesh.device_type}{mesh.shape}{names}, placements={format_placements(self.placements)})")

    __hash__ = object.__hash__

    # --- autograd: what the symbol records (backward and .grad: dtorch/autograd/) -------------
    @property
    def requires_grad(self) -> bool:
        return self._node is not None

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    @property
    def is_leaf(self) -> bool:
        """As in torch: True unless an op recorded for backward made it."""
        return self._node is None or type(self._node) is Leaf

    @property
    def grad_fn(self):
        """The recorded node that made this tensor (dtorch/dtensor/recording.py), None for a leaf."""
        return None if self.is_leaf else self._node

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        """Make this tensor a leaf that gradients accumulate into (torch's rules: a leaf, of a
        floating-point dtype)."""
        if bool(requires_grad) == (self._node is not None):
            return self
        if not self.is_leaf:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you want to use a "
                               "computed variable in a subgraph that doesn't require differentiation use "
                               "var_no_grad = var.detach().")
        if requires_grad and not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise RuntimeError(f"only Tensors of floating point and complex dtype can require gradients, "
                               f"this one is {str(self.dtype)[6:]}")
        self._controller.submit(RequireGrad, (self._id,), bool(requires_grad))
        self._node = Leaf(self) if requires_grad else None
        return self

    # --- layout ----------------------------------------------------------------------------
    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None) -> DTensor:
        """The same logical tensor with new placements; collectives run worker-to-worker."""
        donate = sys.getrefcount(self) <= _TEMPORARY_REFS   # first: `(a @ b).redistribute(...)`
        recorder = profiling.active
        if recorder is not None:   # dtorch.profile: a span like an op's
            with recorder.user_span("redistribute", "op"):
                return self._redistribute(device_mesh, placements, donate)
        return self._redistribute(device_mesh, placements, donate)

    def _redistribute(self, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
                      donate: bool = False) -> DTensor:
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        placements = check_placements(placements if placements is not None else
                                      [Replicate()] * mesh.ndim, self.ndim, mesh)
        if mesh != self.device_mesh:
            return self._move_to(mesh, placements)
        if placements == self.placements:
            return self
        steps = tuple(plan_redistribute(self.placements, placements))
        spec = tensor_meta(self._meta.shape, self.dtype, mesh, placements)
        controller = self._controller
        controller.check_current(self)   # not a tensor that lived on a lost, since replaced, worker
        if controller.tap is not None:
            note_capture_inputs((self,), {})
        out_id = controller.new_id()
        grad = self._node is not None and is_grad_enabled()
        # a temporary's P -> R may reduce in place on the workers (kernels.apply_steps); never a
        # tensor autograd knows, whose value backward may still need
        donate = donate and self._node is None and any(step_kind(b, a) == "all_reduce" for _, b, a in steps)
        seq = controller.submit(Redistribute, out_id, self._id, controller.define_mesh(mesh), self._meta.shape,
                           dtype_name(self.dtype), self.placements, steps, grad, donate)
        moved = DTensor(out_id, spec, seq, controller)
        if grad:
            moved._node = OpNode((self._node,), mesh)
        return moved

    def _move_to(self, mesh: DeviceMesh, placements) -> DTensor:
        """To another mesh (a pipeline stage's sub-mesh, another shape, CPU <-> CUDA): reduce any
        Partial on this mesh, move blocks point-to-point, re-partialize locally on the target."""
        frontend_state.refuse_inside_checkpoint("a move to another mesh")
        source = self.reduce_partials()
        landing = tuple([Replicate() if p.is_partial() else p for p in placements])
        controller = self._controller
        controller.check_current(source)
        out_id = controller.new_id()
        seq = controller.submit(Transfer, out_id, source._id, controller.define_mesh(source.device_mesh),
                                controller.define_mesh(mesh), self._meta.shape, dtype_name(self.dtype),
                                source.placements, landing)
        moved = DTensor(out_id, tensor_meta(self._meta.shape, self.dtype, mesh, landing), seq, controller)
        if source._node is not None and is_grad_enabled():
            moved = land_for_backward(source, moved)
        return moved.redistribute(placements=placements)

    def reduce_partials(self) -> DTensor:
        """Partial dims reduced to Replicate (Shard dims kept): what a read needs."""
        if not any(isinstance(p, Partial) for p in self.placements):
            return self
        return self.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                             for p in self.placements])

    # --- reads: the only calls that wait on workers ------------------------------------------
    def fetch(self):
        """An awaitable future of the full logical tensor (also .result(timeout) / .done())."""
        readable = self.reduce_partials()
        return readable._controller.fetch(readable)

    def _blocking_read(self, what: str) -> torch.Tensor:
        """Every read that waits on the workers comes through here (set_sync_debug_mode's check)."""
        note_blocking_read(what, self._meta.shape)
        return self.fetch().result()

    def to_torch(self) -> torch.Tensor:
        """A blocking read of the whole logical tensor into this process: a plain torch tensor,
        with no autograd history (as torch's x.detach().cpu())."""
        return self._blocking_read("to_torch()")

    def full_tensor(self) -> torch.Tensor:
        return self._blocking_read("full_tensor()")

    def _read_item(self, what: str):
        if self.numel() != 1:
            raise ValueError(f"{what} needs a one-element DTensor, this one has shape {tuple(self.shape)}")
        return self._blocking_read(what).item()

    def item(self):
        return self._read_item("item()")

    def tolist(self):
        return self._blocking_read("tolist()").tolist()

    def __bool__(self) -> bool:
        return bool(self._read_item("bool(x)"))

    def __float__(self) -> float:
        return float(self._read_item("float(x)"))

    def __int__(self) -> int:
        return int(self._read_item("int(x)"))

    def __format__(self, spec: str) -> str:
        """As torch: a 0-d tensor formats as its value (f"{loss:.4f}", a blocking read like item())."""
        if self.ndim == 0:
            return format(self._read_item("format(x)"), spec)
        return object.__format__(self, spec)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a DTensor cannot be pickled (at {user_site()}): its data lives on the workers, and its "
                        "symbol means nothing outside this session. Save with dtorch.checkpoint.save(state, "
                        "directory) (each worker writes its own shards), or pickle x.to_torch()")

    # --- torch interop ------------------------------------------------------------------------
    __torch_function__ = classmethod(torch_function)   # torch.* on a DTensor: dtensor/op_issue.py

    @classmethod
    def from_local(cls, *args, **kwargs):
        """torch's DTensor.from_local(local, mesh, placements) wraps each rank's own shard; a
        single controller holds no rank's shard (ops/unsupported.py NOTES says what to write)."""
        raise unsupported_op("from_local", "DTensor.from_local")

    def __getattr__(self, name: str):
        """Reached only for names neither DTensor nor torch.Tensor has (torch.Tensor's public
        names DTensor lacks are _Refused). A name in NOTES gets its refusal (an AttributeError
        too); other names stay plain AttributeErrors, so copy, pickle and hasattr probes behave
        as usual."""
        if name.startswith("_") or not (hasattr(torch.Tensor, name) or name in NOTES):
            raise AttributeError(f"'DTensor' object has no attribute {name!r}")
        # an in-place form (x.t_()) of a method DTensor composes of ops (x.t()): say so
        raise unsupported_method(name, is_inplace_name(name) and api.has_method(name[:-1]))

    # copy.copy of a torch tensor shares its storage, so here it is the symbol itself (copy's
    # default would clone the slots and free the workers' buffer twice); deepcopy is a clone.
    # x[index] = value and the in-place methods are installed by dtorch/dtensor/inplace.py.
    def __copy__(self) -> DTensor:
        return self

    def __deepcopy__(self, memo) -> DTensor:
        return call_op("clone", (self,), {})

    def to(self, *args, **kwargs):
        """As torch's DTensor: x.to(dtype) casts (a new DTensor, autograd recorded); x.to(device)
        with the mesh's own device ("cpu" on a CPU mesh, x.to(y.device)) is x itself, and x.to(other)
        takes other's dtype; nothing is read. x.to(mesh) (or x.to(mesh, placements=[...])) moves it
        to another mesh: the same placements when that mesh has as many dims, else Replicate.
        Another device type is refused with what to write: reads are only ever explicit
        (to_torch(), item(), numpy(), ...)."""
        if args and isinstance(args[0], DeviceMesh) or "device_mesh" in kwargs:
            return self._to_mesh(*args, **kwargs)
        device, dtype, copy = to_target(args, kwargs)
        if device is not None:
            self._check_device(device, f"x.to({str(device)!r})")
        if dtype not in (None, self.dtype):
            return call_op("to_dtype", (self, dtype), {})
        return call_op("clone", (self,), {}) if copy else self

    def _check_device(self, device: torch.device, call: str) -> None:
        if device.type != self.device_mesh.device_type:
            raise device_refusal(call, device, self.device_mesh)

    def cpu(self, memory_format=None) -> DTensor:
        """On a CPU mesh, x itself (torch's x.cpu() on a CPU tensor); a CUDA mesh refuses with
        what to write. To read the values here: x.to_torch()."""
        self._check_device(torch.device("cpu"), "x.cpu()")
        return self

    def cuda(self, device=None, non_blocking: bool = False, memory_format=None) -> DTensor:
        """On a CUDA mesh, x itself; a CPU mesh refuses with what to write."""
        self._check_device(torch.device("cuda"), "x.cuda()")
        return self

    def numpy(self, *, force: bool = False):
        """A blocking read of the whole tensor as a numpy array. As torch: refused while x
        requires grad (read x.detach().numpy(), or numpy(force=True))."""
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._blocking_read("numpy()").numpy()

    def __array__(self, dtype=None, copy=None):
        """numpy.asarray(x): the same blocking read as numpy()."""
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __matmul__(self, other):
        return call_op("matmul", (self, other), {})

    def __rmatmul__(self, other):
        return call_op("matmul", (other, self), {})

    # --- shape methods (op coverage) ---
    # Forms torch spells differently from one registry op; the rules live in dtorch/ops/view.py
    # and dtorch/ops/indexing.py. Imports are local to keep this block self-contained.
    def __getitem__(self, index) -> DTensor:
        """Indexing with torch's semantics. Basic: ints, slices (step > 0), None and Ellipsis;
        any index works on a Replicate or unsharded dim, a sharded dim takes only a whole slice
        `:`. Advanced (index tensors, lists, bool masks the controller holds): the `index` op
        (dtorch/dtensor/indexing.py; its rules: dtorch/ops/advanced_indexing.py)."""
        from ..ops.indexing import AdvancedIndex, canonical_index
        try:
            canonical = canonical_index(index, self._meta.shape)
        except AdvancedIndex:
            return self._advanced_getitem(index)   # installed by dtorch/dtensor/indexing.py
        return call_op("getitem", (self, canonical), {})

    def view(self, *shape, **size) -> DTensor:
        """x.view(4, 6), x.view((4, 6)) or x.view(size=(4, 6)). The same as reshape: dtorch
        results never share storage visibly, so view's no-copy promise has nothing to keep."""
        if len(shape) == 1 and isinstance(shape[0], torch.dtype) or isinstance(size.get("dtype"), torch.dtype):
            raise UnsupportedOpError("view(dtype) reinterprets bytes, which dtorch does not support; "
                                     "use x.to(dtype) to convert values")
        return call_op("view", (self, shape_argument("view", shape, size, "size")), {})

    def reshape(self, *shape, **keyword) -> DTensor:
        """x.reshape(4, 6), x.reshape((4, 6)) or x.reshape(shape=(4, 6)); one size may be -1."""
        return call_op("reshape", (self, shape_argument("reshape", shape, keyword, "shape")), {})

    @property
    def T(self) -> DTensor:
        """All dims reversed (torch deprecates T for ndim other than 2, dtorch follows the rule)."""
        return call_op("permute", (self, tuple(reversed(range(self.ndim)))), {})

    @property
    def mT(self) -> DTensor:
        """The last two dims swapped (a batch of matrices transposed)."""
        return call_op("transpose", (self, -2, -1), {})

    def redistribute_like(self, other: DTensor) -> DTensor:
        """The same logical tensor with `other`'s placements on `other`'s mesh (e.g. to match an
        operand before an op). Other meshes follow whatever `redistribute` supports."""
        return self.redistribute(other.device_mesh, other.placements)

    def redistribute_by_dict(self, device_mesh: DeviceMesh | dict | None = None, placements_dict: dict | None = None,
                             default_placement_mode: str = "keep") -> DTensor:
        """Redistribute naming mesh dims: x.redistribute_by_dict({"dp": Shard(0), "tp": Replicate()}),
        or DTorch's spelling x.redistribute_by_dict(mesh, placements_dict={...},
        default_placement_mode="keep" | "replicate" | "raise_error").

        Keys are mesh dim names or indices (an unnamed mesh takes indices only). A mesh dim that
        the dict does not list keeps its current placement ("keep", the default), becomes
        Replicate ("replicate"), or raises MeshError ("raise_error", DTorch's default). An unknown
        name raises MeshError, and so does naming one mesh dim twice (by name and by index)."""
        if isinstance(device_mesh, dict):   # dtorch's own order: the dict first
            device_mesh, placements_dict = placements_dict, device_mesh
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        placements, given = _unlisted_placements(self, mesh, default_placement_mode), set()
        for key, placement in (placements_dict or {}).items():
            mesh_dim = mesh.dim_index(key)
            if mesh_dim in given:
                raise MeshError(f"redistribute_by_dict: mesh dim {key!r} is given twice in {placements_dict}")
            given.add(mesh_dim)
            placements[mesh_dim] = placement
        if None in placements:
            missing = [mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d
                       for d, p in enumerate(placements) if p is None]
            raise MeshError(f"redistribute_by_dict: mesh dims {missing} are not in placements_dict and "
                            "default_placement_mode is 'raise_error'")
        return self.redistribute(mesh, placements)

    # --- DTorch's spellings (docs/guide/migrating.md) ---
    @property
    def device(self) -> torch.device:
        """The mesh's device, as torch's DTensor reports it: torch.device("cpu"), or
        torch.device("cuda", 0) (each worker's shard is on its own GPU; index 0 is the first on
        each host). x.to(x.device) and x.to(y.device) keep a DTensor."""
        return mesh_device(self._meta.mesh)

    @property
    def data(self) -> DTensor:
        """As torch's: the same values without autograd history (`detach()`, an alias on the
        workers): `p.data.mul_(0.5)` changes `p` without recording it, and no gradient flows
        back through `p.data`."""
        return self.detach()

    def to_torch_async(self):
        """DTorch's name for fetch(): a future of the whole tensor (await it, or .result())."""
        return self.fetch()

    def _to_mesh(self, device_mesh: DeviceMesh, placements=None) -> DTensor:
        """x.to(mesh): the same placements when the mesh has as many dims, else Replicate."""
        if placements is None and device_mesh.ndim == self.device_mesh.ndim:
            placements = self._meta.placements
        return self.redistribute(device_mesh, placements)


class _Refused:
    """A public torch.Tensor method or attribute that DTensor does not have. Reading it raises the
    refusal with what to write: an AttributeError too, so `hasattr(x, name)` probes in library
    code answer False, as for any object without it (torch.Tensor, the base, has every name)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return self
        # an in-place form (x.t_()) of a method DTensor composes of ops (x.t()): say so
        raise unsupported_method(self.name, is_inplace_name(self.name) and api.has_method(self.name[:-1]))


def refuse_the_rest() -> None:
    """Once every module has registered its methods (dtorch/__init__.py calls this last): each
    public torch.Tensor name DTensor still lacks reads as its refusal (_Refused)."""
    api.seal(_Refused)


def _unlisted_placements(tensor: DTensor, mesh: DeviceMesh, mode: str) -> list:
    """redistribute_by_dict's start: what a mesh dim the dict does not list gets (None: must be listed)."""
    if mode == "keep":
        if mesh.ndim != tensor.device_mesh.ndim:
            raise MeshError(f"redistribute_by_dict: default_placement_mode='keep' needs a mesh of "
                            f"{tensor.device_mesh.ndim} dims like the tensor's, {mesh} has {mesh.ndim}; "
                            "list every dim or use 'replicate'")
        return list(tensor._meta.placements)
    if mode in ("replicate", "raise_error"):
        return [Replicate() if mode == "replicate" else None] * mesh.ndim
    raise ValueError(f"default_placement_mode must be 'keep', 'replicate' or 'raise_error', not {mode!r}")


api.bind(DTensor)   # what the class body defines; everything else is registered in dtensor/api.py


# torch's cast methods, each the one to_dtype op (its rule: dtorch/ops/pointwise.py); set from a
# table, as writing `def int` or `def bool` in the class body would shadow the builtins there.
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
         "long": torch.int64, "int": torch.int32, "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
         "bool": torch.bool}


def _cast(name: str, dtype: torch.dtype):
    def cast(self) -> DTensor:
        return self.to(dtype)
    cast.__name__, cast.__doc__ = name, f"x.{name}(): x.to({dtype})"
    return cast


api.register_methods({name: _cast(name, dtype) for name, dtype in CASTS.items()})
def new_symbol(tensor_id: int, spec: TensorMeta, seq: int, controller) -> DTensor:
    """DTensor(tensor_id, spec, seq, controller), for the per-op path: the same object without
    the Python-level __new__ and __init__ calls (a quarter of what subclassing torch.Tensor added
    to an op's issue, benchmarks/issue_cpu.py)."""
    made = _make_subclass(DTensor, _WRAPPED)
    made._id, made._meta, made._seq, made._controller, made._node = tensor_id, spec, seq, controller, None
    return made


set_tensor_type(DTensor, new_symbol)      # the op-issuing path makes its results of it
install_op_methods(DTensor)   # x + y, -x, x.sum(...): one call_op each
