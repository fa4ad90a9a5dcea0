"""The op-issuing path: a call on DTensors becomes one RunOp command. call_op plans the call
(cached), fixes what dtorch fixes outside strict mode (a local torch tensor uploaded, inputs on a
one-device mesh joined to the others' mesh), turns the plan's inserted redistributes into moves
fused into the op's command (or Redistribute commands before it), puts the arguments on the wire,
records the op for autograd, submits it and returns the output symbol(s). It never waits.
DTensor's op methods (x + y, x.sum()) and torch's functions on DTensors (torch_function, with
the compositions that dtorch writes as Python over ops, dtensor/api.py's TORCH_FUNCTIONS) are
registered from here.

This runs for every op: keep it free of extra calls and attribute lookups (docs/design/benchmarks.md
measures it). dtorch/dtensor/tensor.py re-exports call_op, which most of dtorch imports from there.
"""
from __future__ import annotations

import sys

import torch

from ..spec.placements import Replicate, format_placements
from ..errors import LocalTensorError, MeshError, user_site
from ..ops.unsupported import is_inplace_name, unsupported_method, unsupported_op
from ..ops import REGISTRY, cached_plan
from ..ops.dispatch import PLAIN_TYPES, is_strict, map_tensors
from ..ops.one_device import join_target
from ..ops.tensor_meta import is_local_tensor
from ..ops.operators import BINARY_OPERATORS, UNARY_OPERATORS
from . import api
from .aliasing import VIEW_OPS, note_view
from .autocast import AUTOCAST_OPS, autocast_args
from . import compile_capture as capturing
from ..runtime.controller import profiling, session
from . import frontend_state
from .recording import HopNode, is_grad_enabled, record_op
from ..runtime.protocol import RunOp, dtype_name, wire_ref

__all__ = ["COMPOSITES", "call_op", "install_op_methods", "land_for_backward", "note_capture_inputs", "set_tensor_type",
           "torch_function", "with_local_tensors_uploaded"]

# The DTensor class: results are made of it and arguments recognized by it. dtorch/dtensor/tensor.py
# sets it once the class exists (set_tensor_type): dtensor/tensor.py imports this module for call_op, so
# this one cannot import dtensor/tensor.py back (scripts/import_cycles.py). A module global, as the class
# was when this code lived in dtensor/tensor.py: the per-op path looks it up at the same cost.
DTensor = None
new_symbol = None   # DTensor(id, spec, seq, controller) without its two Python-level calls


def set_tensor_type(tensor_type: type, maker) -> None:
    global DTensor, new_symbol
    DTensor, new_symbol = tensor_type, maker


def call_op(name: str, args: tuple, kwargs: dict):
    """Plan (cached), issue the plan's inserted redistributes if any, enqueue one RunOp command,
    return the output symbol(s). Never waits."""
    if name in AUTOCAST_OPS:   # torch.autocast's casts, which the workers never see (dtorch/dtensor/autocast.py)
        args, kwargs = autocast_args(name, args, kwargs)
    recorder = profiling.active
    if recorder is not None:   # dtorch.profile: the whole issue (plan, moves, submit) as one span
        with recorder.user_span(name, "op"):
            return _issue_op(name, args, kwargs)
    return _issue_op(name, args, kwargs)


def _issue_op(name: str, args: tuple, kwargs: dict):
    given = args   # a view's base is the tensor the user passed, not an inserted move's copy
    try:
        plan = cached_plan(name, args, kwargs)
    except (MeshError, LocalTensorError) as refused:
        args, kwargs, plan = _replan(name, args, kwargs, refused)
    moves = ()
    if plan.moves:
        moves = _fused_moves(plan, args, kwargs)
        if moves is None:
            args, kwargs, moves = *_apply_moves(plan.moves, args, kwargs), ()
    out_specs = plan.out_specs
    controller = session.controller()
    wire_args, nodes, nested = _wire_args(controller, args)
    wire_kwargs = map_tensors(kwargs, controller.reference) if kwargs else {}
    if controller.tap is not None:
        note_capture_inputs(args, kwargs)
    if plan.extra_kwargs:
        wire_kwargs.update(plan.extra_kwargs)
    mesh_id = controller.define_mesh(out_specs[0].mesh)
    grad = False
    if is_grad_enabled() and name not in NOT_DIFFERENTIABLE:
        if nested or kwargs:
            nodes += _nested_grad_nodes(args, kwargs)
        nodes = tuple(nodes)
        grad = bool(nodes)
    if not plan.sequence:
        out_id = controller.new_id()
        seq = controller.submit(RunOp, (out_id,), mesh_id, name, plan.kernel, wire_args, wire_kwargs, plan.input_steps,
                                grad, moves, plan.regather)
        result = new_symbol(out_id, out_specs[0], seq, controller)
        if grad:
            record_op(nodes, (result,), out_specs[0].mesh)
    else:
        out_ids = controller.new_ids(len(out_specs))
        seq = controller.submit(RunOp, out_ids, mesh_id, name, plan.kernel, wire_args, wire_kwargs, plan.input_steps,
                                grad, moves, plan.regather)
        # torch's own result type: torch.return_types.max keeps .values / .indices, as in torch
        result = plan.sequence([new_symbol(i, spec, seq, controller) for i, spec in zip(out_ids, out_specs)])
        if grad:
            record_op(nodes, result, out_specs[0].mesh)
    if name in VIEW_OPS:   # views remember their base, for in-place ops (dtorch/dtensor/aliasing.py)
        note_view(name, given, kwargs, result)
    return result


