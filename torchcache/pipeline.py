"""A lazy pipeline: records read from inputs, filtered and mapped by your functions, tokenized into
a cache, and read back as datasets (DESIGN.md §9.5).

    pipe = (tc.source("data/*.jsonl.zst", text_key="text")   # nothing runs yet
              .filter(lambda r: len(r["text"]) > 200)         # record -> bool
              .map(clean)                                     # record -> record
              .tokenize("tok/tokenizer.json")
              .cache("caches/web"))                           # built, reused, or resumed
    ds = pipe.windows(2048)                                   # a TokenDataset
    for item in ds.shuffle(seed=0).seek(1000): ...

`.cache()` runs `build_cache`'s engine (local processes or Ray, kill -9 safe, resumable); the
functions run in the build workers, which receive them by value. Each function's code and the
values it reads are fingerprinted into the cache's spec: a changed function makes another cache,
never a silent reuse or resume of the old one, and a function that cannot be fingerprinted (it
reads an open file, an object) is refused at once with the reason. A module of the user's own
code that a step reads counts by its source (see torchcache/builder/functions.py); what a step
reads while it runs (os.environ, a file's contents) cannot be seen. Over webdataset tars each
record is a sample: its members' bytes by extension plus "__key__" and "__url__" (decode the text
in a `map`); documents keep the sample key (`document_info(d)["key"]`).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torchcache as tc

from .builder.api import build_cache, checked_build_arguments
from .builder.engine import progress_enabled, run_build
from .builder.functions import function_fingerprint
from .read.cache import TokenCache

__all__ = ["Pipeline", "PipelineCache", "source"]


def source(inputs: Any, *, text_key: str = "text",
           storage_options: dict[str, Any] | None = None) -> "Pipeline":
    """The start of a lazy pipeline over `inputs` (JSON lines, Parquet or webdataset tar paths,
    globs or URLs, or an iterator of dicts): each record is a dict (a Parquet row as pyarrow's
    `to_pylist` makes it, list columns as lists; a tar's sample as webdataset makes it:
    `{"__key__", "__url__", extension: bytes, ...}`); after the steps, its `text_key` field, a
    string, is tokenized. Nothing is read until :meth:`Pipeline.cache`."""
    if not isinstance(text_key, str) or not text_key:
        raise TypeError(f"text_key must be a non-empty string, not {text_key!r}")
    return Pipeline(inputs, text_key, storage_options=storage_options)


@dataclass(frozen=True)
class Pipeline:
    """Inputs, steps and tokenizer of a cache still to be built (immutable: each call returns a
    new pipeline)."""

    inputs: Any
    text_key: str
    steps: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    tokenizer: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None

    def filter(self, fn: Callable[[dict], Any]) -> "Pipeline":
        """Keep the records for which `fn(record)` is true (the others are counted as skipped,
        reason "filtered")."""
        return self._step("filter", fn)

    def map(self, fn: Callable[[dict], dict]) -> "Pipeline":
        """Replace each record by `fn(record)`, a dict."""
        return self._step("map", fn)

    def _step(self, kind: str, fn: Callable[[Any], Any]) -> "Pipeline":
        if self.tokenizer is not None:
            raise ValueError(f"{kind}() after tokenize(): add the record steps before tokenizing")
        function_fingerprint(fn)  # FunctionError now, naming why, rather than at cache()
        return replace(self, steps=self.steps + ((kind, fn),))

    def tokenize(self, tokenizer: Any, **options: Any) -> "Pipeline":
        """Tokenize the records' text with `tokenizer` (a tokenizer.json path, its folder or a
        `tokenizers.Tokenizer`); `options` are `build_cache`'s (eos, bos, block_tokens,
        num_workers, on_error, executor, progress, ...)."""
        unknown = sorted(set(options) - _BUILD_OPTIONS)
        if unknown:
            raise TypeError(f"tokenize() got unknown options {unknown}; it takes build_cache's: "
                            f"{sorted(_BUILD_OPTIONS)}")
        return replace(self, tokenizer=tokenizer, options=dict(options))

    @property
    def fingerprints(self) -> list[dict[str, str]]:
        """Each step and the fingerprint of its function, as the cache's spec records them."""
        return [{"step": kind, "function": function_fingerprint(fn)} for kind, fn in self.steps]

    def cache(self, output: str | os.PathLike) -> "PipelineCache":
        """Build the cache at `output` (or resume it, or find it complete) and open it."""
        if self.tokenizer is None:
            raise ValueError("call tokenize(tokenizer) before cache(output)")
        options = dict(self.options)
        progress = options.pop("progress", None)
        checked = _build_options(text_key=self.text_key, storage_options=self.storage_options,
                                 **options)
        run_build(self.inputs, output, self.tokenizer, progress=progress_enabled(progress),
                  pipeline=self.steps, **checked)
        return PipelineCache(output, storage_options=self.storage_options)


class PipelineCache(TokenCache):
    """The cache a pipeline built: a :class:`torchcache.TokenCache` with dataset shortcuts."""

    def windows(self, seq_len: int, **options: Any) -> Any:
        """``tc.TokenDataset(self, seq_len, **options)``."""
        return tc.TokenDataset(self, seq_len, **options)

    def pack(self, seq_len: int, **options: Any) -> Any:
        """``tc.PackedDataset(self, seq_len, **options)``."""
        return tc.PackedDataset(self, seq_len, **options)

    def documents(self) -> Any:
        """``tc.DocumentDataset(self)``."""
        return tc.DocumentDataset(self)


_BUILD_OPTIONS = {"block_tokens", "num_workers", "on_error", "executor", "eos", "bos",
                  "special_tokens_as_text", "progress", "allow_empty", "input_format",
                  "chat_template", "train_on", "keep_fields", "arrays", "token_arrays",
                  "block_array_bytes"}


def _build_options(**options: Any) -> dict[str, Any]:
    """build_cache's arguments (its own defaults, then `options`), checked as build_cache checks
    them."""
    defaults = inspect.signature(build_cache).parameters
    arguments = {name: defaults[name].default
                 for name in inspect.signature(checked_build_arguments).parameters}
    arguments.update(options)
    return checked_build_arguments(**arguments)
