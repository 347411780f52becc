"""Converting WebDataset tars: reading samples from tars, and `convert_webdataset`.

A webdataset shard is a tar whose members are grouped into samples by key: the member path up to
the first dot of its file name (`shard/000123.txt.gz` has key `shard/000123`, extension
`txt.gz`). Samples are records of the builder, numbered from 1 in tar order, so conversion shares
the builder's determinism, resume, progress and error handling.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from typing import Any, Iterator

import fsspec
import numpy as np

from .inputs import InputError, InputSource, Record, _Counting

_TOKEN_EXTENSIONS = ("npy", "safetensors", "json", "ids.json")


def split_member(name: str) -> tuple[str, str]:
    """(key, extension) of a tar member, by webdataset's rule."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext if dot else ""


def parse_member_spec(spec: str) -> tuple[str, str | None]:
    """`"txt"` -> ("txt", None); `"json:text"` -> ("json", "text"): member extension, JSON field."""
    ext, _, field = spec.partition(":")
    if not ext:
        raise ValueError(f"text_key={spec!r}: name a member extension, e.g. 'txt', 'txt.gz', "
                         "'json:text' or (pre-tokenized) 'npy'")
    return ext.lower(), field or None


def _samples(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, bytes], str]]:
    """(key, {extension: bytes}, last member name) of consecutive members sharing a key."""
    key, members, last = None, {}, ""
    for info in tar:
        if not info.isfile():
            continue
        name = info.name
        base = name.rpartition("/")[2]
        if base.startswith(("__", ".")):
            continue
        k, ext = split_member(name)
        if key is not None and k != key:
            yield key, members, last
            members = {}
        key, last = k, name
        data = tar.extractfile(info)
        members[ext.lower()] = data.read() if data is not None else b""
    if key is not None:
        yield key, members, last


def iter_tar_records(source: InputSource, text_key: str, start: int, on_error: str,
                     storage_options: dict[str, Any] | None, tokens: bool) -> Iterator[Record]:
    """Samples of one webdataset shard after sample `start`, as text or token records."""
    ext, field = parse_member_spec(text_key)
    number, last = 0, ""
    with fsspec.open(source.path, "rb", **(storage_options or {})) as raw:
        counted = _Counting(raw)
        try:
            with tarfile.open(fileobj=io.BufferedReader(counted, 1 << 20), mode="r|*") as tar:
                for key, members, last in _samples(tar):
                    number += 1
                    if number <= start:
                        continue
                    yield _sample_record(source, number, key, members, ext, field, tokens,
                                         counted.count, on_error)
        except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as e:
            where = f"after member {last!r}" if last else "at its start"
            message = (f"{source.path}: cannot read the tar {where} ({type(e).__name__}: {e}); "
                       "the shard is truncated or corrupted")
            if on_error == "raise":
                raise InputError(message + "; fix or remove it, or pass on_error='skip'") from None
            yield Record(number + 1, None, "unreadable", counted.count)


def _sample_record(source: InputSource, number: int, key: str, members: dict[str, bytes],
                   ext: str, field: str | None, tokens: bool, position: int,
                   on_error: str) -> Record:
    def problem(reason: str, detail: str) -> Record:
        if on_error == "raise":
            raise InputError(f"{source.path}: sample {key!r} (member {key}.{ext}): {detail}. Fix "
                             "the shard, or pass on_error='skip' to skip and count such samples")
        return Record(number, None, reason, position, key=key)

    if ext not in members:
        return problem("missing_text", f"no {ext!r} member (the sample has "
                                       f"{sorted(members) or 'no members'}); set text_key")
    data = members[ext]
    if ext.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            return problem("unreadable", f"cannot decompress ({e})")
    if tokens:
        try:
            ids = _decode_tokens(data, ext, field)
        except ValueError as e:
            return problem("bad_tokens", str(e))
        return Record(number, None, None, position, tokens=ids, key=key)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return problem("invalid_utf8", f"invalid UTF-8 at byte {e.start}")
    if field is not None:
        try:
            obj = json.loads(text)
        except ValueError as e:
            return problem("malformed_json", f"malformed JSON ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            return problem("missing_text", f"no string field {field!r} in the JSON member")
        text = obj[field]
    return Record(number, text, None, position, key=key)


def _decode_tokens(data: bytes, ext: str, field: str | None) -> np.ndarray:
    """Token ids from an .npy (no pickle), .safetensors (one tensor) or JSON list member."""
    base = ext[:-3] if ext.endswith(".gz") else ext
    if base.endswith("npy"):
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as e:
            raise ValueError(f"not a readable .npy array ({e})") from None
    elif base.endswith("safetensors"):
        from safetensors.numpy import load
        try:
            tensors = load(data)
        except Exception as e:
            raise ValueError(f"not a readable safetensors file ({e})") from None
        if field is None and len(tensors) != 1:
            raise ValueError(f"holds tensors {sorted(tensors)}; name one, e.g. "
                             f"text_key='safetensors:{sorted(tensors)[0]}'")
        array = tensors[field] if field else next(iter(tensors.values()))
    elif base.endswith("json"):
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise ValueError(f"malformed JSON ({e})") from None
        if field is not None:
            obj = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(obj, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in obj):
            raise ValueError("is not a JSON list of integer token ids")
        array = np.asarray(obj, dtype=np.int64) if obj else np.zeros(0, dtype=np.int64)
    else:
        raise ValueError(f"extension {ext!r} does not hold token ids (use one of "
                         f"{', '.join(_TOKEN_EXTENSIONS)})")
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"holds a {array.dtype} array of shape {array.shape}, not a 1-D array of "
                         "integer token ids")
    return array


def expand_urls(urls: Any) -> list[str]:
    """Brace-expand webdataset URL patterns (`shard-{000000..000099}.tar`), in order."""
    from braceexpand import braceexpand
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
    """
    from .build import build_cache
    sources = expand_urls(urls)
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
