"""Generate docs/reference/ops.md from the registry:

    python -m dtorch.ops.tooling.docs > docs/reference/ops.md

Nothing in the output is written by hand. Per family: the family module's docstring (its rule
in words). Per op: the spellings that reach it, the op's `doc` line from its table row, and, for
ops with sample calls (dtorch/ops/tooling/samples.py), every placement combination its rule accepts on
ONE mesh dim for the first sample, found by asking the rule itself (rules.expand on a 1-D mesh).
An N-D mesh applies the same rule to each of its dims.
"""
from __future__ import annotations

import importlib
import itertools
import sys

import torch

from ...spec.placements import DeviceMesh, format_placements
from ...errors import DTorchError
from ..dispatch import plan_call
from ..operators import SPELLINGS
from ..registry import REGISTRY
from ..tensor_meta import tensor_meta
from .samples import covered_ops, samples
from .simulate import Symbol, placement_options, tensor_inputs, with_inputs

__all__ = ["render"]

_MESH = DeviceMesh("cpu", [0, 1, 2, 3])
_FAMILY_ORDER = ("pointwise", "reduction", "matrix", "linalg", "nn", "vision", "view", "indexing")
# Python operators (ops/operators.py), plus spellings DTensor defines as methods of its own
_OPERATORS = {**SPELLINGS, "matmul": "@", "getitem": "x[...]",
              "to_dtype": "x.to(dtype), x.float(), .half(), .bfloat16(), .double(), .long(), .int(), .bool()"}

# How a call whose placements a rule refuses still runs (dtorch/ops/auto_redistribute.py).
_AUTOMATIC = [
    "**Automatic communication.** When an op's rule refuses its inputs' placements (`x` is `S(0)`",
    "and `y` is `S(1)`; `softmax` or `cumsum` over a sharded dim; a matmul whose contracted dim is",
    "sharded on one side only), dtorch inserts the cheapest redistributes that make the call legal,",
    "as DTensor's sharding propagation does. The candidates are the combinations the op's own rule",
    "accepts (those listed below, and their N-D forms); the cost is the bytes each rank sends,",
    "estimated from the shapes and the mesh (the same estimate a refusal's `Fix:` quotes), so an",
    "all-to-all beats an all-gather and R -> P(sum) or R -> S(d) costs nothing. On an N-D mesh the",
    "choice is made on the mesh dim the rule refuses, then the call is planned again (a choice on",
    "one dim can make another refuse, or nest shards); if that does not settle within a few rounds,",
    "the refused dims become Replicate, then every dim. A call no layout can compute still raises",
    "PlacementError.", "",
    "The moves are fused into the op: its own command runs each move's collectives on the workers",
    "before the kernel (`RunOp.moves`), with the same failure handling as `x.redistribute(...)`, and",
    "a moved input lives only while the op runs. (A kernel that exchanges blocks itself, and one",
    "tensor moved twice in a call, get `Redistribute` commands before the op instead.) The choice is",
    "cached with the call's plan, so a hot loop pays one dict lookup, then the op.",
    "`dtorch.stats()[\"redistributes_inserted\"]` counts the moves, fused or not.",
    "`dtorch.set_strict(True)` (or `DTORCH_STRICT=1` in the environment at import) turns this",
    "off: a refused call raises PlacementError listing the combinations its rule accepts on that mesh",
    "dim and the cheapest redistribute that reaches one, so every collective is spelled out in your",
    "code.", "",
]

# Inputs on different meshes (dtorch/ops/one_device.py).
_MESHES = [
    "**Inputs on different meshes.** An op's inputs share one mesh, with one exception: an input on a",
    "one-device mesh (`dtorch.Tensor(data)` or `dtorch.tensor(data)` without `device_mesh=` lands on",
    "one) is a constant to the others. It joins the one mesh the other inputs share, moved there as",
    "Replicate by the mesh-to-mesh transfer (`x.to(mesh)`), and `redistributes_inserted` counts the",
    "move. The move is made again at every such op: move a tensor used often once, `b = b.to(mesh)`.",
    "Inputs on two larger meshes, and every mixed-mesh call in strict mode, raise MeshError.", "",
    "**A local torch tensor** among an op's DTensor arguments (torch code makes them inside forward:",
    "`torch.arange` positions, a 0-d scale) is a constant the same way: it is uploaded Replicate on the",
    "mesh of the other inputs, at every such call, and `dtorch.stats()[\"local_tensors_uploaded\"]`",
    "counts it. Strict mode refuses it (LocalTensorError, a TypeError): upload it once,",
    "`dtorch.distribute_tensor(t, mesh, [Replicate()])`.", "",
]

