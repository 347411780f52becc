"""The package's import graph: one-way layers, no cycles, no reaching into private names.

Parses every module's source (no import side effects), so a new module must be placed in a
layer here before its imports are accepted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchcache"

# Bottom to top: a module may import only modules in lower layers. The build side (records ...
# build, convert) and the read side (cache_files ... loader) share the layers below format.
LAYERS = [
    ["errors"],
    ["storage", "tokenizing", "_permutation", "_args", "_procs", "_lru", "prefetch"],
    ["packing"],
    ["format", "_state"],
    ["local_copies"],
    ["records", "cache_files", "ledger"],
    ["remote_reads"],
    ["wds", "read", "verify"],
    ["inputs", "dataset", "schedule", "collate", "pack_plan"],
    ["worker", "sample", "mix", "packed", "recipe"],
    ["commit", "loader"],
    ["executors"],
    ["ray_executor"],
    ["engine"],
    ["handle", "repair"],
    ["build"],
    ["convert"],
    ["cli"],
    ["__init__"],
    ["__main__"],
]
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}
# Imported inside functions on purpose: optional extras, loaded only when used.
OPTIONAL_EXTRAS = {"ray", "s3fs", "pyarrow", "zstandard", "torchdata", "yaml"}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def _package_module(node: ast.ImportFrom) -> str | None:
    """The package module an `import from` names (None for other packages)."""
    if node.level == 1:
        return node.module or "__init__"
    if node.level == 0 and node.module and node.module.split(".")[0] == "torchcache":
        parts = node.module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"
    return None


def _imports(tree: ast.Module) -> list[tuple[str, list[str], ast.ImportFrom]]:
    """(module, names, node) for every import of a package module, with `from . import x`
    read as an import of module x."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torchcache" and len(parts) > 1:
                    found.append((parts[1], [], node))
        elif isinstance(node, ast.ImportFrom):
            module = _package_module(node)
            if module == "__init__" and all(alias.name in RANK for alias in node.names):
                found += [(alias.name, [], node) for alias in node.names]
            elif module is not None:
                found.append((module, [alias.name for alias in node.names], node))
    return found


def _function_level(tree: ast.Module) -> list[ast.stmt]:
    nested = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return nested


MODULES = _modules()


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(RANK)) == [], "place new modules in LAYERS"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_go_down(name):
    upward = [(module, node.lineno) for module, _, node in _imports(MODULES[name])
              if module != "__init__" and RANK[module] >= RANK[name]]
    # __version__ is the one thing the CLI takes from the package's top
    upward += [("__init__", node.lineno) for module, names, node in _imports(MODULES[name])
               if module == "__init__" and name != "__main__" and names != ["__version__"]]
    assert upward == [], f"{name} imports a module at its own layer or above"


def test_import_graph_has_no_cycle():
    graph = {name: {m for m, _, _ in _imports(tree) if m in MODULES and m != name}
             for name, tree in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_from_other_modules(name):
    tree = MODULES[name]
    private = [f"{module}.{n} (line {node.lineno})" for module, names, node in _imports(tree)
               for n in names if n.startswith("_") and not n.startswith("__")]
    aliases = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and _package_module(node) == "__init__"
               for alias in node.names}
    aliases |= {alias.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name.startswith("torchcache.") and alias.asname}
    private += [f"{node.value.id}.{node.attr} (line {node.lineno})" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")]
    assert private == [], f"{name} uses another module's private names"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_function_level_imports_are_only_optional_extras(name):
    bad = []
    for node in _function_level(MODULES[name]):
        roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                 else [(node.module or "").split(".")[0] if node.level == 0 else "torchcache"])
        bad += [f"{root} (line {node.lineno})" for root in roots if root not in OPTIONAL_EXTRAS]
    assert bad == [], f"{name} imports inside a function"


def test_the_build_side_and_plans_do_not_import_torch():
    """Build workers and pack planners start fresh interpreters: importing torch (~2 s) in each
    would dominate small jobs. Only the training side (datasets, loader) imports it."""
    code = ("import sys, torchcache, torchcache.build, torchcache.pack_plan, torchcache.worker, "
            "torchcache.cli, torchcache.recipe; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
