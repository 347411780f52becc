"""Records of arrays (issue 32, DESIGN §9.6): `arrays=` keeps record fields as typed arrays beside
the tokens, one sidecar per block (`IIIIII-KKKKKK.arrays.safetensors`) whose checksum the
documents sidecar holds; `cache.document_arrays(i)` reads them back in each record's shape;
DocumentDataset items carry them and `pad_collate` pads them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import torch

import torchcache as tc
from conftest import DATA, python_with_hooks, tree_bytes

SPEECH = DATA / "speech-sample.tar"


def featurize(record):
    """Deterministic float32 [frames, 80] features from the FLAC bytes (no audio decoder needed),
    and a per-frame torch tensor, as a map step would return them."""
    raw = np.frombuffer(record["flac"], dtype=np.uint8)
    features = raw[: len(raw) // 80 * 80].reshape(-1, 80).astype(np.float32) / 255.0
    return {"text": record["txt"].decode("utf-8"), "input_features": features,
            "energy": torch.from_numpy(features.sum(axis=1))}


def image_record(record):
    rng = np.random.default_rng(record["seed"])
    h, w = (int(x) for x in rng.integers(1, 40, size=2))
    return {"text": record["text"], "image": rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)}


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_speech_features_come_back_bit_identical(tmp_path, gpt2_tokenizer_path):
    shutil.copy(SPEECH, tmp_path / "speech.tar")
    cache = (tc.source(str(tmp_path / "speech.tar")).map(featurize)
             .tokenize(gpt2_tokenizer_path, arrays=("input_features", "energy"), progress=False)
             .cache(tmp_path / "c"))
    with tarfile.open(SPEECH) as tar:
        flacs = [tar.extractfile(m).read() for m in tar if m.name.endswith(".flac")]
    assert cache.num_documents == 4 and cache.array_fields == ("energy", "input_features")
    for d in range(cache.num_documents):
        expected = featurize({"flac": flacs[cache.document_info(d)["record"]], "txt": b""})
        got = cache.document_arrays(d)
        assert got["input_features"].dtype == np.float32 and got["input_features"].shape[1] == 80
        assert got["input_features"].tobytes() == expected["input_features"].tobytes()
        assert got["energy"].tobytes() == expected["energy"].numpy().tobytes()
        assert not got["input_features"].flags.writeable and not got["input_features"].flags.owndata
    block = cache.block_table.path(0)
    from safetensors.numpy import load_file  # any safetensors reader opens the sidecar
    stored = load_file(os.path.join(str(tmp_path / "c"), block.replace(".safetensors", ".arrays.safetensors")))
    assert stored["input_features.shapes"].tolist() == [
        list(cache.document_arrays(d)["input_features"].shape) for d in range(4)]
    assert stored["energy.offsets"].tolist()[-1] == stored["energy"].size


def test_images_of_random_sizes_keep_their_shapes_across_blocks(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "img.jsonl", [{"text": f"image {k}", "seed": k} for k in range(12)])
    cache = (tc.source(src).map(image_record)
             .tokenize(gpt2_tokenizer_path, arrays=("image",), block_tokens=8, progress=False)
             .cache(tmp_path / "c"))
    assert cache.num_blocks > 2
    for d in range(12):
        expected = image_record({"text": "", "seed": d})["image"]
        got = cache.document_arrays(d)["image"]
        assert got.dtype == np.uint8 and got.shape == expected.shape
        assert np.array_equal(got, expected)


def test_boxes_from_json_lines_come_back_typed_with_zero_boxes(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "boxes.jsonl", [
        {"text": "two boxes", "boxes": [[1, 2, 3, 4], [5, 6, 7, 8]], "score": [0.5, 1e-4]},
        {"text": "none", "boxes": [], "score": []},
        {"text": "one", "boxes": [[9.5, 0, 1, 2]], "score": [7]}])
    declared = tc.build_cache(src, tmp_path / "declared", gpt2_tokenizer_path, progress=False,
                              arrays={"boxes": "float32[*, 4]", "score": "float16[*]"})
    cache = tc.TokenCache(declared.path)
    first, empty, last = (cache.document_arrays(d) for d in range(3))
    assert first["boxes"].dtype == np.float32 and first["boxes"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert empty["boxes"].shape == (0, 4) and empty["boxes"].dtype == np.float32
    assert first["score"].dtype == np.float16 and first["score"].tolist() == \
        np.array([0.5, 1e-4], np.float16).tolist()
    assert last["boxes"].tolist() == [[9.5, 0, 1, 2]] and empty["score"].shape == (0,)
    # undeclared: the first record's dtype (JSON ints: int64) and trailing dims for empty lists
    src2 = write_jsonl(tmp_path / "ints.jsonl", [{"text": "a", "boxes": [[1, 2, 3, 4]]},
                                                 {"text": "b", "boxes": []}])
    plain = tc.TokenCache(tc.build_cache(src2, tmp_path / "plain", gpt2_tokenizer_path,
                                         progress=False, arrays=("boxes",)).path)
    assert plain.document_arrays(0)["boxes"].dtype == np.int64
    assert plain.document_arrays(1)["boxes"].shape == (0, 4)
    assert declared.fingerprint != tc.build_cache(src, tmp_path / "other", gpt2_tokenizer_path,
                                                  progress=False, arrays={"boxes": "float32[*, 4]",
                                                                         "score": "float32[*]"}).fingerprint


@pytest.mark.parametrize("value, declared, what", [
    ([[1, 2], [3]], None, "not rectangular"),
    ([["a", "b"]], None, "not numbers"),
    ([1.5, 2.5], "int32[*]", "float64 values, which int32 cannot hold"),
    ([300], "uint8[*]", "outside uint8's range"),
    ([-1], "uint8[*]", "outside uint8's range"),
    ([[1, 2, 3]], "float32[*, 4]", "dimension 1 must be 4"),
    ([1, 2, 3, 4], "float32[*, 4]", "rank 1"),
    ([1e300], "float16[*]", "too large for float16"),
    (7, None, "not a list"),
])
def test_a_bad_array_names_file_line_and_field_or_is_a_counted_skip(tmp_path, gpt2_tokenizer_path,
                                                                   value, declared, what):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ok", "a": [[1, 2, 3, 4]] if declared and
                                               "4]" in declared else [1, 2]},
                                              {"text": "bad", "a": value}])
    arrays = {"a": declared} if declared else ("a",)
    with pytest.raises(tc.InputError, match=rf"in\.jsonl:2: array field 'a': .*{what}"):
        tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, progress=False, arrays=arrays)
    result = tc.build_cache(src, tmp_path / "s", gpt2_tokenizer_path, progress=False, arrays=arrays,
                            on_error="skip")
    assert result.skipped == {"bad_array": 1} and result.num_documents == 1


def test_bad_declarations_are_refused_before_any_work(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x", "a": [1]}])
    for arrays, error in (({"a": "float128"}, ValueError), ({"a": "int8[x]"}, ValueError),
                          ("a", TypeError), ({"a.offsets": None}, ValueError)):
        with pytest.raises(error):
            tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, progress=False, arrays=arrays)
    assert not (tmp_path / "c").exists()


def _boxes_cache(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "b.jsonl", [{"text": f"doc {k}", "b": [[k, k + 1]] * (k % 3)}
                                             for k in range(20)])
    return tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, progress=False,
                          arrays={"b": "int32[*, 2]"}, block_tokens=16)


def test_verify_finds_a_damaged_arrays_sidecar_and_repair_restores_it(tmp_path, gpt2_tokenizer_path):
    result = _boxes_cache(tmp_path, gpt2_tokenizer_path)
    cache = tc.TokenCache(result.path)
    name = cache.block_table.path(1).replace(".safetensors", ".arrays.safetensors")
    path = os.path.join(result.path, name)
    good = open(path, "rb").read()
    assert tc.verify_cache(result.path) == []
    damaged = bytearray(good)
    damaged[-1] ^= 1
    open(path, "wb").write(damaged)
    problems = tc.verify_cache(result.path)
    assert len(problems) == 1 and name in problems[0] and "checksum" in problems[0]
    first = int(cache.block_token_starts()[1])
    doc = cache.document_at(first)
    with pytest.raises(tc.CacheFormatError, match=r"arrays\.safetensors"):
        tc.TokenCache(result.path, verify_checksums=True).document_arrays(doc)
    assert tc.repair_cache(result.path).repaired == [name]
    assert open(path, "rb").read() == good and tc.verify_cache(result.path) == []
    open(path, "wb").write(good[: len(good) // 2])  # truncated: found when opened, even unverified
    with pytest.raises(tc.CacheFormatError, match=r"arrays\.safetensors.*(truncated|header)"):
        tc.TokenCache(result.path).document_arrays(doc)
    os.remove(path)
    assert name in tc.verify_cache(result.path)[0]
    assert tc.repair_cache(result.path).repaired == [name] and open(path, "rb").read() == good


def test_document_dataset_and_pad_collate_with_two_workers(tmp_path, gpt2_tokenizer_path):
    result = _boxes_cache(tmp_path, gpt2_tokenizer_path)
    cache = tc.TokenCache(result.path)
    docs = tc.DocumentDataset(cache)
    item = docs[4]
    assert set(item) == {"input_ids", "b"} and item["b"].dtype == torch.int32
    assert item["b"].tolist() == [[4, 5]]
    loader = tc.DataLoader(docs, batch_size=4, collate_fn=tc.pad_collate, num_workers=2)
    batches = list(loader)
    assert len(batches) == 5
    for k, batch in enumerate(batches):
        rows = [cache.document_arrays(d)["b"] for d in range(4 * k, 4 * k + 4)]
        longest = max(len(r) for r in rows)
        assert batch["b"].shape == (4, longest, 2) and batch["b"].dtype == torch.int32
        assert batch["b_shape"].tolist() == [list(r.shape) for r in rows]
        for row, r in zip(batch["b"], rows):
            assert row[: len(r)].tolist() == r.tolist() and not row[len(r):].any()
        assert batch["input_ids"].shape[0] == 4


def test_pad_collate_pads_every_dimension():
    items = [{"input_ids": torch.tensor([1, 2]), "image": torch.ones(2, 3, 3, dtype=torch.uint8)},
             {"input_ids": torch.tensor([3]), "image": torch.full((4, 1, 3), 7, dtype=torch.uint8)}]
    batch = tc.pad_collate(items)
    assert batch["image"].shape == (2, 4, 3, 3) and batch["image_shape"].tolist() == [[2, 3, 3], [4, 1, 3]]
    assert batch["image"][0, 2:].sum() == 0 and batch["image"][1, :, 1:].sum() == 0
    assert batch["image"][1, :, 0].eq(7).all() and set(tc.pad_collate([torch.tensor([1])])) == \
        {"input_ids", "attention_mask", "labels", "lengths"}


def test_a_cache_without_arrays_has_none(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}, {"text": "text"}])
    result = tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, progress=False)
    cache = tc.TokenCache(result.path)
    assert cache.document_arrays(1) == {} and cache.array_fields == ()
    assert "documents" not in cache.spec
    assert not any(n.endswith(".arrays.safetensors") for n in os.listdir(tmp_path / "c" / "blocks"))
    assert isinstance(tc.DocumentDataset(cache)[0], torch.Tensor)


def test_a_remote_cache_serves_identical_arrays(tmp_path, gpt2_tokenizer_path):
    from conftest import moto_s3
    result = _boxes_cache(tmp_path, gpt2_tokenizer_path)
    local = tc.TokenCache(result.path)
    with moto_s3() as options:
        import s3fs
        s3fs.S3FileSystem(**options).put(result.path, "bucket/arrays", recursive=True)
        for limit in (None, "64KB"):  # copied sidecars, and sidecars read into memory
            remote = tc.TokenCache("s3://bucket/arrays", storage_options=options,
                                   local_dir=str(tmp_path / f"copies-{limit}"), cache_limit=limit)
            for d in range(local.num_documents):
                got, expected = remote.document_arrays(d), local.document_arrays(d)
                assert got["b"].dtype == expected["b"].dtype and np.array_equal(got["b"], expected["b"])
            remote.close()


def test_a_killed_build_resumes_to_the_same_arrays_and_a_rerun_keeps_them(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "b.jsonl", [{"text": f"doc {k}", "b": [[k, k + 1]] * (k % 3)}
                                             for k in range(20)])
    options = dict(progress=False, arrays={"b": "int32[*, 2]"}, block_tokens=16, num_workers=1)
    whole = tc.build_cache(src, tmp_path / "whole", gpt2_tokenizer_path, **options)
    script = ("import torchcache as tc\n"
              "tc.build_cache(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, "
              "arrays={'b': 'int32[*, 2]'}, block_tokens=16, num_workers=1)\n")
    command = python_with_hooks(script, src, str(tmp_path / "killed"), gpt2_tokenizer_path,
                                kill_after_commits=3)
    assert subprocess.run(command, timeout=300).returncode == -9
    orphan = tmp_path / "killed" / "blocks" / "000000-000042.arrays.safetensors"
    orphan.write_bytes(b"left by a crash before its block was committed")
    resumed = tc.build_cache(src, tmp_path / "killed", gpt2_tokenizer_path, **options)
    assert resumed.fingerprint == whole.fingerprint and not orphan.exists()
    assert tree_bytes(str(tmp_path / "killed")) == tree_bytes(str(tmp_path / "whole"))
    assert tc.build_cache(src, tmp_path / "whole", gpt2_tokenizer_path, **options).already_complete
    cache = tc.TokenCache(whole.path)
    assert tc.verify_cache(whole.path) == [] and cache.document_arrays(5)["b"].tolist() == [[5, 6]] * 2


def test_a_field_whose_inputs_give_other_dtypes_is_refused_unless_declared(tmp_path, gpt2_tokenizer_path):
    """An undeclared field takes each input's first record's dtype and rank; a cache holds one per
    field, so inputs that disagree (whole numbers in one file, fractions in the other) stop the
    build naming both, and declaring the field builds them alike."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"text": f"one {i}", "w": [1, 2, i]}) + "\n" for i in range(3)))
    second.write_text("".join(json.dumps({"text": f"two {i}", "w": [0.5, i]}) + "\n" for i in range(3)))
    with pytest.raises(tc.BuildError, match=r"array field 'w' is float64 of rank 1 .*b\.jsonl.*int64.*"
                                            r"arrays=\{'w': 'int64\[\*\]'\}"):
        tc.build_cache([first, second], tmp_path / "mixed", gpt2_tokenizer_path, arrays=("w",),
                       num_workers=1, progress=False)
    tc.build_cache([first, second], tmp_path / "declared", gpt2_tokenizer_path,
                   arrays={"w": "float32[*]"}, num_workers=2, progress=False)
    cache = tc.TokenCache(tmp_path / "declared")
    got = [cache.document_arrays(d)["w"] for d in range(cache.num_documents)]
    assert all(a.dtype == np.float32 for a in got)
    assert [a.tolist() for a in got] == [[1, 2, i] for i in range(3)] + [[0.5, i] for i in range(3)]


