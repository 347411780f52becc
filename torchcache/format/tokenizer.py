"""The tokenizer a cache stores: loading one, its canonical JSON and fingerprint, and loading a
cache's copy back, refused unless it is the one the cache was built with."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from typing import Any, Iterator, Union

from tokenizers import Tokenizer

from ..errors import CacheFormatError
from .model_folder import model_file_path
from .tokenizer_backends import TokenizerBackend
from .tokenizer_kinds import other_backend
from .tokenizer_declarations import is_transformers_tokenizer, transformers_backend, with_declared_tokens

TokenizerLike = Union[str, os.PathLike, Tokenizer, TokenizerBackend]


def load_tokenizer(tokenizer: TokenizerLike) -> Tokenizer | TokenizerBackend:
    """A private copy of the tokenizer with truncation and padding off (documents are never cut);
    a tiktoken or SentencePiece tokenizer as its backend (format.tokenizer_backends).

    A model folder gives its tokenizer.json with the tokens its tokenizer_config.json adds (as
    transformers adds them: tokenizer_declarations); a transformers fast tokenizer, its backend.
    """
    if (backend := other_backend(tokenizer)) is not None:  # tiktoken, SentencePiece
        return backend
    if is_transformers_tokenizer(tokenizer):  # (transformers itself is never imported here)
        tokenizer = transformers_backend(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer_from_json(tokenizer.to_str())
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a tokenizer.json path, a model folder, a "
                        f"tokenizers.Tokenizer, a transformers fast tokenizer, a SentencePiece "
                        f".model path, tc.tiktoken_tokenizer(...) or a tiktoken.Encoding, "
                        f"not {type(tokenizer).__name__}")
    path = os.fspath(tokenizer)
    folder = path if os.path.isdir(path) else None
    if folder is not None:  # a model folder: its tokenizer.json, if any link to it stays inside
        path = model_file_path(path, "tokenizer.json") or os.path.join(path, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer {path!r} does not exist; pass a tokenizer.json "
                                "path or a tokenizers.Tokenizer") from None
    try:
        tok = tokenizer_from_json(data.decode("utf-8"))
    except Exception as e:  # the tokenizers library reports a bad file as a plain Exception
        raise ValueError(f"tokenizer {path!r} could not be loaded as a tokenizer.json: {e}") from None
    return tok if folder is None else with_declared_tokens(tok, folder)


def tokenizer_from_json(text: str) -> Tokenizer:
    """The tokenizer a tokenizer.json text describes, with truncation and padding off: the one
    way the package makes a tokenizer, so that every copy encodes whole documents alike."""
    tok = Tokenizer.from_str(text)
    tok.no_truncation()
    tok.no_padding()
    return tok


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off: parsing a tokenizer.json makes some 10^5 acyclic
    objects (its vocabulary and merges), whose allocations would run several full collections
    over every object of the process (a few tenths of a second, varying from run to run)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_tokenizer_json(text: str) -> dict[str, Any]:
    """A tokenizer.json text as a dict, parsed with the garbage collector paused."""
    with _collector_paused():
        return json.loads(text)


def canonical_json(tok: Tokenizer) -> str:
    with _collector_paused():
        return json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"))


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    return fingerprint_of_json(canonical_json(tok))


def fingerprint_of_json(canonical: str) -> str:
    """The fingerprint of a tokenizer from its :func:`canonical_json`."""
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


#: sha256 of a tokenizer.json's bytes -> its tokenizer fingerprint: a pure function, kept so that
#: checking the same file again costs a hash of its bytes, not a parse and a canonical dump
_FINGERPRINTS: dict[str, str] = {}
_MAX_FINGERPRINTS = 8


def cache_tokenizer(data: bytes, fingerprint: str, path: str) -> Tokenizer:
    """The tokenizer a cache stores (its tokenizer.json bytes, read from `path`), refused unless
    it is the one the cache was built with: its fingerprint must be the spec's `fingerprint`.

    Another valid tokenizer would decode the cache's ids to other text without any error.
    """
    tok = _parse_cache_tokenizer(data, path)
    _check_fingerprint(data, fingerprint, path, tok)
    return tok


def check_cache_tokenizer(data: bytes, fingerprint: str, path: str) -> None:
    """:func:`cache_tokenizer`'s check alone (for verify): a CacheFormatError naming `path`
    unless its bytes are the tokenizer the spec's `fingerprint` names."""
    _check_fingerprint(data, fingerprint, path, None)


def _parse_cache_tokenizer(data: bytes, path: str) -> Tokenizer:
    try:
        return tokenizer_from_json(data.decode("utf-8"))
    except Exception as e:  # the tokenizers library reports a bad file as a plain Exception
        raise CacheFormatError(f"{path}: not a valid tokenizer.json ({e}); {_RESTORE}") from e


def _check_fingerprint(data: bytes, fingerprint: str, path: str, tok: Tokenizer | None) -> None:
    digest = hashlib.sha256(data).hexdigest()
    found = _FINGERPRINTS.get(digest)
    if found is None:
        found = tokenizer_fingerprint(tok if tok is not None else _parse_cache_tokenizer(data, path))
        if len(_FINGERPRINTS) >= _MAX_FINGERPRINTS:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[digest] = found
    if found != fingerprint:
        raise CacheFormatError(f"{path}: not the tokenizer the cache was built with: its fingerprint "
                               f"is {found}, the manifest's spec says {fingerprint} (it would "
                               f"decode the cache's token ids to other text); {_RESTORE}")


_RESTORE = "restore the tokenizer.json the cache was built with"
