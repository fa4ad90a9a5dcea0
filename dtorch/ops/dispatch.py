"""PURE: turn an op call on tensor specs into a plan: the redistributes to issue first where the
rules refuse the inputs as given (ops/auto_redistribute.py; none in strict mode, which raises
instead), output specs, local slicing of inputs, and the local kernel. Plans are cached per call
signature, so a hot loop pays one dict lookup and never re-runs meta inference or the rules.
"""
from __future__ import annotations

import os
from numbers import Number

import torch
from typing import NamedTuple

from ..spec.placements import format_placements, local_shape
from ..errors import LocalTensorError, MeshError, PlacementError, ShapeError, UnsupportedOpError, user_site
from ..spec.redistribute import plan_redistribute
from .auto_redistribute import legal_call, takes_communication
from .registry import PEER_KERNELS, REGISTRY, RegisteredOp
from .rules import Call, TensorSlot, expand
from .tensor_meta import TensorMeta, is_local_tensor, refuse_unordered, tensor_meta
from .suggest import spell_placements_code
from .unsupported import refuse_inplace_flag, unsupported_op

__all__ = ["OpPlan", "lookup", "plan_call", "cached_plan", "signature", "map_tensors", "PLAN_CACHE",
           "warm_up_inference", "set_strict", "is_strict"]


class OpPlan(NamedTuple):
    kernel: str
    out_specs: tuple          # TensorMeta per output
    input_steps: tuple        # ((tensor_index, shape, placements, ((mesh_dim, before, after), ...)), ...)
    extra_kwargs: dict
    sequence: type | None = None   # torch's result type when it returns several (tuple, list,
                                   # torch.return_types.max, ...); kept even for one element
    moves: tuple = ()         # ((tensor_index, target placements), ...): redistributes to issue
                              # before the op; out_specs, input_steps and kernel are for the moved inputs
    fused_moves: tuple = ()   # the same moves as steps the op's own command runs first:
                              # ((tensor_index, shape, dtype, placements, steps), ...); () where
                              # the kernel exchanges blocks itself (PEER_KERNELS: moves go first)
    regather: bool = True     # RunOp.regather: no rank holds an empty piece of an input or output


PLAN_CACHE: dict[tuple, OpPlan] = {}
# Meta inference reads only global shapes, dtypes and the other arguments, never placements: every
# layout of the same shapes shares one run of torch's meta kernels (Python refs: ~6 ms for
# batch_norm_from_moments), so a new placement of known shapes plans at the cost of the rules alone.
INFERENCE_CACHE: dict[tuple, tuple] = {}
# Strict: refuse a call whose placements do not line up (today's PlacementError) instead of
# inserting the cheapest redistributes. Plans differ by mode, so a change clears the cache.
_strict = os.environ.get("DTORCH_STRICT", "").strip().lower() not in ("", "0", "false", "no")


def set_strict(strict: bool) -> None:
    """dtorch.set_strict(True): every collective must be spelled out (a call whose placements
    do not line up raises PlacementError with the legal alternatives); False (the default, unless
    DTORCH_STRICT=1 at import) inserts the cheapest redistributes before such a call."""
    global _strict
    if bool(strict) != _strict:
        PLAN_CACHE.clear()
        _strict = bool(strict)


def is_strict() -> bool:
    return _strict


def signature(op: RegisteredOp, args: tuple, kwargs: dict, specs: list) -> tuple:
    """The cache key: tensor specs by their interned key, other values by value (or by type for
    pointwise scalars). Tensors inside lists (cat, stack) count, depth-first, args then kwargs;
    `specs` collects the tensor specs in that same order."""
    key: list = [op.name]
    for a in args:
        if type(a) in PLAIN_TYPES:   # a scalar: no attribute lookup (a failed getattr raises inside)
            key.append(_plain_key(a, op.scalars_by_type))
            continue
        spec = getattr(a, "_meta", None)
        if spec is not None:   # the common case, inline: this runs for every op
            specs.append(spec)
            key.append((spec.key,))
        else:
            key.append(_key_of(a, specs, op.scalars_by_type))
    for name, value in kwargs.items():
        key.append((name, _key_of(value, specs, False)))
    return tuple(key)


PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))   # exact types: never tensors, no attribute lookups


def _plain_key(value, scalars_by_type: bool):
    kind = type(value)
    if kind is str or value is None:
        return value
    # 1 == 1.0 == True as keys: var(x, True) is not var(x, 1); bools always by value: a flag
    # (inplace, training) changes the plan, not just a scalar
    return kind if scalars_by_type and kind is not bool else (kind, value)


def _key_of(value, specs: list, scalars_by_type: bool):
    if type(value) in PLAIN_TYPES:
        return _plain_key(value, scalars_by_type)
    spec = getattr(value, "_meta", None)
    if spec is not None:
        specs.append(spec)
        return (spec.key,)   # never a bare int: max(x, y) must not share max(x, 1)'s plan
    if type(value) in (list, tuple):
        return (type(value),) + tuple([_key_of(v, specs, scalars_by_type) for v in value])
    if isinstance(value, Number):   # 1 == 1.0 == True as keys: var(x, True) is not var(x, 1)
        # bools always by value: a flag (inplace, training) changes the plan, not just a scalar
        return type(value) if scalars_by_type and type(value) is not bool else (type(value), value)
    return value


def plan_call(op: RegisteredOp, args: tuple, kwargs: dict, specs: list[TensorMeta],
              strict: bool | None = None) -> OpPlan:
    """Build the plan for one call (cold path: runs meta inference and the rules). Outside strict
    mode (`strict` None: the global mode) inputs whose placements the rules refuse get moves."""
    if not specs:
        raise ShapeError(f"{op.name}: no dtorch tensor among the arguments")
    if _holds_torch_tensor(args, kwargs):   # (the frontend uploads it and plans again, outside strict mode)
        raise LocalTensorError(f"{op.name}: a local torch.Tensor among DTensor arguments at {user_site()}; in strict "
                               "mode upload it yourself: dtorch.distribute_tensor(t, mesh, [Replicate()]) (outside "
                               "it dtorch does that, each call)")
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise MeshError(f"{op.name}: inputs live on different meshes ({mesh} and {spec.mesh}) at "
                            f"{user_site()}; move one with x.redistribute(device_mesh=..., placements=...)")
    refuse_inplace_flag(op.name, op.torch_fn, args, kwargs)
    _refuse_complex_scalars(op, args, kwargs)
    slot_args, slot_kwargs = _with_slots(args, kwargs)
    outputs, sequence = _infer(op, args, kwargs, specs)
    call = Call(op.name, tuple(specs), slot_args, slot_kwargs, outputs)
    moves = ()
    if not (_strict if strict is None else strict):
        found = legal_call(op.rule, call)
        if found is not None:   # otherwise no layout works: expand raises the strict error
            call, moves = found
    required, out_placements = expand(op.rule, call)
    input_steps = _local_input_steps(call, required)
    kernel, extra = op.local(call, required) if op.local else (op.name, {})
    for (_shape, dtype), placements in zip(outputs, out_placements):
        if dtype.is_complex:   # (tensor_meta refuses it too, without the op's name)
            refuse_unordered(dtype, mesh, placements, f"{op.name} of {_placements_of(call.inputs)}")
    out_specs = tuple([tensor_meta(shape, dtype, mesh, placements)
                      for (shape, dtype), placements in zip(outputs, out_placements)])
    fused = () if kernel in PEER_KERNELS else _fused_moves(moves, specs)
    pieces = [(spec.shape, placements) for spec, placements in zip(call.inputs, required)]
    regather = not any(_some_rank_empty(shape, mesh, placements)
                       for shape, placements in pieces + [(spec.shape, spec.placements) for spec in out_specs])
    return OpPlan(kernel, out_specs, input_steps, extra, sequence, moves, fused, regather)


def _placements_of(inputs) -> str:
    return ", ".join(format_placements(spec.placements) for spec in inputs)


def _some_rank_empty(shape, mesh, placements) -> bool:
    """Whether some rank's piece is empty (5 rows on 4 ranks): its kernel may take torch's
    empty-input shortcut and save nothing for backward (conv2d does), so a gathered parameter
    must not be gathered again there, a collective the other ranks would wait in."""
    return any(0 in local_shape(shape, mesh, placements, rank) for rank in mesh.ranks)


