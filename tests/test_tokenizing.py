"""Cutting long documents before encoding must never change the ids."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.builder.tokenizing import DocumentEncoder, can_cut_safely, cut_text
from torchcache.format.tokenizer import load_tokenizer

_ALPHABET = st.sampled_from(["\n", "\n\n", " ", "  ", "\t", "\r", "a", "B", "7", ".", "'s", "é",
                             "\u00a0", "\u2028", "\x1c", "日本", "<|endoftext|>", " the", "\n \n"])


@functools.lru_cache(maxsize=None)
def _gpt2(path):
    tok = load_tokenizer(path)
    tok.encode_special_tokens = True
    return tok


def _whole(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


@settings(max_examples=300, deadline=None)
@given(st.lists(_ALPHABET, min_size=0, max_size=80).map("".join), st.integers(1, 12))
def test_cut_pieces_encode_to_the_same_ids(gpt2_tokenizer_path, text, target):
    tok = _gpt2(gpt2_tokenizer_path)
    pieces = cut_text(text, target)
    assert "".join(pieces) == text
    ids = [i for p in pieces for i in _whole(tok, p)]
    assert ids == _whole(tok, text)


def test_encoder_matches_whole_document_encoding_on_real_books(gpt2_tokenizer_path, books):
    tok = load_tokenizer(gpt2_tokenizer_path)
    assert can_cut_safely(tok)
    encoder = DocumentEncoder(tok.to_str(), bos_id=None, eos_id=None, dtype=np.uint16,
                              piece_chars=1000)
    texts = [b["text"] for b in books]
    assert sum(len(cut_text(t, 1000)) for t in texts) > 5 * len(texts), "books must actually be cut"
    for text, ids in zip(texts, encoder.encode(texts)):
        assert ids.tolist() == _whole(tok, text)


def test_no_cutting_for_tokenizers_without_a_known_safe_cut():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    assert not can_cut_safely(wordpiece)
    prefixed = Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not can_cut_safely(prefixed)
    lowered = Tokenizer(models.BPE())
    lowered.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lowered.normalizer = normalizers.Lowercase()
    assert not can_cut_safely(lowered)
    encoder = DocumentEncoder(wordpiece.to_str(), bos_id=None, eos_id=None, dtype=np.uint16)
    assert encoder.cut is False
