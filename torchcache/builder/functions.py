"""A user's record functions (a pipeline's filter and map steps): fingerprinted by what they do,
and sent to build workers by value.

A cache built through functions is a function of their code, so their code and every value they
read (closure cells, defaults, the globals they name) is part of the cache's identity: changing a
function changes the fingerprint, and an old cache is never reused or resumed with a new
function. Build workers are fresh interpreters that may not be able to import the user's script
(a notebook, a `__main__` module), so a function travels by value: its code object (marshal),
and its closure, defaults and globals (modules by name, functions by value, plain values as
they are). Anything else (an open file, a class instance) cannot be fingerprinted or sent: the
error names the function and the value.

A module a function reads (``import helpers`` then ``helpers.clean(...)``) is described by
:func:`describe_module`: an installed one (the standard library, anything under site-packages or
dist-packages, and torchcache itself) by its name and its distribution's version; a module of the
user's own code (any other file: beside the script, or on sys.path from the user's project) by
its name and the sha256 of its source file, and of the source files of every other user module
its namespace reaches (modules it imported, functions and classes it imported from them). So an
edit of ``helpers.py`` (a constant, a function) changes the fingerprint; the hash covers the file
as it is on disk, which is what the build workers import. What a function reads at run time
(``os.environ``, a file's contents) cannot be seen.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib
import importlib.metadata
import json
import marshal
import os
import pickle
import re
import sys
import sysconfig
import types
from typing import Any, Callable

_PLAIN = (type(None), bool, int, float, str, bytes)
_VERSION = f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}"


class FunctionError(TypeError):
    """A function that cannot be fingerprinted or sent to a build worker (the message says why)."""


def function_fingerprint(fn: Callable[..., Any]) -> str:
    """sha256 (hex) of what `fn` does: its code and every value it reads, and the Python version
    (whose bytecode it is)."""
    described = {"python": _VERSION, "function": _describe(_checked(fn), fn.__qualname__, [])}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def pack_function(fn: Callable[..., Any]) -> bytes:
    """`fn` as bytes that :func:`unpack_function` turns back into an equal function in another
    interpreter of the same Python version."""
    _describe(_checked(fn), fn.__qualname__, [])  # refuses what cannot be sent, with its reason
    return pickle.dumps((_VERSION, _packed(fn, [])))


def unpack_function(data: bytes) -> Callable[..., Any]:
    version, packed = pickle.loads(data)
    if version != _VERSION:
        raise FunctionError(f"a function packed by {version} cannot run on {_VERSION}")
    return _unpacked(packed, {})


# ---------------------------------------------------------------- what a function is

def _checked(fn: Any) -> types.FunctionType:
    if not isinstance(fn, types.FunctionType):
        raise FunctionError(f"{fn!r} is a {type(fn).__name__}, not a Python function (def or lambda): "
                            "pipeline steps must be plain functions, so that their code can be "
                            "fingerprinted and sent to build workers")
    return fn


def _global_names(code: types.CodeType) -> set[str]:
    """The global names `code` (and the code nested in it: lambdas, comprehensions) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _code(code: types.CodeType) -> dict[str, Any]:
    return {"bytecode": code.co_code.hex(), "names": list(code.co_names),
            "varnames": list(code.co_varnames), "freevars": list(code.co_freevars),
            "cellvars": list(code.co_cellvars), "args": [code.co_argcount, code.co_posonlyargcount,
                                                         code.co_kwonlyargcount, code.co_flags],
            "consts": [_code(c) if isinstance(c, types.CodeType) else _value(c, "a constant", "", [])
                       for c in code.co_consts]}


def _describe(fn: types.FunctionType, owner: str, stack: list[int]) -> dict[str, Any]:
    if id(fn) in stack:
        return {"recursive": fn.__qualname__}
    stack = stack + [id(fn)]
    where = f"function {fn.__qualname__!r}" + (f" (used by {owner!r})" if owner != fn.__qualname__ else "")
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    return {
        "code": _code(fn.__code__),
        "defaults": _value(fn.__defaults__, "a default", where, stack),
        "kwdefaults": _value(fn.__kwdefaults__, "a default", where, stack),
        "closure": [_value(v, f"the closure value {name!r}", where, stack)
                    for name, v in zip(fn.__code__.co_freevars, cells)],
        "globals": {name: _value(fn.__globals__[name], f"the global {name!r}", where, stack)
                    for name in sorted(_global_names(fn.__code__)) if name in fn.__globals__},
    }


def _value(value: Any, what: str, where: str, stack: list[int]) -> Any:
    """A JSON description of a value a function reads (refused when it says nothing stable)."""
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [_value(v, what, where, stack) for v in value]}
    if isinstance(value, (set, frozenset)):
        items = [_value(v, what, where, stack) for v in value]
        return {"set": sorted(items, key=lambda x: json.dumps(x, sort_keys=True))}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _value(v, what, where, stack) for k, v in value.items()}}
    if isinstance(value, re.Pattern):
        return {"regex": [_value(value.pattern, what, where, stack), value.flags]}
    if isinstance(value, types.ModuleType):
        return describe_module(value)
    if isinstance(value, types.FunctionType):
        return {"function": _describe(value, where or value.__qualname__, stack)}
    if isinstance(value, types.BuiltinFunctionType):
        return {"builtin": f"{value.__module__}.{value.__qualname__}"}
    raise FunctionError(f"cannot fingerprint {where or 'the function'}: {what} is a "
                        f"{type(value).__name__} ({_brief(value)}); a pipeline step may read plain "
                        "values (numbers, strings, tuples, lists, dicts, sets, compiled regexes), "
                        "modules and other functions: pass what it needs as one of those")


