"""tiktoken and SentencePiece tokenizers: ids equal the library's own encode (and, for tiktoken's
GPT-2 ranks, the GPT-2 tokenizer.json's), long texts cut only where the backend proves it, loss
masks equal an oracle from the library's own token bytes or pieces, and a cache built with one
reads, decodes, traces and verifies in a fresh process without the other libraries."""

from __future__ import annotations

import json
import lzma
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torchcache as tc
from torchcache.builder.tokenizing import DocumentEncoder
from torchcache.format.tokenizer import load_tokenizer

from conftest import DATA, killed_build_resumes_to_the_same_bytes, paragraphs, write_jsonl

tiktoken = pytest.importorskip("tiktoken")
spm = pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def ranks_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2.tiktoken"
    path.write_bytes(lzma.decompress((DATA / "gpt2.tiktoken.xz").read_bytes()))
    return str(path)


@pytest.fixture(scope="module")
def gpt2_tiktoken(ranks_path):
    return tc.tiktoken_tokenizer(ranks_path, special_tokens={"<|endoftext|>": 50256})


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory, books) -> dict[str, str]:
    """BPE and unigram models trained here by sentencepiece's own trainer on 300 K characters."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(b["text"] for b in books)[:300_000], encoding="utf-8")
    models = {}
    for kind in ("bpe", "unigram"):
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / kind),
                                       vocab_size=2000, model_type=kind, minloglevel=2,
                                       num_threads=1)
        models[kind] = str(folder / f"{kind}.model")
    return models


def _tricky(books, rng: random.Random) -> list[str]:
    """Unicode, long whitespace runs, the end-of-text token written as text, and a text of more
    than 100 K characters made of real paragraphs (so that it is cut)."""
    parts = paragraphs(books)
    long_text = ""
    while len(long_text) < 120_000:
        long_text += rng.choice(parts) + rng.choice(["\n\n", "\n\n\n", " \n\n", "\n\n  "])
    return ["Été à Paris — naïve café 日本語のテキスト 🎉🎉 Ω≈ç√∫",
            "word" + " " * 300 + "\n" * 50 + "\t\t end   \n\n\n",
            "before <|endoftext|> after<|endoftext|>\n\n<|endoftext|>",
            "\n\nleading blank lines and a lone surrogate? no: just é\u0301 combining",
            long_text]


def _encoder(backend, **options) -> DocumentEncoder:
    return DocumentEncoder(backend, bos_id=None, eos_id=None, dtype=np.int64, **options)


# ---------------------------------------------------------------- tiktoken

def test_tiktoken_ids_equal_tiktoken_and_the_gpt2_tokenizer_json(gpt2_tiktoken, gpt2, books):
    enc = gpt2_tiktoken.encoding
    texts = [b["text"] for b in books] + _tricky(books, random.Random(1))
    plain = json.loads(gpt2.to_str())
    from tokenizers import Tokenizer
    hf = Tokenizer.from_str(json.dumps(plain))
    hf.encode_special_tokens = True  # "<|endoftext|>" in a text is text, as encode_ordinary takes it
    for piece_chars in (300, 16_384):
        encoder = _encoder(gpt2_tiktoken, piece_chars=piece_chars)
        pieces, counts = encoder.pieces(texts)
        assert "".join(pieces) == "".join(texts) and max(counts) >= 3  # long texts really are cut
        for text, ids in zip(texts, encoder.encode(texts), strict=True):
            assert ids.tolist() == enc.encode_ordinary(text)
            assert ids.tolist() == hf.encode(text, add_special_tokens=False).ids
        for text, (ids, offsets) in zip(texts, encoder.encode_with_offsets(texts), strict=True):
            assert ids == enc.encode_ordinary(text)
            assert offsets[0, 0] == 0 and offsets[-1, 1] == len(text)
    # special tokens as tokens: tiktoken's encode with them allowed
    encoder = _encoder(gpt2_tiktoken, special_tokens_as_text=False, piece_chars=300)
    for text, ids in zip(texts, encoder.encode(texts), strict=True):
        assert ids.tolist() == enc.encode(text, allowed_special="all")
    assert encoder.encode([texts[-3]])[0].tolist().count(50256) == 3
    # a lone surrogate (JSON allows "\ud800"): tiktoken's own encode replaces it with U+FFFD
    lone = "a lone \ud800 surrogate, then é"
    ids, offsets = _encoder(gpt2_tiktoken).encode_with_offsets([lone])[0]
    assert ids == enc.encode_ordinary(lone) and offsets[-1, 1] == len(lone)
    trained = _encoder(gpt2_tiktoken).encode_trained([lone], [[(7, 8)]])[0][1]
    oracle, at = [], 0  # tokens whose bytes overlap U+FFFD's 3 bytes, at byte 7
    for token in enc.decode_tokens_bytes(ids):
        oracle.append(at < 10 and 7 < at + len(token))
        at += len(token)
    assert trained.tolist() == oracle and any(oracle)


#: cl100k_base's split pattern (tiktoken_ext.openai_public): it keeps a newline run whole
CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
          r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


def test_a_pattern_that_keeps_newline_runs_whole_is_cut_after_them(ranks_path, books):
    """GPT-2's cut (between the newlines of a blank line) would split cl100k's "\n\n" piece: the
    tokenizer refuses it on the probe, and the cut after the blank line is used and proven."""
    tok = tc.tiktoken_tokenizer(ranks_path, pattern=CL100K)
    texts = [b["text"] for b in books] + _tricky(books, random.Random(6))
    encoder = _encoder(tok, piece_chars=300)
    pieces, counts = encoder.pieces(texts)
    assert max(counts) >= 3
    for piece, following in zip(pieces, pieces[1:]):  # (pieces of one text, or of the next)
        if piece.endswith("\n") and not piece.endswith("\n\n"):
            assert not following.startswith("\n")  # never between the newlines
    assert sum(p.endswith("\n\n") and n[:1].isalpha() for p, n in zip(pieces, pieces[1:])) > 20
    for text, ids in zip(texts, encoder.encode(texts), strict=True):
        assert ids.tolist() == tok.encoding.encode_ordinary(text)


def test_a_tiktoken_encoding_is_taken_as_it_is(gpt2_tiktoken):
    enc = tiktoken.Encoding("mine", pat_str=gpt2_tiktoken.pattern, mergeable_ranks=gpt2_tiktoken.ranks,
                            special_tokens={"<|endoftext|>": 50256})
    tok = load_tokenizer(enc)
    assert tok.fingerprint == gpt2_tiktoken.fingerprint  # the same files, whatever the name


def _byte_oracle(token_bytes: list[bytes], text: str, start_char: int) -> list[bool]:
    """Trained flags from the tokens' own bytes: a token is trained when its bytes overlap the
    completion's (from `start_char` on)."""
    start = len(text[:start_char].encode("utf-8"))
    out, at = [], 0
    for b in token_bytes:
        out.append(at + len(b) > start)
        at += len(b)
    return out


