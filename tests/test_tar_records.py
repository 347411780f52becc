"""Webdataset tars as records (issue 32): `tc.source("*.tar")` hands each sample to the pipeline's
steps as webdataset itself groups it (a dict of member extension -> bytes, plus "__key__" and
"__url__"); the cache keeps the tar and the sample key of each document; a record whose text is
still bytes, or a damaged tar, is an error naming the tar and the sample (or a counted skip); the
function-fingerprint and kill -9 resume rules of other pipelines hold."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import webdataset as wds

import torchcache as tc
from conftest import DATA, paragraphs, python_with_hooks, tree_bytes

SPEECH = DATA / "speech-sample.tar"
SPEECH_KEYS = ["utt00000", "utt00001", "utt00002", "utt00004"]


def transcript(record):
    return {"text": record["txt"].decode("utf-8")}


def described(record):
    """The whole record as text: each value, or the sha256 of its bytes, by key."""
    return {"text": json.dumps({k: v if isinstance(v, str) else
                                [type(v).__name__, hashlib.sha256(v).hexdigest()]
                                for k, v in record.items()}, sort_keys=True)}


def webdataset_samples(path: str) -> list[dict]:
    """The samples webdataset's own reader makes of a tar."""
    dataset = wds.WebDataset(path, shardshuffle=False, empty_check=False)
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in dataset]


def write_tar(path, samples: list[dict]) -> str:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    return str(path)


@pytest.fixture
def speech(tmp_path) -> str:
    path = tmp_path / "speech" / "speech-sample.tar"
    path.parent.mkdir()
    shutil.copy(SPEECH, path)
    return str(path)


def test_the_speech_tar_makes_one_document_per_utterance(tmp_path, speech, gpt2, gpt2_tokenizer_path):
    cache = (tc.source(str(tmp_path / "speech" / "*.tar")).map(transcript)
             .tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "c"))
    eos = gpt2.token_to_id("<|endoftext|>")
    with tarfile.open(SPEECH) as tar:
        texts = {m.name[:-4]: tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")}
    assert cache.num_documents == len(SPEECH_KEYS) and cache.skipped == {}
    for d, key in enumerate(SPEECH_KEYS):
        assert cache.document(d).tolist() == gpt2.encode(texts[key]).ids + [eos]
        info = cache.document_info(d)
        assert (info["input"], info["record"], info["key"]) == (speech, d, key)
        assert cache.document_key(d) == key


def test_each_record_is_the_sample_webdataset_makes(tmp_path, speech, gpt2_tokenizer_path):
    cache = (tc.source(speech).map(described).tokenize(gpt2_tokenizer_path, eos=None, progress=False)
             .cache(tmp_path / "c"))
    expected = [described(s)["text"] for s in webdataset_samples(speech)]
    assert [cache.decode(cache.document(d)) for d in range(cache.num_documents)] == expected
    first = json.loads(expected[0])
    assert sorted(first) == ["__key__", "__url__", "flac", "json", "txt"]
    assert first["__key__"] == "utt00000" and first["__url__"] == speech


def test_members_group_as_webdataset_groups_them(tmp_path, gpt2_tokenizer_path):
    """Consecutive members sharing a key make a sample (a key that comes back later starts
    another); extensions are lower-cased and everything after the first dot; keys keep their
    folder; a member without an extension is left out (it does not split its sample)."""
    path = tmp_path / "g.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("a/x.txt", b"one"), ("a/NOTES", b"no extension"),
                           ("a/x.Meta.JSON", b"{}"), ("a/y.txt", b"two"), ("a/x.txt", b"three"),
                           ("b.seg.0.txt", b"four")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache = (tc.source(str(path)).map(described).tokenize(gpt2_tokenizer_path, eos=None, progress=False)
             .cache(tmp_path / "c"))
    expected = [described(s)["text"] for s in webdataset_samples(str(path))]
    assert [cache.decode(cache.document(d)) for d in range(cache.num_documents)] == expected
    assert [cache.document_info(d)["key"] for d in range(4)] == ["a/x", "a/y", "a/x", "b"]
    assert sorted(json.loads(expected[0])) == ["__key__", "__url__", "meta.json", "txt"]


def test_a_repeated_extension_in_a_sample_names_the_member(tmp_path, gpt2_tokenizer_path):
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("k.txt", "k.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match="duplicate"):  # webdataset refuses it too
        webdataset_samples(str(path))
    pipe = tc.source(str(path)).map(transcript)
    with pytest.raises(tc.InputError, match=r"dup\.tar: sample 'k'.*member 'k\.txt'.*twice"):
        pipe.tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "raise")
    cache = pipe.tokenize(gpt2_tokenizer_path, progress=False, on_error="skip",
                          allow_empty=True).cache(tmp_path / "skip")
    assert cache.skipped == {"bad_content": 1}


def test_text_still_in_bytes_is_an_error_that_says_to_decode_it(tmp_path, speech, gpt2_tokenizer_path):
    as_bytes = tc.source(speech).map(lambda r: {"text": r["txt"]})
    with pytest.raises(tc.InputError, match=r"speech-sample\.tar: sample 'utt00000'.*'text' is "
                                            r"bytes.*decode it in a map step"):
        as_bytes.tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "bytes")
    member_bytes = tc.source(speech, text_key="txt").filter(lambda r: True)
    with pytest.raises(tc.InputError, match=r"speech-sample\.tar: sample 'utt00000': field 'txt' is "
                                            r"bytes \(the bytes of member 'utt00000\.txt'\).*decode "
                                            r"it in a map step"):
        member_bytes.tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "nomap")
    missing = tc.source(speech).filter(lambda r: True)
    with pytest.raises(tc.InputError, match=r"sample 'utt00000'.*no 'text' field.*'flac', 'json', "
                                            r"'txt'.*map step"):
        missing.tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "missing")
    kept_bytes = tc.source(speech).map(lambda r: {**r, "text": r["txt"].decode()})
    with pytest.raises(tc.InputError, match=r"sample 'utt00000': the kept fields \['json'\] are not "
                                            r"plain JSON data.*decode a tar member's bytes"):
        kept_bytes.tokenize(gpt2_tokenizer_path, progress=False,
                            keep_fields=("json",)).cache(tmp_path / "kept")
    cache = as_bytes.tokenize(gpt2_tokenizer_path, progress=False, on_error="skip",
                              allow_empty=True).cache(tmp_path / "skip")
    assert cache.num_documents == 0 and cache.skipped == {"missing_text": len(SPEECH_KEYS)}