def describe_module(module: types.ModuleType) -> dict[str, Any]:
    """What a module a function reads stands for in its fingerprint: ``{"module": name}`` plus
    ``"version"`` (its distribution's) for an installed module, or ``"source"`` (sha256 of its
    source file and of the user modules its namespace reaches) for the user's own code."""
    if _user_file(module) is None:
        version = _installed_version(module.__name__.partition(".")[0])
        return {"module": module.__name__, **({"version": version} if version else {})}
    return {"module": module.__name__, "source": _user_sources(module)}


def _user_file(module: types.ModuleType) -> str | None:
    """The source file of a module of the user's own code; None for the standard library, an
    installed package (site-packages, dist-packages), torchcache itself, and modules without a
    file (built-in, namespace packages)."""
    top = module.__name__.partition(".")[0]
    if top in sys.builtin_module_names or top in sys.stdlib_module_names or top == "torchcache":
        return None
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return None
    for installed in _installed_roots():
        if path.startswith(installed + os.sep):
            return None
    return path


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    """The folders of the standard library and of installed packages (this interpreter's)."""
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib",
                                                                 "purelib", "platlib")
                         if paths.get(key)}))


@functools.lru_cache(maxsize=None)
def _installed_version(top: str) -> str | None:
    """The version of the distribution that provides top-level module `top` (None if none)."""
    for distribution in _distributions().get(top, ()):
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _user_sources(module: types.ModuleType) -> str:
    """sha256 of the source files of `module` and of every user module reached from its
    namespace (a module in it, or the module of a function or class in it), by module name."""
    hashes: dict[str, str] = {}
    todo = [module]
    while todo:
        current = todo.pop()
        path = _user_file(current)
        if current.__name__ in hashes or path is None:
            continue
        with open(path, "rb") as f:
            hashes[current.__name__] = hashlib.sha256(f.read()).hexdigest()
        for value in list(vars(current).values()):
            if isinstance(value, types.ModuleType):
                todo.append(value)
            elif isinstance(value, (types.FunctionType, type)):
                owner = sys.modules.get(getattr(value, "__module__", None) or "")
                if owner is not None:
                    todo.append(owner)
    return hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- sending a function by value

def _packed(fn: types.FunctionType, stack: list[int]) -> dict[str, Any]:
    stack = stack + [id(fn)]
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    pack = lambda value: _pack_value(value, stack)  # noqa: E731
    return {"code": marshal.dumps(fn.__code__), "name": fn.__name__, "qualname": fn.__qualname__,
            "defaults": pack(fn.__defaults__), "kwdefaults": pack(fn.__kwdefaults__),
            "closure": [pack(v) for v in cells],
            "globals": {name: pack(fn.__globals__[name])
                        for name in sorted(_global_names(fn.__code__)) if name in fn.__globals__}}


def _pack_value(value: Any, stack: list[int]) -> Any:
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__, _import_root(value))
    if isinstance(value, types.FunctionType):
        if id(value) in stack:  # recursion: the function being built
            return ("recursive", value.__qualname__)
        return ("function", _packed(value, stack))
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", value.__module__, value.__qualname__)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_pack_value(v, stack) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: _pack_value(v, stack) for k, v in value.items()})
    return ("value", value)


def _unpack_value(packed: Any, building: dict[str, Any]) -> Any:
    kind = packed[0]
    if kind == "module":
        return _import(packed[1], packed[2] if len(packed) > 2 else None)
    if kind == "function":
        return _unpacked(packed[1], building)
    if kind == "recursive":
        return building[packed[1]]
    if kind == "builtin":
        return getattr(importlib.import_module(packed[1] or "builtins"), packed[2])
    if kind in ("tuple", "list"):
        items = [_unpack_value(v, building) for v in packed[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _unpack_value(v, building) for k, v in packed[1].items()}
    return packed[1]


def _import_root(module: types.ModuleType) -> str | None:
    """The sys.path folder a user module was imported from (None for an installed one): a build
    worker, started elsewhere than the user's script, imports it from there."""
    path = _user_file(module)
    if path is None:
        return None
    root = os.path.dirname(path)
    if os.path.splitext(os.path.basename(path))[0] == "__init__":
        root = os.path.dirname(root)
    for _ in range(module.__name__.count(".")):
        root = os.path.dirname(root)
    return root


def _import(name: str, root: str | None) -> types.ModuleType:
    """Module `name`, as this interpreter finds it, else from `root` (the folder the user's
    process imported it from)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if root is None or not name.startswith(error.name or "\0") or root in sys.path:
            raise
    sys.path.append(root)  # appended: never shadows what this interpreter already finds
    return importlib.import_module(name)


def _unpacked(packed: dict[str, Any], building: dict[str, Any]) -> types.FunctionType:
    scope: dict[str, Any] = {"__builtins__": builtins}
    unpack = lambda value: _unpack_value(value, building)  # noqa: E731
    cells = [types.CellType() for _ in packed["closure"]]
    fn = types.FunctionType(marshal.loads(packed["code"]), scope, packed["name"], None,
                            tuple(cells) or None)
    building = dict(building, **{packed["qualname"]: fn})
    unpack = lambda value: _unpack_value(value, building)  # noqa: E731
    fn.__qualname__ = packed["qualname"]
    fn.__defaults__ = unpack(packed["defaults"])
    fn.__kwdefaults__ = unpack(packed["kwdefaults"])
    for cell, value in zip(cells, packed["closure"]):
        cell.cell_contents = unpack(value)
    scope.update({name: unpack(v) for name, v in packed["globals"].items()})
    return fn