def _prompt_completions(books) -> list[dict]:
    rng = random.Random(3)
    parts = paragraphs(books, 400)
    records = [{"prompt": rng.choice(parts)[:200] + rng.choice([" ", "\n\n", "", "  "]),
                "completion": rng.choice(parts)[:300]} for _ in range(60)]
    records.append({"prompt": "Translate: été → ", "completion": "summer 夏 🎉"})
    return records


def test_tiktoken_prompt_completion_masks_equal_the_token_bytes_oracle(tmp_path, gpt2_tiktoken,
                                                                       books):
    records = _prompt_completions(books)
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tc.build_cache(str(path), str(tmp_path / "cache"), gpt2_tiktoken,
                   input_format="prompt_completion", num_workers=1, progress=False)
    cache = tc.TokenCache(str(tmp_path / "cache"))
    enc = gpt2_tiktoken.encoding
    for i, r in enumerate(records):
        text = r["prompt"] + r["completion"]
        ids = enc.encode_ordinary(text)
        assert cache.document(i).tolist() == ids + [50256]
        mask = cache.document_loss_mask(i).tolist()
        oracle = _byte_oracle(enc.decode_tokens_bytes(ids), text, len(r["prompt"]))
        assert mask[:-1] == oracle and mask[-1] == oracle[-1]


