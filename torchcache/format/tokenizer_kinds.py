"""Which tokenizer backend a value is (tiktoken, SentencePiece), and making one from a cache's
stored files: the one module that knows every backend (format.tokenizer_backends has what they
share)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

from ..errors import CacheFormatError
from . import sentencepiece_backend, tiktoken_backend
from .sentencepiece_backend import SentencePieceTokenizer
from .tiktoken_backend import TiktokenTokenizer
from .model_folder import model_file_path
from .tokenizer_backends import TokenizerBackend, check_backend_files


def _loaders() -> dict[str, Callable[[dict[str, bytes]], TokenizerBackend]]:
    return {"tiktoken": TiktokenTokenizer.from_files,
            "sentencepiece": SentencePieceTokenizer.from_files}


def backend_from_files(kind: str, files: Mapping[str, bytes] | Sequence[tuple[str, bytes]]
                       ) -> TokenizerBackend:
    """The backend `kind` made from its stored files."""
    loaders = _loaders()
    if kind not in loaders:
        raise CacheFormatError(f"tokenizer kind {kind!r} is not one this torchcache knows "
                               f"({', '.join(['hf', *loaders])}); upgrade torchcache")
    return loaders[kind](dict(files))


def cache_backend(spec_tokenizer: dict[str, Any], files: Mapping[str, bytes],
                  where: Callable[[str], str]) -> TokenizerBackend:
    """The backend a cache stores, refused (CacheFormatError naming the file) unless every file is
    the one the cache was built with."""
    check_backend_files(spec_tokenizer, files, where)
    return backend_from_files(spec_tokenizer["kind"], files)


def other_backend(tokenizer: Any) -> TokenizerBackend | None:
    """`tokenizer` as a tiktoken or SentencePiece backend when it is one (a backend, a
    ``tiktoken.Encoding``, a ``tiktoken:PATH[:PATTERN]`` string, a ``.model`` path, a model
    folder with a ``tokenizer.model`` and no ``tokenizer.json``); None for
    anything else (a Hugging Face tokenizer, or a mistake load_tokenizer reports)."""
    if isinstance(tokenizer, TokenizerBackend):
        return tokenizer
    if tiktoken_backend.is_encoding(tokenizer):
        return tiktoken_backend.from_encoding(tokenizer)
    if not isinstance(tokenizer, (str, os.PathLike)):
        return None
    path = os.fspath(tokenizer)
    if isinstance(path, str) and path.startswith("tiktoken:"):
        return tiktoken_backend.from_spec(path)
    if isinstance(path, str) and path.endswith(".tiktoken"):
        raise ValueError(f"tokenizer {path!r}: a .tiktoken file needs its split pattern and "
                         "special tokens: pass tc.tiktoken_tokenizer(path, pattern='gpt2' or a "
                         "regex, special_tokens={...}), or 'tiktoken:PATH[:PATTERN]'")
    if isinstance(path, str) and path.endswith(".model") and not os.path.isdir(path):
        return sentencepiece_backend.sentencepiece_tokenizer(path)
    if os.path.isdir(path) and model_file_path(path, "tokenizer.json") is None:
        model = model_file_path(path, "tokenizer.model")  # a SentencePiece folder (Llama 2 style)
        if model is not None:
            return sentencepiece_backend.sentencepiece_tokenizer(model)
    return None
