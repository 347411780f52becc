"""What a training step read: each sample of a global batch, the documents it is made of, where
they came from (input file, record, kept fields) and their first words.

From the loader's configuration and state alone (`DataLoader.step_samples`), the datasets'
`sample_documents` and the caches' `document_info`: no pass over the data, O(global batch) reads.
`torchcache trace` prints it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..read.cache import TokenCache

__all__ = ["trace_step"]


def trace_step(loader: Any, step: int, *, words: int = 8) -> list[dict[str, Any]]:
    """The samples of global step `step` of `loader` (a :class:`torchcache.DataLoader`), all
    ranks together, in the order of :meth:`~torchcache.DataLoader.step_samples`, each as
    ``{"rank", "sample", "documents": [{"source", "document", "start", "end", "input",
    "record", "fields", "text"}, ...]}``: document ``document``'s tokens ``[start, end)`` of
    that source's cache, its input file and record (None only for caches built before records
    were kept, where it cannot be known), its sample key (``"key"``, only where the document has
    one: a webdataset tar's ``__key__``), and the first `words` words of that range (token ids
    when the cache has no tokenizer).

    >>> import tokenizers  # a toy tokenizer: one word, one id
    >>> tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
    ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
    >>> tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    >>> _ = tc.build_cache(iter(["hello world hello", "world", "hello world"]), "cache", tok,
    ...                    progress=False)
    >>> loader = tc.DataLoader(tc.TokenDataset("cache", 3), batch_size=2)  # 2 windows a step
    >>> [(s["sample"], [(d["document"], d["start"], d["end"], d["text"]) for d in s["documents"]])
    ...  for s in tc.trace_step(loader, 0)]
    [(0, [(0, 0, 4, 'hello world hello <|endoftext|>')]), (1, [(0, 3, 4, '<|endoftext|>'), (1, 0, 2, 'world <|endoftext|>'), (2, 0, 1, 'hello')])]
    """
    dataset = loader.dataset
    if not callable(getattr(dataset, "sample_documents", None)):
        raise TypeError(f"trace_step needs a dataset that knows its samples' documents "
                        f"(TokenDataset, PackedDataset, DocumentDataset, MixtureDataset), not "
                        f"{type(dataset).__name__}")
    indices = loader.step_samples(step)
    world = loader.sampler.world_size
    out = []
    for k, index in enumerate(indices):
        pieces = [_described(dataset, piece, words) for piece in dataset.sample_documents(index)]
        out.append({"rank": k % world, "sample": index, "documents": pieces})
    return out


def _described(dataset: Any, piece: dict[str, Any], words: int) -> dict[str, Any]:
    """A piece of a sample with its document's provenance and first words."""
    if "document" not in piece:  # a source that is not a cache: its own index only
        return dict(piece)
    cache = _cache_of(dataset, piece.get("source"))
    info = cache.document_info(piece["document"])
    start, _ = cache.document_span(piece["document"])
    end = min(start + piece["end"], start + piece["start"] + 4 * words + 16)
    ids = cache.read(start + piece["start"], end).astype(np.int64)
    key = {"key": info["key"]} if "key" in info else {}  # a tar sample's __key__
    return {**piece, "input": info["input"], "record": info["record"], "fields": info["fields"],
            **key, "text": _first_words(cache, ids, words)}


def _cache_of(dataset: Any, source: str | None) -> TokenCache:
    """The cache a source name (a path of names through nested mixtures) reads."""
    for name in source.split("/") if source else ():
        dataset = dataset.datasets[name]
    return dataset.cache


def _first_words(cache: TokenCache, ids: np.ndarray, words: int) -> str:
    if cache.spec["tokenizer"] is None:
        return " ".join(map(str, ids[:words].tolist()))
    return " ".join(cache.decode(ids).split()[:words])
