"""The exceptions a user of torchcache can catch; every other module raises these (or builtins).

Each message names the file, line or argument at fault and says what to do.
"""

from __future__ import annotations


class CacheFormatError(ValueError):
    """A cache file is missing, truncated, corrupted or not in a format this version can read.

    Example:
        >>> try:
        ...     tc.TokenCache("caches/web")
        ... except tc.CacheFormatError as e:
        ...     print(e)   # names the file; `torchcache verify --repair` may fix a damaged block
    """


class BuildError(RuntimeError):
    """The build could not finish; everything committed so far is kept and a re-run resumes.

    Example:
        >>> try:
        ...     tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")
        ... except tc.BuildError as e:
        ...     print(e)   # e.g. another builder holds the output; re-run once it is free
    """


class InputError(ValueError):
    """A malformed input record: the message names the file and line and what to do.

    Example:
        >>> tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json", on_error="skip")
        ... # skips and counts bad records instead of raising InputError
    """


class InputChangedError(InputError):
    """An input differs from the one an interrupted build read: resuming would mix two versions
    of it in one cache. Never skipped, whatever on_error says.

    Example:
        >>> # edit data/part-0.jsonl after a build was killed, then re-run the same build:
        >>> tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")  # InputChangedError
    """
