"""torchcache: tokenized pre-training data for PyTorch, built once and read with exact resume."""

from __future__ import annotations

import importlib
from typing import Any

from .build import BuildError, BuildResult, build_cache
from .convert import convert_webdataset
from .format import CacheFormatError
from .handle import BuildHandle
from .inputs import InputChangedError, InputError
from .read import Problem, TokenCache, check_cache, verify_cache
from .repair import RepairResult, repair_cache

__version__ = "0.1.0"

# The training side needs torch; import it only when used, so build workers start fast and small.
_LAZY = {
    "DataLoader": ".loader",
    "DistributedSampler": ".sample",
    "DocumentDataset": ".dataset",
    "MixtureDataset": ".mix",
    "TokenDataset": ".dataset",
}

__all__ = [
    "BuildError", "BuildHandle", "BuildResult", "CacheFormatError", "DataLoader",
    "DistributedSampler", "DocumentDataset", "InputChangedError", "InputError", "MixtureDataset",
    "Problem", "RepairResult", "TokenCache", "TokenDataset", "build_cache", "check_cache",
    "convert_webdataset", "repair_cache", "verify_cache",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
