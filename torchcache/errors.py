"""The exceptions a user of torchcache can catch; every other module raises these (or builtins).

Each message names the file, line or argument at fault and says what to do.
"""

from __future__ import annotations


class CacheFormatError(ValueError):
    """A cache file is missing, truncated, corrupted or not in a format this version can read.

    Example (a cache whose head.json was replaced by something else):
        >>> import os, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        ...     {"[UNK]": 0, "</s>": 1, "hi": 2}, unk_token="[UNK]"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> out = os.path.join(tmp.name, "cache")
        >>> _ = tc.build_cache(iter(["hi"]), out, tokenizer, progress=False)
        >>> with open(os.path.join(out, "head.json"), "w") as f:
        ...     _ = f.write("not json")
        >>> try:
        ...     tc.TokenCache(out)
        ... except tc.CacheFormatError as e:
        ...     print(type(e).__name__, "naming", os.path.basename(str(e).split(":")[0]))
        CacheFormatError naming head.json
        >>> tmp.cleanup()
    """


class BuildError(RuntimeError):
    """The build could not finish; everything committed so far is kept and a re-run resumes.

    Example:
        >>> try:  # doctest: +SKIP
        ...     tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")
        ... except tc.BuildError as e:
        ...     print(e)   # e.g. another builder holds the output; re-run once it is free
    """


class InputError(ValueError):
    """A malformed input record: the message names the file and line and what to do.

    Example (line 2 of a jsonl input is not JSON):
        >>> import os, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        ...     {"[UNK]": 0, "</s>": 1, "hi": 2}, unk_token="[UNK]"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data = os.path.join(tmp.name, "part-0.jsonl")
        >>> with open(data, "w") as f:
        ...     _ = f.write('{"text": "hi"}\\n{"text": oops}\\n')
        >>> try:
        ...     tc.build_cache(data, os.path.join(tmp.name, "a"), tokenizer, progress=False)
        ... except tc.InputError as e:
        ...     print(type(e).__name__, "at", str(e).split(": ")[0].split(os.sep)[-1])
        InputError at part-0.jsonl:2
        >>> tc.build_cache(data, os.path.join(tmp.name, "b"), tokenizer, on_error="skip",
        ...                progress=False).skipped   # skipped and counted instead
        {'malformed_json': 1}
        >>> tmp.cleanup()
    """


class InputChangedError(InputError):
    """An input differs from the one an interrupted build read: resuming would mix two versions
    of it in one cache. Never skipped, whatever on_error says.

    Example:
        >>> # edit data/part-0.jsonl after a build was killed, then re-run the same build:
        >>> tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")  # doctest: +SKIP
        Traceback (most recent call last):
        torchcache.errors.InputChangedError: data/part-0.jsonl: ...
    """
