"""Shared fixtures: the real GPT-2 tokenizer and a small real corpus, both from tests/data."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def gpt2_tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    return str(path)


@pytest.fixture(scope="session")
def gpt2(gpt2_tokenizer_path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(gpt2_tokenizer_path)


@pytest.fixture(scope="session")
def books() -> list[dict]:
    with open(DATA / "gutenberg_small.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def paragraphs(books: list[dict], limit: int | None = None) -> list[str]:
    """Real short documents: the books cut at blank lines."""
    out = [p for b in books for p in b["text"].split("\n\n") if p.strip()]
    return out[:limit] if limit else out


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture()
def shards(tmp_path, books) -> list[str]:
    """Three real jsonl shards of paragraph documents (about 1,500 documents)."""
    docs = paragraphs(books)
    d = tmp_path / "in"
    d.mkdir()
    return [write_jsonl(d / f"part-{i}.jsonl", docs[i::3]) for i in range(3)]


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file of a cache (but the lock), by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = Path(full).read_bytes()
    return out
