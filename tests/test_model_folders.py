"""A model folder or a transformers fast tokenizer as `tokenizer=` (issue 33, item 1): the
tokens, BOS/EOS and chat template they declare beside tokenizer.json.

The oracle is transformers itself: AutoTokenizer.from_pretrained(folder) on real folders made here
from tests/data's GPT-2 tokenizer, and PreTrainedTokenizerFast's own encode and apply_chat_template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, processors

import torchcache as tc
from test_chat import variant
from test_trust_chat import CHATML
from torchcache.format.tokenizer import canonical_json, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello <|im_start|>user\nhi there<|im_end|> and <think>a thought</think>",
         "plain text, nothing special", "x<|endoftext|>y </s> <s>hello<q>",
         "<|im_end|><|im_end|>\n\n<think>"]


def added(content: str, **flags) -> dict:
    """An added_tokens_decoder entry as transformers saves one."""
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True} | flags


# tokenizer_config.json contents (and a special_tokens_map.json for the last): added tokens the
# tokenizer.json lacks, ones it has in its vocabulary or as added tokens (with other flags),
# special tokens it lacks (as strings and as AddedToken dicts)
CONFIGS = {
    "added-tokens": ({"eos_token": "<|im_end|>", "added_tokens_decoder": {
        "50256": added("<|endoftext|>", normalized=True), "50257": added("<|im_start|>"),
        "50258": added("<|im_end|>"), "50259": added("<think>", special=False, normalized=True),
        "50260": added("</think>", special=False, normalized=True)}}, None),
    "vocabulary-word-and-new-flags": ({"added_tokens_decoder": {
        "31373": added("hello", special=False), "50256": added("<|endoftext|>", lstrip=True)}},
        None),
    "missing-special-tokens": ({"eos_token": "</s>", "bos_token": {
        "content": "<s>", "lstrip": True, "__type": "AddedToken"}, "pad_token": "<pad>"}, None),
    "special-tokens-map": ({"model_max_length": 1024}, {"eos_token": {"content": "<|im_end|>"},
                                                        "unk_token": "<|endoftext|>"}),
}


def make_folder(path: Path, tokenizer_json: bytes, config: dict | None,
                special_map: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_bytes(tokenizer_json)
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    return path


def write_texts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def documents(out) -> list[list[int]]:
    cache = tc.TokenCache(out)
    return [cache.document(i).tolist() for i in range(cache.num_documents)]


def backend(hf) -> Tokenizer:
    tok = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_model_folder_gives_the_tokens_and_eos_transformers_gives(tmp_path, gpt2_tokenizer_path,
                                                                   name):
    config, special_map = CONFIGS[name]
    folder = make_folder(tmp_path / "model", Path(gpt2_tokenizer_path).read_bytes(), config,
                         special_map)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    # the same tokenizer as transformers makes of the folder, added tokens and their flags included
    assert canonical_json(load_tokenizer(str(folder))) == canonical_json(backend(hf))
    eos = hf.eos_token_id if hf.eos_token is not None else hf.convert_tokens_to_ids("<|endoftext|>")
    inputs = write_texts(tmp_path / "texts.jsonl", TEXTS)
    tc.build_cache(inputs, tmp_path / "out", str(folder), special_tokens_as_text=False,
                   progress=False)
    assert documents(tmp_path / "out") == [hf(t)["input_ids"] + [eos] for t in TEXTS]
    # the cache keeps that tokenizer: it decodes the ids as transformers does
    cache = tc.TokenCache(tmp_path / "out")
    assert [cache.decode(ids) for ids in documents(tmp_path / "out")] == \
        [hf.decode(hf(t)["input_ids"] + [eos]) for t in TEXTS]
    # special tokens in the text are text by default: transformers' split_special_tokens
    split = transformers.AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)
    tc.build_cache(inputs, tmp_path / "split", str(folder), progress=False)
    assert documents(tmp_path / "split") == [split(t)["input_ids"] + [eos] for t in TEXTS]


def test_eos_auto_is_the_folders_eos_token_and_a_guess_for_a_bare_tokenizer(tmp_path,
                                                                            chatml_tokenizer_path):
    tok = Tokenizer.from_file(chatml_tokenizer_path)
    data = Path(chatml_tokenizer_path).read_bytes()
    inputs = write_texts(tmp_path / "texts.jsonl", ["one", "two"])
    end = {"<|im_end|>": tok.token_to_id("<|im_end|>"),
           "<|endoftext|>": tok.token_to_id("<|endoftext|>")}
    for i, config in enumerate([{"eos_token": "<|im_end|>"},
                                {"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}]):
        folder = make_folder(tmp_path / f"model{i}", data, config)
        assert transformers.AutoTokenizer.from_pretrained(str(folder)).eos_token == "<|im_end|>"
        tc.build_cache(inputs, tmp_path / f"out{i}", str(folder), progress=False)
        assert tc.TokenCache(tmp_path / f"out{i}").eos_id == end["<|im_end|>"]
        # its tokenizer.json alone declares nothing: the usual end-of-text token
        tc.build_cache(inputs, tmp_path / f"bare{i}", str(folder / "tokenizer.json"), progress=False)
        assert tc.TokenCache(tmp_path / f"bare{i}").eos_id == end["<|endoftext|>"]
    # special_tokens_map.json alone, and a folder that declares no eos_token: the guess
    folder = make_folder(tmp_path / "map", data, None, {"eos_token": "<|im_end|>"})
    tc.build_cache(inputs, tmp_path / "out-map", str(folder), progress=False)
    assert tc.TokenCache(tmp_path / "out-map").eos_id == end["<|im_end|>"]
    folder = make_folder(tmp_path / "none", data, {"model_max_length": 8})
    tc.build_cache(inputs, tmp_path / "out-none", str(folder), progress=False)
    assert tc.TokenCache(tmp_path / "out-none").eos_id == end["<|endoftext|>"]


def llama_style(gpt2_tokenizer_path: str) -> bytes:
    """GPT-2 with <s> and </s> and a post-processor that puts <s> before each text, as Llama's and
    Gemma's tokenizer.json do."""
    tok = Tokenizer.from_file(gpt2_tokenizer_path)
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str().encode()