def _fused_moves(moves: tuple, specs: list) -> tuple:
    """Each move as the redistribute steps from the input's own placements to its target."""
    return tuple([(index, specs[index].shape, specs[index].dtype, specs[index].placements,
                  tuple(plan_redistribute(specs[index].placements, target))) for index, target in moves])


def _holds_torch_tensor(args, kwargs) -> bool:
    """A local torch.Tensor anywhere in the arguments (inside torch.index_put's tuple, say)."""
    found: list = []
    map_tensors((args, kwargs), found.append, is_local_tensor)
    return bool(found)


def _refuse_complex_scalars(op: RegisteredOp, args, kwargs) -> None:
    """The wire carries no Python complex scalar (protocol's encoder refuses it), and a command
    that cannot be encoded must never be issued: refused here, with the spelling that works."""
    found: list = []
    map_tensors((args, kwargs), found.append, lambda value: type(value) is complex)
    if found:
        raise UnsupportedOpError(f"{op.name}: a Python complex scalar {found[0]} at {user_site()}: dtorch does not "
                                 f"send complex scalars to the workers yet; pass it as a tensor, "
                                 f"torch.tensor({found[0]}) (dtorch uploads it; in strict mode use "
                                 f"dtorch.tensor({found[0]}, device_mesh=mesh, placements=[Replicate()]))")


def _is_symbol(value) -> bool:
    return hasattr(value, "_meta")


def map_tensors(value, fn, is_tensor=_is_symbol):
    """Apply fn to every tensor in an argument structure (lists and tuples nested, dict values),
    in the depth-first order `signature` numbers them. Tensors are dtorch symbols by default;
    the validator passes another test to map plain torch tensors the same way."""
    if is_tensor(value):
        return fn(value)
    if type(value) in (list, tuple):
        mapped = [map_tensors(v, fn, is_tensor) for v in value]
        return mapped if type(value) is list else tuple(mapped)   # tuple(<generator>): tests/test_soak.py
    if type(value) is dict:
        return {k: map_tensors(v, fn, is_tensor) for k, v in value.items()}
    return value


def _with_slots(args, kwargs):
    counter = iter(range(1 << 30))
    slot = lambda value: TensorSlot(next(counter))  # noqa: E731
    return map_tensors(args, slot), map_tensors(kwargs, slot)


def warm_up_inference() -> None:
    """torch's first meta-tensor op imports torch._dynamo (1-2 s); every later one is cheap. The
    session runs this while workers start, so the user's first op does not pay for it."""
    torch.add(torch.empty(1, device="meta"), 1)


def _infer(op: RegisteredOp, args, kwargs, specs) -> tuple[tuple, type | None]:
    """Output (shape, dtype) pairs from running the torch function on meta tensors, and
    the type of torch's result when it is a sequence (None for a single tensor)."""
    shape_args, shape_kwargs = map_tensors((args, kwargs), _ShapeOnly)
    key = signature(op, shape_args, shape_kwargs, [])
    found = INFERENCE_CACHE.get(key)
    if found is None:
        found = INFERENCE_CACHE[key] = _run_meta(op, args, kwargs, specs)
    return found


class _ShapeOnly:
    """A tensor argument as inference's cache sees it: its global shape and dtype, placed on
    nothing (interned like any meta, so the key stays small)."""
    __slots__ = ("_meta",)

    def __init__(self, tensor):
        spec = tensor._meta
        self._meta = tensor_meta(spec.shape, spec.dtype, spec.mesh, ())


