"""`build_cache`: the one call that tokenizes inputs into a cache (a thin facade).

It checks every argument before anything is read or written, then runs the build engine in
this process, or in the background behind a `BuildHandle`. See `engine` for the build itself,
`worker` for the per-input work, `commit` for the manifest and `executors` for parallelism.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._util.args import int_arg
from .engine import BuildResult, progress_enabled, run_build
from .handle import BuildHandle
from ..format.tokenizer import TokenizerLike


def build_cache(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike | None, *,
                text_key: str = "text", block_tokens: int = 2 ** 24, num_workers: int | None = None,
                on_error: str = "raise", background: bool = False, executor: str = "local",
                eos: int | str | None = "auto", bos: int | str | None = None,
                special_tokens_as_text: bool = True, progress: bool | None = None,
                storage_options: dict[str, Any] | None = None,
                vocab_size: int | None = None, allow_empty: bool = False) -> "BuildResult | BuildHandle":
    """Tokenize `inputs` into a cache at `output`.

    Re-running a finished build with the same arguments is a cheap no-op; an interrupted build
    (even by kill -9) resumes where it stopped and ends with exactly the cache an uninterrupted
    build would have made.

    Args:
        inputs: paths, globs, directories or fsspec URLs (jsonl, txt, parquet, webdataset tar;
            .gz/.zst compressed), webdataset-style `pipe:COMMAND` URLs, or an iterator of strings.
        output: a new or empty directory, or an fsspec URL (s3://...).
        tokenizer: a `tokenizer.json` path (or its folder) or a `tokenizers.Tokenizer` (for a
            Hugging Face fast tokenizer, its `backend_tokenizer`); None only for pre-tokenized
            webdataset samples (see convert_webdataset).
        text_key: the JSON field or Parquet column holding the text.
        block_tokens: tokens per block (whole documents; the unit of parallelism and reading).
        num_workers: worker processes; default the CPUs this process may use (affinity, cgroup).
        on_error: "raise" stops at a bad record naming file and line; "skip" counts it.
        background: return a BuildHandle at once; training can read the committed prefix.
        executor: "local" (processes on this machine) or "ray" (tasks on a Ray cluster).
        eos, bos: a token id, a token string, "auto" (the tokenizer's end-of-text) or None.
        special_tokens_as_text: tokenize "<|endoftext|>" written in a document as plain text.
        progress: a progress bar; default on unless the TQDM_DISABLE environment variable is set.
        storage_options: fsspec options for remote inputs and outputs.
        vocab_size: for pre-tokenized inputs only (sets the dtype, checks the ids).
        allow_empty: accept a build whose inputs hold no document (else BuildError).

    Example:
        >>> result = tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")
        >>> result.num_tokens, result.skipped
        >>> handle = tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json", background=True)
        >>> handle.wait()
    """
    _check_build_arguments(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                           on_error=on_error, background=background, executor=executor, eos=eos,
                           bos=bos, special_tokens_as_text=special_tokens_as_text,
                           progress=progress, storage_options=storage_options,
                           vocab_size=vocab_size, allow_empty=allow_empty)
    kwargs = dict(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                  on_error=on_error, eos=eos, bos=bos, special_tokens_as_text=special_tokens_as_text,
                  storage_options=storage_options, vocab_size=vocab_size, executor=executor,
                  allow_empty=allow_empty)
    if background:
        return BuildHandle.start(inputs, output, tokenizer, kwargs)
    return run_build(inputs, output, tokenizer, progress=progress_enabled(progress), **kwargs)


def _check_build_arguments(*, text_key, block_tokens, num_workers, on_error, background, executor,
                           eos, bos, special_tokens_as_text, progress, storage_options, vocab_size,
                           allow_empty) -> None:
    """Every argument's type and value, before anything is read or written."""
    if not isinstance(text_key, str) or not text_key:
        raise TypeError(f"text_key must be a non-empty string naming the text field, not {text_key!r}")
    int_arg(block_tokens, "block_tokens", minimum=1)
    if num_workers is not None:
        int_arg(num_workers, "num_workers", minimum=0)
    if vocab_size is not None:
        int_arg(vocab_size, "vocab_size", minimum=1, maximum=2 ** 32)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    for name, token in (("eos", eos), ("bos", bos)):
        if token is not None and (isinstance(token, bool) or not isinstance(token, (int, np.integer, str))):
            raise TypeError(f"{name} must be a token id (int), a token string, 'auto' or None, "
                            f"not {token!r}")
    for name, flag in (("background", background), ("special_tokens_as_text", special_tokens_as_text),
                       ("allow_empty", allow_empty)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, not {flag!r}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, not {progress!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options, not {storage_options!r}")