def test_a_block_closes_at_block_array_bytes_and_reads_the_same(tmp_path, gpt2_tokenizer_path):
    # 12 images of 1..39 x 1..39 x 3 bytes: a block of arrays closes before the document that
    # would take it past block_array_bytes (a larger document gets a block of its own), so the
    # build holds at most that much per input; the documents read back are the same
    src = write_jsonl(tmp_path / "img.jsonl", [{"text": f"image {k}", "seed": k} for k in range(12)])
    limit = 3000
    small = (tc.source(src).map(image_record)
             .tokenize(gpt2_tokenizer_path, arrays=("image",), block_array_bytes=limit, progress=False)
             .cache(tmp_path / "small"))
    whole = (tc.source(src).map(image_record)
             .tokenize(gpt2_tokenizer_path, arrays=("image",), progress=False).cache(tmp_path / "whole"))
    sizes = [image_record({"text": "", "seed": k})["image"].nbytes for k in range(12)]
    expected, block = [], []
    for size in sizes:  # the rule, applied to the sizes: whole documents, at most `limit` unless alone
        if block and sum(block) + size > limit:
            expected.append(len(block))
            block = []
        block.append(size)
        if sum(block) >= limit:
            expected.append(len(block))
            block = []
    expected += [len(block)] if block else []
    assert whole.num_blocks == 1 and len(expected) > 3
    assert [int(n) for n in small.block_table.records["num_documents"]] == expected
    assert small.spec["block_array_bytes"] == limit and "block_array_bytes" not in \
        tc.TokenCache(_text_only_cache(tmp_path, gpt2_tokenizer_path)).spec
    for d in range(12):
        assert np.array_equal(small.document_arrays(d)["image"], whole.document_arrays(d)["image"])
    assert tc.verify_cache(tmp_path / "small") == []
    with pytest.raises(ValueError, match="block_array_bytes"):
        tc.build_cache(src, tmp_path / "bad", gpt2_tokenizer_path, arrays=("seed",), block_array_bytes=0)


def _text_only_cache(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    return tc.build_cache(src, tmp_path / "text-only", tokenizer, progress=False).path


def transposed_record(record):
    """Features as feature extractors return them: a transposed (Fortran-order) array, and a
    strided view."""
    base = np.arange(record["seed"] * 240, (record["seed"] + 1) * 240, dtype=np.float32).reshape(80, 3)
    return {"text": record["text"], "fortran": base.T, "strided": base[::2, ::2]}


def test_arrays_in_any_memory_layout_come_back_in_their_shape(tmp_path, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {k}", "seed": k} for k in range(6)])
    cache = (tc.source(src).map(transposed_record)
             .tokenize(gpt2_tokenizer_path, arrays=("fortran", "strided"), block_tokens=6,
                       progress=False).cache(tmp_path / "c"))
    assert cache.num_blocks > 1
    for d in range(6):
        expected, got = transposed_record({"text": "", "seed": d}), cache.document_arrays(d)
        for name in ("fortran", "strided"):
            assert got[name].shape == expected[name].shape
            assert np.array_equal(got[name], expected[name])
