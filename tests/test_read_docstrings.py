"""The docstring examples of the read side run and say what they show (files ones are skipped)."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
import torch

import torchcache as tc

MODULES = ["torchcache._lru", "torchcache._state", "torchcache.cache_files", "torchcache.collate",
           "torchcache.dataset", "torchcache.loader", "torchcache.mix", "torchcache.read",
           "torchcache.sample", "torchcache.schedule", "torchcache.verify"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"tc": tc, "torch": torch, "np": np},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