_READ_BACK = """
import json, sys
for blocked in sys.argv[2].split(","):
    sys.modules[blocked] = None  # not installed, as far as this process knows
import torchcache as tc
from torchcache.cli import main
cache = tc.TokenCache(sys.argv[1])
def text_of(i):  # the document's record, where the cache says it comes from
    info = cache.document_info(i)
    with open(info["input"], encoding="utf-8") as f:
        return json.loads(f.readlines()[info["record"]])["text"]
texts = [text_of(i) for i in range(cache.num_documents)]
assert cache.num_documents > 300
tok = cache.tokenizer()
assert type(tok).__name__ == sys.argv[3], type(tok)
if sys.argv[3] == "SentencePieceTokenizer":  # its normalizer folds whitespace: its own round trip
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=sys.argv[4])
    expected = [sp.decode(sp.encode(text)) for text in texts]
else:
    expected = texts
for i, text in enumerate(texts):
    assert cache.decode(cache.document(i), skip_special_tokens=True) == expected[i], i
    assert tok.encode(text) == cache.document(i)[:-1].tolist(), i
assert tc.check_cache(sys.argv[1]) == []
assert main(["verify", sys.argv[1]]) == 0
assert main(["show", sys.argv[1], "-d", "0"]) == 0
assert main(["trace", sys.argv[1], "--step", "0", "--seq-len", "64", "--batch-size", "2"]) == 0
print("READ BACK OK")
"""


def _read_back(cache: Path, blocked: str, kind: str, model: str = "") -> str:
    out = subprocess.run([sys.executable, "-c", _READ_BACK, str(cache), blocked, kind, model],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "READ BACK OK" in out.stdout
    return out.stdout


def test_a_tiktoken_cache_reads_decodes_traces_and_verifies_in_a_fresh_process(
        tmp_path, gpt2_tiktoken, ranks_path, books):
    texts = [p for p in paragraphs(books, 300)] + _tricky(books, random.Random(2))
    inputs = [write_jsonl(tmp_path / f"in-{k}.jsonl", texts[k::2]) for k in range(2)]
    out = tmp_path / "cache"
    # the CLI's -t tiktoken:PATH (default pattern gpt2, <|endoftext|> after the last rank)
    from torchcache.cli import main
    assert main(["build", *inputs, "-o", str(out), "-t", f"tiktoken:{ranks_path}",
                 "--workers", "2", "--block-tokens", "4096"]) == 0
    cache = tc.TokenCache(str(out))
    assert cache.spec["tokenizer"]["kind"] == "tiktoken"
    assert cache.spec["tokenizer"]["fingerprint"] == gpt2_tiktoken.fingerprint
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("tokenizer")) == \
        ["tokenizer.tiktoken", "tokenizer.tiktoken.json"]
    _read_back(out, "sentencepiece,transformers", "TiktokenTokenizer")


def test_a_swapped_tiktoken_ranks_file_is_refused_naming_it(tmp_path, gpt2_tiktoken, books):
    out = tmp_path / "cache"
    tc.build_cache(write_jsonl(tmp_path / "in.jsonl", paragraphs(books, 50)), str(out),
                   gpt2_tiktoken, num_workers=1, progress=False)
    ranks = out / "tokenizer.tiktoken"
    lines = ranks.read_bytes().splitlines(keepends=True)
    a, b = lines[300].split(), lines[301].split()  # two tokens trade ids: a valid, other file
    lines[300], lines[301] = a[0] + b" " + b[1] + b"\n", b[0] + b" " + a[1] + b"\n"
    ranks.write_bytes(b"".join(lines))
    with pytest.raises(tc.CacheFormatError, match=str(ranks)):
        tc.TokenCache(str(out)).decode([1, 2, 3])
    problems = tc.check_cache(str(out))
    assert [p.file for p in problems] == ["tokenizer.tiktoken"] and str(ranks) in problems[0].message
    ranks.unlink()
    assert "missing" in tc.check_cache(str(out))[0].message


def test_a_bare_tiktoken_path_asks_for_its_pattern(tmp_path, ranks_path, books):
    with pytest.raises(ValueError, match="split pattern"):
        tc.build_cache(write_jsonl(tmp_path / "in.jsonl", ["hello"]), str(tmp_path / "c"),
                       ranks_path)


