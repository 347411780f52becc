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

# Bottom to top: a module may import modules of its own folder and of the folders below it, never
# above (docs/architecture.md). `read` sits below `builder` because verify and repair read a cache
# through the same checked file access as TokenCache; the read side never imports the build side.
FOLDERS = ["errors", "_util", "order", "format", "read", "builder", "train", "integrations", "pipeline",
           "cli", "__init__",
           "__main__"]
FOLDER_RANK = {folder: rank for rank, folder in enumerate(FOLDERS)}
# Imported inside functions on purpose: optional extras, loaded only when used.
OPTIONAL_EXTRAS = {"ray", "s3fs", "pyarrow", "zstandard", "torchdata", "yaml"}
# Training frameworks (integrations/): each imported at the top of its one integrations module,
# which nothing in the package imports, so only a user's own import loads it.
FRAMEWORK_EXTRAS = {"transformers": "integrations.transformers"}
# integrations/ sits on top of the training side: it reads nothing a build writes and builds nothing.
INTEGRATIONS_MAY_IMPORT = {"train", "read", "format", "order", "_util", "errors"}
# order/ is pure arithmetic: no I/O, no torch, nothing that reaches files or processes.
ORDER_FORBIDDEN = {"torch", "os", "io", "pathlib", "shutil", "tempfile", "subprocess", "mmap", "socket",
                   "fsspec", "safetensors", "tokenizers", "threading", "multiprocessing"}
MAX_TOP_LEVEL_FILES = 6


def _name(path: pathlib.Path) -> str:
    """A module's dotted name inside the package: "read.cache", "cli", "train" (a folder's __init__)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _folder(module: str) -> str:
    return module.split(".")[0]


def _package_of(module: str) -> list[str]:
    """The package a module's relative imports start from."""
    parts = module.split(".")
    path = PACKAGE.joinpath(*parts)
    return parts if path.is_dir() else parts[:-1]


def _resolve(importer: str, node: ast.ImportFrom) -> str | None:
    """The package module an `import from` names (None for other packages)."""
    if node.level == 0:
        if node.module and node.module.split(".")[0] == "torchcache":
            return ".".join(node.module.split(".")[1:]) or "__init__"
        return None
    base = _package_of(importer)
    base = base[:len(base) - (node.level - 1)]
    parts = base + (node.module.split(".") if node.module else [])
    return ".".join(parts) or "__init__"


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str], ast.stmt]]:
    """(module, names, node) for every import of a package module, with `from .x import y` read
    as an import of module x.y when y is a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torchcache" and len(parts) > 1:
                    found.append((".".join(parts[1:]), [], node))
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, node)
            if module is None:
                continue
            submodules = [alias.name for alias in node.names
                          if (f"{module}.{alias.name}" if module != "__init__" else alias.name) in MODULES]
            if submodules:
                found += [((f"{module}.{sub}" if module != "__init__" else sub), [], node) for sub in submodules]
            else:
                found.append((module, [alias.name for alias in node.names], node))
    return found


def _function_level(tree: ast.Module) -> list[ast.stmt]:
    nested = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return nested


MODULES = _modules()


def test_every_module_is_in_a_known_folder():
    assert sorted({_folder(m) for m in MODULES} - set(FOLDER_RANK)) == [], "place new folders in FOLDERS"


def test_few_files_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, f"the package's top holds {top}: put modules in their layer's folder"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_go_down(name):
    rank = FOLDER_RANK[_folder(name)]
    upward = [(module, node.lineno) for module, names, node in _imports(name, MODULES[name])
              if module != "__init__" and FOLDER_RANK[_folder(module)] > rank]
    # __version__ is the one thing the CLI takes from the package's top
    upward += [("__init__", node.lineno) for module, names, node in _imports(name, MODULES[name])
               if module == "__init__" and name != "__main__" and names != ["__version__"]]
    assert upward == [], f"{name} imports a folder above its own"


def test_import_graph_has_no_cycle():
    graph = {name: {m for m, _, _ in _imports(name, tree) if m in MODULES and m != name}
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
    imports = _imports(name, tree)
    private = [f"{module}.{n} (line {node.lineno})" for module, names, node in imports
               for n in names if n.startswith("_") and not n.startswith("__")]
    private += [f"{module} (line {node.lineno})" for module, _, node in imports
                if any(part.startswith("_") and not part.startswith("__") and part != "_util"
                       for part in module.split("."))]
    aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and _resolve(name, node) is not None for alias in node.names}
    aliases |= {alias.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name.startswith("torchcache.") and alias.asname}
    private += [f"{node.value.id}.{node.attr} (line {node.lineno})" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")]
    assert private == [], f"{name} uses another module's private names"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _folder(m) == "order"))
def test_order_is_pure(name):
    """order/ is arithmetic on positions and plans: it must not reach files, processes or torch."""
    roots = set()
    for node in ast.walk(MODULES[name]):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            roots.add("open()")
    assert sorted(roots & (ORDER_FORBIDDEN | {"open()"})) == []


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
    code = ("import sys, torchcache, torchcache.builder.api, torchcache.read.pack_plan, torchcache.builder.worker, "
            "torchcache.cli, torchcache.train.recipe; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _private_definitions(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, methods, classes, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


DEFINED_PRIVATE = {name: _private_definitions(tree) for name, tree in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_attributes_of_other_modules_objects(name):
    """`other._x` on an object of another module's class is a hidden protocol: give it a public
    name instead. (Names this module defines are its own business, and so are `self._x` a class
    inherits from a base class in the same folder.)"""
    own = DEFINED_PRIVATE[name]
    family = set().union(*(names for module, names in DEFINED_PRIVATE.items()
                           if _folder(module) == _folder(name)))
    others = set().union(*(names for module, names in DEFINED_PRIVATE.items() if module != name))
    reached = sorted({f"{ast.unparse(node.value)}.{node.attr} (line {node.lineno})"
                      for node in ast.walk(MODULES[name])
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__") and node.attr not in own
                      and node.attr in others
                      and not (isinstance(node.value, ast.Name) and node.value.id == "self"
                               and node.attr in family)})
    assert reached == [], f"{name} reaches into other modules' objects"


def _roots(tree: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("name", sorted(MODULES))
def test_frameworks_are_imported_only_by_their_integration(name):
    """transformers (and the other training frameworks) are optional extras: only their own
    module in integrations/ imports them."""
    found = {root for root in _roots(MODULES[name]) & set(FRAMEWORK_EXTRAS) if FRAMEWORK_EXTRAS[root] != name}
    assert found == set(), f"{name} imports {sorted(found)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_nothing_imports_integrations(name):
    """integrations/ is imported by users only: `import torchcache` never loads a framework."""
    if _folder(name) == "integrations":
        folders = {_folder(module) for module, _, _ in _imports(name, MODULES[name])}
        assert folders - {"integrations"} <= INTEGRATIONS_MAY_IMPORT, f"{name} imports {sorted(folders)}"
        return
    assert [m for m, _, _ in _imports(name, MODULES[name]) if _folder(m) == "integrations"] == []
