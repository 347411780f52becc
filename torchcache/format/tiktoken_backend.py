"""tiktoken tokenizers: a `.tiktoken` BPE ranks file plus its split pattern and special tokens
(or a ``tiktoken.Encoding``), encoded by tiktoken itself.

The cache keeps the ranks (``tokenizer.tiktoken``, tiktoken's own format: base64 token, rank,
one a line, in rank order) and ``tokenizer.tiktoken.json`` (pattern, special tokens).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from .tokenizer_backends import TokenizerBackend, read_tokenizer_file, require_library

RANKS_NAME = "tokenizer.tiktoken"
CONFIG_NAME = "tokenizer.tiktoken.json"

#: GPT-2's split pattern, as tiktoken writes it (tiktoken_ext.openai_public.r50k_pat_str)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
PATTERNS = {"gpt2": GPT2_PATTERN}


class TiktokenTokenizer(TokenizerBackend):
    """A tiktoken BPE: ranks (token bytes -> id), split pattern, special tokens (text -> id).

    A toy ranks file (every byte, then one merge) in tiktoken's format:

    >>> import base64
    >>> ranks = [bytes([b]) for b in range(256)] + [b"hi"]
    >>> with open("toy.tiktoken", "wb") as f:
    ...     _ = f.writelines(base64.b64encode(t) + b" %d\\n" % i for i, t in enumerate(ranks))
    >>> tok = tc.tiktoken_tokenizer("toy.tiktoken")  # the gpt2 pattern; <|endoftext|> = 257
    >>> tok.encode("hi hi!"), tok.vocab_size, tok.token_to_id("<|endoftext|>")
    ([256, 32, 256, 33], 258, 257)
    >>> tok.decode([256, 32, 256])
    'hi hi'
    """

    kind = "tiktoken"

    def __init__(self, ranks: Mapping[bytes, int], pattern: str, special_tokens: Mapping[str, int],
                 where: str = "tiktoken tokenizer", files: dict[str, bytes] | None = None):
        self.ranks = dict(ranks)
        self.pattern = pattern
        self.specials = {str(k): int(v) for k, v in special_tokens.items()}
        taken = set(self.ranks.values())
        for text, i in self.specials.items():
            if i in taken:
                raise ValueError(f"{where}: special token {text!r} has id {i}, which is also the "
                                 "rank of a token of the ranks file; give it an unused id")
        if files is None:  # the canonical files: ranks in rank order, settings as sorted JSON
            lines = sorted(self.ranks.items(), key=lambda kv: kv[1])
            ranks_file = b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n"
                                  for t, r in lines)
            config = json.dumps({"pattern": pattern,
                                 "special_tokens": dict(sorted(self.specials.items()))},
                                sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
            files = {RANKS_NAME: ranks_file, CONFIG_NAME: config}
        self.files = files
        self._encoding: Any = None
        self._lengths: np.ndarray | None = None

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "TiktokenTokenizer":
        """The tokenizer whose files these are (a cache's, checked by hash, or a build's, sent
        to its workers): kept as they are, not made again."""
        config = json.loads(files[CONFIG_NAME].decode("utf-8"))
        return cls(parse_ranks(files[RANKS_NAME], RANKS_NAME), config["pattern"],
                   config["special_tokens"], RANKS_NAME, dict(files))

    @property
    def encoding(self) -> Any:
        """The ``tiktoken.Encoding`` (made at first use; needs tiktoken)."""
        if self._encoding is None:
            tiktoken = require_library("tiktoken")
            self._encoding = tiktoken.Encoding("torchcache", pat_str=self.pattern,
                                               mergeable_ranks=self.ranks,
                                               special_tokens=self.specials)
        return self._encoding

    def __getstate__(self) -> dict[str, Any]:  # the Encoding is remade, not pickled
        return {**self.__dict__, "_encoding": None}

    # ------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return max([*self.ranks.values(), *self.specials.values()]) + 1

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        return self.ranks.get(token.encode("utf-8"))

    def special_tokens(self) -> dict[str, int]:
        return dict(self.specials)

    # ------------------------------------------------------------ encoding
    def encode_batch(self, texts: Sequence[str], special_tokens_as_text: bool) -> list[np.ndarray]:
        return [self._encode(text, special_tokens_as_text)[0] for text in texts]

    def _encode(self, text: str, as_text: bool) -> tuple[np.ndarray, str]:
        """(ids, the text tiktoken encoded): tiktoken's encode_ordinary, or its encode with every
        special token allowed; a text with lone surrogates is encoded as tiktoken's encode does
        (each one becomes U+FFFD)."""
        enc = self.encoding
        allowed = set() if as_text else "all"
        try:
            return enc.encode_to_numpy(text, allowed_special=allowed, disallowed_special=()), text
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return enc.encode_to_numpy(text, allowed_special=allowed, disallowed_special=()), text

    def encode_offsets_batch(self, texts: Sequence[str], special_tokens_as_text: bool
                             ) -> list[tuple[np.ndarray, np.ndarray]]:
        sizes = self.token_byte_lengths()
        out = []
        for text in texts:
            ids, encoded = self._encode(text, special_tokens_as_text)
            ends = np.cumsum(sizes[ids])
            out.append((ids, _char_offsets(encoded, ends - sizes[ids], ends)))
        return out

    def token_byte_lengths(self) -> np.ndarray:
        """Each id's bytes: its ranks entry (the token's bytes), a special token's UTF-8."""
        if self._lengths is None:
            lengths = np.zeros(self.vocab_size, dtype=np.int64)
            for token, i in self.ranks.items():
                lengths[i] = len(token)
            for text, i in self.specials.items():
                lengths[i] = len(text.encode("utf-8"))
            self._lengths = lengths
        return self._lengths

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = set(self.specials.values())
            ids = [i for i in ids if i not in special]
        return self.encoding.decode(ids)


