"""SentencePiece tokenizers (Llama 2, Gemma, T5...): a `.model` file, encoded by sentencepiece
itself. The cache keeps the model as ``tokenizer.model``.

Ids are ``sp.encode(text)`` exactly (no BOS/EOS: those come from the build's bos/eos options).
sentencepiece takes control-token strings ("</s>") in a text as text; with
special_tokens_as_text=False (chat renderings) the text is split at them, each one becomes its
token and the text between is ``sp.encode``d, as sentencepiece-based tokenizers do.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import numpy as np

from .tokenizer_backends import TokenizerBackend, read_tokenizer_file, require_library

MODEL_NAME = "tokenizer.model"


class SentencePieceTokenizer(TokenizerBackend):
    """A SentencePiece model (BPE or unigram).

    A toy model, trained here by sentencepiece's own trainer:

    >>> import io, sentencepiece
    >>> model = io.BytesIO()
    >>> sentencepiece.SentencePieceTrainer.train(
    ...     sentence_iterator=iter(["the cat sat on the mat", "a cat and a hat"] * 50),
    ...     model_writer=model, vocab_size=30, hard_vocab_limit=False, minloglevel=2)
    >>> with open("toy.model", "wb") as f:
    ...     _ = f.write(model.getvalue())
    >>> tok = tc.sentencepiece_tokenizer("toy.model")
    >>> tok.encode("the cat sat") == tok.processor.encode("the cat sat")
    True
    >>> tok.decode(tok.encode("the cat sat")), tok.token_to_id("</s>")
    ('the cat sat', 2)
    """

    kind = "sentencepiece"

    def __init__(self, model: bytes, where: str = MODEL_NAME):
        self.files = {MODEL_NAME: bytes(model)}
        self.where = where
        self._processor: Any = None
        self._specials: dict[str, int] | None = None
        self._split: re.Pattern[str] | None = None

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "SentencePieceTokenizer":
        return cls(files[MODEL_NAME])

    @property
    def processor(self) -> Any:
        """The ``sentencepiece.SentencePieceProcessor`` (made at first use; needs sentencepiece)."""
        if self._processor is None:
            spm = require_library("sentencepiece")
            sp = spm.SentencePieceProcessor()
            try:
                sp.LoadFromSerializedProto(self.files[MODEL_NAME])
            except (RuntimeError, OSError) as e:
                raise ValueError(f"{self.where}: not a SentencePiece model ({e})") from None
            self._processor = sp
        return self._processor

    def __getstate__(self) -> dict[str, Any]:  # the processor is remade, not pickled
        return {**self.__dict__, "_processor": None, "_split": None}

    # ------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return int(self.processor.get_piece_size())

    def token_to_id(self, token: str) -> int | None:
        sp = self.processor
        i = int(sp.piece_to_id(token))
        if sp.is_unknown(i) and token != sp.id_to_piece(i):
            return None  # sentencepiece answers the unknown id for a piece it does not have
        return i

    def special_tokens(self) -> dict[str, int]:
        """The control pieces (<s>, </s>, ...)."""
        if self._specials is None:
            sp = self.processor
            self._specials = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())
                              if sp.is_control(i) and sp.id_to_piece(i)}
        return dict(self._specials)

    # ------------------------------------------------------------ encoding
    def encode_batch(self, texts: Sequence[str], special_tokens_as_text: bool) -> list[np.ndarray]:
        if special_tokens_as_text:  # (int32 arrays: a fifth faster than lists)
            return self.processor.encode(list(texts), num_threads=1, return_type="numpy")
        return [ids for ids, _ in self.encode_offsets_batch(texts, False)]

    def encode_offsets_batch(self, texts: Sequence[str], special_tokens_as_text: bool
                             ) -> list[tuple[np.ndarray, np.ndarray]]:
        if special_tokens_as_text:
            return [_ids_offsets(r) for r in self._offsets(list(texts))]
        return [self._encode_split(text) for text in texts]

    def _offsets(self, texts: list[str]) -> list[dict[str, Any]]:
        return self.processor.encode(texts, return_type="offset_mapping", num_threads=1)

    def _encode_split(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """A text with its control-token strings as those tokens, the text between sp.encoded."""
        specials = self.special_tokens()
        if self._split is None:
            names = sorted(specials, key=len, reverse=True)
            self._split = re.compile("|".join(map(re.escape, names))) if names else re.compile(r"(?!)")
        parts, at = [], 0  # (start, end, special?)
        for m in self._split.finditer(text):
            parts.append((at, m.start(), False))
            parts.append((m.start(), m.end(), True))
            at = m.end()
        parts.append((at, len(text), False))
        plain = iter(self._offsets([text[a:b] for a, b, special in parts if b > a and not special]))
        ids, offsets = [np.zeros(0, np.int64)], [np.zeros((0, 2), np.int64)]
        for a, b, special in parts:
            if special:
                ids.append(np.array([specials[text[a:b]]], dtype=np.int64))
                offsets.append(np.array([[a, b]], dtype=np.int64))
            elif b > a:
                got, spans = _ids_offsets(next(plain))
                ids.append(got)
                offsets.append(spans + a)
        return np.concatenate(ids), np.concatenate(offsets)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = set(self.special_tokens().values())
            ids = [i for i in ids if i not in special]
        return self.processor.decode(ids)

    def cut_candidates(self) -> Sequence[re.Pattern[str]]:
        """None: a SentencePiece text is encoded whole, never cut. No window around a cut can
        prove it: a unigram model's Viterbi sums scores from the start of the text, and near-ties
        fall differently with what came before (seen: "Timberlakes" segmented la|ke|s 10 K
        characters into a book and l|ak|es 20 K characters in). Each worker encodes in one
        thread, so cutting would not be faster either."""
        return ()


def _ids_offsets(result: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(result["ids"], dtype=np.int64)
    offsets = np.asarray(result["offsets"], dtype=np.int64).reshape(-1, 2)
    return ids, offsets


def sentencepiece_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """The SentencePiece model at `path` (a ``.model`` file), to pass as ``tokenizer=`` (a
    ``.model`` path is taken as one too). Needs sentencepiece
    (``pip install 'torchcache-lm[sentencepiece]'``)."""
    path = os.fspath(path)
    data = read_tokenizer_file(path, "SentencePiece model")
    tok = SentencePieceTokenizer(data, path)
    tok.processor  # noqa: B018 - load it now: a bad file is reported here, naming its path
    return tok
