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
import tarfile

import numpy as np
import pytest
import webdataset as wds

import torchcache as tc
from conftest import DATA, killed_build_resumes_to_the_same_bytes, paragraphs, tree_bytes

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

    killed_build_resumes_to_the_same_bytes(KILLED_SCRIPT, json.dumps(tars), gpt2_tokenizer_path, root=tmp_path)
    cache = tc.TokenCache(tmp_path / "whole")
    assert cache.num_blocks > 3 and cache.skipped.get("filtered", 0) > 0
    for d in range(0, cache.num_documents, 9):
        info = cache.document_info(d)
        assert cache.decode(cache.document(d)[:-1]).endswith(" " + info["key"])
        assert info["input"] in tars and info["key"] == f"doc{info['record']:05d}"


# ---------------------------------------------------------------- format v3 keeps the sample keys

def transcript_and_length(record):
    return {"text": record["txt"].decode("utf-8"), "n": len(record["txt"])}


def transcript_and_energy(record):
    raw = np.frombuffer(record["flac"], dtype=np.uint8)
    return {"text": record["txt"].decode("utf-8"),
            "energy": raw[: len(raw) // 80 * 80].reshape(-1, 80).astype(np.float32).sum(axis=1)}


def _blocks(path) -> list[str]:
    return sorted(p.name for p in (path / "blocks").iterdir())


@pytest.mark.parametrize("kept", [{"keep_fields": ("n",)}, {"arrays": ("energy",)}])
def test_a_v3_tar_cache_keeps_each_sample_key_in_its_documents_sidecar(tmp_path, speech,
                                                                       gpt2_tokenizer_path, kept):
    step = transcript_and_length if "keep_fields" in kept else transcript_and_energy
    cache = (tc.source(speech).map(step).tokenize(gpt2_tokenizer_path, progress=False, **kept)
             .cache(tmp_path / "c"))
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["version"] == 3
    assert [cache.document_key(d) for d in range(cache.num_documents)] == SPEECH_KEYS
    assert [cache.document_info(d)["key"] for d in range(cache.num_documents)] == SPEECH_KEYS
    assert cache.trace(int(cache.block_token_starts()[0]))["key"] == SPEECH_KEYS[0]
    assert not [name for name in _blocks(tmp_path / "c") if name.endswith(".keys.json")]
    assert tc.verify_cache(tmp_path / "c") == []
    assert [tc.TokenCache(tmp_path / "c", verify_checksums=True).document_key(d)
            for d in range(cache.num_documents)] == SPEECH_KEYS


def _patch_docs_checksum(cache_dir, b: int, data: bytes) -> None:
    """Make index record b's third checksum (the documents sidecar's, in v3) that of `data`."""
    index = cache_dir / "index" / "000000.bin"
    raw = bytearray(index.read_bytes())
    raw[b * 128 + 96: b * 128 + 128] = hashlib.sha256(data).digest()
    index.write_bytes(bytes(raw))


def test_verify_and_reads_find_damaged_sample_keys_in_a_v3_sidecar(tmp_path, speech,
                                                                    gpt2_tokenizer_path):
    """(A pipeline cache is not repairable: its steps are recorded by fingerprint only; the
    damaged file is put back by hand between the cases.)"""
    from safetensors.numpy import load_file
    from torchcache.format import blocks as fmt
    from torchcache.format.storage import LocalStorage

    out = tmp_path / "c"
    cache = (tc.source(speech).map(transcript_and_length)
             .tokenize(gpt2_tokenizer_path, progress=False, keep_fields=("n",)).cache(out))
    name = cache.block_table.path(0).replace(".safetensors", ".docs.safetensors")
    path = out / name
    good = path.read_bytes()
    assert good.count(b"utt00001") == 1

    path.write_bytes(good.replace(b"utt00001", b"utt0000X"))  # bytes flipped inside the keys
    problems = tc.verify_cache(out)
    assert len(problems) == 1 and name in problems[0] and "checksum" in problems[0]
    with pytest.raises(tc.CacheFormatError, match=r"docs\.safetensors"):
        tc.TokenCache(out, verify_checksums=True).document_key(1)
    path.write_bytes(good)

    path.write_bytes(good.replace(b'"utt00001"', b'"utt00001\xff'))  # not UTF-8 JSON
    with pytest.raises(tc.CacheFormatError, match=r"docs\.safetensors: the sample keys are not a UTF-8 "
                                                  r"JSON list.*corrupted"):
        tc.TokenCache(out).document_key(0)
    path.write_bytes(good)

    # a sidecar rewritten whole with one key too few, its checksum recorded: a structural problem
    tensors = load_file(str(path))
    tensors["keys"] = np.frombuffer(json.dumps(SPEECH_KEYS[:-1], separators=(",", ":")).encode(),
                                    dtype=np.uint8)
    fmt.write_tensors_file(LocalStorage(str(out)), name, tensors,
                           {"format": "torchcache", "version": "3"})
    _patch_docs_checksum(out, 0, path.read_bytes())
    problems = tc.verify_cache(out)
    assert len(problems) == 1 and name in problems[0] and "checksum" not in problems[0]
    assert "keys holds 3 sample keys, the block has 4 documents" in problems[0]
    with pytest.raises(tc.CacheFormatError, match=r"docs\.safetensors: keys holds 3"):
        tc.TokenCache(out).document_info(0)
    _patch_docs_checksum(out, 0, good)  # the record back: the file is now the damage
    assert "checksum" in tc.verify_cache(out)[0]
    path.write_bytes(good)
    assert tc.verify_cache(out) == [] and tc.TokenCache(out).document_key(3) == SPEECH_KEYS[3]
