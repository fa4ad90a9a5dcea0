"""The layers of docs/architecture.md ("Where model-level code goes"), checked on the source: each
dtorch module sits in one layer and imports only from its own layer or lower ones. Imports inside
functions count too. A module the table does not place fails, so a new folder gets its place here
and in the docs before its code lands."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (layer, module prefixes), lowest first. The model-level layers are placed before their code
# exists (the models and training issues fill them in).
LAYERS = [
    ("pure", ("dtorch.errors", "dtorch.distributed_spec", "dtorch.redistribute", "dtorch.rng", "dtorch.ops")),
    ("launcher", ("dtorch_launcher",)),
    ("runtime", ("dtorch.runtime",)),
    ("frontend", ("dtorch.aliasing", "dtorch.recording", "dtorch.sync_debug", "dtorch.tensor", "dtorch.op_issue", "dtorch.factories", "dtorch.inplace",
                  "dtorch.advanced_indexing", "dtorch.capture", "dtorch.compile", "dtorch.autocast", "dtorch.composites",
                  "dtorch.composite_losses", "dtorch.composite_layers", "dtorch.composite_foreach")),
    ("autograd", ("dtorch.autograd",)),
    ("modules", ("dtorch.nn", "dtorch.optim", "dtorch.utils")),
    ("checkpoint", ("dtorch.checkpoint",)),
    ("models", ("dtorch.models",)),
    ("profile", ("dtorch.profile",)),   # dtorch.profile: records every layer's calls, used by none
    ("public surface", ("dtorch",)),   # dtorch/__init__.py re-exports every layer
]
# What the pure layer must never import, whatever its place: processes, sockets, event loops.
NOT_PURE = ("zmq", "asyncio", "subprocess", "multiprocessing")


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the most specific prefix naming `module`."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def test_every_module_has_a_layer():
    unplaced = [m for m in _script().import_graph(ROOT, lazy=True) if layer_of(m) is None]
    assert not unplaced, f"give these modules a layer in LAYERS and docs/architecture.md: {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in sorted(_script().import_graph(ROOT, lazy=True).items()) for b in sorted(targets)
              if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layering (docs/architecture.md):\n" + "\n".join(upward)


def test_the_pure_layer_starts_nothing():
    import ast
    script = _script()
    offenders = []
    for module, path in script.module_files(ROOT).items():
        if LAYERS[layer_of(module)][0] != "pure":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] in NOT_PURE]
    assert not offenders, offenders


def test_the_layer_table_sees_an_upward_import():
    # the check itself: a runtime module importing the frontend would be refused
    assert layer_of("dtorch.tensor") > layer_of("dtorch.runtime.worker")
    assert layer_of("dtorch.ops.dispatch") < layer_of("dtorch.runtime.session") < layer_of("dtorch.nn.functional")
    assert layer_of("dtorch") == len(LAYERS) - 1 and layer_of("numpy") is None
