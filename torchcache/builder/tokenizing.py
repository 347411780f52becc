"""Fast whole-document encoding: EOS/BOS, safe cuts of long documents."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Sequence

import numpy as np
from tokenizers import Tokenizer

from ..format.tokenizer import parse_tokenizer_json, tokenizer_from_json
from ..format.tokenizer_backends import TokenizerBackend
from ..format.tokenizer_declarations import Declarations
from .chat import trained_token_mask

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
# A blank line followed by a non-space: a *candidate* cut, between the two newlines. GPT-2's
# pre-tokenizer splits there when the non-space is plain text, but not when it is an added token
# (<|im_end|>, [/INST]...), which the tokenizer splits out first, leaving "\n\n" one token; so
# every cut an encoder makes is also checked by the tokenizer itself (DocumentEncoder.pieces).
_SAFE_CUT = re.compile(r"(?<=\n)(?=\n\S)")
_PIECE_CHARS = 16_384
# A sample with blank lines before words, digits, punctuation, indents and accents: a backend's
# candidate cut patterns are tried on it, and the one it proves most often is used
_PROBE = ("It was the best of times.\n\nIt was the worst of times, 1999.\n\n\"Quoted,\" she "
          "said.\n\n  Indented line.\n\n42 items.\n\nÉté à Paris.\n\nThe end of it.\n\n"
          "- a list\n\nAnother paragraph here.\n\nLast words.")
_CHECK_CHARS = 64  # characters on each side of a cut that the tokenizer encodes to prove it


def special_token_id(tok: Tokenizer, token: int | str | None, role: str,
                     declared: Declarations | None = None) -> int | None:
    """Resolve a BOS/EOS argument (id, token string, None, or "auto") to an id.

    "auto" for eos: the eos_token a model folder or transformers tokenizer declares (`declared`),
    else the first of the usual end-of-text tokens the tokenizer has. "auto" for bos: see
    auto_bos_id.
    """
    if token is None:
        return None
    if isinstance(token, bool):
        raise TypeError(f"{role} must be a token id, a token string, None or 'auto'")
    if token == "auto" and role == "bos":
        return auto_bos_id(tok, declared)
    if token == "auto" and declared is not None and "eos_token" in declared.special_tokens:
        name = declared.special_tokens["eos_token"]
        found = tok.token_to_id(name)
        if found is None:
            raise ValueError(f"{role}='auto': the eos_token {name!r} of {declared.origin} is not a "
                             f"token of the tokenizer; pass {role}=<id or token string>")
        return found
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
    vocab = tok.vocab_size if isinstance(tok, TokenizerBackend) else \
        tok.get_vocab_size(with_added_tokens=True)
    if not 0 <= int(token) < vocab:
        raise ValueError(f"{role}={token} is outside the vocabulary (size {vocab})")
    return int(token)


def auto_bos_id(tok: Tokenizer, declared: Declarations | None = None) -> int | None:
    """bos="auto": the token the tokenizer itself puts before a text (its post-processor's, as
    transformers' tok(text)["input_ids"] starts with it: Llama, Gemma, Llama 3), or none.

    tiktoken and SentencePiece tokenizers put none (pass bos="<s>" for Llama 2's).
    transformers 5 reads the BOS from tokenizer.json's post-processor and ignores
    tokenizer_config.json's add_bos_token (transformers 4's Llama and Gemma tokenizers followed
    add_bos_token instead); a folder whose two files disagree is refused rather than guessed.
    """
    if isinstance(tok, TokenizerBackend):  # tiktoken and sentencepiece encodes add no BOS
        return None
    encoding = tok.encode("a", add_special_tokens=True)
    lead = list(itertools.takewhile(bool, encoding.special_tokens_mask))
    if len(lead) > 1:
        raise ValueError(f"bos='auto': the tokenizer puts {len(lead)} special tokens "
                         f"{encoding.tokens[:len(lead)]} before each text, not one; pass "
                         "bos=<id or token string>")
    found = encoding.ids[0] if lead else None
    add = declared.add_bos_token if declared is not None else None
    if add is not None:
        bos = declared.special_tokens.get("bos_token") if declared is not None else None
        wanted = tok.token_to_id(bos) if add and bos is not None else None
        if add != (found is not None) or (add and wanted != found):
            adds = (f"adds {encoding.tokens[0]!r}" if found is not None else "adds none")
            raise ValueError(
                f"bos='auto': {declared.config if declared else ''} sets add_bos_token "
                f"{str(add).lower()} (bos_token {bos!r}), but the post-processor of its "
                f"tokenizer.json {adds} before each text; transformers 5 follows tokenizer.json, "
                "transformers 4 followed add_bos_token: pass bos=<id or token string> or bos=None")
    return found


def can_cut_safely(tok: Tokenizer) -> bool:
    """True when long texts may be cut before encoding at all: a byte-level BPE with the GPT-2
    regex and no prefix space (GPT-2, GPT-NeoX, Pythia...), with no normalizer or NFC, and no
    added token that could span or eat a cut. Each cut is still proven by the tokenizer before it
    is made (DocumentEncoder.pieces); a blank line before an added token is never one."""
    spec = parse_tokenizer_json(tok.to_str())
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


def cut_points(text: str, target: int = _PIECE_CHARS,
               candidates: re.Pattern[str] = _SAFE_CUT) -> list[int]:
    """Candidate cuts of a long text: the first match of `candidates` at or after every `target`
    characters (none for a text under 2 * target). Candidates only: DocumentEncoder keeps a cut
    only once the tokenizer has shown that it leaves the ids unchanged."""
    cuts: list[int] = []
    start = 0
    while len(text) - start > 2 * target:
        match = candidates.search(text, start + target)
        if match is None:
            break
        start = match.start()
        cuts.append(start)
    return cuts


def cut_text(text: str, target: int = _PIECE_CHARS) -> list[str]:
    """A long text cut into pieces of about `target` characters at the candidate cuts."""
    bounds = [0, *cut_points(text, target), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def cut_candidates(tok: Tokenizer) -> re.Pattern[str]:
    """_SAFE_CUT less the blank lines followed by one of the tokenizer's added tokens (special or
    not), where "\n\n" stays one token."""
    added = sorted({t.content for t in tok.get_added_tokens_decoder().values() if t.content},
                   key=len, reverse=True)
    if not added:
        return _SAFE_CUT
    return re.compile(r"(?<=\n)(?=\n(?!" + "|".join(map(re.escape, added)) + r")\S)")


class DocumentEncoder:
    """Encodes whole documents to id arrays, with BOS/EOS as configured.

    Special-token strings inside the text are encoded as plain text by default, so a document
    cannot inject a boundary or control token.
    """

    def __init__(self, tokenizer_json: str | TokenizerBackend, *, bos_id: int | None,
                 eos_id: int | None, dtype: np.dtype, special_tokens_as_text: bool = True,
                 cut: bool | None = None, piece_chars: int = _PIECE_CHARS):
        self.backend: TokenizerBackend | None = None
        if isinstance(tokenizer_json, TokenizerBackend):  # tiktoken, SentencePiece
            self._init_backend(tokenizer_json, bos_id, eos_id, dtype, special_tokens_as_text,
                               cut, piece_chars)
            return
        self.tok = tokenizer_from_json(untrimmed_offsets(tokenizer_json))
        self.tok.encode_special_tokens = special_tokens_as_text
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, np.dtype(dtype)
        self.cut = can_cut_safely(self.tok) if cut is None else cut
        self.piece_chars = piece_chars
        self._candidates = cut_candidates(self.tok) if self.cut else _SAFE_CUT
        longest = max((len(t.content) for t in self.tok.get_added_tokens_decoder().values()),
                      default=0)
        self._check_chars = max(_CHECK_CHARS, 2 * longest + 2)
        self._token_bytes: np.ndarray | None = None  # made at the first encode_trained
        self._token_bytes_known = False

    def _init_backend(self, backend: TokenizerBackend, bos_id: int | None, eos_id: int | None,
                      dtype: np.dtype, as_text: bool, cut: bool | None, piece_chars: int) -> None:
        """A tiktoken or SentencePiece backend: its library encodes; long texts are cut at the
        backend's candidate cuts that the backend itself proves (a pattern is chosen once, the
        one whose cuts of a sample text it proves most often; none: texts are not cut)."""
        self.tok, self.backend, self.as_text = None, backend, as_text
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, np.dtype(dtype)
        self.piece_chars = piece_chars
        self._check_chars = backend.check_chars
        self._token_bytes, self._token_bytes_known = backend.token_byte_lengths(), True
        self._candidates = _SAFE_CUT
        self.cut = cut is not False
        if self.cut:
            best, proven = None, 0
            for pattern in backend.cut_candidates():
                offered = [m.start() for m in pattern.finditer(_PROBE)]
                kept = len(self.proven_cuts([_PROBE], [offered])[0])
                if kept > proven:
                    best, proven = pattern, kept
            self.cut = best is not None
            self._candidates = best if best is not None else _SAFE_CUT

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids (no BOS/EOS), as lists: what a cut's proof compares."""
        if self.backend is not None:
            return [ids.tolist() for ids in self.backend.encode_batch(texts, self.as_text)]
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def pieces(self, texts: Sequence[str]) -> tuple[list[str], list[int]]:
        """The texts cut into pieces to encode in parallel, and each text's piece count.

        Only for a tokenizer can_cut_safely accepts, and only at cuts the tokenizer proves: the
        text around each candidate cut (_check_chars on each side) is encoded whole and as its
        two halves, and the cut is kept only when the halves' ids join into exactly the whole's.
        A cut it refuses is simply not made (that piece grows).
        """
        cuts = [cut_points(text, self.piece_chars, self._candidates) if self.cut else []
                for text in texts]
        if any(cuts):
            cuts = self.proven_cuts(texts, cuts)
        pieces: list[str] = []
        counts: list[int] = []
        for text, points in zip(texts, cuts):
            bounds = [0, *points, len(text)]
            pieces.extend(text[a:b] for a, b in zip(bounds, bounds[1:]))
            counts.append(len(bounds) - 1)
        return pieces, counts

    def proven_cuts(self, texts: Sequence[str], cuts: list[list[int]]) -> list[list[int]]:
        """The cuts whose two sides encode to exactly the ids of the text around them."""
        width, checks = self._check_chars, []
        for text, points in zip(texts, cuts):
            for c in points:
                a, b = max(0, c - width), min(len(text), c + width)
                checks.extend((text[a:b], text[a:c], text[c:b]))
        ids = iter(self._ids(checks))
        proven = []
        for points in cuts:
            kept = []
            for c in points:
                whole, left, right = next(ids), next(ids), next(ids)
                if whole == left + right:
                    kept.append(c)
            proven.append(kept)
        return proven

    def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], np.ndarray]]:
        """Each text's ids (no BOS/EOS) and their (start, end) character offsets in the text."""
        pieces, counts = self.pieces(texts)
        if self.backend is not None:
            return self._backend_offsets(pieces, counts)
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

    def _backend_offsets(self, pieces: list[str], counts: list[int]
                         ) -> list[tuple[list[int], np.ndarray]]:
        encoded = self.backend.encode_offsets_batch(pieces, self.as_text)
        out, i = [], 0
        for n in counts:
            ids, offsets, shift = [], [np.zeros((0, 2), np.int64)], 0
            for piece, (piece_ids, piece_offsets) in zip(pieces[i:i + n], encoded[i:i + n]):
                ids.extend(piece_ids.tolist())
                offsets.append(piece_offsets + shift)
                shift += len(piece)
            out.append((ids, np.concatenate(offsets)))
            i += n
        return out

    def _backend_ids(self, pieces: list[str], counts: list[int], dtype: Any = np.int64
                     ) -> list[np.ndarray]:
        """Each text's ids (as `dtype`), joined from its pieces' ids."""
        encoded = self.backend.encode_batch(pieces, self.as_text)
        out, i = [], 0
        for n in counts:
            parts = encoded[i:i + n]
            out.append(parts[0].astype(dtype) if n == 1 else np.concatenate(parts).astype(dtype))
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
        pieces, counts = self.pieces(texts)
        if self.backend is not None:
            joined = iter(self._backend_ids(pieces, counts))
        else:
            encodings = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        out: list[Any] = []
        again, i = [], 0
        for k, (text, n) in enumerate(zip(texts, counts)):
            if self.backend is not None:
                ids = next(joined)
            else:
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
        pieces, counts = self.pieces(texts)
        if self.backend is not None:
            head = np.asarray([] if self.bos_id is None else [self.bos_id], dtype=self.dtype)
            tail = np.asarray([] if self.eos_id is None else [self.eos_id], dtype=self.dtype)
            return [np.concatenate([head, ids, tail])
                    for ids in self._backend_ids(pieces, counts, self.dtype)]
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



def untrimmed_offsets(tokenizer_json: str) -> str:
    """The tokenizer.json with its post-processor's offset trimming off (GPT-NeoX, RoBERTa): the
    same ids, but each token's offsets cover all its characters, whitespace included, so a token
    made only of untrained characters (a prompt's trailing spaces) is never taken for a zero-width
    token at the start of a trained span."""
    spec = parse_tokenizer_json(tokenizer_json)
    post = spec.get("post_processor") or {}
    found = False
    for part in [post, *post.get("processors", [])]:
        if isinstance(part, dict) and part.get("trim_offsets"):
            part["trim_offsets"] = False
            found = True
    return json.dumps(spec) if found else tokenizer_json


def token_byte_lengths(tok: Tokenizer) -> np.ndarray | None:
    """The UTF-8 bytes of the text each id stands for, for a byte-level BPE tokenizer without a
    normalizer (its vocabulary maps one character to one byte; added tokens are their content);
    None for any other tokenizer."""
    spec = parse_tokenizer_json(tok.to_str())
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
