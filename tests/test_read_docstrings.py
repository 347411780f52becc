"""The docstring examples of every torchcache module run and show what they say.

Each module with examples is one test: its examples run (with `tc`, `torch` and `np` defined,
in a fresh working directory), and a module whose examples are all `+SKIP` fails: a docstring
example that never runs is not a check.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest
import torch

import torchcache as tc

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def package_modules() -> list[str]:
    """Every module of the package (but `__main__`, which runs the command line on import)."""
    names = [tc.__name__] + [m.name for m in pkgutil.walk_packages(tc.__path__, tc.__name__ + ".")]
    return sorted(n for n in names if not n.endswith(".__main__"))


def examples(module) -> list[doctest.DocTest]:
    """The docstrings of `module` (its own objects, not those it imports) that hold examples."""
    return [t for t in doctest.DocTestFinder().find(module) if t.examples]


MODULES = [name for name in package_modules() if examples(importlib.import_module(name))]


def test_the_modules_with_examples_are_found():
    """The discovery finds the package's folders (a rename must not make this test vacuous)."""
    assert {"torchcache.order.schedule", "torchcache.train.collate", "torchcache.train.sampler"} \
        <= set(MODULES)
    assert not [n for n in package_modules() if n.startswith("torchcache.dataset")]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    tests = examples(module)
    run = [e for t in tests for e in t.examples if not e.options.get(doctest.SKIP)]
    total = sum(len(t.examples) for t in tests)
    assert run, f"all {total} docstring examples of {name} are skipped: make them runnable " \
                "(build what they need in a temporary directory)"
    monkeypatch.chdir(tmp_path)  # an example that writes relative paths writes here
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in tests:
        test.globs.update({"tc": tc, "torch": torch, "np": np})
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
    assert runner.tries == len(run)
