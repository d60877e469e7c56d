"""Measure kbit_core's import graph: cycles, imports that point up the layer map, and imports of kbit's own modules
made inside functions (or only for type checkers, under ``if TYPE_CHECKING:``).

The graph is grimp's (the one import-linter checks), so these numbers and `lint-imports` agree. The layer map is
read from the "layers" contract in pyproject.toml; ``--layers FILE`` measures against another one (one layer per
line, lowest first, modules of one layer separated by ``|``), e.g. to measure a tree from before the map existed.

Usage: python scripts/import_graph.py [--layers FILE] [--list]
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kbit_core"


def pyproject_layers() -> list[list[str]]:
    """The layers contract of pyproject.toml, lowest layer first, as full module names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    container = contract.get("containers", [""])[0]
    # import-linter lists layers highest first; "a | b" are independent siblings, "a : b" siblings that may import
    # each other.
    layers = []
    for line in reversed(contract["layers"]):
        names = [n.strip().strip("()") for n in line.replace(":", "|").split("|")]
        layers.append([f"{container}.{n}" if container else n for n in names if n])
    return layers


def file_layers(path: Path) -> list[list[str]]:
    return [[n.strip() for n in line.split("|") if n.strip()] for line in path.read_text().splitlines() if line.strip()]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The index of the layer holding ``module`` (by longest matching prefix), None when no layer holds it."""
    best, best_len = None, -1
    for index, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    return best


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one node (each one import cycle or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def folder_of(module: str) -> str:
    """The module's folder: kbit_core.train.loop -> kbit_core.train; a top-level module is its own folder."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _kbit_imports(node: ast.AST) -> list[str]:
    """The kbit modules ``node`` imports, if it is an import ("(relative)" for a relative one)."""
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] if node.level == 0 else ["(relative)"]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        return []
    return [n for n in names if n.split(".")[0] in (PACKAGE, "(relative)")]


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def hidden_imports() -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """(file, line, imported module) for every import of kbit's own modules inside a function, and for every one
    under ``if TYPE_CHECKING:`` (a module-level import that only type checkers make: another way round a cycle)."""
    in_functions, type_only = set(), set()
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        file = str(path.relative_to(ROOT))
        for block in ast.walk(ast.parse(path.read_text())):
            if isinstance(block, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found = in_functions
            elif _is_type_checking(block):
                found = type_only
            else:
                continue
            for node in ast.walk(block):
                found.update((file, node.lineno, name) for name in _kbit_imports(node))
    return sorted(in_functions), sorted(type_only)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=Path, help="a layer map file instead of pyproject's layers contract")
    parser.add_argument("--list", action="store_true", help="list every upward and function-level import")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    layers = file_layers(args.layers) if args.layers else pyproject_layers()

    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    modules = set(graph.modules)
    edges: dict[str, set[str]] = defaultdict(set)
    folder_edges: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            # A package's __init__ importing its own children is how a package exposes them, not a cycle.
            if imported.startswith(module + "."):
                continue
            edges[module].add(imported)
            if folder_of(module) != folder_of(imported):
                folder_edges[folder_of(module)].add(folder_of(imported))

    module_cycles = strongly_connected(modules, edges)
    folder_cycles = strongly_connected({folder_of(m) for m in modules}, folder_edges)
    upward, unmapped = [], sorted(m for m in modules if layer_of(m, layers) is None and m != PACKAGE)
    for module in sorted(modules):
        for imported in sorted(edges[module]):
            low, high = layer_of(module, layers), layer_of(imported, layers)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} -> {imported}")
    local, type_only = hidden_imports()

    print(f"modules: {len(modules)}, imports between them: {sum(len(v) for v in edges.values())}")
    print(f"cycles between files (strongly connected groups): {len(module_cycles)}")
    for component in module_cycles:
        print("  " + " <-> ".join(component))
    print(f"cycles between folders: {len(folder_cycles)}")
    for component in folder_cycles:
        print("  " + " <-> ".join(component))
    print(f"upward imports (against the layer map): {len(upward)}")
    for line in upward if args.list else upward[:20]:
        print("  " + line)
    print(f"modules in no layer: {len(unmapped)}" + (f" ({', '.join(unmapped)})" if unmapped else ""))
    # The CLI's commands import what they run after their config has loaded (its import budget, docs/architecture.md).
    outside_cli = [entry for entry in local if not entry[0].startswith("kbit_core/cli/")]
    print(f"function-level imports of kbit modules: {len(local)} ({len(outside_cli)} outside kbit_core/cli)")
    if args.list:
        for file, line, name in local:
            print(f"  {file}:{line} {name}")
    print(f"imports of kbit modules under TYPE_CHECKING: {len(type_only)}")
    if args.list:
        for file, line, name in type_only:
            print(f"  {file}:{line} {name}")
    return 1 if module_cycles or folder_cycles or upward else 0


if __name__ == "__main__":
    sys.exit(main())
