"""The lazy pipeline: `tc.source(...).filter(f).map(g).tokenize(tok).cache(dir)` makes, byte for
byte, the cache `build_cache` makes of the same filtered and mapped texts; the functions reach
fresh worker processes by value (from a plain script's __main__); changing one makes another
cache; a kill -9 mid-build resumes to the same bytes."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest

import torchcache as tc
from torchcache.builder.functions import (FunctionError, function_fingerprint, pack_function,
                                        unpack_function)
from conftest import killed_build_resumes_to_the_same_bytes, paragraphs, tree_bytes

MIN_CHARS = 120
SPACES = re.compile(r"\s+")


def long_enough(record):
    return len(record["text"]) > MIN_CHARS


def clean(record):
    return {"text": SPACES.sub(" ", record["text"]).strip().lower()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, books) -> list[str]:
    root = tmp_path_factory.mktemp("pipeline-inputs")
    docs = paragraphs(books, 400)
    paths = []
    for k in range(2):
        path = root / f"part-{k}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for text in docs[k::2]:
                f.write(json.dumps({"text": text, "n": len(text)}) + "\n")
        paths.append(str(path))
    return paths


def mapped_inputs(inputs: list[str], out_dir) -> list[str]:
    """The same inputs, filtered and mapped here (what the pipeline's workers must do)."""
    out = []
    for k, path in enumerate(inputs):
        target = out_dir / f"mapped-{k}.jsonl"
        with open(path, encoding="utf-8") as f, open(target, "w", encoding="utf-8") as w:
            for line in f:
                record = json.loads(line)
                if long_enough(record):
                    w.write(json.dumps(clean(record)) + "\n")
        out.append(str(target))
    return out


def blocks(root) -> dict:
    return {k: v for k, v in tree_bytes(str(root)).items() if k.startswith("blocks/")}


def test_a_pipeline_cache_is_the_build_of_its_mapped_texts(tmp_path, inputs, gpt2_tokenizer_path):
    pipe = (tc.source(inputs).filter(long_enough).map(clean)
            .tokenize(gpt2_tokenizer_path, block_tokens=3000, num_workers=2, progress=False))
    cache = pipe.cache(tmp_path / "pipe")
    reference = tc.build_cache(mapped_inputs(inputs, tmp_path), tmp_path / "plain",
                               gpt2_tokenizer_path, block_tokens=3000, progress=False)
    assert cache.num_blocks > 4 and cache.num_documents == reference.num_documents
    # the same tokens and documents; the pipeline's offsets sidecars also keep the records the
    # filter left out (record runs: provenance names the lines of the pipeline's own inputs)
    tokens = {k: v for k, v in blocks(tmp_path / "pipe").items() if ".offsets." not in k}
    assert tokens == {k: v for k, v in blocks(tmp_path / "plain").items() if ".offsets." not in k}
    plain = tc.TokenCache(tmp_path / "plain")
    for b in range(cache.num_blocks):
        np.testing.assert_array_equal(cache.block_offsets(b), plain.block_offsets(b))
    lines = [open(path, encoding="utf-8").read().splitlines() for path in inputs]
    for d in range(0, cache.num_documents, 7):
        info = cache.document_info(d)
        record = json.loads(lines[inputs.index(info["input"])][info["record"]])
        assert long_enough(record) and cache.decode(cache.document(d)).startswith(clean(record)["text"])
    assert cache.skipped["filtered"] == 400 - reference.num_documents > 0
    assert cache.spec["pipeline"] == pipe.fingerprints
    assert pipe.cache(tmp_path / "pipe").num_tokens == cache.num_tokens  # complete: reused
    ds = cache.windows(32)
    view = list(ds.shuffle(seed=4).seek(len(ds) - 3))
    order = tc.DistributedSampler(ds, seed=4)
    order.set_position(len(ds) - 3)
    assert [item["input_ids"].tolist() for item in view] == \
        [ds[i]["input_ids"].tolist() for i in list(order)]
    assert len(cache.pack(32)) > 0 and len(cache.documents()) == cache.num_documents


def test_changing_a_function_makes_another_cache(tmp_path, inputs, gpt2_tokenizer_path):
    def shorter(limit):
        return lambda record: {"text": record["text"][:limit]}

    fingerprints = {function_fingerprint(shorter(100)), function_fingerprint(shorter(101))}
    assert len(fingerprints) == 2  # a closure value is part of what a function does
    first = tc.source(inputs).map(shorter(100)).tokenize(gpt2_tokenizer_path, progress=False)
    first.cache(tmp_path / "c")
    edited = tc.source(inputs).map(shorter(101)).tokenize(gpt2_tokenizer_path, progress=False)
    with pytest.raises(tc.BuildError, match="pipeline"):
        edited.cache(tmp_path / "c")


def test_a_function_that_cannot_be_fingerprinted_is_refused_at_once(inputs):
    handle = open(inputs[0], encoding="utf-8")
    try:
        with pytest.raises(FunctionError, match="'handle' is a TextIOWrapper"):
            tc.source(inputs).map(lambda record: {"text": handle.readline()})
    finally:
        handle.close()
    with pytest.raises(FunctionError, match="not a Python function"):
        tc.source(inputs).filter(len)


def test_functions_travel_by_value(inputs):
    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def step(record, suffix="!"):
        return {"text": clean(record)["text"] + suffix + str(fact(4)) + json.dumps(MIN_CHARS)}

    again = unpack_function(pack_function(step))
    record = {"text": "  Two   WORDS "}
    assert again(record) == step(record) == {"text": "two words!24120"}


def test_a_step_that_raises_names_the_record(tmp_path, inputs, gpt2_tokenizer_path):
    def picky(record):
        if record["n"] % 7 == 0:
            raise KeyError("seven")
        return record

    pipe = tc.source(inputs).map(picky)
    with pytest.raises(tc.InputError, match=r"part-\d\.jsonl:\d+: the map step .*picky raised KeyError"):
        pipe.tokenize(gpt2_tokenizer_path, progress=False, num_workers=1).cache(tmp_path / "raise")
    cache = pipe.tokenize(gpt2_tokenizer_path, progress=False, on_error="skip").cache(tmp_path / "skip")
    assert cache.skipped["map_error"] > 0


PLAIN_SCRIPT = textwrap.dedent("""\
    import re, sys
    import torchcache as tc
    WORDS = re.compile(r"[a-z]+")
    MIN = 3

    def enough(record):
        return len(WORDS.findall(record["text"].lower())) >= MIN

    tc.source(json.loads(sys.argv[1])).filter(enough).map(lambda r: {"text": r["text"].upper()}) \\
        .tokenize(sys.argv[2], block_tokens=1500, num_workers=2, progress=False).cache(sys.argv[3])
    """)


@pytest.mark.slow
def test_a_plain_script_killed_mid_build_resumes_to_the_same_bytes(tmp_path, inputs, gpt2_tokenizer_path):
    """Functions of a script's __main__ (no __name__ guard) reach fresh worker processes; a build
    killed (SIGKILL) after a few commits resumes to the bytes of an uninterrupted one."""
    killed_build_resumes_to_the_same_bytes(PLAIN_SCRIPT, json.dumps(inputs), gpt2_tokenizer_path, root=tmp_path)
    cache = tc.TokenCache(tmp_path / "whole")
    text = cache.decode(cache.document(0)[:-1])  # (without the EOS the build added)
    assert text == text.upper() and cache.skipped.get("filtered", 0) > 0
    assert np.all(cache.document_lengths() > 0)