def test_a_missing_library_is_one_line_naming_the_extra(tmp_path, gpt2_tiktoken, sp_models, books):
    code = ("import sys; sys.modules['tiktoken'] = None; sys.modules['sentencepiece'] = None\n"
            "import torchcache as tc\n"
            "for make in (lambda: tc.tiktoken_tokenizer(sys.argv[1]).encode('x'),\n"
            "             lambda: tc.sentencepiece_tokenizer(sys.argv[2])):\n"
            "    try:\n        make()\n    except ImportError as e:\n        print(e)\n")
    ranks = tmp_path / "r.tiktoken"
    ranks.write_bytes(b"YQ== 0\nYg== 1\n")
    out = subprocess.run([sys.executable, "-c", code, str(ranks), sp_models["bpe"]],
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert lines == ["tiktoken tokenizers need the tiktoken package: pip install "
                     "'torchcache-lm[tiktoken]' (or pip install tiktoken)",
                     "sentencepiece tokenizers need the sentencepiece package: pip install "
                     "'torchcache-lm[sentencepiece]' (or pip install sentencepiece)"], out.stderr


# ---------------------------------------------------------------- SentencePiece

@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_ids_and_decoding_equal_sentencepieces_own(sp_models, books, kind):
    sp = spm.SentencePieceProcessor(model_file=sp_models[kind])
    backend = tc.sentencepiece_tokenizer(sp_models[kind])
    texts = [b["text"] for b in books] + _tricky(books, random.Random(4))
    encoder = _encoder(backend, piece_chars=300)
    pieces, counts = encoder.pieces(texts)
    assert pieces == texts and max(len(t) for t in texts) > 100_000  # never cut (see below)
    for text, ids in zip(texts, encoder.encode(texts), strict=True):
        assert ids.tolist() == sp.encode(text)
        assert backend.decode(ids) == sp.decode(sp.encode(text))
    for text, (ids, offsets) in zip(texts, encoder.encode_with_offsets(texts), strict=True):
        assert ids == sp.encode(text) and len(offsets) == len(ids)
    assert backend.token_to_id("</s>") == sp.eos_id() and backend.token_to_id("<nope>") is None


def test_a_unigram_models_ids_depend_on_text_far_before_so_sentencepiece_texts_are_never_cut(
        sp_models, books):
    """Why no window can prove a SentencePiece cut: the unigram model's segmentation of a word
    can change with text thousands of characters before it (its Viterbi sums scores from the
    start; seen with this corpus: "Timberlakes" is la|ke|s 10 K characters into its book, l|ak|es
    20 K in). So the encoder never cuts a SentencePiece text, and its ids are sp.encode's."""
    sp = spm.SentencePieceProcessor(model_file=sp_models["unigram"])
    text = "\n".join(b["text"] for b in books)[:200_000]
    whole = sp.encode(text)
    backend = tc.sentencepiece_tokenizer(sp_models["unigram"])
    encoder = _encoder(backend, piece_chars=300)
    assert encoder.cut is False and encoder.pieces([text]) == ([text], [1])
    assert encoder.encode([text])[0].tolist() == whole


def _pieces_oracle(sp, text: str, start_char: int) -> list[bool]:
    """Trained flags from sentencepiece's own pieces (their byte spans in the text)."""
    start = len(text[:start_char].encode("utf-8"))
    return [p.end > start for p in sp.encode(text, out_type="proto").pieces]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_prompt_completion_masks_equal_its_pieces_oracle(tmp_path, sp_models, books,
                                                                       kind):
    records = _prompt_completions(books)
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tc.build_cache(str(path), str(tmp_path / "cache"), sp_models[kind],
                   input_format="prompt_completion", num_workers=1, progress=False)
    cache = tc.TokenCache(str(tmp_path / "cache"))
    sp = spm.SentencePieceProcessor(model_file=sp_models[kind])
    assert cache.spec["eos_id"] == sp.eos_id()
    for i, r in enumerate(records):
        text = r["prompt"] + r["completion"]
        assert cache.document(i).tolist() == sp.encode(text) + [sp.eos_id()]
        mask = cache.document_loss_mask(i).tolist()
        assert mask[:-1] == _pieces_oracle(sp, text, len(r["prompt"]))


def test_a_sentencepiece_cache_reads_decodes_traces_and_verifies_in_a_fresh_process(
        tmp_path, sp_models, books):
    texts = [p for p in paragraphs(books, 300)] + _tricky(books, random.Random(5))
    inputs = [write_jsonl(tmp_path / f"in-{k}.jsonl", texts[k::2]) for k in range(2)]
    out = tmp_path / "cache"
    from torchcache.cli import main
    assert main(["build", *inputs, "-o", str(out), "-t", sp_models["bpe"], "--workers", "2",
                 "--block-tokens", "4096"]) == 0
    cache = tc.TokenCache(str(out))
    assert cache.spec["tokenizer"]["kind"] == "sentencepiece" and cache.spec["eos_id"] == 2
    _read_back(out, "tiktoken,transformers", "SentencePieceTokenizer", sp_models["bpe"])
    model = out / "tokenizer.model"
    model.write_bytes(Path(sp_models["unigram"]).read_bytes())  # another valid model
    with pytest.raises(tc.CacheFormatError, match=str(model)):
        tc.TokenCache(str(out)).decode([5])
    assert [p.file for p in tc.check_cache(str(out))] == ["tokenizer.model"]


# ---------------------------------------------------------------- chat

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
          "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\n' }}"
          "{% endfor %}")


