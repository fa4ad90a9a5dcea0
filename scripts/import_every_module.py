"""Import every module of dtorch and dtorch_launcher, named from a source tree; exit non-zero on the
first that fails.

    python3 -I scripts/import_every_module.py SOURCE            # from the installed dtorch (a wheel)
    python3 -I scripts/import_every_module.py SOURCE --tree     # from SOURCE itself
    ... --block numpy --block matplotlib                        # as if these were not installed

Without --tree a module imported from SOURCE is an error too, so a run outside the tree proves the
wheel holds every module. .ci/fresh_venv.sh runs it in a fresh venv; tests/test_packaging.py runs
it with --tree, blocking every installed package that dtorch does not declare.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

PACKAGES = {"dtorch": "dtorch", "launcher": "dtorch_launcher"}  # folder -> installed name


def module_names(source: Path) -> list[str]:
    names = []
    for folder, package in PACKAGES.items():
        for path in sorted((source / folder).rglob("*.py")):
            parts = path.relative_to(source / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package,) + parts))
    return names


class Blocker(importlib.abc.MetaPathFinder):
    """Makes the named top-level packages unimportable, as in a venv that lacks them."""

    def __init__(self, blocked: set[str]):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: dtorch does not declare it)",
                                      name=name)
        return None


def import_from_tree(source: Path) -> None:
    sys.path.insert(0, str(source))
    launcher = source / "launcher" / "__init__.py"
    spec = importlib.util.spec_from_file_location("dtorch_launcher", launcher,
                                                  submodule_search_locations=[str(launcher.parent)])
    sys.modules["dtorch_launcher"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--tree", action="store_true", help="import from SOURCE, not the installed dtorch")
    parser.add_argument("--block", action="append", default=[], metavar="NAME")
    args = parser.parse_args()
    source = args.source.resolve()
    sys.meta_path.insert(0, Blocker(set(args.block)))
    if args.tree:
        import_from_tree(source)
    names = module_names(source)
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 -- report which module, then fail
            sys.exit(f"cannot import {name}: {type(error).__name__}: {error}")
        if not args.tree and Path(module.__file__).resolve().is_relative_to(source):
            sys.exit(f"{name} was imported from the source tree ({module.__file__}), not the installed dtorch")
    print(f"{len(names)} modules of dtorch and dtorch_launcher import "
          f"({'from the tree' if args.tree else 'from the installed dtorch'})")


if __name__ == "__main__":
    main()
