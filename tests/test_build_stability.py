"""The bytes of a cache are pinned: the same inputs, tokenizer and options give the same files
in every version of the package (refactors of the builder must not change a single byte).

The expected digests were made by the builder before the issue-11 refactor; a change in the
format must come with a new format version, not an edit of these values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import torchcache as tc
from conftest import DATA
from torchcache.format.ledger import read_manifest

PINNED = {
    "workers2": ("148c15ea00faff92740b4ea166a69883520c44668675a6ae11ad8e12b7991769",
                 "4ca4864e7eb1cc7b32f251aaf4a8533ed06195c297201964a39897d6101e2362"),
    "inline": ("2f9bb058b0a4c8f8ee89ab3d4daa670469d63d9fe7df951ef1e7b918ed5d9275",
               "2a001be94e05ff9bc3286f8997c09e1f7d4e8438477e92b4412abb2c6a2bcca5"),
}
PINNED_WDS_FILES = "666ea59ba7169b07847f7a7d956c2e71ac37cb2a7ba3c4d204fe93a7d7f69047"


def _block_files_digest(cache: Path) -> str:
    blocks = sorted((cache / "blocks").iterdir())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in blocks)).hexdigest()


def _block_entries_digest(cache: Path) -> str:
    """The block list (input paths, which differ per machine, are not in it), as v1 manifests
    held it: the same in format v2 (where the index holds it)."""
    blocks = read_manifest(str(cache))["blocks"]
    return hashlib.sha256(json.dumps(blocks, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name, options", [("workers2", dict(num_workers=2)),
                                           ("inline", dict(num_workers=0, bos="<|endoftext|>"))])
def test_a_build_gives_the_pinned_bytes(tmp_path, shards, gpt2_tokenizer_path, name, options):
    out = tmp_path / name
    tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=20000, progress=False, **options)
    assert (_block_entries_digest(out), _block_files_digest(out)) == PINNED[name]


def test_a_webdataset_conversion_gives_the_pinned_bytes(tmp_path, gpt2_tokenizer_path):
    out = tmp_path / "wds"
    tc.convert_webdataset(str(DATA / "compressed.tar"), out, tokenizer=gpt2_tokenizer_path,
                          text_key="txt.gz", progress=False)
    assert _block_files_digest(out) == PINNED_WDS_FILES
