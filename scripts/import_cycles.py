"""The import edges among dtorch's own modules (dtorch/, launcher/ and benchmarks/, read with ast,
nothing imported), and the cycles in them.

    python3 scripts/import_cycles.py            # cycles among module-level imports; exit 1 if any
    python3 scripts/import_cycles.py --lazy     # imports inside functions count too
    python3 scripts/import_cycles.py --lazy --type-only   # and those under `if TYPE_CHECKING:` (the tests' view)
    python3 scripts/import_cycles.py --edges    # every edge, then the cycles

An edge a -> b means that importing a imports b: a module-level import, also under `if` or `try`,
but not under `if TYPE_CHECKING:` (never run) unless --type-only. `from package import name` points at
package.name when that is a module, else at the package. The parent packages Python runs on the
way (dtorch/__init__.py for every dtorch.x) are not edges: every module would import the root.
tests/test_packaging.py fails on a cycle that its allow-list does not name.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = {"dtorch": "dtorch", "launcher": "dtorch_launcher", "benchmarks": "benchmarks"}  # folder -> import name


def module_files(source: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the packages under `source`."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((source / folder).rglob("*.py")):
            parts = path.relative_to(source / folder).with_suffix("").parts
            modules[".".join((package,) + parts).removesuffix(".__init__")] = path
    return modules


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module name that `from ... import` starts from."""
    if node.level == 0:
        return node.module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imported_modules(tree: ast.AST, importer: str, is_package: bool, known: set[str], lazy: bool,
                     in_function: bool = False, type_only: bool = False):
    """(imported module, whether inside a function) for each import of one of `known`; with
    `type_only`, the imports under `if TYPE_CHECKING:` too (they tie the modules' designs together
    even though they never run)."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node) and not type_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, in_function
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, importer, is_package)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known or base in known:
                    yield (target if target in known else base), in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if lazy or not inner:
            yield from imported_modules(node, importer, is_package, known, lazy, inner, type_only)


def import_graph(source: Path, lazy: bool = False, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports (module-level only unless `lazy`; run-time imports only
    unless `type_only`)."""
    files = module_files(source)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        found = imported_modules(tree, module, path.name == "__init__.py", set(files), lazy, type_only=type_only)
        graph[module] = {target for target, _ in found if target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every elementary cycle, each once, starting at its alphabetically first module.

    The walk from each start stays inside the start's strongly connected component: a path that
    leaves it can never come back, and following every such path made the search exponential in
    the graph's depth (38 s for 164 modules, over the test's 120 s limit at 171)."""
    component = _components(graph)
    found = []
    for start in sorted(graph):
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        while stack:
            node, successors = stack[-1]
            following = next(successors, None)
            if following is None:
                stack.pop()
                path.pop()
            elif following == start:
                found.append(tuple(path))
            elif following > start and following not in path and component[following] == component[start]:
                stack.append((following, iter(sorted(graph.get(following, ())))))
                path.append(following)
    return found


def _components(graph: dict[str, set[str]]) -> dict[str, int]:
    """Module -> the number of its strongly connected component (Kosaraju, without recursion)."""
    nodes = sorted(set(graph).union(*graph.values()))
    finished, seen = [], set()
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        while stack:
            node, successors = stack[-1]
            following = next(successors, None)
            if following is None:
                stack.pop()
                finished.append(node)
            elif following not in seen:
                seen.add(following)
                stack.append((following, iter(sorted(graph.get(following, ())))))
    reverse = {node: [] for node in nodes}
    for node, targets in graph.items():
        for target in targets:
            reverse[target].append(node)
    component = {}
    for number, root in enumerate(reversed(finished)):
        if root in component:
            continue
        component[root], stack = number, [root]
        while stack:
            for source in reverse[stack.pop()]:
                if source not in component:
                    component[source] = number
                    stack.append(source)
    return component


def show(cycle: tuple[str, ...]) -> str:
    return " -> ".join(cycle + cycle[:1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--lazy", action="store_true", help="count imports inside functions too")
    parser.add_argument("--type-only", action="store_true", help="count imports under `if TYPE_CHECKING:` too")
    parser.add_argument("--edges", action="store_true", help="print every edge first")
    args = parser.parse_args()
    graph = import_graph(args.source, args.lazy, args.type_only)
    if args.edges:
        for module in sorted(graph):
            for target in sorted(graph[module]):
                print(f"{module} -> {target}")
    found = cycles(graph)
    for cycle in found:
        print(show(cycle))
    print(f"{len(found)} cycle(s) among {len(graph)} modules "
          f"({'every import' if args.lazy else 'module-level imports'})", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
