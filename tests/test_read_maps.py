"""Reading through memory maps within a cache's budget (``TokenCache(..., map_bytes=)``): the
same tokens as pread, bounded mapped bytes, and nothing mapped where the budget is 0 (what a
loader gives its DataLoader workers, see TokenCache.with_map_bytes)."""

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
# files this process has mapped (from /proc/self/maps), with their sizes. argv: root, map_bytes
# ("default": the argument not given).
READ_EVERYTHING = """
import hashlib, json, os, sys
import numpy as np
import torchcache as tc

def mapped_blocks(root):
    with open('/proc/self/maps') as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {p: os.path.getsize(p) for p in paths
            if p.startswith(os.path.join(root, 'blocks')) and os.path.exists(p)}

root, budget = sys.argv[1], sys.argv[2]
cache = tc.TokenCache(root) if budget == "default" else tc.TokenCache(root, map_bytes=budget)
h = hashlib.sha256()
h.update(cache.read(0, cache.num_tokens).tobytes())
h.update(cache.read_many(np.arange(0, cache.num_tokens - 100, 37), 100).tobytes())  # rows cross blocks
spans = np.arange(0, cache.num_tokens - 3000, 1001)
h.update(cache.read_ranges(spans, spans % 2999).tobytes())  # ranges of many lengths, crossing blocks
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

# Items that say how many block files the process reading them has mapped; argv: root, map_bytes
# of the cache the workers read.
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

cache = tc.TokenCache(sys.argv[1])
workers_cache = cache.with_map_bytes(int(sys.argv[2]))
in_workers = [int(batch.max()) for batch in torch.utils.data.DataLoader(
    MappedBlocks(tc.TokenDataset(workers_cache, 64)), batch_size=4, num_workers=2)]
in_main = [int(batch.max()) for batch in torch.utils.data.DataLoader(
    MappedBlocks(tc.TokenDataset(cache, 64)), batch_size=4)]
print(json.dumps({"workers": max(in_workers), "main": max(in_main),
                  "map_bytes": [cache.map_bytes, workers_cache.map_bytes]}))
"""


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    tmp = tmp_path_factory.mktemp("maps")
    src = write_jsonl(tmp / "docs.jsonl", paragraphs(books, 400))
    tc.build_cache(src, tmp / "cache", gpt2_tokenizer_path, block_tokens=2_000, progress=False)
    return str(tmp / "cache")


def result(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})},
                          cwd=str(Path(__file__).parent.parent))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_maps_within_the_budget_read_the_same_tokens_as_pread(cache_root):
    # the environment is not read: the read mode is the argument's alone (here the default)
    default = result(READ_EVERYTHING, cache_root, "default", env={"TORCHCACHE_MAP_BYTES": "0"})
    pread = result(READ_EVERYTHING, cache_root, "0")
    sizes = sorted(os.path.getsize(p) for p in Path(cache_root, "blocks").rglob("*")
                   if p.is_file() and p.suffix == ".safetensors" and ".offsets" not in p.name)
    budget = sum(sizes[-3:])  # room for about three of the cache's blocks
    bounded = result(READ_EVERYTHING, cache_root, f"{budget}B")
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


def test_workers_given_a_copy_with_map_bytes_0_map_nothing(cache_root):
    """Worker processes read with pread when their cache says so, so their RSS stays flat; the
    decision is the cache's own (the same code maps in workers given a budget)."""
    counts = result(IN_WORKERS, cache_root, "0")
    assert counts == {"workers": 0, "main": counts["main"], "map_bytes": [256 << 20, 0]}
    assert counts["main"] > 0
    assert result(IN_WORKERS, cache_root, str(1 << 30))["workers"] > 0


def test_each_cache_has_its_own_budget_and_copies_share_nothing_open(cache_root):
    cache = tc.TokenCache(cache_root, map_bytes="1MiB")
    tokens = cache.read(0, cache.num_tokens)
    copy = cache.with_map_bytes(0)
    assert (copy.map_bytes, cache.map_bytes) == (0, 1 << 20)
    assert (copy.read(0, copy.num_tokens) == tokens).all()
    copy.close()  # closes only its own blocks
    assert (cache.read(0, cache.num_tokens) == tokens).all()
    cache.close()


@pytest.mark.parametrize("value, error", [("lots", ValueError), ("-1", ValueError),
                                          ("1.5.GB", ValueError), (-1, ValueError),
                                          (1.5, TypeError)])
def test_a_bad_budget_names_the_argument(cache_root, value, error):
    with pytest.raises(error, match="map_bytes"):
        tc.TokenCache(cache_root, map_bytes=value)
    with pytest.raises(error, match="map_bytes"):
        tc.TokenCache(cache_root).with_map_bytes(value)