def test_a_damaged_tar_names_the_file(tmp_path, speech, gpt2_tokenizer_path):
    data = open(speech, "rb").read()
    with tarfile.open(speech) as tar:
        members = tar.getmembers()
    cut = members[3].offset_data + 1000  # inside utt00001.flac: the second sample is cut
    damaged = tmp_path / "cut.tar"
    damaged.write_bytes(data[:cut])
    pipe = tc.source(str(damaged)).map(transcript)
    with pytest.raises(tc.InputError, match=r"cut\.tar.*cannot read the tar after member "
                                            r"'utt00000\.json'"):
        pipe.tokenize(gpt2_tokenizer_path, progress=False).cache(tmp_path / "raise")
    cache = pipe.tokenize(gpt2_tokenizer_path, progress=False, on_error="skip").cache(tmp_path / "skip")
    assert cache.num_documents == 1 and cache.skipped == {"unreadable": 1}
    assert cache.document_info(0)["key"] == "utt00000"


def test_the_text_build_of_a_tar_makes_the_same_tokens(tmp_path, speech, gpt2_tokenizer_path):
    """build_cache(tar, text_key="txt") reads the member as text, as before; a pipeline that
    decodes it makes the same blocks and keys."""
    text = tc.build_cache(speech, tmp_path / "text", gpt2_tokenizer_path, text_key="txt",
                          progress=False)
    pipe = tc.source(speech).map(transcript).tokenize(gpt2_tokenizer_path, progress=False)
    cache = pipe.cache(tmp_path / "pipe")
    plain = tc.TokenCache(tmp_path / "text")
    assert text.num_documents == cache.num_documents == len(SPEECH_KEYS)
    for d in range(cache.num_documents):
        assert cache.document(d).tolist() == plain.document(d).tolist()
        assert cache.document_info(d) == plain.document_info(d)
    blocks = lambda root: {k: v for k, v in tree_bytes(str(root)).items()  # noqa: E731
                           if k.startswith("blocks/")}
    assert blocks(tmp_path / "pipe") == blocks(tmp_path / "text")


def test_function_fingerprints_still_decide(tmp_path, speech, gpt2_tokenizer_path):
    def upper(record):
        return {"text": record["txt"].decode().upper()}

    first = tc.source(speech).map(transcript).tokenize(gpt2_tokenizer_path, progress=False)
    before = tree_bytes(str(first.cache(tmp_path / "c").url))
    assert tree_bytes(str(first.cache(tmp_path / "c").url)) == before  # the same pipeline: reused
    edited = tc.source(speech).map(upper).tokenize(gpt2_tokenizer_path, progress=False)
    with pytest.raises(tc.BuildError, match="pipeline"):
        edited.cache(tmp_path / "c")


KILLED_SCRIPT = (
    "import torchcache as tc\n"
    "def decoded(r):\n"
    "    return {'text': r['txt'].decode('utf-8') + ' ' + r['__key__']}\n"
    "tc.source(json.loads(sys.argv[1])).filter(lambda r: len(r['txt']) > 80).map(decoded) \\\n"
    "    .tokenize(sys.argv[2], block_tokens=1500, num_workers=2, progress=False).cache(sys.argv[3])\n")


@pytest.mark.slow
def test_a_tar_pipeline_killed_mid_build_resumes_to_the_same_bytes(tmp_path, books,
                                                                   gpt2_tokenizer_path):
    docs = paragraphs(books, 240)
    tars = [write_tar(tmp_path / f"shard-{k}.tar",
                      [{"__key__": f"doc{i:05d}", "txt": text, "json": {"n": i}}
                       for i, text in enumerate(docs[k::2])]) for k in range(2)]

    def run(out, **hooks):
        command = python_with_hooks(KILLED_SCRIPT, json.dumps(tars), gpt2_tokenizer_path, str(out),
                                    **hooks)
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = run(tmp_path / "killed", kill_after_commits=3)
    assert killed.returncode == -9
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert tree_bytes(str(tmp_path / "killed")) == tree_bytes(str(tmp_path / "whole"))
    cache = tc.TokenCache(tmp_path / "whole")
    assert cache.num_blocks > 3 and cache.skipped.get("filtered", 0) > 0
    for d in range(0, cache.num_documents, 9):
        info = cache.document_info(d)
        assert cache.decode(cache.document(d)[:-1]).endswith(" " + info["key"])
        assert info["input"] in tars and info["key"] == f"doc{info['record']:05d}"
