"""Limits on what rendering a chat template may cost: work and output, per rendering of a record.

A template is code someone else wrote. The Jinja sandbox stops it reaching files or private
attributes, but not from looping over range(100000) inside range(100000), or from writing a
2 GB text. So every rendering runs under a budget, counted deterministically by the sandbox:

- steps: each loop iteration, call, filter, attribute or item lookup and operator counts one, and
  each one that makes or reads a string or list also counts its length (so the work of C-level
  filters such as `sum` or `join` is counted too);
- output: the characters written by every {{ ... }} and every piece of template text, including
  what {% set %} blocks capture;
- a filter or string method that makes text of a given size (`center`, `ljust`, `indent`...) may
  not take a size above the output limit, nor a format string a width above it (`center(10**10)`
  would allocate before anything could count it), and `*`, `**` and `%` are checked before they
  run.

Both limits grow with the record: a rendering may take MAX_STEPS + STEPS_PER_CHAR steps and write
MAX_OUTPUT + OUTPUT_PER_CHAR characters per character of the record's messages and tools (as
JSON), far more than any real template needs. A wall-clock backstop (MAX_SECONDS per record,
checked as steps are counted) catches what the counts miss. Exceeding a limit raises
RenderLimitExceeded; the chat module turns it into a bad record naming the template.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS = 10_000_000
STEPS_PER_CHAR = 64
MAX_OUTPUT = 4 << 20  # characters
OUTPUT_PER_CHAR = 8
MAX_SECONDS = 120.0
_CLOCK_EVERY = 1 << 14  # steps between two looks at the clock
_MAX_POWER_BITS = 1 << 16

# the filters the instrumented syntax tree calls (a template may call them too: they only count)
LOOP_FILTER, OUTPUT_FILTER, SIZE_FILTER = "torchcache_loop", "torchcache_output", "torchcache_size"


class RenderLimitExceeded(Exception):
    """A rendering went over its budget; the message says which limit."""


@dataclass(frozen=True)
class RecordLimits:
    """The budget of each rendering of one record, and the record's deadline."""

    steps: int
    output: int
    deadline: float

    @classmethod
    def for_input(cls, chars: int) -> "RecordLimits":
        """The limits for a record whose messages and tools take `chars` characters as JSON."""
        return cls(MAX_STEPS + STEPS_PER_CHAR * chars, MAX_OUTPUT + OUTPUT_PER_CHAR * chars,
                   time.monotonic() + MAX_SECONDS)


class _Budget:
    """What one rendering has spent so far."""

    __slots__ = ("limits", "steps", "output", "next_clock")

    def __init__(self, limits: RecordLimits):
        self.limits, self.steps, self.output, self.next_clock = limits, 0, 0, _CLOCK_EVERY

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.steps:
            raise RenderLimitExceeded(f"more than {self.limits.steps:,} steps (loop iterations, "
                                      "calls, filters, lookups and the characters they make)")
        if self.steps >= self.next_clock:
            self.next_clock = self.steps + _CLOCK_EVERY
            if time.monotonic() > self.limits.deadline:
                raise RenderLimitExceeded(f"more than {MAX_SECONDS:.0f} seconds")

    def emit(self, n: int) -> None:
        self.output += n
        if self.output > self.limits.output:
            raise RenderLimitExceeded(f"more than {self.limits.output:,} characters of output")

    def check_size(self, n: int, what: str) -> None:
        if n > self.limits.output:
            raise RenderLimitExceeded(f"{what} of {n:,} (more than the {self.limits.output:,} "
                                      "characters a rendering may write)")


_CURRENT: ContextVar[_Budget | None] = ContextVar("torchcache_render_budget", default=None)


@contextlib.contextmanager
def budget(limits: RecordLimits) -> Iterator[None]:
    """Run one rendering under a fresh budget with these limits."""
    token = _CURRENT.set(_Budget(limits))
    try:
        yield
    finally:
        _CURRENT.reset(token)


_SIZED = (str, list, tuple, dict, range, set, frozenset)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _charge(value: Any = None) -> None:
    """One step, plus the size of `value` (a string or list made or read), to the current budget."""
    current = _CURRENT.get()
    if current is not None:
        current.step(1 + len(value) if isinstance(value, _SIZED) else 1)


# filters and string methods whose integer arguments are sizes of what they make, and those that
# take a format string (whose widths are)
_SIZE_ARGUMENTS = frozenset({"center", "ljust", "rjust", "zfill", "indent", "wordwrap",
                             "expandtabs", "generate_lorem_ipsum"})