def note_capture_inputs(args: tuple, kwargs: dict) -> None:
    capture = capturing.active()   # None on a thread other than the capturing one
    if capture is not None:
        found = []
        map_tensors((args, kwargs), found.append)
        capture.note_inputs(found)


def _replan(name: str, args: tuple, kwargs: dict, refused: Exception) -> tuple:
    """(args, kwargs, plan) after the two fixes dtorch makes outside strict mode: a local torch
    tensor argument is uploaded Replicate on the others' mesh (a constant, like a Python scalar),
    and inputs on a one-device mesh join the mesh the others share. Else `refused` is raised."""
    if isinstance(refused, LocalTensorError):
        uploaded = None if is_strict() else _upload_local_tensors(args, kwargs)
        if uploaded is None:
            raise refused
        args, kwargs = uploaded
        try:
            return args, kwargs, cached_plan(name, args, kwargs)
        except MeshError as mismatch:
            refused = mismatch
    joined = _join_one_device_inputs(args, kwargs)
    if joined is None:
        raise refused
    return *joined, cached_plan(name, *joined)


def _upload_local_tensors(args: tuple, kwargs: dict):
    """(args, kwargs) with each torch tensor uploaded Replicate on the DTensors' mesh (the larger
    one where a one-device input will join it)."""
    metas = []
    map_tensors((args, kwargs), lambda t: metas.append(t._meta))
    larger = [meta.mesh for meta in metas if meta.mesh.size() > 1]
    mesh = larger[0] if larger else metas[0].mesh
    controller = session.controller()

    def upload(local: torch.Tensor) -> DTensor:
        frontend_state.count(controller, "local_tensors_uploaded")
        # dtensor/factories.py's seam: it imports dtensor/tensor.py, which imports this module
        return DTensor._upload_constant(local, mesh)
    return map_tensors(args, upload, is_local_tensor), map_tensors(kwargs, upload, is_local_tensor)


def with_local_tensors_uploaded(composite):
    """`composite` (Python over ops, which reads its arguments' placements and mesh) taking torch
    tensors beside DTensors, as an op does: a loss's target or class weights, a mask. Each is
    uploaded once, Replicate on the DTensors' mesh, before the body runs (the ops in it slice it
    locally where their rules shard it; dtorch.stats()["local_tensors_uploaded"] counts it).
    Strict mode refuses it, as it does for an op."""
    def uploading(*args, **kwargs):
        local, symbols = [], []
        map_tensors((args, kwargs), local.append, is_local_tensor)
        if local:
            map_tensors((args, kwargs), symbols.append)
        if not local or not symbols:
            return composite(*args, **kwargs)
        if is_strict():
            mesh = symbols[0].device_mesh
            raise LocalTensorError(
                f"{composite.__name__}: a local torch.Tensor of shape {tuple(local[0].shape)} beside DTensors "
                f"{format_placements(symbols[0].placements)} on {mesh} at {user_site()}; in strict mode upload it "
                f"yourself as {format_placements([Replicate()] * mesh.ndim)}: dtorch.distribute_tensor(t, mesh, "
                f"[{', '.join(['Replicate()'] * mesh.ndim)}]) (outside it dtorch does that, each call)")
        args, kwargs = _upload_local_tensors(args, kwargs)
        return composite(*args, **kwargs)
    uploading.__name__, uploading.__qualname__, uploading.__doc__ = \
        composite.__name__, composite.__qualname__, composite.__doc__
    uploading.__wrapped__ = composite
    return uploading


def land_for_backward(source: DTensor, landed: DTensor) -> DTensor:
    """A move to another mesh, recorded: the landed tensor becomes a leaf on its mesh (backward
    there stops at it), the HopNode keeps both ends for backward to continue on the source mesh,
    and the caller gets a view of the landed tensor, so no symbol holds a node that holds it."""
    landed.requires_grad_()
    hop = HopNode(source, landed)
    landed._node = hop
    view = call_op("view", (landed, tuple(landed.shape)), {})
    landed._node = None
    return view