# Ops whose CPU and CUDA kernels refuse floating-point inputs of two dtypes, where torch's meta
# kernels return a dtype anyway (torch 2.13: mm of float32 and bfloat16 is float32 on meta):
# refused here, at the user's line, rather than on every worker. Norms take a lower-precision
# input with float32 parameters (the input's dtype wins), not the reverse.
_ONE_DTYPE_OPS = frozenset({"mm", "matmul", "linear", "addmm", "mv", "addbmm", "cross", "linalg_cross", "conv1d",
                            "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_NORM_OPS = frozenset({"layer_norm", "group_norm", "batch_norm", "rms_norm"})
_LOWER_PRECISION = frozenset({torch.float16, torch.bfloat16})


def _refuse_mixed_dtypes(op: RegisteredOp, specs) -> None:
    dtypes = [s.dtype for s in specs if s.dtype.is_floating_point or s.dtype.is_complex]
    if len(set(dtypes)) < 2 or op.name not in _ONE_DTYPE_OPS | _NORM_OPS:
        return
    if op.name in _NORM_OPS and dtypes[0] in _LOWER_PRECISION and set(dtypes[1:]) == {torch.float32}:
        return
    names = " and ".join(sorted({str(d)[6:] for d in dtypes}))
    raise ShapeError(f"{op.name}: inputs of two dtypes ({names}) at {user_site()}; torch's kernels take one "
                     f"dtype here: cast one with .to({dtypes[0]}) (or run under torch.autocast, or "
                     "dtorch.nn.mixed_precision, which cast for you)")


# Reductions that torch refuses over an empty dim (max of nothing has no value) and for complex
# inputs (complex numbers have no order), where its meta kernels return a shape anyway (torch
# 2.13: torch.amax of a (0, 5) or a complex meta tensor is a tensor): for such an input, the call
# runs once more on real CPU zeros that hold one element (expanded), so that torch's own check
# refuses it here, at the user's line, instead of -inf or an error on the workers.
_EMPTY_REFUSING_OPS = frozenset({"max", "min", "amax", "amin", "argmax", "argmin", "aminmax", "median", "nanmedian",
                                 "mode", "kthvalue"})


def _run_meta(op: RegisteredOp, args, kwargs, specs) -> tuple[tuple, type | None]:
    _refuse_mixed_dtypes(op, specs)
    meta = lambda value: value._meta.meta()  # noqa: E731
    zeros = lambda value: torch.zeros((), dtype=value._meta.dtype).expand(value._meta.shape)  # noqa: E731
    try:
        if op.name in _EMPTY_REFUSING_OPS and any(0 in s.shape or s.dtype.is_complex for s in specs):
            op.torch_fn(*map_tensors(args, zeros), **map_tensors(kwargs, zeros))
        result = op.torch_fn(*map_tensors(args, meta), **map_tensors(kwargs, meta))
    except Exception as error:
        shapes = ", ".join(f"{tuple(s.shape)} {str(s.dtype)[6:]}" for s in specs)
        raise ShapeError(f"{op.name}: torch rejects inputs of shape {shapes} at {user_site()}: {error}") from None
    sequence = type(result) if isinstance(result, (tuple, list)) else None
    results = result if sequence else (result,)
    return tuple([(tuple(r.shape), r.dtype) for r in results]), sequence


def _local_input_steps(call: Call, required: list) -> tuple:
    """Inputs whose placement must change before the op: only free local slicing is automatic."""
    steps_per_input = []
    for index, (spec, wanted) in enumerate(zip(call.inputs, required)):
        if spec.placements == wanted:
            continue
        if takes_communication(spec.placements, wanted):
            raise PlacementError(f"{call.op}: input {index} is {format_placements(spec.placements)} but the "
                                 f"op needs {format_placements(wanted)} on {spec.mesh}, which takes "
                                 f"communication; redistribute it explicitly at {user_site()}. Fix: "
                                 f"input{index}.redistribute(placements={spell_placements_code(wanted)})")
        steps = plan_redistribute(spec.placements, wanted)
        steps_per_input.append((index, spec.shape, spec.placements, tuple(steps)))
    return tuple(steps_per_input)


def lookup(name: str) -> RegisteredOp:
    """The registered op, or UnsupportedOpError naming the nearest ones and what to write instead."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise unsupported_op(name, f"dtorch op {name!r}")
    return spec


def cached_plan(op_name: str, args: tuple, kwargs: dict) -> OpPlan:
    op = lookup(op_name)
    specs: list = []
    key = signature(op, args, kwargs, specs)
    plan = PLAN_CACHE.get(key)
    if plan is None:
        plan = PLAN_CACHE[key] = plan_call(op, args, kwargs, specs)
    return plan

