"""The layers of docs/design/architecture.md ("Where model-level code goes"), checked on the source: each
dtorch module sits in one layer and imports only from its own layer or lower ones. Imports inside
functions count too. A module the table does not place fails, so a new folder gets its place here
and in the docs before its code lands."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (layer, modules), lowest first. A name ending in ".*" places a package and every module under
# it; any other name places exactly that module. Nothing has a default: a new top-level module or
# package fails test_every_module_has_a_layer until it is placed here and in docs/design/architecture.md.
LAYERS = [
    ("pure", ("dtorch.errors", "dtorch.spec.*", "dtorch.ops.*")),
    ("launcher", ("dtorch_launcher.*",)),
    ("runtime: shared", ("dtorch.runtime", "dtorch.runtime.protocol", "dtorch.runtime.transport")),
    ("runtime: devices", ("dtorch.runtime.devices.*",)),
    ("runtime: worker", ("dtorch.runtime.worker.*",)),
    ("runtime: processes", ("dtorch.runtime.processes.*",)),
    ("runtime: controller", ("dtorch.runtime.controller.*",)),
    ("dtensor", ("dtorch.dtensor.*",)),
    ("torch api", ("dtorch.torch_api.*", "dtorch.compile", "dtorch.compile_signature")),
    ("autograd", ("dtorch.autograd.*",)),
    ("modules", ("dtorch.nn.*", "dtorch.optim.*", "dtorch.utils.*")),
    ("checkpoint", ("dtorch.checkpoint.*",)),
    ("models", ("dtorch.models.*",)),
    ("profile", ("dtorch.profile.*",)),   # dtorch.profile: records every layer's calls, used by none
    ("public surface", ("dtorch",)),   # dtorch/__init__.py re-exports every layer
    ("benchmarks", ("benchmarks.*",)),
]
# The two processes: nothing a worker runs may import the controller's side.
WORKER_SIDE = ("dtorch.runtime.devices", "dtorch.runtime.worker", "dtorch.runtime.processes")
CONTROLLER_SIDE = "dtorch.runtime.controller"
# What the pure layer must never import, whatever its place: processes, sockets, event loops.
NOT_PURE = ("zmq", "asyncio", "subprocess", "multiprocessing")


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _places(name: str, module: str) -> bool:
    if name.endswith(".*"):
        package = name[:-2]
        return module == package or module.startswith(package + ".")
    return module == name


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the one entry that places `module`, or None."""
    found = [index for index, (_, names) in enumerate(LAYERS) for name in names if _places(name, module)]
    assert len(found) <= 1, f"{module} is placed twice in LAYERS"
    return found[0] if found else None


def _graph():
    return _script().import_graph(ROOT, lazy=True, type_only=True)


def test_every_module_has_a_layer():
    unplaced = [m for m in _graph() if layer_of(m) is None]
    assert not unplaced, f"give these modules a layer in LAYERS and docs/design/architecture.md: {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in sorted(_graph().items()) for b in sorted(targets)
              if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layering (docs/design/architecture.md):\n" + "\n".join(upward)


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


def test_no_worker_module_imports_the_controller_side():
    """Checked on its own as well as by the layers: the split of runtime/ is the split of the
    two processes, so a worker module that imported the controller's would run its code (and
    its imports) in every worker."""
    crossing = [f"{a} imports {b}" for a, targets in sorted(_graph().items()) for b in sorted(targets)
                if a.startswith(WORKER_SIDE) and b.startswith(CONTROLLER_SIDE)]
    assert not crossing, crossing


def test_the_layer_table_sees_an_upward_import():
    # the check itself: a runtime module importing the frontend would be refused
    assert layer_of("dtorch.dtensor.tensor") > layer_of("dtorch.runtime.worker.worker")
    assert (layer_of("dtorch.ops.dispatch") < layer_of("dtorch.runtime.controller.session")
            < layer_of("dtorch.nn.functional"))
    assert layer_of("dtorch.runtime.worker.kernels") < layer_of("dtorch.runtime.controller.controller")
    assert layer_of("dtorch") == len(LAYERS) - 2 and layer_of("numpy") is None
    # nothing falls into a default layer: a new module directly under dtorch/ or runtime/ is unplaced
    assert layer_of("dtorch.new_module") is None and layer_of("dtorch.runtime.new_module") is None