_FORMATS = frozenset({"format", "format_map"})
_WIDTHS = re.compile(r"\d{7,}")


def _check_arguments(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Before a call or filter `name` runs: no size argument (or width in a format string) above
    the output limit, since what it would make is allocated before anything can count it."""
    current = _CURRENT.get()
    if current is None or (name not in _SIZE_ARGUMENTS and name not in _FORMATS):
        return
    sizes = name in _SIZE_ARGUMENTS
    for value in (*args, *kwargs.values()):
        if sizes and type(value) is int and abs(value) > current.limits.output:
            current.check_size(abs(value), f"a size argument of {name}")
        elif not sizes and isinstance(value, str):
            _check_widths(value, current)


def _check_widths(template: str, current: _Budget) -> None:
    for width in _WIDTHS.findall(template):
        current.check_size(int(width), "a width in a format string")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, counting steps in every call, lookup and operator it intercepts."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_arguments(getattr(__obj, "__name__", ""), (getattr(__obj, "__self__", None), *args),
                         kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _charge(result)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _charge()
        current = _CURRENT.get()
        if current is not None and attribute in _FORMATS and isinstance(obj, str):
            _check_widths(obj, current)  # (the sandbox wraps str.format: check its string here)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _charge()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        current = _CURRENT.get()
        if current is None:
            return super().call_binop(context, operator, left, right)
        if operator != "+":
            if operator == "%" and isinstance(left, str):
                _check_widths(left, current)
            elif operator == "*":
                for sequence, times in ((left, right), (right, left)):
                    if _size(sequence) and type(times) is int:
                        current.check_size(_size(sequence) * times, "a repetition")
            elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1:
                if right * math.log2(abs(left)) > _MAX_POWER_BITS:
                    raise RenderLimitExceeded(f"a power {left}**{right} of more than "
                                              f"{_MAX_POWER_BITS:,} bits")
        result = self.binop_table[operator](left, right)
        current.step(1 + len(result) if isinstance(result, _SIZED) else 1)
        return result


def bound_filters(env: jinja2.Environment) -> None:
    """Count every filter of `env` (its input's and result's sizes) and add the filters the
    instrumented tree calls; run once the environment's filters are all set."""
    for name, fn in list(env.filters.items()):
        env.filters[name] = _counted_filter(name, fn)
    env.filters[LOOP_FILTER] = _loop
    env.filters[OUTPUT_FILTER] = _output
    env.filters[SIZE_FILTER] = _sized


def _counted_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/env passed first

    @functools.wraps(fn)  # (copies jinja_pass_arg, so Jinja passes the same arguments)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(name, args[skip:], kwargs)
        _charge(args[skip] if len(args) > skip else None)
        result = fn(*args, **kwargs)
        _charge(result)
        return result
    return counted


@jinja2.pass_context  # (never folded into a constant when the template is compiled)
def _loop(context: Any, iterable: Any) -> Any:
    current = _CURRENT.get()
    return iterable if current is None else _counted_items(iterable, current)


def _counted_items(iterable: Any, current: _Budget) -> Iterator[Any]:
    for item in iterable:
        current.step()
        yield item


@jinja2.pass_context
def _output(context: Any, value: Any) -> Any:
    current = _CURRENT.get()
    if current is not None:
        current.emit(len(value) if isinstance(value, str) else len(str(value)))
    return value


@jinja2.pass_context
def _sized(context: Any, value: Any) -> Any:
    _charge(value)
    return value


def instrument(tree: nodes.Template) -> nodes.Template:
    """The template's syntax tree with every loop's items, every output and every `~` counted."""
    for loop in tree.find_all(nodes.For):
        loop.iter = _filtered(loop.iter, LOOP_FILTER)
    for concat in list(tree.find_all(nodes.Concat)):
        _replace(tree, concat, _filtered(concat, SIZE_FILTER))
    for output in tree.find_all(nodes.Output):
        output.nodes = [_filtered(child, OUTPUT_FILTER) for child in output.nodes]
    return tree


def _filtered(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def _replace(tree: nodes.Node, old: nodes.Node, new: nodes.Node) -> None:
    """Put `new` where `old` is in the tree (as a field, or in a list field, of its parent)."""
    for parent in tree.find_all(nodes.Node):
        for field, value in parent.iter_fields():
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                setattr(parent, field, [new if v is old else v for v in value])
                return
