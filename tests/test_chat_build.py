"""Chat, instruction and pre-tokenized builds (format v3): the stored tokens and loss masks equal an
independent oracle, records keep their provenance, bad records name their file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import torchcache as tc
from test_chat import (CHATML, LLAMA3, SPECIAL, chatml_pieces, expected, generate_conversations,
                       llama3_pieces, loop_mask, variant)
from torchcache.builder.chat import TRAIN_ON

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def chat_tokenizer(gpt2_tokenizer_path, tmp_path_factory) -> tuple[str, Tokenizer]:
    """GPT-2 with the chat markers as special tokens, saved with a tokenizer_config.json that holds
    the ChatML template and the Llama 3 special tokens."""
    tok = Tokenizer.from_file(gpt2_tokenizer_path)
    tok.add_special_tokens(CHAT_TOKENS)
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    config = dict(SPECIAL, chat_template=variant(CHATML, tags=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder / "tokenizer.json"), tok


@pytest.fixture(scope="module")
def conversations(books) -> list[list[dict]]:
    return generate_conversations(books, 240, seed=3)


def write_records(path: Path, records: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return str(path)


def oracle(tok: Tokenizer, text: str, spans, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The document a chat record must become: the whole text tokenized once (special tokens
    recognised), the per-token overlap rule applied by a loop, EOS trained when the last token is."""
    encoding = tok.encode(text, add_special_tokens=False)
    mask = loop_mask(encoding.offsets, spans, len(text))
    return (np.array(encoding.ids + [eos]),
            np.append(mask, mask[-1] if len(mask) else False))


def stored(cache: tc.TokenCache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(cache.document(i), cache.document_loss_mask(i)) for i in range(cache.num_documents)]


@pytest.mark.parametrize("tags", [False, True], ids=["turns", "generation-tags"])
@pytest.mark.parametrize("source, pieces", [(CHATML, chatml_pieces), (LLAMA3, llama3_pieces)],
                         ids=["chatml", "llama3"])
def test_a_chat_build_stores_the_oracle_masks(tmp_path, chat_tokenizer, conversations, source,
                                              pieces, tags):
    path, tok = chat_tokenizer
    eos = tok.token_to_id("<|endoftext|>")
    inputs = [write_records(tmp_path / f"chats-{k}.jsonl",
                            [{"messages": m} for m in conversations[k::2]]) for k in range(2)]
    template = variant(source, tags)
    for train_on in TRAIN_ON:
        out = tmp_path / f"cache-{train_on}"
        result = tc.build_cache(inputs, out, path, input_format="messages", chat_template=template,
                                train_on=train_on, block_tokens=8_000, num_workers=2, progress=False)
        assert result.num_documents == len(conversations) and result.skipped == {}
        cache = tc.TokenCache(out)
        assert cache.has_loss_mask and cache.chat_template == template and cache.num_blocks > 4
        order = [conversations[k::2][j] for j, k in _round_robin(cache)]
        for i, (ids, mask) in enumerate(stored(cache)):
            text, spans = expected(pieces(order[i]), train_on)
            text = text.replace("26 Jul 2024", "01 Jan 2025")  # builds pin strftime_now
            want_ids, want_mask = oracle(tok, text, spans, eos)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask, err_msg=f"{train_on} document {i}")
        assert 0 < cache.loss_mask(0, cache.num_tokens).mean() <= 1


def test_a_tokenizer_with_a_normalizer_masks_by_its_offsets(tmp_path, chat_tokenizer, conversations):
    """NFC changes lengths, so token bytes cannot be summed: the tokenizer's own character
    offsets decide, and the masks still equal the oracle's (unicode content included)."""
    from tokenizers import normalizers
    from torchcache.builder.tokenizing import token_byte_lengths
    _, plain = chat_tokenizer
    tok = Tokenizer.from_str(plain.to_str())
    tok.normalizer = normalizers.NFC()
    assert token_byte_lengths(tok) is None and token_byte_lengths(plain) is not None
    path = tmp_path / "nfc.json"
    tok.save(str(path))
    eos = tok.token_to_id("<|endoftext|>")
    source = write_records(tmp_path / "c.jsonl", [{"messages": m} for m in conversations[:80]])
    tc.build_cache(source, tmp_path / "nfc", str(path), input_format="messages",
                   chat_template=variant(CHATML, tags=True), progress=False)
    cache = tc.TokenCache(tmp_path / "nfc")
    for messages, (ids, mask) in zip(conversations[:80], stored(cache), strict=True):
        text, spans = expected(chatml_pieces(messages), "assistant")
        want_ids, want_mask = oracle(tok, text, spans, eos)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)