def test_bos_auto_is_the_bos_the_tokenizer_puts_before_a_text(tmp_path, gpt2_tokenizer_path):
    inputs = write_texts(tmp_path / "texts.jsonl", TEXTS[:2])
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}
    folder = make_folder(tmp_path / "llama", llama_style(gpt2_tokenizer_path), config)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tc.build_cache(inputs, tmp_path / "out", str(folder), bos="auto", progress=False)
    assert tc.TokenCache(tmp_path / "out").bos_id == hf.bos_token_id
    assert documents(tmp_path / "out") == [hf(t)["input_ids"] + [hf.eos_token_id] for t in TEXTS[:2]]
    # a tokenizer that puts none before a text (GPT-2) gets none, as transformers' encode
    gpt2 = transformers.PreTrainedTokenizerFast(tokenizer_file=gpt2_tokenizer_path)
    tc.build_cache(inputs, tmp_path / "gpt2", gpt2_tokenizer_path, bos="auto", eos=None,
                   progress=False)
    assert tc.TokenCache(tmp_path / "gpt2").bos_id is None
    assert documents(tmp_path / "gpt2") == [gpt2(t)["input_ids"] for t in TEXTS[:2]]


def test_a_folder_whose_add_bos_token_and_tokenizer_json_disagree_is_refused(tmp_path,
                                                                             gpt2_tokenizer_path):
    inputs = write_texts(tmp_path / "texts.jsonl", ["one"])
    config = {"add_bos_token": True, "bos_token": "<|endoftext|>"}
    folder = make_folder(tmp_path / "model", Path(gpt2_tokenizer_path).read_bytes(), config)
    # transformers 5 follows the tokenizer.json's post-processor, which adds no BOS
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf("one")["input_ids"] == hf("one", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=f"{folder / 'tokenizer_config.json'} sets add_bos_token "
                                         "true .* adds none before each text"):
        tc.build_cache(inputs, tmp_path / "out", str(folder), bos="auto", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    # and the other way round: add_bos_token false, but tokenizer.json adds <s>
    config = {"add_bos_token": False, "bos_token": "<s>"}
    folder = make_folder(tmp_path / "llama", llama_style(gpt2_tokenizer_path), config)
    with pytest.raises(ValueError, match="sets add_bos_token false .* adds '<s>' before each text"):
        tc.build_cache(inputs, tmp_path / "out", str(folder), bos="auto", progress=False)
    # an explicit bos is taken as given
    tc.build_cache(inputs, tmp_path / "out", str(folder), bos="<s>", progress=False)
    assert documents(tmp_path / "out")[0][0] == hf.convert_tokens_to_ids("<|endoftext|>") + 1


def test_a_declared_added_token_whose_id_would_move_is_refused(tmp_path, gpt2_tokenizer_path):
    config = {"added_tokens_decoder": {"50300": added("<a>")}}
    folder = make_folder(tmp_path / "model", Path(gpt2_tokenizer_path).read_bytes(), config)
    with pytest.raises(ValueError, match=r"tokenizer_config.json: added_tokens_decoder declares "
                                         r"'<a>' as id 50300, but added to .*tokenizer.json it gets "
                                         r"id 50257"):
        load_tokenizer(str(folder))


def hub_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache: models--org--name/snapshots/<rev>/* are relative links to
    ../../blobs/<hash>."""
    model = root / "models--org--name"
    (model / "blobs").mkdir(parents=True)
    snapshot = model / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = model / "blobs" / f"blob-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_links(tmp_path,
                                                                      gpt2_tokenizer_path):
    config, _ = CONFIGS["added-tokens"]
    snapshot = hub_snapshot(tmp_path / "hub", {
        "tokenizer.json": Path(gpt2_tokenizer_path).read_bytes(),
        "tokenizer_config.json": json.dumps(config).encode(),
        "special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>"}).encode()})
    hf = transformers.AutoTokenizer.from_pretrained(str(snapshot))
    inputs = write_texts(tmp_path / "texts.jsonl", TEXTS)
    tc.build_cache(inputs, tmp_path / "out", str(snapshot), special_tokens_as_text=False,
                   progress=False)
    assert documents(tmp_path / "out") == [hf(t)["input_ids"] + [hf.eos_token_id] for t in TEXTS]
    # each file the folder's tokens come from follows the link rule: not out of models--org--name
    outside = tmp_path / "outside.json"
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        link = snapshot / name
        outside.write_bytes(link.read_bytes())
        link.unlink()
        link.symlink_to(outside)
        with pytest.raises(ValueError, match=f"{link} is a link to {outside}, outside the model "
                                             f"folder {tmp_path / 'hub' / 'models--org--name'}"):
            tc.build_cache(inputs, tmp_path / f"out-{name}", str(snapshot), progress=False)
        link.unlink()
        (snapshot.parent.parent / "blobs" / f"blob-{name}").rename(snapshot / name)


# --- a transformers PreTrainedTokenizerFast -------------------------------------------------------

def test_a_transformers_tokenizer_builds_the_cache_its_folder_builds(tmp_path,
                                                                    chatml_tokenizer_path, books):
    template = variant(CHATML, tags=True)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=chatml_tokenizer_path,
                                              eos_token="<|endoftext|>", chat_template=template)
    eos = hf.eos_token_id
    folder = make_folder(tmp_path / "model", Path(chatml_tokenizer_path).read_bytes(),
                         {"eos_token": "<|endoftext|>", "chat_template": template})
    texts = [b["text"][:3000] for b in books[:6]] + TEXTS
    inputs = write_texts(tmp_path / "texts.jsonl", texts)
    for name, tokenizer in (("object", hf), ("folder", str(folder))):
        tc.build_cache(inputs, tmp_path / f"text-{name}", tokenizer, special_tokens_as_text=False,
                       progress=False)
    assert documents(tmp_path / "text-object") == [hf(t)["input_ids"] + [eos] for t in texts]
    # a background build (in a child process) takes it too
    handle = tc.build_cache(inputs, tmp_path / "background", hf, special_tokens_as_text=False,
                            background=True, progress=False)
    handle.wait()
    assert tc.TokenCache(tmp_path / "background").fingerprint == \
        tc.TokenCache(tmp_path / "text-object").fingerprint
    assert documents(tmp_path / "background") == documents(tmp_path / "text-object")
    chats = [[{"role": "user", "content": b["text"][:200]},
              {"role": "assistant", "content": b["text"][200:500]},
              {"role": "user", "content": "And then?"},
              {"role": "assistant", "content": b["text"][500:900]}] for b in books[:6]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    for name, tokenizer in (("object", hf), ("folder", str(folder))):
        tc.build_cache(str(tmp_path / "chats.jsonl"), tmp_path / f"chat-{name}", tokenizer,
                       input_format="messages", progress=False)
    cache = tc.TokenCache(tmp_path / "chat-object")
    for i, messages in enumerate(chats):
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        assert mask.any() and not mask.all()
        assert cache.document(i).tolist() == list(out["input_ids"]) + [eos]
        np.testing.assert_array_equal(cache.document_loss_mask(i), np.append(mask, mask[-1]))
    # one cache per content: the object and its folder make the same spec and fingerprint
    for kind in ("text", "chat"):
        by_object, by_folder = (tc.TokenCache(tmp_path / f"{kind}-{n}") for n in ("object", "folder"))
        assert by_object.spec == by_folder.spec and by_object.fingerprint == by_folder.fingerprint
    # and a pipeline's tokenize takes it too
    tc.source(inputs).tokenize(hf, special_tokens_as_text=False, progress=False).cache(
        tmp_path / "pipeline")
    assert documents(tmp_path / "pipeline") == [hf(t)["input_ids"] + [eos] for t in texts]


def test_a_slow_transformers_tokenizer_is_a_clear_error(tmp_path):
    slow = transformers.CanineTokenizer()
    assert not slow.is_fast
    inputs = write_texts(tmp_path / "texts.jsonl", ["one"])
    with pytest.raises(TypeError, match=r"slow transformers tokenizer \(CanineTokenizer\).*"
                                        r"use_fast=True.*or pass its tokenizer.json"):
        tc.build_cache(inputs, tmp_path / "out", slow, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_subclass_of_a_transformers_tokenizer_is_one(tmp_path, gpt2_tokenizer_path):
    class Mine(transformers.PreTrainedTokenizerFast):  # a user's class, in this module
        pass

    hf = Mine(tokenizer_file=gpt2_tokenizer_path, eos_token="<|endoftext|>")
    inputs = write_texts(tmp_path / "texts.jsonl", TEXTS[1:3])
    tc.build_cache(inputs, tmp_path / "out", hf, progress=False)
    assert documents(tmp_path / "out") == [
        hf(t, split_special_tokens=True)["input_ids"] + [hf.eos_token_id] for t in TEXTS[1:3]]


def test_a_model_folder_from_the_command_line_without_transformers_imported(tmp_path,
                                                                            chatml_tokenizer_path):
    folder = make_folder(tmp_path / "model", Path(chatml_tokenizer_path).read_bytes(),
                         {"eos_token": "<|im_end|>"})
    inputs = write_texts(tmp_path / "texts.jsonl", ["one two", "three"])
    code = ("import sys, torchcache.cli as cli\n"
            "code = cli.main(sys.argv[1:])\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code, "build", inputs, "-o", str(tmp_path / "out"),
                           "-t", str(folder)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TQDM_DISABLE="1"))
    assert done.returncode == 0, done.stderr
    tok = Tokenizer.from_file(chatml_tokenizer_path)
    assert documents(tmp_path / "out") == [tok.encode(t).ids + [tok.token_to_id("<|im_end|>")]
                                           for t in ("one two", "three")]