# What no rule table can say: whole features dtorch lacks. Each raises UnsupportedOpError at the
# user's line (dtorch/ops/unsupported.py), never a silent wrong value.
_NOT_YET = [
    "Not supported yet, and what to use instead:", "",
    "- **higher-order gradients** (`create_graph=True`): first-order autograd works on every op here",
    "  (`loss.backward()`, `.grad`, `dtorch.autograd.grad`, `retain_grad()`; docs/design/autograd.md).",
    "- **in-place forms of ops dtorch lacks** (`x.resize_()`, `x.as_strided_()`, `x.renorm_()`); the others",
    "  work (`x.add_(1)`, `x[i] = v`, `F.relu(x, inplace=True)`, `x.t_()`, `x.unsqueeze_(0)`), views",
    "  included: see [inplace.md](inplace.md).",
    "- **`to_local()` / `DTensor.from_local()`**: the controller holds no shards; read the whole tensor",
    "  with `x.to_torch()` (or `await x.fetch()`), upload one with `dtorch.distribute_tensor(t, mesh,",
    "  placements)` (or `dtorch.tensor(t, device_mesh=..., placements=...)`), or make it there with a",
    "  factory (`dtorch.randn(..., device_mesh=, placements=)`) so no process holds the whole tensor;",
    "  `x.local_shape(rank)` and `x.local_offset(rank)` say where each shard sits.",
    "- **`x.to(\"cuda\")` on a CPU mesh** (or `x.cpu()` on a CUDA one): move to a mesh of that device,",
    "  `x.to(mesh)` or `x.redistribute(device_mesh=mesh, placements=[...])`. `x.to(x.device)` and `x.cpu()`",
    "  on a CPU mesh keep the DTensor; reads are explicit (`to_torch()`, `numpy()`, `item()`).",
    "- **`mesh[\"dp\"]`** keeps index 0 of the other mesh dims (torch's DeviceMesh gives the calling",
    "  rank's own slice; a single controller has no calling rank): `mesh.unbind(\"tp\")` gives every slice.",
    "",
    "**Ops whose shape depends on the values are blocking reads**, documented as such: `nonzero` /",
    "`argwhere` / `nonzero_static`, `x[mask]` with a DTensor bool mask, `masked_select`, `unique` /",
    "`unique_consecutive` and `bincount` (dtorch/torch_api/data_dependent.py). Each reads the least it",
    "needs (the mask, the values, or `bincount`'s minimum and maximum) through the one read path, so",
    "`dtorch.stats()` counts it and `dtorch.set_sync_debug_mode(\"warn\" | \"error\")` names its line; the",
    "selection then runs on the workers (`x[mask]` and `masked_select` use the `index` op, so the result",
    "stays on x's mesh and gradients reach x; positions and `unique`'s results are Replicate). To keep a",
    "step free of reads, keep the shape (`dtorch.where(mask, x, 0)`, `x.masked_fill(~mask, 0)`). Writes",
    "read nothing (`x[mask] = v` is a `where` or a `masked_scatter`).", "",
    "**Composed from the ops below** (dtorch/torch_api/methods.py; each follows the rules of the ops it uses,",
    "tested against torch in tests/test_torch_methods.py): `t`, `H`, `mH`, `adjoint`, `swapaxes` / `swapdims`,",
    "`movedim` / `moveaxis`, `view_as`, `reshape_as`, `expand_as`, `type_as`, `new_zeros` / `new_ones` /",
    "`new_full` / `new_empty` (Replicate on the tensor's mesh), `clip`, `x.where(cond, y)`, `tril` / `triu`",
    "(a mask from two `arange`s and `masked_fill`), `flip` / `fliplr` / `flipud` (`index_select` of a",
    "reversed `arange`), `rot90` (flips and a transpose, as torch composes it), `roll` (`narrow` and `cat`),",
    "`select`, `aminmax`, `count_nonzero`, `var_mean`, `std_mean`; as methods and under their `torch.*` names.",
    "(`x.unfold(dimension, size, step)` is an op, below; `torch.nn.functional.unfold`, im2col, is refused.)",
    "",
]


