"""A build makes its tokenizer's DocumentEncoder once per process, not once per input: making one
parses the tokenizer's JSON several times (tenths of a second for GPT-2), which used to cost every
input of a build of many small inputs that much again."""

from __future__ import annotations

from conftest import paragraphs, write_jsonl

import torchcache as tc
import torchcache.builder.worker as worker


def test_an_inline_build_of_three_inputs_makes_one_encoder(tmp_path, books, gpt2_tokenizer_path,
                                                         gpt2, monkeypatch):
    made = []

    class Counted(worker.DocumentEncoder):  # the real encoder, counted as it is made
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(worker, "DocumentEncoder", Counted)
    docs = paragraphs(books, 300)
    shards = [write_jsonl(tmp_path / f"part-{i}.jsonl", docs[i::3]) for i in range(3)]
    result = tc.build_cache(shards, tmp_path / "c", gpt2_tokenizer_path, num_workers=1,
                            block_tokens=2048, progress=False)
    assert len(made) == 1
    cache = tc.TokenCache(result.path)
    assert cache.num_documents == len(docs)
    inputs = set()
    for d in range(0, len(docs), 7):  # every input's ids are the tokenizer's own
        info = cache.document_info(d)
        inputs.add(info["input"])
        text = docs[int(info["input"][-7]) + 3 * info["record"]]  # part-<i>.jsonl, its record
        ids = cache.document(d).tolist()
        assert ids[:-1] == gpt2.encode(text, add_special_tokens=False).ids
        assert ids[-1] == cache.eos_id
    assert len(inputs) == 3
