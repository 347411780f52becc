"""The ids and masks a build stores are the tokenizer's own (issue 31, items 1-3): long texts cut
for speed still give tokenizer.encode(whole text), with added and special tokens after blank
lines; a prompt's whitespace token is never trained (the completion-only rule of transformers and
TRL); pre-tokenized labels in another convention are refused, naming file:line.

Every expectation comes from the tokenizer (or transformers) itself, never from our rendering."""

from __future__ import annotations

import json
import lzma
import random
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import torchcache as tc
from torchcache.builder.tokenizing import DocumentEncoder

DATA = Path(__file__).parent / "data"
# Control tokens that real templates put right after a blank line (ChatML, Llama 2, Phi-3, </s>)
SPECIAL = ["<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "</s>", "<|end|>"]
PLAIN_ADDED = ["<tool_call>"]  # an added token that is not special: split out even as text


def _paragraphs(books: list[dict]) -> list[str]:
    return [p for b in books for p in b["text"].split("\n\n") if p.strip()]


def _write(path: Path, records: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module", params=["gpt2", "neox"])
def tokenizer(request, gpt2_tokenizer_path, tmp_path_factory) -> tuple[str, Tokenizer]:
    """GPT-2 or the real GPT-NeoX-20B tokenizer (tests/data), with the control tokens added as
    special tokens and one more added token that is not special, saved to a file."""
    if request.param == "gpt2":
        tok = Tokenizer.from_file(gpt2_tokenizer_path)
    else:
        tok = Tokenizer.from_str(lzma.decompress((DATA / "gpt-neox-20b-tokenizer.json.xz")
                                                 .read_bytes()).decode())
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(PLAIN_ADDED)
    path = tmp_path_factory.mktemp(f"{request.param}-added") / "tokenizer.json"
    tok.save(str(path))
    return str(path), Tokenizer.from_file(str(path))


def _encode(tok: Tokenizer, text: str, special_tokens_as_text: bool = False) -> list[int]:
    tok.encode_special_tokens = special_tokens_as_text
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


def _long_document(paragraphs: list[str], rng: random.Random, chars: int) -> str:
    """Real paragraphs, some run together into long lines, with blank lines before control
    tokens (and before plain text) throughout: over `chars` characters."""
    parts: list[str] = []
    size = 0
    while size < chars:
        run = " ".join(rng.choice(paragraphs) for _ in range(rng.choice([1, 1, 4, 30])))
        parts.append(run)
        parts.append("\n\n" + rng.choice(SPECIAL + PLAIN_ADDED + ["<|endoftext|>"])
                     if rng.random() < 0.7 else "")
        parts.append("\n\n")
        size += len(run) + 16
    return "".join(parts)


@pytest.mark.parametrize("piece_chars", [300, 16_384])
def test_cuts_are_proven_by_the_tokenizer(tokenizer, books, piece_chars):
    """The encoder's cuts of long texts never change the ids, with special tokens recognised or
    taken as text, and the texts really are cut (so the rule is exercised, not bypassed)."""
    path, tok = tokenizer
    rng = random.Random(piece_chars)
    texts = [_long_document(_paragraphs(books), rng, 120_000) for _ in range(2)]
    for as_text in (False, True):
        encoder = DocumentEncoder(Path(path).read_text(), bos_id=None, eos_id=None,
                                  dtype=np.int64, special_tokens_as_text=as_text,
                                  piece_chars=piece_chars)
        pieces, counts = encoder.pieces(texts)
        assert "".join(pieces) == "".join(texts) and min(counts) >= 3
        for text, ids in zip(texts, encoder.encode(texts), strict=True):
            assert ids.tolist() == _encode(tok, text, as_text)
        for text, (ids, _) in zip(texts, encoder.encode_with_offsets(texts), strict=True):
            assert ids == _encode(tok, text, as_text)


@pytest.mark.parametrize("as_text", [False, True])
def test_the_tokenizer_refuses_a_cut_before_an_added_token(tokenizer, as_text):
    """Every blank line before a non-space offered as a cut: the tokenizer's own check keeps those
    before plain text, and refuses those before a token it splits out first (special tokens only
    when they are not taken as text; an added token that is not special always)."""
    path, _ = tokenizer
    encoder = DocumentEncoder(Path(path).read_text(), bos_id=None, eos_id=None, dtype=np.int64,
                              special_tokens_as_text=as_text)
    text = ("Hello there.\n\n<|im_end|>\n\nGeneral Kenobi.\n\n[/INST] ok\n\n<tool_call>{}"
            "\n\nplain\n\n</s>")
    offered = [m.start() for m in re.finditer(r"(?<=\n)(?=\n\S)", text)]
    splits_out = ("<tool_call>",) if as_text else ("<|im_end|>", "[/INST]", "</s>", "<tool_call>")
    want = [c for c in offered if not text[c + 1:].startswith(splits_out)]
    assert len(offered) == 6 and 2 <= len(want) < len(offered)
    assert encoder.proven_cuts([text], [offered]) == [want]


@pytest.mark.parametrize("special_tokens_as_text", [False, True])
def test_a_text_build_of_long_documents_stores_the_tokenizers_ids(tmp_path, tokenizer, books,
                                                                  special_tokens_as_text):
    path, tok = tokenizer
    rng = random.Random(7)
    texts = [_long_document(_paragraphs(books), rng, 110_000) for _ in range(3)]
    source = _write(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    tc.build_cache(source, tmp_path / "cache", path, special_tokens_as_text=special_tokens_as_text,
                   progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    eos = tok.token_to_id("<|endoftext|>")
    assert cache.num_documents == len(texts)
    for i, text in enumerate(texts):
        assert cache.document(i).tolist() == _encode(tok, text, special_tokens_as_text) + [eos], i


# Templates that end a turn with a blank line before the control token, with generation tags so
# that transformers gives the assistant mask to compare with.
CHATML_BLANK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}\n\n<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}\n\n<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_BLANK = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}\n\n[/INST]"
    "{% else %}{% generation %} {{ m.content }}\n\n</s>{% endgeneration %}{% endif %}{% endfor %}")