def _round_robin(cache: tc.TokenCache) -> list[tuple[int, int]]:
    """(record index, input) of each document, from the provenance the cache keeps."""
    out = []
    for i in range(cache.num_documents):
        info = cache.document_info(i)
        out.append((info["record"], int(info["input"].rsplit("-", 1)[1].split(".")[0])))
    return out


def test_sharegpt_records_give_the_messages_cache(tmp_path, chat_tokenizer, conversations):
    path, _ = chat_tokenizer
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    plain = write_records(tmp_path / "a.jsonl", [{"messages": m} for m in conversations[:60]])
    share = write_records(tmp_path / "b.jsonl", [{"conversations": [
        {"from": names[t["role"]], "value": t["content"]} for t in m]} for m in conversations[:60]])
    caches = []
    for name, source in (("plain", plain), ("share", share)):
        tc.build_cache(source, tmp_path / name, path, input_format="messages", progress=False)
        caches.append(tc.TokenCache(tmp_path / name))
    assert caches[0].chat_template == variant(CHATML, tags=False)  # the tokenizer's own template
    for (a_ids, a_mask), (b_ids, b_mask) in zip(stored(caches[0]), stored(caches[1]), strict=True):
        np.testing.assert_array_equal(a_ids, b_ids)
        np.testing.assert_array_equal(a_mask, b_mask)


def test_prompt_completion_trains_the_completion(tmp_path, chat_tokenizer, books):
    path, tok = chat_tokenizer
    eos = tok.token_to_id("<|endoftext|>")
    texts = [p for b in books for p in b["text"].split("\n\n") if p.strip()][:300]
    records = [{"prompt": texts[k] + "\n\nSummary:", "completion": " " + texts[k + 1][:200]}
               for k in range(0, 298, 2)]
    source = write_records(tmp_path / "pc.jsonl", records)
    for train_on in ("assistant", "all"):
        out = tmp_path / train_on
        tc.build_cache(source, out, path, input_format="prompt_completion", train_on=train_on,
                       progress=False)
        cache = tc.TokenCache(out)
        for record, (ids, mask) in zip(records, stored(cache), strict=True):
            text = record["prompt"] + record["completion"]
            start = 0 if train_on == "all" else len(record["prompt"])
            want_ids, want_mask = oracle(tok, text, [(start, len(text))], eos)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)


def test_pre_tokenized_records_keep_their_mask(tmp_path):
    rng = np.random.default_rng(0)
    records, want = [], []
    for k in range(200):
        ids = rng.integers(0, 1000, rng.integers(1, 60)).tolist()
        flags = (rng.random(len(ids)) < 0.5).astype(int).tolist()
        if k % 2:
            records.append({"input_ids": ids, "loss_mask": flags})
        else:
            records.append({"input_ids": ids, "labels": [t if f else -100 for t, f in zip(ids, flags)]})
        want.append((np.array(ids), np.array(flags, dtype=bool)))
    source = write_records(tmp_path / "tokens.jsonl", records)
    tc.build_cache(source, tmp_path / "exact", None, input_format="tokens", vocab_size=1000, eos=None,
                   progress=False, block_tokens=500)
    cache = tc.TokenCache(tmp_path / "exact")
    assert cache.has_loss_mask and cache.num_blocks > 5
    for (ids, mask), (want_ids, want_mask) in zip(stored(cache), want, strict=True):
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)
    tc.build_cache(source, tmp_path / "eos", None, input_format="tokens", vocab_size=1001, eos=1000,
                   progress=False)
    for (ids, mask), (want_ids, want_mask) in zip(stored(tc.TokenCache(tmp_path / "eos")), want):
        np.testing.assert_array_equal(ids, np.append(want_ids, 1000))
        np.testing.assert_array_equal(mask, np.append(want_mask, want_mask[-1]))


BAD = [
    ({"text": "no messages here"}, "no_messages", "no 'messages'"),
    ({"messages": []}, "empty_conversation", "no messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown_role", "wizard"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, "bad_content", "not a string"),
    ({"messages": [{"role": "assistant", "content": "I speak first"}]}, "role_order",
     "turns must go user, assistant"),
]


