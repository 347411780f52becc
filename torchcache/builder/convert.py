"""Converting WebDataset shards into a cache: `convert_webdataset`.

A webdataset shard is a tar whose members are grouped into samples by key (see `wds`). Samples
are records of the builder, numbered from 1 in tar order, so conversion shares the builder's
determinism, resume, progress and error handling; the shards are read by `inputs`.
"""

from __future__ import annotations

import os
from typing import Any

from braceexpand import braceexpand

from .api import build_cache
from .inputs import input_kind

_KIND_NAMES = {"jsonl": "JSON lines", "txt": "text", "parquet": "Parquet"}


def expand_urls(urls: Any) -> list[str]:
    """Brace-expand webdataset URL patterns (`shard-{000000..000099}.tar`), in order; `::`
    separates several patterns, as in webdataset.

    >>> expand_urls("shard-{000..002}.tar::extra.tar")
    ['shard-000.tar', 'shard-001.tar', 'shard-002.tar', 'extra.tar']
    """
    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    out: list[str] = []
    for url in urls:
        for part in os.fspath(url).split("::"):
            out.extend(braceexpand(part))
    if not out:
        raise ValueError("no webdataset URLs given")
    return out


def convert_webdataset(urls: Any, output: str | os.PathLike, *, tokenizer: Any = None,
                       text_key: str | None = None, vocab_size: int | None = None,
                       eos_id: int | None = None, bos_id: int | None = None,
                       **build_options: Any):
    """Convert WebDataset shards into a cache, with the builder's determinism and resume.

    With a `tokenizer`, `text_key` names the text member (default `"txt"`; `"txt.gz"`, or
    `"json:text"` for a field of a JSON member) and documents are tokenized as in `build_cache`
    (EOS from the tokenizer unless `eos_id`/`eos` says otherwise). Without one, `text_key` names a
    member holding token ids (default `"npy"`; `"safetensors"`, `"json"` for a list of ints,
    `"json:ids"`) written as they are, plus `bos_id`/`eos_id` when given; `vocab_size` sets the
    dtype (uint16 when it fits, else uint32) and ids outside it are an error. Every document's
    sample key (`__key__`) is kept: `TokenCache.document_key(i)`. Other options go to
    `build_cache` (num_workers, on_error, block_tokens, background, progress...).

    Typical calls: ``tc.convert_webdataset("shards/train-{000000..000099}.tar", "caches/wds",
    tokenizer="tokenizer.json", text_key="json:text")``, or, for token ids in .npy members,
    ``tc.convert_webdataset("pipe:curl -s https://host/tok-{000..009}.tar", "caches/ids",
    vocab_size=50257, eos_id=50256)``.

    Example (a shard of two text samples):

        >>> import io, os, tarfile, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
        ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with tarfile.open(os.path.join(tmp.name, "shard-000000.tar"), "w") as tar:
        ...     for key, text in [("doc-a", b"hello"), ("doc-b", b"world")]:
        ...         member = tarfile.TarInfo(f"{key}.txt")
        ...         member.size = len(text)
        ...         tar.addfile(member, io.BytesIO(text))
        >>> out = os.path.join(tmp.name, "cache")
        >>> result = tc.convert_webdataset(os.path.join(tmp.name, "shard-{000000..000000}.tar"), out,
        ...                                tokenizer=tokenizer, num_workers=1, progress=False)
        >>> result.num_documents, tc.TokenCache(out).document_key(1)
        (2, 'doc-b')
        >>> tmp.cleanup()
    """
    sources = expand_urls(urls)
    for url in sources:
        kind = input_kind(url)
        if kind is not None and kind != "wds":
            raise ValueError(f"{url} is a {_KIND_NAMES[kind]} file, not a webdataset tar (.tar, "
                             ".tar.gz, .tgz), the only input webdataset conversion reads; for "
                             "JSON lines, text and Parquet files, build them with build_cache")
    if tokenizer is not None:
        if vocab_size is not None:
            raise ValueError("vocab_size comes from the tokenizer; pass it only for pre-tokenized "
                             "samples (tokenizer=None)")
        if eos_id is not None:
            build_options.setdefault("eos", eos_id)
        if bos_id is not None:
            build_options.setdefault("bos", bos_id)
        return build_cache(sources, output, tokenizer, text_key=text_key or "txt", **build_options)
    return build_cache(sources, output, None, text_key=text_key or "npy", vocab_size=vocab_size,
                       eos=eos_id, bos=bos_id, **build_options)
