"""dtorch installs and imports with what pyproject.toml declares, nothing more.

A static scan reads every import in dtorch/ and launcher/: a module-level import must be the
standard library, dtorch itself or a base dependency; an optional extra's package (cupy) only
inside a function or a try/except ImportError. Tensor.numpy() and torch.from_numpy count as
numpy: torch does not depend on it. Then a subprocess imports every module with every installed
package outside the base dependencies' closure blocked. .ci/fresh_venv.sh checks the same for
real, in a fresh venv, from a built wheel.

Last, scripts/import_cycles.py lists the import edges among dtorch's own modules: a cycle that
ALLOWED_CYCLES does not name (with its reason) fails.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
from packaging.requirements import Requirement  # noqa: E402 -- pytest depends on packaging

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"dtorch": "dtorch", "launcher": "dtorch_launcher"}  # folder -> installed name
OWN = set(SOURCES.values())
# Distributions whose import name is not their name with '-' -> '_'.
IMPORT_NAMES = {"pyzmq": "zmq", "cupy-cuda12x": "cupy", "cupy-cuda13x": "cupy"}
# Calls that need numpy although no `import numpy` stands in the file.
NUMPY_CALLS = {"numpy", "from_numpy"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def import_name(requirement: str) -> str:
    name = Requirement(requirement).name.lower()
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def base_imports() -> set[str]:
    return {import_name(r) for r in project()["dependencies"]}


def optional_imports() -> set[str]:
    return {import_name(r) for extra, requirements in project()["optional-dependencies"].items()
            if extra != "test" for r in requirements}


def _catches_import_error(node: ast.Try) -> bool:
    names = {ast.unparse(handler.type) for handler in node.handlers if handler.type is not None}
    return bool(names & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)"})


def imports(tree: ast.AST, guarded: bool = False):
    """(line, top-level name, guarded) for each import and numpy-needing call; guarded means
    inside a function or a try that catches ImportError."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.partition(".")[0], guarded) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module.partition(".")[0], guarded
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in NUMPY_CALLS:
            yield node.lineno, "numpy", guarded
        inner = guarded or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
            or (isinstance(node, ast.Try) and _catches_import_error(node))
        yield from imports(node, inner)


def undeclared(source: str, where: str, base: set[str], optional: set[str]) -> list[str]:
    allowed = set(sys.stdlib_module_names) | OWN | base
    problems = []
    for line, name, guarded in imports(ast.parse(source)):
        if name in allowed or (guarded and name in optional):
            continue
        why = ("an optional extra's package, imported where every user meets it: move it into the "
               "function that needs it, with an ImportError naming the extra") if name in optional \
            else "not declared in pyproject.toml's dependencies"
        problems.append(f"{where}:{line}: {name} ({why})")
    return problems


def source_files():
    for folder in SOURCES:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_import_is_declared():
    base, optional = base_imports(), optional_imports()
    problems = [p for path in source_files()
                for p in undeclared(path.read_text(), str(path.relative_to(ROOT)), base, optional)]
    assert not problems, "imports that a fresh `pip install dtorch` would not satisfy:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, problem", [
    ("import numpy as np\n", "numpy (not declared"),
    ("def read(t):\n    return t.numpy()\n", "numpy (not declared"),
    ("import cupy\n", "cupy (an optional extra's package"),
    ("import matplotlib.pyplot\n", "matplotlib (an optional extra's package"),
])
def test_the_scan_catches_an_undeclared_import(source, problem):
    problems = undeclared(source, "x.py", base={"torch", "zmq", "msgpack"}, optional={"cupy", "matplotlib"})
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize("source", [
    "def start():\n    import cupy\n",
    "try:\n    import cupy\nexcept ImportError:\n    cupy = None\n",
    "import os, json\nfrom . import spec\nimport torch.distributed\n",
])
def test_the_scan_accepts_guarded_optional_and_standard_imports(source):
    assert undeclared(source, "x.py", base={"torch"}, optional={"cupy"}) == []


def test_every_folder_of_modules_is_a_found_package():
    """setup.py finds the packages (setuptools' find_packages): a folder of modules without an
    __init__.py would be left out of the wheel, silently, and work only from a checkout."""
    from setuptools import find_packages
    found = set(find_packages(str(ROOT), include=["dtorch", "dtorch.*"])) | {"dtorch_launcher"}
    folders = {".".join((SOURCES[path.parent.relative_to(ROOT).parts[0]],) + path.parent.relative_to(ROOT).parts[1:])
               for folder in SOURCES for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert folders == found, f"folders of modules that are not packages: {sorted(folders - found)}"
    assert "find_packages" in (ROOT / "setup.py").read_text()


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, transitively (markers evaluated here)."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def test_every_module_imports_with_only_the_base_dependencies():
    closure = installed_closure(project()["dependencies"])
    blocked = {module for module, distributions in importlib.metadata.packages_distributions().items()
               if not {d.lower().replace("_", "-") for d in distributions} & closure} - OWN
    assert "pytest" in blocked  # the block is real: the test extra is not a base dependency
    command = [sys.executable, "-I", str(ROOT / "scripts" / "import_every_module.py"), str(ROOT), "--tree"]
    command += [f"--block={name}" for name in sorted(blocked)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stdout + finished.stderr


# --- import cycles (scripts/import_cycles.py) ------------------------------------------------------
# Cycles still allowed, each with why; every import counts, also inside functions (a lazy import
# that closes a circle still ties the two modules together). Each cycle is written as the script
# prints it: starting at its alphabetically first module.
ALLOWED_CYCLES: dict = {}   # none: keep it that way, or name the cycle and why here


def _import_cycles_script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_beyond_the_allow_list():
    script = _import_cycles_script()
    found = script.cycles(script.import_graph(ROOT, lazy=True, type_only=True))
    unlisted = [script.show(cycle) for cycle in found if cycle not in ALLOWED_CYCLES]
    assert not unlisted, ("import cycles among dtorch's modules (python3 scripts/import_cycles.py --lazy "
                          "--edges shows every edge); break them, or list them in ALLOWED_CYCLES with "
                          "a reason:\n" + "\n".join(unlisted))


def test_the_cycle_scan_sees_lazy_imports_and_skips_type_checking(tmp_path):
    script = _import_cycles_script()
    (tmp_path / "dtorch" / "runtime").mkdir(parents=True)
    (tmp_path / "launcher").mkdir()
    files = {"dtorch/__init__.py": "", "dtorch/runtime/__init__.py": "",
             "dtorch/runtime/a.py": "from . import b\n",
             "dtorch/runtime/b.py": "def f():\n    from .a import x\n",
             "dtorch/runtime/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
             "dtorch/runtime/d.py": "import dtorch.runtime.c\nfrom ..runtime.c import y\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert script.import_graph(tmp_path)["dtorch.runtime.a"] == {"dtorch.runtime.b"}
    assert script.import_graph(tmp_path)["dtorch.runtime.b"] == set()
    assert script.import_graph(tmp_path, lazy=True)["dtorch.runtime.b"] == {"dtorch.runtime.a"}
    assert script.import_graph(tmp_path, lazy=True)["dtorch.runtime.c"] == set()
    assert script.import_graph(tmp_path)["dtorch.runtime.d"] == {"dtorch.runtime.c"}
    assert script.cycles(script.import_graph(tmp_path, lazy=True)) == [("dtorch.runtime.a", "dtorch.runtime.b")]
    assert script.cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"a", "b"}}) == [("a", "b"), ("a", "b", "c"), ("b", "c")]
