"""DTensor's API has one home (issue 44): dtensor/api.py is the only module that assigns onto
DTensor or writes the table of torch functions, and a name registered twice is refused with both
places named, whatever the import order."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dtorch
from dtorch.dtensor import api
from dtorch.dtensor.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
TABLE_NAMES = ("TORCH_FUNCTIONS", "COMPOSITES")


def _writes_onto_dtensor(tree: ast.AST) -> list[int]:
    """Lines that assign an attribute of DTensor, or write the torch-function table."""
    lines = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            owner = getattr(target, "value", None)
            if not isinstance(owner, ast.Name):
                continue
            if (isinstance(target, ast.Attribute) and owner.id == "DTensor") or (
                    isinstance(target, ast.Subscript) and owner.id in TABLE_NAMES):
                lines.append(node.lineno)
        if isinstance(node, ast.Call):
            function = node.func
            if (isinstance(function, ast.Name) and function.id == "setattr" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "DTensor"):
                lines.append(node.lineno)
            if (isinstance(function, ast.Attribute) and function.attr in ("update", "setdefault", "pop", "__setitem__")
                    and isinstance(function.value, ast.Name) and function.value.id in TABLE_NAMES):
                lines.append(node.lineno)
    return lines


def test_only_the_api_table_assigns_onto_dtensor():
    offenders = []
    for path in sorted((ROOT / "dtorch").rglob("*.py")):
        if path == ROOT / "dtorch" / "dtensor" / "api.py":
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in _writes_onto_dtensor(ast.parse(path.read_text()))]
    assert not offenders, ("register DTensor's methods and torch functions through dtorch/dtensor/api.py, "
                           f"not by assignment: {offenders}")


def test_the_source_check_sees_each_way_of_assigning():
    source = ("DTensor.x = 1\nsetattr(DTensor, 'y', 2)\nCOMPOSITES['z'] = f\nTORCH_FUNCTIONS.update(a=f)\n"
              "COMPOSITES.setdefault('b', f)\nDTensor.w: int = 3\nother.x = 1\n")
    assert sorted(_writes_onto_dtensor(ast.parse(source))) == [1, 2, 3, 4, 5, 6]


def test_a_second_method_is_refused_naming_both_places():
    first = api.sites()["methods"]["is_cuda"]
    with pytest.raises(RuntimeError) as refused:
        api.register_method("is_cuda", property(lambda self: False))
    assert first in str(refused.value) and "test_api_table.py" in str(refused.value)
    assert DTensor.is_cuda.fget is not None and api.sites()["methods"]["is_cuda"] == first   # nothing changed


def test_a_second_torch_function_is_refused_naming_both_places():
    first = api.sites()["functions"]["cross_entropy"]
    before = api.TORCH_FUNCTIONS["cross_entropy"]
    with pytest.raises(RuntimeError) as refused:
        api.register_function("cross_entropy", lambda *args, **kwargs: None)
    assert first.startswith("nn/functional.py:") and first in str(refused.value)
    assert api.TORCH_FUNCTIONS["cross_entropy"] is before


def test_a_name_of_the_class_body_is_refused_unless_said():
    with pytest.raises(RuntimeError, match="class body"):
        api.register_method("redistribute", lambda self: None)
    assert api.sites()["methods"]["data"].startswith("dtensor/inplace.py:")   # the one replacement, said so


def test_every_registration_names_its_module():
    sites = api.sites()
    assert len(sites["methods"]) > 300 and len(sites["functions"]) > 100
    unnamed = [name for table in sites.values() for name, site in table.items()
               if not (site.endswith(tuple(f":{n}" for n in range(1, 100000))) and ".py:" in site)]
    assert not unnamed
    assert dtorch.DTensor is DTensor and api.TORCH_FUNCTIONS["zeros_like"] is not None


def _capture_calls(tree: ast.AST) -> set[str]:
    """Methods called on a capture: `capture.x(...)` or `<...>.capture.x(...)`, and the same on
    `tap`, the name the controller knows a capture by (controller.CommandTap)."""
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if ((isinstance(owner, ast.Name) and owner.id in ("capture", "tap"))
                    or (isinstance(owner, ast.Attribute) and owner.attr in ("capture", "tap"))):
                called.add(node.func.attr)
    return called


def test_the_layers_feed_a_capture_only_through_its_hooks():
    """dtorch.compile's capture has one documented interface (compile_capture.CaptureHooks): the
    modules that feed it call nothing else on it."""
    from dtorch.dtensor.compile_capture import Capture, CaptureHooks
    hooks = {name for name in vars(CaptureHooks) if not name.startswith("_")}
    assert hooks <= set(vars(Capture)) and len(hooks) == 8
    owners = {ROOT / "dtorch" / "dtensor" / "compile_capture.py", ROOT / "dtorch" / "compile.py"}
    stray = {f"{path.relative_to(ROOT)}: capture.{name}" for path in sorted((ROOT / "dtorch").rglob("*.py"))
             if path not in owners for name in _capture_calls(ast.parse(path.read_text())) - hooks}
    assert not stray, f"calls on a capture outside CaptureHooks (add the hook there, documented): {sorted(stray)}"
    seen = _capture_calls(ast.parse("capture.finish()\nself.controller.capture.check()\nother.x()\ntap.record()"))
    assert seen == {"finish", "check", "record"}
