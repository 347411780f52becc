"""torchcache: tokenized pre-training data for PyTorch, built once and read with exact resume."""

from __future__ import annotations

import importlib
from typing import Any

from .build import build_cache
from .engine import BuildResult
from .convert import convert_webdataset
from .errors import BuildError, CacheFormatError, InputChangedError, InputError
from .handle import BuildHandle
from .read import TokenCache
from .verify import Problem, check_cache, verify_cache
from .repair import RepairResult, repair_cache

__version__ = "0.1.0"

# The training side needs torch; import it only when used, so build workers start fast and small.
_LAZY = {
    "DataLoader": ".loader",
    "DistributedSampler": ".sample",
    "DocumentDataset": ".dataset",
    "MixtureDataset": ".mix",
    "MixtureSchedule": ".schedule",
    "PackedDataset": ".packed",
    "TokenDataset": ".dataset",
    "packed_collate": ".collate",
    "pad_collate": ".collate",
}

__all__ = [
    "BuildError", "BuildHandle", "BuildResult", "CacheFormatError", "DataLoader",
    "DistributedSampler", "DocumentDataset", "InputChangedError", "InputError", "MixtureDataset",
    "MixtureSchedule", "PackedDataset", "Problem", "RepairResult", "TokenCache", "TokenDataset", "build_cache",
    "check_cache", "convert_webdataset", "packed_collate", "pad_collate", "repair_cache",
    "verify_cache",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
