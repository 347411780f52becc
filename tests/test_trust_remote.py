"""Remote reads and local copies never serve bytes other than those committed (issue 21, items
7-10 and 13): blocks changed on the store after commit (ranged and full-copy modes), local copies
damaged after download, stale copies of a cache rebuilt at the same URL, errors that are not
corruption, and a mapped block cut short under a reader (SIGBUS).

A real moto S3 server on loopback (through s3fs) and real caches built from the test corpus.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import paragraphs, write_jsonl

import torchcache as tc
from torchcache.read.local_copies import fetch_verified
from torchcache.format.storage import RemoteStorage

BLOCK = 2_000
BLOCK0 = "blocks/000000-000000.safetensors"  # block 0 of the stream
MODES = {"ranged": 1, "full-copy": None}  # cache_limit: 1 byte fits no block, None copies all


def build(root, texts, tokenizer) -> str:
    root.mkdir(parents=True, exist_ok=True)
    inputs = [write_jsonl(root / f"in{i}.jsonl", texts[i::2]) for i in range(2)]
    tc.build_cache(inputs, root / "cache", tokenizer, block_tokens=BLOCK, num_workers=1,
                   progress=False)
    return str(root / "cache")


@pytest.fixture(scope="module")
def built(tmp_path_factory, books, gpt2_tokenizer_path):
    """Two local caches of other texts: (a, b)."""
    root = tmp_path_factory.mktemp("trust")
    docs = paragraphs(books)[:400]
    a = build(root / "a", docs, gpt2_tokenizer_path)
    b = build(root / "b", [d.replace("the", "THE") for d in docs], gpt2_tokenizer_path)
    return a, b


def upload(s3, local: str, name: str) -> str:
    import s3fs
    fs = s3fs.S3FileSystem(**s3)
    if fs.exists(f"bucket/{name}"):
        fs.rm(f"bucket/{name}", recursive=True)
    fs.put(local, f"bucket/{name}", recursive=True)
    return f"s3://bucket/{name}"


def change_in_place(s3, url: str, rel: str) -> None:
    """Flip a byte of a token near the end of a remote file, keeping its size."""
    import s3fs
    fs = s3fs.S3FileSystem(**s3)
    key = url[len("s3://"):] + "/" + rel
    data = bytearray(fs.cat_file(key))
    data[-3] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def block_copies(local_dir) -> list:
    return [p for p in local_dir.rglob("000000-000000.safetensors*")
            if p.is_file() and p.stat().st_size > 0 and ".tmp-" not in p.name]


def last_tokens(cache: tc.TokenCache, n: int = 10) -> tuple[int, int]:
    end = int(cache.block_token_starts()[1])
    return end - n, end


# ---------------------------------------------------------------- item 7: changed on the store

@pytest.mark.s3
@pytest.mark.parametrize("mode", MODES)
def test_a_block_changed_on_the_store_after_first_read_is_refused(tmp_path, built, s3, mode):
    a, _ = built
    url = upload(s3, a, f"changed-{mode}")
    ref = tc.TokenCache(a)
    span = last_tokens(ref)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=MODES[mode])
    assert np.array_equal(cache.read(*span), ref.read(*span))
    change_in_place(s3, url, BLOCK0)
    if mode == "full-copy":  # a verified copy is kept: it still holds the committed bytes
        assert np.array_equal(cache.read(*span), ref.read(*span))
        return
    with pytest.raises(tc.CacheFormatError, match=f"{url}/{BLOCK0}: .*changed after commit"):
        cache.read(*span)
    again = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=MODES[mode])
    with pytest.raises(tc.CacheFormatError, match=f"{url}/{BLOCK0}: .*changed after commit"):
        again.read(*span)


@pytest.mark.s3
@pytest.mark.parametrize("mode", MODES)
def test_a_block_changed_on_the_store_before_first_read_is_refused(tmp_path, built, s3, mode):
    a, _ = built
    url = upload(s3, a, f"changed-early-{mode}")
    change_in_place(s3, url, BLOCK0)
    ref = tc.TokenCache(a)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=MODES[mode])
    with pytest.raises(tc.CacheFormatError, match=f"{url}/{BLOCK0}: .*changed after commit"):
        cache.read(*last_tokens(ref))
    # the other blocks still read, by range (after one verified download each)
    start = int(ref.block_token_starts()[1])
    assert np.array_equal(cache.read(start, start + 50), ref.read(start, start + 50))


@pytest.mark.s3
def test_ranged_reads_cost_one_verification_per_block_per_machine(tmp_path, built, s3):
    """The first ranged read of a block downloads it once to tie the object's version to the
    committed checksum; later readers on the machine (new caches, processes) do not."""
    a, _ = built
    url = upload(s3, a, "verify-once")
    ref = tc.TokenCache(a)
    starts = ref.block_token_starts()
    local_dir = str(tmp_path / "copies")
    first = tc.TokenCache(url, storage_options=s3, local_dir=local_dir, cache_limit=1)
    for _ in range(3):
        assert np.array_equal(first.read(int(starts[2]), int(starts[2]) + 64),
                              ref.read(int(starts[2]), int(starts[2]) + 64))
    size = ref.block_table.size(2)
    assert first.stats()["verified_bytes"] == size
    second = tc.TokenCache(url, storage_options=s3, local_dir=local_dir, cache_limit=1)
    assert np.array_equal(second.read(int(starts[2]) + 5, int(starts[2]) + 70),
                          ref.read(int(starts[2]) + 5, int(starts[2]) + 70))
    assert second.stats()["verified_bytes"] == 0 and second.stats()["ranged_reads"] == 1


# ---------------------------------------------------------------- item 8: damaged local copies

@pytest.mark.s3
@pytest.mark.parametrize("limit", [None, "1MB"])
def test_a_local_copy_damaged_after_download_is_fetched_again(tmp_path, built, s3, limit):
    a, _ = built
    url = upload(s3, a, "damaged-copy")
    ref = tc.TokenCache(a)
    span = last_tokens(ref)
    local_dir = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(local_dir), cache_limit=limit)
    assert np.array_equal(cache.read(*span), ref.read(*span))
    cache.close()
    [copy] = block_copies(local_dir)
    with open(copy, "r+b") as f:  # damage it in place, keeping its size
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = tc.TokenCache(url, storage_options=s3, local_dir=str(local_dir), cache_limit=limit)
    assert np.array_equal(again.read(*span), ref.read(*span))
    assert again.stats()["whole_block_downloads"] == 1  # the damaged copy was replaced
    [copy] = block_copies(local_dir)
    assert copy.read_bytes() == open(os.path.join(a, BLOCK0), "rb").read()


# ---------------------------------------------------------------- item 9: stale copies

@pytest.mark.s3
@pytest.mark.parametrize("limit", [None, "1MB"])
def test_copies_of_a_cache_rebuilt_at_the_same_url_are_never_served(tmp_path, built, s3, limit):
    """A cache rebuilt at the same URL whose fingerprint stays the same (the copies' folder is
    named by it): the old copies do not match the new checksums, so they are never read."""
    a, b = built
    url = upload(s3, a, f"rebuilt-{limit}")
    local_dir = tmp_path / "copies"
    old = tc.TokenCache(url, storage_options=s3, local_dir=str(local_dir), cache_limit=limit)
    old.read(0, old.num_tokens)
    old.close()
    assert block_copies(local_dir)
    url = upload(s3, b, f"rebuilt-{limit}")
    ref = tc.TokenCache(b)
    fingerprint_b = ref.fingerprint
    if fingerprint_b != old.fingerprint:  # make the rebuilt cache meet the old copies
        shutil.move(str(local_dir / old.fingerprint), str(local_dir / fingerprint_b))
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(local_dir), cache_limit=limit)
    stop = min(cache.num_tokens, ref.num_tokens)
    assert np.array_equal(cache.read(0, stop), ref.read(0, stop))


# ---------------------------------------------------------------- item 13: not corruption

@pytest.mark.s3
def test_a_credentials_error_keeps_its_type_and_names_the_url(built, s3, monkeypatch):
    from moto import settings
    a, _ = built
    url = upload(s3, a, "credentials")
    checksum = tc.TokenCache(a).block_table.checksum(0)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys now
    wrong = dict(s3, key="nobody", secret="wrong")
    with pytest.raises(PermissionError, match=f"{url}/{BLOCK0}") as raised:
        fetch_verified(RemoteStorage(url, wrong), BLOCK0, checksum)
    assert not isinstance(raised.value, tc.CacheFormatError)
    assert raised.value.__cause__ is not None


def test_a_bug_is_not_reported_as_corruption(tmp_path):
    class Broken(RemoteStorage):
        def __init__(self):
            self.url = "s3://bucket/broken"

        def read(self, rel):
            raise TypeError("a bug")
    with pytest.raises(TypeError, match="a bug"):
        fetch_verified(Broken(), BLOCK0, "sha256:" + "0" * 64)


# ---------------------------------------------------------------- item 10: SIGBUS

_TRUNCATED = """
import os, sys
import torchcache as tc
cache = tc.TokenCache(sys.argv[1], map_bytes=sys.argv[3])
cache.read(0, 10)  # block 0 is open (mapped, unless map_bytes is 0)
os.truncate(sys.argv[2], 0)  # another program cuts it short
cache.read(100, 110)
"""


@pytest.mark.parametrize("map_bytes", ["256MiB", "0"])
def test_a_mapped_block_cut_short_names_the_file_in_the_last_words(tmp_path, built, map_bytes):
    a, _ = built
    cache = tmp_path / "cache"
    shutil.copytree(a, cache)
    block = str(cache / BLOCK0)
    run = subprocess.run([sys.executable, "-c", _TRUNCATED, str(cache), block, map_bytes],
                         capture_output=True, text=True, timeout=120)
    if map_bytes != "0":  # mapped: a bus error, whose last words name the block file
        assert run.returncode == -signal.SIGBUS, run.stderr
        assert "Fatal Python error: Bus error" in run.stderr
        assert f'File "{block}", line' in run.stderr  # the frame reading it names the file
    else:  # pread: an ordinary error naming the file
        assert run.returncode == 1 and f"{block}: unexpected end" in run.stderr, run.stderr


@pytest.mark.s3
def test_verify_checks_the_store_not_only_a_copy_made_before_it_changed(tmp_path, built, s3):
    """A full copy made while the store was intact does not hide a later change from verify."""
    a, _ = built
    url = upload(s3, a, "verify-after-change")
    local_dir = str(tmp_path / "copies")
    assert tc.check_cache(url, storage_options=s3, local_dir=local_dir) == []
    change_in_place(s3, url, BLOCK0)
    problems = tc.check_cache(url, storage_options=s3, local_dir=local_dir)
    assert [p.file for p in problems] == [BLOCK0]
    assert "changed after commit" in problems[0].message


@pytest.mark.s3
def test_build_cache_into_a_missing_bucket_is_refused_not_created(tmp_path, s3, gpt2_tokenizer_path):
    import s3fs
    docs = write_jsonl(tmp_path / "docs.jsonl", ["a document", "another one"])
    with pytest.raises(FileNotFoundError, match="s3://nobucket/cache: bucket 'nobucket' does not exist"):
        tc.build_cache([docs], "s3://nobucket/cache", gpt2_tokenizer_path, storage_options=s3,
                       progress=False)
    assert not s3fs.S3FileSystem(**s3).exists("nobucket")


# ---------------------------------------------------------------- items 4 and 5 on a store

@pytest.mark.s3
@pytest.mark.parametrize("mode", MODES)
def test_a_remote_cache_without_head_json_is_damage_not_an_empty_cache(tmp_path, built, s3, mode):
    import s3fs
    a, _ = built
    url = upload(s3, a, f"no-head-{mode}")
    s3fs.S3FileSystem(**s3).rm_file(url[len("s3://"):] + "/head.json")
    with pytest.raises(tc.CacheFormatError, match=rf"{url}/head\.json: missing.*verify --repair"):
        tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                      cache_limit=MODES[mode])
    problems = tc.check_cache(url, storage_options=s3, local_dir=str(tmp_path / "copies"))
    assert [p.file for p in problems] == ["head.json"]


@pytest.mark.s3
@pytest.mark.parametrize("mode", MODES)
def test_a_swapped_tokenizer_on_the_store_is_refused(tmp_path, built, s3, mode):
    import s3fs
    from tokenizers import Tokenizer, models, pre_tokenizers
    a, _ = built
    url = upload(s3, a, f"swapped-tokenizer-{mode}")
    other = Tokenizer(models.WordLevel({f"w{i}": i for i in range(60_000)} | {"[UNK]": 60_000},
                                       unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    s3fs.S3FileSystem(**s3).pipe_file(url[len("s3://"):] + "/tokenizer.json", other.to_str().encode())
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=MODES[mode])
    with pytest.raises(tc.CacheFormatError, match="tokenizer.json: .*not the tokenizer the cache was built with"):
        cache.decode(cache.document(0))
    problems = tc.check_cache(url, storage_options=s3, local_dir=str(tmp_path / "copies"))
    assert [p.file for p in problems] == ["tokenizer.json"]