def _char_offsets(text: str, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Byte spans of `text`'s UTF-8 as (start, end) character spans (a span that ends inside a
    character takes all of it)."""
    if text.isascii():
        return np.stack([starts, ends], axis=1).astype(np.int64)
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    char_of_byte = np.cumsum((raw & 0xC0) != 0x80) - 1
    char_of_byte = np.append(char_of_byte, len(text))  # the end of the text
    first = char_of_byte[starts]
    last = np.where(ends > starts, char_of_byte[np.maximum(ends - 1, 0)] + 1, first)
    return np.stack([first, last], axis=1).astype(np.int64)


def parse_ranks(data: bytes, where: str) -> dict[bytes, int]:
    """A .tiktoken file's ranks (token bytes -> rank); ValueError naming the line otherwise."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{where}:{number}: not a tiktoken ranks line (base64 token, space, "
                             f"rank): {line[:80]!r} ({e})") from None
    if not ranks:
        raise ValueError(f"{where}: holds no ranks; pass a .tiktoken BPE file")
    return ranks


def tiktoken_tokenizer(path: str | os.PathLike, pattern: str = "gpt2",
                       special_tokens: Mapping[str, int] | None = None) -> TiktokenTokenizer:
    """A tiktoken tokenizer to pass as ``tokenizer=``: the BPE ranks of the `.tiktoken` file at
    `path`, split by `pattern` ("gpt2", built in, or a regex as tiktoken takes it) with
    `special_tokens` (text -> id; default ``{"<|endoftext|>": <the id after the last rank>}``,
    GPT-2's). Encoding needs tiktoken (``pip install 'torchcache-lm[tiktoken]'``).

    >>> tok = tc.tiktoken_tokenizer("gpt2.tiktoken", special_tokens={"<|endoftext|>": 50256})  # doctest: +SKIP
    >>> tc.build_cache("data/*.jsonl", "caches/web", tok)  # doctest: +SKIP
    """
    path = os.fspath(path)
    data = read_tokenizer_file(path, "tiktoken ranks file")
    ranks = parse_ranks(data, path)
    if special_tokens is None:
        special_tokens = {"<|endoftext|>": max(ranks.values()) + 1}
    return TiktokenTokenizer(ranks, PATTERNS.get(pattern, pattern), special_tokens, path)


def from_encoding(encoding: Any) -> TiktokenTokenizer:
    """A ``tiktoken.Encoding``'s ranks, pattern and special tokens (tiktoken has no public name
    for its ranks and pattern; these two attributes are what its own constructor stores)."""
    specials = {text: encoding.encode_single_token(text) for text in encoding.special_tokens_set}
    return TiktokenTokenizer(encoding._mergeable_ranks, encoding._pat_str, specials,
                             f"tiktoken encoding {encoding.name!r}")


def is_encoding(obj: Any) -> bool:
    """True for a ``tiktoken.Encoding`` (checked without importing tiktoken)."""
    return type(obj).__module__.startswith("tiktoken") and type(obj).__name__ == "Encoding"


def from_spec(spec: str) -> TiktokenTokenizer:
    """``tiktoken:PATH[:PATTERN]`` (the CLI's ``-t``): the ranks file and its pattern (default gpt2)."""
    rest = spec[len("tiktoken:"):]
    path, _, pattern = rest.partition(":")
    if os.path.exists(rest):  # a path that holds a colon
        path, pattern = rest, ""
    return tiktoken_tokenizer(path, pattern or "gpt2")