def _conversations(books) -> list[list[dict]]:
    rng = random.Random(9)
    parts = paragraphs(books, 300)
    out = []
    for _ in range(30):
        turns = []
        for k in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": rng.choice(parts)[:150]})
            turns.append({"role": "assistant", "content": rng.choice(parts)[:250]
                          + rng.choice(["", " ", "\n", " été 🎉"])})
        out.append(turns)
    return out


def _chatml_text(turns: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The ChatML rendering, written out here by hand (not by torchcache's renderer), and the
    character spans of what each assistant writes (its content and end-of-turn marker)."""
    text, spans = "", []
    for m in turns:
        text += "<|im_start|>" + m["role"] + "\n"
        if m["role"] == "assistant":
            spans.append((len(text), len(text) + len(m["content"]) + len("<|im_end|>")))
        text += m["content"] + "<|im_end|>\n"
    return text, spans


def _overlaps(spans_bytes: list[tuple[int, int]], a: int, b: int) -> bool:
    return any(a < e and s < b for s, e in spans_bytes) or (a == b and any(s <= a < e for s, e in spans_bytes))


def _build_chat(tmp_path, tokenizer, conversations) -> tc.TokenCache:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                            for c in conversations))
    tc.build_cache(str(path), str(tmp_path / "cache"), tokenizer, input_format="messages",
                   chat_template=CHATML, num_workers=1, progress=False, eos=None)
    return tc.TokenCache(str(tmp_path / "cache"))


def test_tiktoken_chat_masks_equal_the_token_bytes_oracle(tmp_path, ranks_path, books):
    tok = tc.tiktoken_tokenizer(ranks_path, special_tokens={"<|endoftext|>": 50256,
                                                            "<|im_start|>": 50257,
                                                            "<|im_end|>": 50258})
    conversations = _conversations(books)
    cache = _build_chat(tmp_path, tok, conversations)
    enc = tok.encoding
    for i, turns in enumerate(conversations):
        text, spans = _chatml_text(turns)
        ids = enc.encode(text, allowed_special="all")
        assert cache.document(i).tolist() == ids
        byte_spans = [(len(text[:a].encode()), len(text[:b].encode())) for a, b in spans]
        oracle, at = [], 0
        for token in enc.decode_tokens_bytes(ids):
            oracle.append(_overlaps(byte_spans, at, at + len(token)))
            at += len(token)
        assert cache.document_loss_mask(i).tolist() == oracle


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_chat_masks_equal_its_pieces_oracle(tmp_path, books, kind):
    """A model with the ChatML markers as control pieces: the text between them is sp.encode'd,
    each marker is its piece; the mask comes from sentencepiece's own pieces' byte spans."""
    folder = tmp_path / "model"
    folder.mkdir()
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(b["text"] for b in books)[:200_000], encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "m"),
                                   vocab_size=1500, model_type=kind, minloglevel=2, num_threads=1,
                                   control_symbols=["<|im_start|>", "<|im_end|>"])
    model = str(folder / "m.model")
    sp = spm.SentencePieceProcessor(model_file=model)
    conversations = _conversations(books)
    cache = _build_chat(tmp_path, model, conversations)
    markers = {"<|im_start|>": sp.piece_to_id("<|im_start|>"), "<|im_end|>": sp.piece_to_id("<|im_end|>")}
    for i, turns in enumerate(conversations):
        text, spans = _chatml_text(turns)
        byte_spans = [(len(text[:a].encode()), len(text[:b].encode())) for a, b in spans]
        ids, oracle = [], []
        # walk the text: markers are their pieces, the text between is sentencepiece's own
        at_char = 0
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            base = len(text[:at_char].encode())
            if part in markers:
                ids.append(markers[part])
                oracle.append(_overlaps(byte_spans, base, base + len(part.encode())))
            elif part:
                for p in sp.encode(part, out_type="proto").pieces:
                    ids.append(p.id)
                    oracle.append(_overlaps(byte_spans, base + p.begin, base + p.end))
            at_char += len(part)
        assert cache.document(i).tolist() == ids
        assert cache.document_loss_mask(i).tolist() == oracle


# ---------------------------------------------------------------- resume, background

_RESUMABLE = """
import torchcache as tc
tok = sys.argv[2] if sys.argv[2].endswith(".model") else tc.tiktoken_tokenizer(sys.argv[2])
tc.build_cache(json.loads(sys.argv[1]), sys.argv[3], tok, num_workers=2, block_tokens=2000,
               progress=False)
"""


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_a_killed_build_resumes_to_the_same_bytes(tmp_path, kind, ranks_path, sp_models, books):
    docs = paragraphs(books, 600)
    inputs = [write_jsonl(tmp_path / f"in-{k}.jsonl", docs[k::2]) for k in range(2)]
    tokenizer = ranks_path if kind == "tiktoken" else sp_models["unigram"]
    whole = killed_build_resumes_to_the_same_bytes(_RESUMABLE, json.dumps(inputs), tokenizer,
                                                   root=tmp_path)
    assert tc.TokenCache(str(whole)).spec["tokenizer"]["kind"] == kind


def test_a_background_build_takes_a_backend_object(tmp_path, gpt2_tiktoken, books):
    handle = tc.build_cache(write_jsonl(tmp_path / "in.jsonl", paragraphs(books, 40)),
                            str(tmp_path / "cache"), gpt2_tiktoken, background=True)
    result = handle.wait(120)
    cache = tc.TokenCache(result.path)
    assert cache.document(0).tolist() == gpt2_tiktoken.encode(paragraphs(books, 1)[0]) + [50256]


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_a_lost_block_is_repaired_with_the_caches_own_tokenizer(tmp_path, kind, gpt2_tiktoken,
                                                                sp_models, books):
    tokenizer = gpt2_tiktoken if kind == "tiktoken" else sp_models["bpe"]
    out = tmp_path / "cache"
    tc.build_cache(write_jsonl(tmp_path / "in.jsonl", paragraphs(books, 300)), str(out), tokenizer,
                   num_workers=1, block_tokens=3000, progress=False)
    block = out / "blocks" / "000000-000001.safetensors"
    good = block.read_bytes()
    block.unlink()
    assert tc.repair_cache(str(out)).repaired == ["blocks/000000-000001.safetensors"]
    assert block.read_bytes() == good


def test_a_model_folder_with_only_a_sentencepiece_model_uses_it(tmp_path, sp_models, books):
    folder = tmp_path / "llama2-like"
    folder.mkdir()
    shutil.copy(sp_models["bpe"], folder / "tokenizer.model")
    texts = [b["text"][:3000] for b in books[:3]]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cache = tc.TokenCache(tc.build_cache([str(path)], tmp_path / "c", str(folder), progress=False).path)
    sp = spm.SentencePieceProcessor(model_file=sp_models["bpe"])
    assert cache.spec["tokenizer"]["kind"] == "sentencepiece"
    for d, text in enumerate(texts):
        assert cache.document(d).tolist() == sp.encode(text) + [sp.eos_id()]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.model").symlink_to(folder / "tokenizer.model")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tokenizer.model").symlink_to(outside / "tokenizer.model")
    with pytest.raises(ValueError, match="outside the model folder"):
        tc.build_cache([str(path)], tmp_path / "c2", str(linked), progress=False)