def _conversation(paragraphs: list[str], rng: random.Random, chars: int) -> list[dict]:
    """Alternating user/assistant turns of real text, over `chars` characters in all: some turns
    one long line, some with blank lines inside."""
    messages: list[dict] = []
    size = 0
    while size < chars:
        sep = rng.choice([" ", " ", "\n\n"])
        content = sep.join(rng.choice(paragraphs) for _ in range(rng.choice([1, 5, 40])))
        messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant",
                         "content": content})
        size += len(content)
    if len(messages) % 2:
        messages.append({"role": "assistant", "content": rng.choice(paragraphs)})
    return messages


@pytest.mark.parametrize("template", [CHATML_BLANK, LLAMA2_BLANK], ids=["chatml", "llama2"])
def test_a_chat_build_of_long_conversations_stores_the_tokenizers_ids(tmp_path, tokenizer, books,
                                                                      template):
    """Conversations over 100K characters: the ids are the tokenizer's ids of transformers'
    rendering, and the mask is transformers' assistant mask for the template's generation tags."""
    transformers = pytest.importorskip("transformers")
    path, tok = tokenizer
    rng = random.Random(11)
    conversations = [_conversation(_paragraphs(books), rng, 105_000) for _ in range(2)]
    source = _write(tmp_path / "chats.jsonl", [{"messages": m} for m in conversations])
    tc.build_cache(source, tmp_path / "cache", path, input_format="messages",
                   chat_template=template, progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(path))
    eos = tok.token_to_id("<|endoftext|>")
    assert cache.num_documents == len(conversations)
    for i, messages in enumerate(conversations):
        text = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
        assert len(text) > 100_000
        want = _encode(tok, text)
        assert cache.document(i).tolist() == want + [eos], i
        out = hf.apply_chat_template(messages, chat_template=template, tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True)
        assert list(out["input_ids"]) == want
        mask = np.array(out["assistant_masks"], dtype=bool)
        np.testing.assert_array_equal(cache.document_loss_mask(i), np.append(mask, mask[-1]))


# --- item 2: a prompt's whitespace token is the prompt's ---------------------------------------

