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
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import json
import marshal
import pickle
import re
import sys
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
        return {"module": value.__name__}
    if isinstance(value, types.FunctionType):
        return {"function": _describe(value, where or value.__qualname__, stack)}
    if isinstance(value, types.BuiltinFunctionType):
        return {"builtin": f"{value.__module__}.{value.__qualname__}"}
    raise FunctionError(f"cannot fingerprint {where or 'the function'}: {what} is a "
                        f"{type(value).__name__} ({_brief(value)}); a pipeline step may read plain "
                        "values (numbers, strings, tuples, lists, dicts, sets, compiled regexes), "
                        "modules and other functions: pass what it needs as one of those")


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
        return ("module", value.__name__)
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
        return importlib.import_module(packed[1])
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