# Complex dtypes: what works through the collectives, and what is refused at the call
# (comm.real_view and comm.reducible on the workers; tensor_meta.refuse_unordered, dispatch's
# ordering reductions and complex scalars on the controller; tests/test_complex.py).
_COMPLEX = [
    "**Complex tensors** (complex64, complex128) work as in torch wherever torch's op takes them: every",
    "redistribute (S(d), R, P(sum), P(avg); uneven shapes, N-D meshes), moves between meshes, reads, and",
    "the ops below on complex values (`+`, `*`, `/`, `@`, `einsum`, `sum`, `mean`, `var`, `cumsum`, `vdot`,",
    "`abs`, `exp`, ...), backward included. The workers' collectives, Gloo and NCCL alike, carry a complex",
    "tensor as its real view (`torch.view_as_real`: real and imaginary parts side by side), so a sum or",
    "mean over ranks is exactly complex addition. Refused at your line, before anything is sent:", "",
    "- **`P(max)` / `P(min)` of a complex tensor**, from a factory, a redistribute or an op's result:",
    "  complex numbers have no order (torch.amax refuses them too); PlacementError naming the placements",
    "  and the mesh. Order by `x.abs()`.",
    "- **ordering ops on complex inputs** (`max`, `min`, `amax`, `amin`, `argmax`, `argmin`, `median`,",
    "  `nanmedian`, `mode`, `kthvalue`): torch's own refusal, as ShapeError at your line, not on the workers.",
    "- **a Python complex scalar** (`x * (1 + 2j)`): the wire carries none yet; UnsupportedOpError says",
    "  to pass `torch.tensor(1 + 2j)`, which dtorch uploads.", "",
    "A complex value given to `dtorch.full` or `x.fill_` cannot be sent to the workers: that command",
    "fails (RemoteError at its read, naming your line) and the session goes on; upload it with",
    "`dtorch.tensor`. Not there yet: the complex-only ops (`x.real`, `x.imag`, `conj`, `angle`,",
    "`view_as_real`, `view_as_complex`, `torch.complex`, `polar`, `torch.fft`) are not dtorch ops",
    "(UnsupportedOpError).", "",
]


def render() -> str:
    families = sorted({spec.family for spec in REGISTRY.values()},
                      key=lambda f: (_FAMILY_ORDER.index(f) if f in _FAMILY_ORDER else len(_FAMILY_ORDER), f))
    lines = ["# Supported ops and their placement rules", "",
             "Generated by `python -m dtorch.ops.tooling.docs > docs/reference/ops.md` from the rule tables; do not "
             "edit.",
             "Placements: `R` Replicate, `S(d)` Shard(d), `P(op)` Partial. A rule is written for one mesh dim",
             "and applied to every dim of an N-D mesh. The combinations listed per op are those its rule",
             "accepts as given; R -> S(d), a local slice, is done inside the op (marked *sliced* below).",
             "See docs/adding_an_op.md to add one.", ""] + _AUTOMATIC + _MESHES + _NOT_YET + _COMPLEX
    counts = {family: sum(s.family == family for s in REGISTRY.values()) for family in families}
    lines += [f"- [{family}](#{family}): {counts[family]} ops" for family in families]
    for family in families:
        lines += _family(family)
    return "\n".join(lines) + "\n"


def _family(family: str) -> list:
    names = sorted(n for n, s in REGISTRY.items() if s.family == family)
    module = importlib.import_module(f"dtorch.ops.{family}")
    lines = ["", f"## {family}", "", f"`dtorch/ops/{family}.py`:", "",
             "```", (module.__doc__ or "").strip(), "```"]
    for name in names:
        lines += _op(name)
    return lines


def _op(name: str) -> list:
    spec = REGISTRY[name]
    spellings = [f"`dtorch.{name}`"] + ([f"`x.{name}(...)`"] if spec.method else [])
    if hasattr(torch, name) or hasattr(torch.nn.functional, name):
        spellings.append(f"`torch{'' if hasattr(torch, name) else '.nn.functional'}.{name}`")
    if name in _OPERATORS:
        spellings.append(f"`{_OPERATORS[name]}`")
    lines = ["", f"### {name}", "", " · ".join(spellings)]
    if spec.doc:
        lines += ["", f"Rule: {spec.doc}"]
    if name in covered_ops():
        lines += ["", *_accepted(name)]
    return lines


def _accepted(name: str) -> list:
    sample = samples(name)[0]
    values = tensor_inputs(sample)
    shapes = ", ".join(f"{tuple(v.shape)} {str(v.dtype)[6:]}" for v in values)
    found = []
    for combo in itertools.product(*[placement_options(v) for v in values]):
        specs = [tensor_meta(v.shape, v.dtype, _MESH, (p,)) for v, p in zip(values, combo)]
        args, kwargs = with_inputs(sample, [Symbol(s) for s in specs])
        try:
            plan = plan_call(REGISTRY[name], args, kwargs, specs, strict=True)
        except DTorchError:
            continue
        sliced = " *sliced*" if plan.input_steps else ""
        outputs = ", ".join(format_placements(s.placements)[1:-1] for s in plan.out_specs)
        found.append(f"`{', '.join(map(repr, combo))} -> {outputs}`{sliced}")
    return [f"Accepted on one mesh dim for inputs {shapes} ({len(found)}):", "",
            " · ".join(found) if found else "(none)"]


if __name__ == "__main__":
    sys.stdout.write(render())
