"""Reading a cache of document arrays (issue 32, items 4 and 6): while it is being built, through
DataLoader workers (tensors, not pickled numpy), with exact resume in a fresh process, trace and
sample_documents naming each document's record, and from a remote store under a cache_limit of a
third of its size."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest
import torch
from conftest import paragraphs, wait_for_blocks
from test_remote_cache import tree_bytes

import torchcache as tc

ARRAYS = {"feat": "float32[*, 3]", "ids": "int16[*]"}
BATCH, WINDOW = 8, 64


def record(k: int, text: str) -> dict:
    """Record k: its text and two arrays of k-dependent shapes (some empty), exactly float32-
    and int16-representable, so that the stored values must equal these bit for bit."""
    rng = np.random.default_rng(k)
    return {"text": text, "feat": rng.standard_normal((k % 5, 3)).astype(np.float32).tolist(),
            "ids": rng.integers(-2**15, 2**15, size=k % 7).tolist()}


def expected_arrays(k: int) -> dict[str, np.ndarray]:
    r = record(k, "")
    return {"feat": np.asarray(r["feat"], np.float32).reshape(-1, 3), "ids": np.asarray(r["ids"], np.int16)}


class _GatedRecords:
    """Yields the first `gate` records, then waits until released: a build that is
    deterministically incomplete while the test reads it."""

    def __init__(self, records: list[dict], gate: int):
        self.records, self.gate, self.release = records, gate, threading.Event()

    def __iter__(self):
        for i, r in enumerate(self.records):
            if i == self.gate:
                assert self.release.wait(120), "test never released the build"
            yield r


def same_item(a, b) -> bool:
    """Two DocumentDataset items or pad_collate batches, equal key for key, dtype and bits."""
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)


@pytest.fixture()
def records(books) -> list[dict]:
    return [record(k, t) for k, t in enumerate(paragraphs(books))]


def test_a_growing_arrays_cache_serves_its_committed_prefix_as_the_finished_one(
        tmp_path, records, gpt2_tokenizer_path):
    """Train while building, with arrays: a sampler over the committed prefix (quick-start
    windows) feeds 2 workers that refresh as the cache grows; every batch read during the build,
    arrays included, equals the finished cache's, and a state saved mid-build resumes on it."""
    gated = _GatedRecords(records, gate=1050)  # (past a worker's first batch of 1024 records)
    handle = tc.build_cache(iter(gated), tmp_path / "c", gpt2_tokenizer_path, arrays=ARRAYS,
                            block_tokens=2000, num_workers=1, background=True, progress=False)
    try:
        cache = wait_for_blocks(tmp_path / "c", handle, minimum=8)
        docs = tc.DocumentDataset(cache)
        committed = len(docs)
        assert not docs.complete and WINDOW * 2 <= committed < 1050
        # what the reader sees is only what was committed: nothing past it
        with pytest.raises(IndexError):
            cache.document_arrays(committed)
        for d in range(committed):
            got = cache.document_arrays(d)
            assert all(got[k].tobytes() == v.tobytes() and got[k].shape == v.shape
                       for k, v in expected_arrays(d).items())
        sampler = tc.DistributedSampler(docs, seed=3, window=WINDOW, build=handle, wait_timeout=120)
        loader = tc.DataLoader(docs, batch_size=BATCH, sampler=sampler, num_workers=2,
                               collate_fn=tc.pad_collate)
        it = iter(loader)
        early = [next(it) for _ in range(WINDOW // BATCH * (committed // WINDOW))]
        assert not tc.TokenCache(tmp_path / "c").complete, "these batches came from a growing cache"
        state = json.loads(json.dumps(loader.state_dict()))
    finally:
        gated.release.set()
    rest = list(it)  # the sampler waits for each next window; the workers refresh to read it
    handle.wait(120)
    assert handle.error is None
    final = tc.DocumentDataset(tmp_path / "c")
    assert docs.refresh() == len(final) == len(records) and docs.complete
    assert sum(len(b["input_ids"]) for b in early + rest) == len(final)

    ref = tc.DataLoader(final, batch_size=BATCH, num_workers=0, collate_fn=tc.pad_collate,
                        sampler=tc.DistributedSampler(final, seed=3, window=WINDOW))
    reference = list(ref)
    assert len(reference) == len(early) + len(rest)
    assert all(same_item(a, b) for a, b in zip(early + rest, reference))
    for d in range(len(final)):  # the finished cache holds the records' arrays bit for bit
        got = final.cache.document_arrays(d)
        assert all(got[k].tobytes() == v.tobytes() and got[k].shape == v.shape
                   for k, v in expected_arrays(d).items())

    resumed = tc.DataLoader(final, batch_size=BATCH, num_workers=2, collate_fn=tc.pad_collate,
                            sampler=tc.DistributedSampler(final, seed=3, window=WINDOW))
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) and all(same_item(a, b) for a, b in zip(again, rest))


# ---------------------------------------------------------------- a webdataset tar of arrays

def write_tar(path, texts: list[str]) -> list[str]:
    """A webdataset tar: per sample `<key>.txt`, `<key>.feat` (float32 [k % 5, 3], raw bytes)
    and `<key>.ids` (int16 [k % 7]); returns the sample keys in order."""
    keys = []
    with tarfile.open(path, "w") as tar:
        for k, text in enumerate(texts):
            key = f"utt-{k:04d}"
            arrays = expected_arrays(k)
            for ext, data in (("txt", text.encode()), ("feat", arrays["feat"].tobytes()),
                              ("ids", arrays["ids"].tobytes())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            keys.append(key)
    return keys


def decode(sample: dict) -> dict:
    """A tar sample's bytes -> text and arrays, as a pipeline's map makes them."""
    return {"text": sample["txt"].decode("utf-8"),
            "feat": np.frombuffer(sample["feat"], dtype=np.float32).reshape(-1, 3),
            "ids": np.frombuffer(sample["ids"], dtype=np.int16)}


@pytest.fixture()
def tar_cache(tmp_path, books, gpt2_tokenizer_path):
    """(cache path, tar path, sample keys): 60 tar samples of arrays, over several blocks."""
    tar = tmp_path / "speech-000.tar"
    keys = write_tar(tar, paragraphs(books, 60))
    cache = (tc.source(str(tar)).map(decode)
             .tokenize(gpt2_tokenizer_path, arrays=ARRAYS, block_tokens=600, progress=False)
             .cache(tmp_path / "c"))
    assert cache.num_documents == 60 and cache.num_blocks >= 4
    return str(tmp_path / "c"), str(tar), keys


def loader_over(path: str, **options) -> tc.DataLoader:
    return tc.DataLoader(tc.DocumentDataset(path), batch_size=3, shuffle=True, seed=11,
                         collate_fn=tc.pad_collate, num_workers=2, **options)


RESUME_SCRIPT = """\
import json, sys
import torchcache as tc
from safetensors.torch import save_file
path, state, out = sys.argv[1:]
loader = tc.DataLoader(tc.DocumentDataset(path), batch_size=3, shuffle=True, seed=11,
                       collate_fn=tc.pad_collate, num_workers=2)
loader.load_state_dict(json.load(open(state)))
batches = [b for _ in range(2) for b in loader]  # the rest of epoch 0, then epoch 1
save_file({f"{i}/{k}": v.contiguous() for i, b in enumerate(batches) for k, v in b.items()}, out)
"""


def test_exact_resume_in_a_fresh_process_gives_the_same_arrays(tmp_path, tar_cache):
    """A shuffled loader of 2 workers over an arrays cache, stopped mid-epoch: a fresh process
    (a plain script, no main guard) loads the saved state, and its batches, arrays included,
    are the uninterrupted run's, bit for bit."""
    path, _, _ = tar_cache
    uninterrupted = loader_over(path)
    whole = [b for _ in range(2) for b in uninterrupted]  # epochs 0 and 1
    assert len(whole) == 40 and {"feat", "feat_shape", "ids", "ids_shape"} <= set(whole[0])
    loader = loader_over(path)
    it = iter(loader)
    for k in range(7):
        assert same_item(next(it), whole[k])
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(loader.state_dict()))
    del it
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    done = subprocess.run([sys.executable, str(script), path, str(state_file), str(tmp_path / "rest.st")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "rest.st")
    rest = [{k.split("/", 1)[1]: v for k, v in saved.items() if k.split("/")[0] == str(i)}
            for i in range(len(whole) - 7)]
    assert len(saved) == sum(len(b) for b in whole[7:])
    assert all(same_item(a, b) for a, b in zip(rest, whole[7:]))


def test_trace_and_sample_documents_name_each_documents_tar_sample(tmp_path, tar_cache):
    """trace_step, document_info and `torchcache trace` (from a saved state alone) of a
    DocumentDataset loader over a tar-built arrays cache name each document's sample key and
    tar:record; sample_documents is the whole document, as for tokens."""
    path, tar, keys = tar_cache
    cache = tc.TokenCache(path)
    docs = tc.DocumentDataset(cache)
    for d in (0, 17, 59):
        start, stop = cache.document_span(d)
        assert docs.sample_documents(d) == [{"source": None, "document": d, "start": 0,
                                             "end": stop - start}]
        assert len(docs[d]["input_ids"]) == stop - start
        info = cache.document_info(d)
        assert (info["input"], info["record"], info["key"]) == (tar, d, keys[d])
    loader = loader_over(path)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(loader.state_dict()))
    next(it)
    step5 = next(it)  # what step 5 really read
    traced = tc.trace_step(loader, 5)
    assert [s["sample"] for s in traced] == list(loader.step_samples(5))
    for row, length, sample in zip(step5["input_ids"], step5["lengths"], traced):
        assert row[:length].tolist() == cache.document(sample["sample"]).tolist()
    for sample in traced:
        (piece,) = sample["documents"]
        d = sample["sample"]
        assert (piece["document"], piece["record"], piece["key"], piece["input"]) == (d, d, keys[d], tar)
    done = subprocess.run([sys.executable, "-m", "torchcache", "trace", path, "--step", "5",
                           "--state", str(state_file)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "step 5: 3 samples over 1 rank"
    for sample in traced:
        d = sample["sample"]
        assert any(f"document {d} " in line and f"{tar}:{d + 1}  key {keys[d]}" in line for line in lines)
    both = subprocess.run([sys.executable, "-m", "torchcache", "trace", path, "--step", "5",
                           "--documents", "--seq-len", "8", "--batch-size", "3"],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "--documents reads whole documents" in both.stderr
    as_json = subprocess.run([sys.executable, "-m", "torchcache", "trace", path, "--step", "5",
                              "--documents", "--batch-size", "3", "--seed", "11", "--json"],
                             capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["samples"] == json.loads(json.dumps(traced))


def leaves(value):
    """Every leaf of a batch (nested dicts, lists and tuples)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in leaves(v)]
    return [value]


def items_as_they_are(items: list) -> list:
    """A collate function that sends the DocumentDataset items themselves back from the worker,
    after checking there that they hold tensors only."""
    from torch.utils.data import get_worker_info
    assert get_worker_info() is not None, "expected to run in a worker process"
    bad = [type(x).__name__ for x in leaves(items) if not isinstance(x, torch.Tensor)]
    assert not bad, f"a DocumentDataset item holds {bad}, not only tensors"
    return items


@pytest.mark.parametrize("collate", [tc.pad_collate, items_as_they_are])
def test_workers_send_tensors_not_pickled_numpy(tar_cache, collate):
    """What a worker returns for an arrays cache (pad_collate batches, or the items themselves)
    is torch tensors only (checked in the worker, and as received): no numpy array is pickled
    through the worker queue."""
    path, _, _ = tar_cache
    cache = tc.TokenCache(path)
    loader = tc.DataLoader(tc.DocumentDataset(path), batch_size=4, collate_fn=collate,
                           num_workers=2)
    seen = 0
    for k, batch in enumerate(loader):
        values = leaves(batch)
        assert not [v for v in values if isinstance(v, np.ndarray)]
        assert all(isinstance(v, torch.Tensor) for v in values)
        items = batch if isinstance(batch, list) else []
        for d, item in enumerate(items, start=4 * k):
            assert same_item({n: item[n] for n in ARRAYS},
                             {n: torch.from_numpy(a.copy()) for n, a in cache.document_arrays(d).items()})
        seen += 1
    assert seen == 15


# ---------------------------------------------------------------- a remote cache under a limit

@pytest.mark.s3
def test_a_remote_cache_under_a_third_of_its_size_serves_identical_arrays(tmp_path, s3,
                                                                        gpt2_tokenizer_path):
    """A remote arrays cache read with cache_limit at a third of its size: every document's
    arrays, one by one and through a shuffled loader of 2 workers, equal the local cache's bit
    for bit; the copy directory never holds more than the limit; the arrays sidecars are local
    copies counted in it and evicted like blocks (a second pass reads those kept, not the store)."""
    import s3fs
    rng = np.random.default_rng(0)
    src = tmp_path / "a.jsonl"
    features = [rng.standard_normal((20 + k % 40, 16)).astype(np.float32) for k in range(120)]
    src.write_text("".join(json.dumps({"text": f"utterance {k} " * (1 + k % 4), "feat": f.tolist()})
                           + "\n" for k, f in enumerate(features)))
    built = tc.build_cache(str(src), tmp_path / "c", gpt2_tokenizer_path, progress=False,
                           arrays={"feat": "float32[*, 16]"}, block_tokens=100, num_workers=1)
    local = tc.TokenCache(built.path)
    sidecars = sorted((tmp_path / "c" / "blocks").glob("*.arrays.safetensors"))
    size = tree_bytes(tmp_path / "c" / "blocks")
    arrays_bytes = sum(p.stat().st_size for p in sidecars)
    assert local.num_blocks >= 10 and arrays_bytes > 0.8 * size
    limit = size // 3
    s3fs.S3FileSystem(**s3).put(built.path, "bucket/arrays-third", recursive=True)
    copies = tmp_path / "copies"
    remote = tc.TokenCache("s3://bucket/arrays-third", storage_options=s3, local_dir=str(copies),
                           cache_limit=limit)
    peak = 0
    for d in range(local.num_documents):
        got, want = remote.document_arrays(d)["feat"], local.document_arrays(d)["feat"]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        assert want.tobytes() == features[d].tobytes()  # (and the local cache holds the input's)
        peak = max(peak, tree_bytes(copies))
    assert 0 < peak <= limit
    first = remote.stats()
    kept = sorted(p.name for p in copies.rglob("*.arrays.safetensors.*") if ".ok-" not in p.name)
    assert kept and first["evictions"] > 0  # sidecars are copies under the limit, evicted as needed
    assert first["bytes_downloaded"] < 1.2 * size  # each sidecar fetched once in a forward pass

    remote_docs, local_docs = tc.DocumentDataset(remote), tc.DocumentDataset(local)
    got_loader = tc.DataLoader(remote_docs, batch_size=8, shuffle=True, seed=2, num_workers=2,
                               collate_fn=tc.pad_collate)
    want_loader = tc.DataLoader(local_docs, batch_size=8, shuffle=True, seed=2, num_workers=0,
                                collate_fn=tc.pad_collate)
    count = 0
    for got, want in zip(got_loader, want_loader, strict=True):
        assert same_item(got, want)
        peak = max(peak, tree_bytes(copies))
        count += 1
    assert count == 15 and peak <= limit
    remote.close()

    # a fresh reader of the same copy directory: the sidecars kept there are read locally
    again = tc.TokenCache("s3://bucket/arrays-third", storage_options=s3, local_dir=str(copies),
                          cache_limit=limit)
    kept = [p for p in copies.rglob("*.arrays.safetensors.*") if ".ok-" not in p.name]
    held = {p.name.split(".")[0] for p in kept}
    before = again.stats()["bytes_downloaded"]
    for d in range(local.num_documents):
        b = int(np.searchsorted(local.block_token_starts(), local.document_span(d)[0], side="right")) - 1
        if local.block_table.path(b).split("/")[-1].split(".")[0] in held:
            assert again.document_arrays(d)["feat"].tobytes() == local.document_arrays(d)["feat"].tobytes()
    assert held and again.stats()["bytes_downloaded"] - before < sum(p.stat().st_size for p in kept)
    assert tree_bytes(copies) <= limit
    again.close()

    # a limit smaller than any sidecar: no copy fits, each is read into memory, still exact
    smallest = min(p.stat().st_size for p in sidecars)
    tiny = tc.TokenCache("s3://bucket/arrays-third", storage_options=s3,
                         local_dir=str(tmp_path / "tiny"), cache_limit=smallest - 1)
    for d in range(0, local.num_documents, 7):
        assert tiny.document_arrays(d)["feat"].tobytes() == local.document_arrays(d)["feat"].tobytes()
    assert tiny.stats()["refused_copies"] > 0 and tree_bytes(tmp_path / "tiny") < smallest
    tiny.close()
