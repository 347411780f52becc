"""torchcache: tokenized pre-training data for PyTorch, built once and read with exact resume."""

from __future__ import annotations

import importlib
from typing import Any

from .builder.api import build_cache
from .builder.convert import convert_webdataset
from .builder.engine import BuildResult
from .builder.handle import BuildHandle
from .builder.repair import RepairResult, repair_cache
from .builder.verify import Problem, check_cache, verify_cache
from .errors import BuildError, CacheFormatError, InputChangedError, InputError
from .format.sentencepiece_backend import sentencepiece_tokenizer
from .format.tiktoken_backend import tiktoken_tokenizer
from .read.cache import TokenCache

__version__ = "0.1.0"

# The training side needs torch; import it only when used, so build workers start fast and small.
_LAZY = {
    "DataLoader": ".train.loader",
    "DistributedSampler": ".train.sampler",
    "DocumentDataset": ".train.dataset",
    "MixtureDataset": ".train.mix",
    "MixtureSchedule": ".order.schedule",
    "PackedDataset": ".train.packed",
    "RecipeError": ".train.recipe",
    "RecipePlan": ".train.recipe",
    "TokenDataset": ".train.dataset",
    "load_recipe": ".train.recipe",
    "packed_collate": ".train.collate",
    "pad_collate": ".train.collate",
    "plan_recipe": ".train.recipe",
    "source": ".pipeline",
    "trace_step": ".train.trace",
}

__all__ = [
    "BuildError", "BuildHandle", "BuildResult", "CacheFormatError", "DataLoader",
    "DistributedSampler", "DocumentDataset", "InputChangedError", "InputError", "MixtureDataset",
    "MixtureSchedule", "PackedDataset", "Problem", "RecipeError", "RecipePlan", "RepairResult",
    "TokenCache", "TokenDataset", "build_cache", "check_cache", "convert_webdataset", "load_recipe",
    "packed_collate", "pad_collate", "plan_recipe", "repair_cache", "sentencepiece_tokenizer",
    "source", "tiktoken_tokenizer", "trace_step", "verify_cache",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