PROMPT_ENDS = ["", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", ":  ", "\n  ", "    "]
COMPLETION_STARTS = ["", " ", "  ", "\n", "\n\n", "\t ", "   ", "\n "]


def completion_only_mask(tok: Tokenizer, prompt: str, completion: str) -> list[bool]:
    """transformers'/TRL's completion-only mask, from the tokenizer alone: when the prompt's ids
    are a prefix of the whole text's ids, exactly the tokens after them are trained; otherwise
    the tokens that decode to a prefix of the prompt are the prompt's, the rest are trained."""
    prompt_ids = _encode(tok, prompt)
    ids = _encode(tok, prompt + completion)
    if ids[:len(prompt_ids)] == prompt_ids:
        untrained = len(prompt_ids)
    else:
        untrained = max(k for k in range(len(ids) + 1) if prompt.startswith(tok.decode(ids[:k])))
    return [False] * untrained + [True] * (len(ids) - untrained)


def test_a_prompts_whitespace_token_is_never_trained(tmp_path, tokenizer, books):
    path, tok = tokenizer
    rng = random.Random(5)
    paragraphs = _paragraphs(books)
    records = []
    for _ in range(240):
        prompt = rng.choice(paragraphs)[:rng.randint(1, 200)].strip() + rng.choice(PROMPT_ENDS)
        completion = rng.choice(COMPLETION_STARTS) + rng.choice(paragraphs)[:rng.randint(1, 120)]
        completion = completion.rstrip() + rng.choice(["", " "])
        records.append({"prompt": prompt, "completion": completion})
    source = _write(tmp_path / "pc.jsonl", records)
    tc.build_cache(source, tmp_path / "cache", path, input_format="prompt_completion",
                   progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    eos = tok.token_to_id("<|endoftext|>")
    assert cache.num_documents == len(records)
    wrong = []
    for i, record in enumerate(records):
        ids = _encode(tok, record["prompt"] + record["completion"])
        want = completion_only_mask(tok, record["prompt"], record["completion"])
        assert cache.document(i).tolist() == ids + [eos]
        if cache.document_loss_mask(i).tolist() != want + [want[-1]]:
            wrong.append((i, record))
    assert not wrong, f"{len(wrong)} of {len(records)} differ, first: {wrong[0]}"


# --- item 3: pre-tokenized labels in the convention we read -------------------------------------

def test_labels_that_are_not_the_input_ids_name_the_record(tmp_path):
    good = {"input_ids": [30, 31, 32, 33], "labels": [-100, 31, 32, 33]}
    shifted = {"input_ids": [30, 31, 32, 33], "labels": [-100, 32, 33, -100]}  # shifted by one
    source = _write(tmp_path / "tokens.jsonl", [good, good, shifted, good])
    with pytest.raises(tc.InputError) as raised:
        tc.build_cache(source, tmp_path / "raise", None, input_format="tokens", vocab_size=100,
                       eos=None, progress=False)
    message = str(raised.value)
    assert f"{source}:3:" in message
    assert "labels" in message and "input_ids" in message and "-100" in message
    assert "shifted" in message  # says which convention: unshifted, as Hugging Face's
    result = tc.build_cache(source, tmp_path / "skip", None, input_format="tokens", vocab_size=100,
                            eos=None, on_error="skip", progress=False)
    assert result.skipped == {"bad_labels": 1} and result.num_documents == 3
    cache = tc.TokenCache(tmp_path / "skip")
    assert cache.skipped == {"bad_labels": 1}
    for i in range(3):
        assert cache.document(i).tolist()[:4] == [30, 31, 32, 33]
        assert cache.document_loss_mask(i).tolist()[:4] == [False, True, True, True]


def test_a_label_differing_anywhere_is_refused(tmp_path):
    """Not only shifted labels: any label that is neither -100 nor its own input id."""
    rng = np.random.default_rng(1)
    records = []
    for _ in range(50):
        ids = rng.integers(0, 1000, 20).tolist()
        labels = [t if rng.random() < 0.6 else -100 for t in ids]
        records.append({"input_ids": ids, "labels": labels})
    bad = dict(records[40])
    bad["labels"] = list(bad["labels"])
    bad["labels"][7] = (bad["input_ids"][7] + 1) % 1000
    records[40] = bad
    source = _write(tmp_path / "tokens.jsonl", records)
    with pytest.raises(tc.InputError, match=f"{source}:41:.*position 7"):
        tc.build_cache(source, tmp_path / "raise", None, input_format="tokens", vocab_size=1000,
                       eos=None, progress=False)