@pytest.mark.parametrize("record, reason, words", BAD, ids=[b[1] for b in BAD])
def test_a_bad_chat_record_names_its_file_and_line(tmp_path, chat_tokenizer, record, reason, words):
    path, _ = chat_tokenizer
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    source = write_records(tmp_path / "chats.jsonl", [good, good, record, good])
    with pytest.raises(tc.InputError) as raised:
        tc.build_cache(source, tmp_path / "raise", path, input_format="messages", progress=False)
    assert f"{source}:3:" in str(raised.value) and words in str(raised.value)
    result = tc.build_cache(source, tmp_path / "skip", path, input_format="messages",
                            on_error="skip", progress=False)
    assert result.skipped == {reason: 1} and result.num_documents == 3
    assert [tc.TokenCache(tmp_path / "skip").document_info(i)["record"] for i in range(3)] == [0, 1, 3]


def test_kept_fields_and_provenance(tmp_path, gpt2_tokenizer_path, books):
    records = [{"text": p, "id": f"doc-{k}", "meta": {"k": k}, "dropped": "x"}
               for k, p in enumerate(p for b in books for p in b["text"].split("\n\n") if p.strip())][:120]
    source = write_records(tmp_path / "docs.jsonl", records)
    tc.build_cache(source, tmp_path / "kept", gpt2_tokenizer_path, keep_fields=["id", "meta"],
                   block_tokens=2000, progress=False)
    cache = tc.TokenCache(tmp_path / "kept")
    assert not cache.has_loss_mask and cache.num_blocks > 3
    for i in range(cache.num_documents):
        info = cache.document_info(i)
        assert info == {"document": i, "input": source, "record": i,
                        "fields": {"id": f"doc-{i}", "meta": {"k": i}}}
        assert cache.document_loss_mask(i).all()  # a cache without a mask trains every token
    tc.build_cache(source, tmp_path / "plain", gpt2_tokenizer_path, progress=False)
    plain = tc.TokenCache(tmp_path / "plain")
    assert json.loads((tmp_path / "plain/manifest.json").read_text())["version"] == 2
    assert json.loads((tmp_path / "kept/manifest.json").read_text())["version"] == 3
    assert plain.document_info(5) == {"document": 5, "input": source, "record": 5, "fields": {}}
    assert np.array_equal(plain.read(0, plain.num_tokens), cache.read(0, cache.num_tokens))


def test_the_template_and_train_on_are_the_cache_identity(tmp_path, chat_tokenizer):
    path, _ = chat_tokenizer
    source = write_records(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    fingerprints = set()
    for template, train_on in ((variant(CHATML, False), "assistant"), (variant(CHATML, True), "assistant"),
                               (variant(CHATML, False), "all")):
        out = tmp_path / f"c{len(fingerprints)}"
        tc.build_cache(source, out, path, input_format="messages", chat_template=template,
                       train_on=train_on, progress=False)
        fingerprints.add(tc.TokenCache(out).fingerprint)
    assert len(fingerprints) == 3
    with pytest.raises(tc.BuildError, match="differs in: documents"):
        tc.build_cache(source, tmp_path / "c0", path, input_format="messages",
                       chat_template=variant(CHATML, True), progress=False)


def test_messages_refuse_special_tokens_as_text_and_other_inputs(tmp_path, chat_tokenizer):
    path, _ = chat_tokenizer
    source = write_records(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(ValueError, match="special_tokens_as_text"):
        tc.build_cache(source, tmp_path / "a", path, input_format="messages",
                       special_tokens_as_text=True, progress=False)
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(ValueError, match="JSON lines"):
        tc.build_cache(str(tmp_path / "t.txt"), tmp_path / "b", path, input_format="messages",
                       progress=False)
    with pytest.raises(ValueError, match="input_format"):
        tc.build_cache(source, tmp_path / "c", path, input_format="chat", progress=False)


def test_an_iterable_of_dicts_builds_and_is_checked_on_rerun(tmp_path, chat_tokenizer):
    path, _ = chat_tokenizer
    chats = [{"messages": [{"role": "user", "content": f"Q{k}"}, {"role": "assistant", "content": f"A{k}"}]}
             for k in range(30)]
    out = tmp_path / "it"
    first = tc.build_cache(iter(chats), out, path, input_format="messages", progress=False)
    assert first.num_documents == 30
    assert tc.build_cache(iter(chats), out, path, input_format="messages",
                          progress=False).already_complete
    with pytest.raises(tc.InputChangedError):
        tc.build_cache(iter(chats[:-1]), out, path, input_format="messages", progress=False)
