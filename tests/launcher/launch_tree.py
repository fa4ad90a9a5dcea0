"""Import ``dtorch_launcher`` from THIS source tree, installed or not.

setuptools installs launcher/ as ``dtorch_launcher`` (see pyproject.toml). The tests must run
against the tree they sit in, also before (or without) ``pip install -e .`` and never against a
stale copy in site-packages.
"""
import importlib
import importlib.util
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
LAUNCHER_DIRECTORY = REPOSITORY / "launcher"


def load_launcher_from_tree():
    if "dtorch_launcher" in sys.modules:
        return sys.modules["dtorch_launcher"]
    installed = importlib.util.find_spec("dtorch_launcher")
    if installed is not None and Path(installed.origin).resolve().parent == LAUNCHER_DIRECTORY:
        return importlib.import_module("dtorch_launcher")
    spec = importlib.util.spec_from_file_location(
        "dtorch_launcher", LAUNCHER_DIRECTORY / "__init__.py",
        submodule_search_locations=[str(LAUNCHER_DIRECTORY)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dtorch_launcher"] = module
    spec.loader.exec_module(module)
    return module
