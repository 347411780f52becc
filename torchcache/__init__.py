"""torchcache: tokenized pre-training data for PyTorch, built once and read with exact resume."""

from .build import BuildError, BuildResult, build_cache
from .format import CacheFormatError
from .handle import BuildHandle
from .inputs import InputError
from .read import TokenCache, verify_cache

__version__ = "0.1.0"

__all__ = [
    "BuildError", "BuildHandle", "BuildResult", "CacheFormatError", "InputError", "TokenCache",
    "build_cache", "verify_cache",
]
