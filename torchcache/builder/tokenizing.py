"""Fast whole-document encoding: EOS/BOS, safe cuts of long documents."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Sequence

import numpy as np
from tokenizers import Tokenizer

from ..format.tokenizer import tokenizer_from_json
from .chat import trained_token_mask

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
# A blank line followed by a non-space: GPT-2's byte-level pre-tokenizer always cuts between the
# two newlines there, so encoding the halves separately yields exactly the same ids.
_SAFE_CUT = re.compile(r"(?<=\n)(?=\n\S)")
_PIECE_CHARS = 16_384


def special_token_id(tok: Tokenizer, token: int | str | None, role: str) -> int | None:
    """Resolve a BOS/EOS argument (id, token string, None, or "auto" for EOS) to an id."""
    if token is None:
        return None
    if isinstance(token, bool):
        raise TypeError(f"{role} must be a token id, a token string, None or 'auto'")
    if token == "auto":
        for candidate in _EOS_CANDIDATES:
            found = tok.token_to_id(candidate)
            if found is not None:
                return found
        raise ValueError(f"could not find an end-of-document token in the tokenizer (tried "
                         f"{', '.join(_EOS_CANDIDATES)}); pass {role}=<id or token string>, or "
                         f"{role}=None to store documents without one")
    if isinstance(token, str):
        found = tok.token_to_id(token)
        if found is None:
            raise ValueError(f"{role}={token!r} is not a token of this tokenizer")
        return found
    if not isinstance(token, (int, np.integer)):
        raise TypeError(f"{role} must be a token id (int), a token string, None or 'auto', "
                        f"not {token!r}")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if not 0 <= int(token) < vocab:
        raise ValueError(f"{role}={token} is outside the vocabulary (size {vocab})")
    return int(token)


def can_cut_safely(tok: Tokenizer) -> bool:
    """True when cutting text at _SAFE_CUT provably leaves the ids unchanged.

    That holds for a byte-level BPE with the GPT-2 regex and no prefix space (GPT-2, GPT-NeoX,
    Pythia...), with no normalizer or NFC, and no added token that could span or eat the cut.
    """
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if not (pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space", True)
            and pre.get("use_regex", True)):
        return False
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        return False
    for added in spec.get("added_tokens", []):
        if "\n" in added["content"] or added.get("lstrip") or added.get("rstrip"):
            return False
    return True


def cut_text(text: str, target: int = _PIECE_CHARS) -> list[str]:
    """Cut a long text into pieces of about `target` characters at safe cut points only."""
    if len(text) <= 2 * target:
        return [text]
    pieces, start = [], 0
    while len(text) - start > 2 * target:
        match = _SAFE_CUT.search(text, start + target)
        if match is None:
            break
        pieces.append(text[start:match.start()])
        start = match.start()
    pieces.append(text[start:])
    return pieces


class DocumentEncoder:
    """Encodes whole documents to id arrays, with BOS/EOS as configured.

    Special-token strings inside the text are encoded as plain text by default, so a document
    cannot inject a boundary or control token.
    """

    def __init__(self, tokenizer_json: str, *, bos_id: int | None, eos_id: int | None,
                 dtype: np.dtype, special_tokens_as_text: bool = True, cut: bool | None = None,
                 piece_chars: int = _PIECE_CHARS):
        self.tok = tokenizer_from_json(tokenizer_json)
        self.tok.encode_special_tokens = special_tokens_as_text
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, np.dtype(dtype)
        self.cut = can_cut_safely(self.tok) if cut is None else cut
        self.piece_chars = piece_chars
        self._token_bytes: np.ndarray | None = None  # made at the first encode_trained
        self._token_bytes_known = False

    def _pieces(self, texts: Sequence[str]) -> tuple[list[str], list[int]]:
        """The texts cut at safe points (when the tokenizer allows), and each text's piece count."""
        pieces: list[str] = []
        counts: list[int] = []
        for text in texts:
            parts = cut_text(text, self.piece_chars) if self.cut else [text]
            pieces.extend(parts)
            counts.append(len(parts))
        return pieces, counts

    def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], np.ndarray]]:
        """Each text's ids (no BOS/EOS) and their (start, end) character offsets in the text."""
        pieces, counts = self._pieces(texts)
        encodings = self.tok.encode_batch(pieces, add_special_tokens=False)
        out, i = [], 0
        for n in counts:
            ids: list[int] = []
            offsets, shift = [], 0
            for piece, enc in zip(pieces[i:i + n], encodings[i:i + n]):
                ids.extend(enc.ids)
                flat = itertools.chain.from_iterable(enc.offsets)  # (numpy's tuple path is slow)
                pairs = np.fromiter(flat, dtype=np.int64, count=2 * len(enc.ids)).reshape(-1, 2)
                offsets.append(pairs + shift)
                shift += len(piece)
            out.append((ids, np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64)))
            i += n
        return out

    def encode_trained(self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's ids (int64, no BOS/EOS) and which are trained: those whose characters
        overlap one of the text's trained `spans` (see chat.trained_token_mask).

        A byte-level BPE tokenizer without a normalizer (GPT-2, Llama 3...) encodes with the fast
        encoder and takes each token's bytes from its vocabulary entry (a third faster than asking
        for offsets); a text whose tokens' bytes do not add up to its own, and any other
        tokenizer, get the tokenizer's character offsets instead.
        """
        if not self._token_bytes_known:
            self._token_bytes, self._token_bytes_known = token_byte_lengths(self.tok), True
        sizes = self._token_bytes
        if sizes is None:
            return [(np.asarray(ids, dtype=np.int64), trained_token_mask(offsets, text_spans))
                    for (ids, offsets), text_spans in zip(self.encode_with_offsets(texts), spans)]
        pieces, counts = self._pieces(texts)
        encodings = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        out: list[Any] = []
        again, i = [], 0
        for k, (text, n) in enumerate(zip(texts, counts)):
            ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings[i:i + n]),
                              dtype=np.int64)
            i += n
            ends = np.cumsum(sizes[ids])
            if (int(ends[-1]) if len(ends) else 0) != len(text.encode("utf-8", "surrogatepass")):
                again.append(k)
                out.append(None)
                continue
            offsets = np.stack([ends - sizes[ids], ends], axis=1)
            out.append((ids, trained_token_mask(offsets, _byte_spans(text, spans[k]))))
        for k, (ids, offsets) in zip(again, self.encode_with_offsets([texts[k] for k in again])):
            out[k] = (np.asarray(ids, dtype=np.int64), trained_token_mask(offsets, spans[k]))
        return out

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        pieces, counts = self._pieces(texts)
        encodings = self.tok.encode_batch_fast(pieces, add_special_tokens=False) \
            if hasattr(self.tok, "encode_batch_fast") else \
            self.tok.encode_batch(pieces, add_special_tokens=False)
        out, i = [], 0
        head = [] if self.bos_id is None else [self.bos_id]
        tail = [] if self.eos_id is None else [self.eos_id]
        for n in counts:
            ids: list[int] = list(head)
            for enc in encodings[i:i + n]:
                ids.extend(enc.ids)
            ids.extend(tail)
            out.append(np.asarray(ids, dtype=self.dtype))
            i += n
        return out



def token_byte_lengths(tok: Tokenizer) -> np.ndarray | None:
    """The UTF-8 bytes of the text each id stands for, for a byte-level BPE tokenizer without a
    normalizer (its vocabulary maps one character to one byte; added tokens are their content);
    None for any other tokenizer."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if (spec.get("normalizer") is not None or len(byte_level) != 1
            or byte_level[0].get("add_prefix_space", True)
            or (spec.get("decoder") or {}).get("type") != "ByteLevel"):
        return None
    lengths = np.full(tok.get_vocab_size(with_added_tokens=True), -1, dtype=np.int64)
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i < len(lengths):
            lengths[i] = len(token)
    for i, added in tok.get_added_tokens_decoder().items():
        if i < len(lengths):
            lengths[i] = len(added.content.encode("utf-8"))
    return None if (lengths < 0).any() else lengths


def _byte_spans(text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character spans of `text` as UTF-8 byte spans."""
    if text.isascii():
        return list(spans)
    positions = sorted({p for span in spans for p in span})
    at, done, previous = {}, 0, 0
    for p in positions:
        done += len(text[previous:p].encode("utf-8", "surrogatepass"))
        at[p], previous = done, p
    return [(at[a], at[b]) for a, b in spans]