def _wire_args(controller, args: tuple) -> tuple:
    """(args as they go on the wire, the autograd nodes of the top-level tensors among them,
    whether a list or tuple holds more), in one pass. The hot case (a DTensor of this session,
    or a scalar) is inline; a tensor from another session, a subclass (nn.Parameter) or a list
    takes controller.reference, which checks and explains."""
    wire, nodes, nested = [], [], False
    first_valid = controller.meshes.first_valid_id   # controller.reference's two checks, inline below
    for a in args:
        kind = type(a)
        if kind is DTensor or (kind not in PLAIN_TYPES and isinstance(a, DTensor)):
            if kind is DTensor and a._controller is controller and a._id >= first_valid:
                wire.append(wire_ref(a._id))
            else:   # an ended session's tensor raises; one that may have lived on a lost rank is checked
                wire.append(controller.reference(a))
            if a._node is not None:
                nodes.append(a._node)
        elif kind is list or kind is tuple:
            wire.append(map_tensors(a, controller.reference))
            nested = True
        else:
            wire.append(a)
    return tuple(wire), nodes, nested


def _nested_grad_nodes(args: tuple, kwargs: dict) -> list:
    """The nodes of tensors inside lists and tuples, then kwargs (after the top-level ones)."""
    nodes = []
    map_tensors(([a for a in args if type(a) in (list, tuple)], kwargs),
                lambda t: nodes.append(t._node) if t._node is not None else None)
    return nodes


NOT_DIFFERENTIABLE = frozenset({"detach"})


def _fused_moves(plan, args: tuple, kwargs: dict) -> tuple | None:
    """The plan's inserted redistributes (dtorch.set_strict(False), the default) as RunOp.moves:
    the op's own command runs them first (dtorch/runtime/worker/fused_moves.py), so each moved input
    lives on the workers only while the op runs and there is no Redistribute command, symbol or
    Free for it. None where they must be Redistribute commands instead: the kernel exchanges
    blocks itself (plan.fused_moves is empty), or one tensor is moved twice (cat([x, x]), which
    a Redistribute moves once)."""
    if not plan.fused_moves:
        return None
    tensors = []
    map_tensors((args, kwargs), tensors.append)
    moved = [tensors[index] for index, *_ in plan.fused_moves]
    if len({tensor._id for tensor in moved}) < len(moved):
        return None
    grad_mode, fused = is_grad_enabled(), []
    for (index, shape, dtype, placements, steps), (_, target), tensor in zip(plan.fused_moves, plan.moves, moved):
        with profiling.span("redistribute (inserted)", "redistribute", to=format_placements(target), fused=True):
            fused.append((index, shape, dtype_name(dtype), placements, steps, grad_mode and tensor._node is not None))
        frontend_state.count(tensor._controller, "redistributes_inserted")
    return tuple(fused)


