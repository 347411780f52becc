"""The docstring examples of the read side run and say what they show (files ones are skipped)."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
import torch

import torchcache as tc

MODULES = ["torchcache._util.lru", "torchcache.order.state", "torchcache.read.cache_files", "torchcache.train.collate",
           "torchcache.train.dataset", "torchcache.train.loader", "torchcache.train.mix", "torchcache.read.cache",
           "torchcache.train.sampler", "torchcache.order.schedule", "torchcache.build.verify"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"tc": tc, "torch": torch, "np": np},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
