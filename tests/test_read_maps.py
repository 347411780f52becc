"""Reading through memory maps within a budget: the same tokens as pread, bounded RSS, none in
DataLoader workers (TORCHCACHE_MAP_BYTES; see torchcache/read.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import paragraphs, write_jsonl

import torchcache as tc

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                reason="counts mapped files in /proc/self/maps (Linux)")

# A user's script (no __main__ guard): everything a training job reads, hashed, and the block
# files this process has mapped (from /proc/self/maps), with their sizes.
READ_EVERYTHING = """
import hashlib, json, os, sys
import numpy as np
import torchcache as tc

def mapped_blocks(root):
    with open('/proc/self/maps') as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {p: os.path.getsize(p) for p in paths
            if p.startswith(os.path.join(root, 'blocks')) and os.path.exists(p)}

root = sys.argv[1]
cache = tc.TokenCache(root)
h = hashlib.sha256()
h.update(cache.read(0, cache.num_tokens).tobytes())
h.update(cache.read_many(np.arange(0, cache.num_tokens - 100, 37), 100).tobytes())  # rows cross blocks
for ds in (tc.TokenDataset(cache, 64), tc.PackedDataset(cache, 64)):
    for batch in tc.DataLoader(ds, batch_size=8, shuffle=True):  # prefetch thread and loop thread
        for value in batch.values():
            h.update(value.numpy().tobytes())
during = mapped_blocks(root)
first = cache.read(0, cache.num_tokens)
cache.close()
after_close = mapped_blocks(root)
again = cache.read(0, cache.num_tokens)  # every block reopened after the pool closed it
print(json.dumps({"digest": h.hexdigest(), "mapped": during, "after_close": after_close,
                  "reopened": mapped_blocks(root), "same_again": bool(np.array_equal(first, again)),
                  "blocks": cache.num_blocks}))
"""

# Items that say how many block files the process reading them has mapped.
IN_WORKERS = """
import json, os, sys
import torch
import torchcache as tc

class MappedBlocks(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds
    def __len__(self):
        return len(self.ds)
    def __getitem__(self, i):
        self.ds[i]
        with open('/proc/self/maps') as f:
            return sum(os.path.join(sys.argv[1], 'blocks') in line for line in f)

ds = MappedBlocks(tc.TokenDataset(sys.argv[1], 64))
in_workers = [int(batch.max()) for batch in tc.DataLoader(ds, batch_size=4, num_workers=2)]
in_main = [int(batch.max()) for batch in tc.DataLoader(ds, batch_size=4, prefetch_batches=0)]
print(json.dumps({"workers": max(in_workers), "main": max(in_main)}))
"""


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    tmp = tmp_path_factory.mktemp("maps")
    src = write_jsonl(tmp / "docs.jsonl", paragraphs(books, 400))
    tc.build_cache(src, tmp / "cache", gpt2_tokenizer_path, block_tokens=2_000, progress=False)
    return str(tmp / "cache")


def run(code: str, root: str, budget: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCHCACHE_MAP_BYTES"}
    if budget is not None:
        env["TORCHCACHE_MAP_BYTES"] = budget
    return subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                          timeout=300, env=env, cwd=str(Path(__file__).parent.parent))


def result(code: str, root: str, budget: str | None) -> dict:
    done = run(code, root, budget)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_maps_within_the_budget_read_the_same_tokens_as_pread(cache_root):
    default = result(READ_EVERYTHING, cache_root, None)
    pread = result(READ_EVERYTHING, cache_root, "0")
    sizes = sorted(os.path.getsize(p) for p in Path(cache_root, "blocks").rglob("*")
                   if p.is_file() and p.suffix == ".safetensors" and ".offsets" not in p.name)
    budget = sum(sizes[-3:])  # room for about three of the cache's blocks
    bounded = result(READ_EVERYTHING, cache_root, str(budget))
    assert default["blocks"] > 10
    assert default["digest"] == pread["digest"] == bounded["digest"]
    assert len(default["mapped"]) == default["blocks"]  # a small cache: every block mapped
    assert pread["mapped"] == {}
    assert 3 <= len(bounded["mapped"]) < bounded["blocks"]
    assert sum(bounded["mapped"].values()) <= budget
    assert default["after_close"] == bounded["after_close"] == {}  # close() unmaps
    # a block reopened after the pool closed it is read with pread (mapping it at every reopen
    # would cost more than it saves when a cache has more blocks than the pool holds)
    assert default["reopened"] == {} and default["same_again"]


def test_dataloader_workers_read_with_pread(cache_root):
    """Workers (many per GPU) never map blocks, so their RSS stays flat; the main process does."""
    counts = result(IN_WORKERS, cache_root, None)
    assert counts["workers"] == 0
    assert counts["main"] > 0


@pytest.mark.parametrize("value", ["lots", "-1", "1.5.GB"])
def test_a_bad_budget_names_the_variable(cache_root, value):
    done = run("import sys, torchcache as tc; tc.TokenCache(sys.argv[1]).read(0, 10)", cache_root, value)
    assert done.returncode != 0
    assert "TORCHCACHE_MAP_BYTES" in done.stderr and value in done.stderr