def _apply_moves(moves: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The plan's inserted redistributes issued as Redistribute commands before the op, where
    _fused_moves cannot fuse them. Tensors are numbered as `signature` numbers them; one tensor
    passed twice with the same target moves once."""
    targets, numbers, moved = dict(moves), iter(range(1 << 30)), {}

    def move(tensor: DTensor) -> DTensor:
        target = targets.get(next(numbers))
        if target is None:
            return tensor
        key = (tensor._id, target)
        if key not in moved:
            with profiling.span("redistribute (inserted)", "redistribute", to=format_placements(target)):
                moved[key] = tensor.redistribute(placements=target)
            frontend_state.count(tensor._controller, "redistributes_inserted")
        return moved[key]
    return map_tensors(args, move), map_tensors(kwargs, move)


def _join_one_device_inputs(args: tuple, kwargs: dict):
    """The one rule for inputs on different meshes (dtorch/ops/one_device.py): those on a one-device
    mesh move, as Replicate, to the mesh the others share. None where it does not apply, or in
    strict mode (every move spelled out)."""
    metas = []
    map_tensors((args, kwargs), lambda t: metas.append(t._meta))
    target = None if is_strict() else join_target(metas)
    if target is None:
        return None

    def join(tensor: DTensor) -> DTensor:
        if tensor.device_mesh == target:
            return tensor
        frontend_state.count(tensor._controller, "redistributes_inserted")
        with profiling.span("redistribute (inserted)", "redistribute", to=f"{target} [R]"):
            return tensor.redistribute(target, [Replicate()] * target.ndim)
    return map_tensors(args, join), map_tensors(kwargs, join)


# torch functions that reach dtorch as a Python function over ops rather than straight as the
# registry op of their name (registered in dtensor/api.py): cross_entropy's mean over a sharded
# batch is a sharded sum over a count (dtorch/nn/functional.py), torch.zeros_like(x) is a factory
# (dtorch/dtensor/factories.py).
COMPOSITES = api.TORCH_FUNCTIONS   # read on every torch call: a module global, one lookup


def _run_init(func, args: tuple, kwargs: dict):
    """torch.nn.init's functions are Python over tensor methods (uniform_, normal_, fill_, copy_,
    erfinv_, ...), which DTensor has: torch's own body runs on the DTensor, with torch's dispatch
    back to __torch_function__ off for that call. One that needs what dtorch lacks (orthogonal_'s
    QR, eye_'s out=) is refused with an UnsupportedOpError."""
    with torch._C.DisableTorchFunction():
        try:
            return func(*args, **kwargs)
        except (TypeError, AttributeError) as error:
            raise unsupported_op(func.__name__, f"torch.nn.init.{func.__name__}") from error


# func -> its name, interned: a builtin's __name__ is a new str on every access, and the command
# ring (command_sites.py) keeps each command's op name for SITE_RING commands: one shared str per
# op instead of ~55 B per command, and no str(func) made and dropped per call. Bounded, since a
# property's getter arrives as a new method-wrapper object each time (equal, so it hits).
_FUNCTION_NAMES: dict = {}
_MAX_FUNCTION_NAMES = 4096


def _function_name(func) -> str:
    name = sys.intern(getattr(func, "__name__", None) or str(func))
    try:
        if len(_FUNCTION_NAMES) < _MAX_FUNCTION_NAMES:
            _FUNCTION_NAMES[func] = name
    except TypeError:
        pass
    return name


def torch_function(cls, func, types, args=(), kwargs=None):
    """DTensor.__torch_function__ (bound there as a classmethod: a torch call on a DTensor pays no
    call more than before it moved here): a composite, a registry op through call_op, torch.nn.init's
    own Python, or a torch in-place function as the DTensor method; anything else is refused."""
    try:
        name = _FUNCTION_NAMES[func]
    except (KeyError, TypeError):   # a first call of func, or an unhashable callable
        name = _function_name(func)
    composite = COMPOSITES.get(name)
    if composite is not None:
        if name in AUTOCAST_OPS:   # F.cross_entropy under torch.autocast: float32, as torch's
            args, kwargs = autocast_args(name, tuple(args), kwargs or {})
        return composite(*args, **(kwargs or {}))
    if name in REGISTRY:
        if kwargs and kwargs.get("inplace"):   # F.relu(x, inplace=True): computed, then x rebound
            return args[0]._assign(call_op(name, tuple(args), dict(kwargs, inplace=False)), f"{name}(inplace=True)")
        return call_op(name, tuple(args), kwargs or {})
    if getattr(func, "__module__", None) == "torch.nn.init":   # (after the ops: no op is named like one)
        return _run_init(func, args, kwargs or {})
    if is_inplace_name(name) and name in DTensor.__dict__:   # torch.relu_(x), torch.Tensor.add_(x, y)
        return getattr(DTensor, name)(*args, **(kwargs or {}))
    if name in _DESCRIPTOR_CALLS:   # x.<attribute> of torch.Tensor's that DTensor does not define
        attribute = getattr(func.__self__, "__name__", None) or getattr(func.__self__.fget, "__name__", "?")
        if attribute.startswith("_"):   # torch's private state (x._version, x._base): as any object lacking it
            raise AttributeError(f"'DTensor' object has no attribute {attribute!r}")
        raise unsupported_method(attribute, False)
    if getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor.")):   # x.<method>(...)
        raise unsupported_method(name, is_inplace_name(name) and name[:-1] in DTensor.__dict__)
    module = "torch.nn.functional" if getattr(func, "__module__", "").startswith("torch.nn") else "torch"
    raise unsupported_op(name, f"{module}.{name}")


# torch.Tensor's C attributes (x.names, x.is_xpu, ...) reach __torch_function__ as their
# descriptor's __get__ / __set__; the refusal is an AttributeError, so hasattr probes answer False.
_DESCRIPTOR_CALLS = frozenset({"__get__", "__set__", "__delete__"})


def _method(op_name: str):
    def method(self, *args, **kwargs):
        return call_op(op_name, (self,) + args, kwargs)
    method.__name__ = op_name
    return method


def install_op_methods(tensor_type: type) -> None:
    """Give DTensor a method per Python operator (x + y, -x) and per registry op that torch has
    as a method (x.sum(...)), each one call_op; methods the class defines itself stay."""
    for dunder, op_name in BINARY_OPERATORS.items():
        api.register_method(dunder, lambda self, other, _op=op_name: call_op(_op, (self, other), {}))
    for dunder, op_name in UNARY_OPERATORS.items():
        api.register_method(dunder, lambda self, _op=op_name: call_op(_op, (self,), {}))
    for op_name, spec in REGISTRY.items():
        if spec.method and not api.in_class_body(op_name):
            api.register_method(op_name, _method(op_name))
