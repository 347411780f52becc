"""Map-style datasets over a cache: fixed-length token windows, and whole documents.

Both read a batch in one gather of the cache (:meth:`torchcache.TokenCache.read_ranges`). To
batch documents (different lengths) use :func:`torchcache.pad_collate` or
:func:`torchcache.packed_collate` as the DataLoader's ``collate_fn``.

A tiny cache, built here from a word-level tokenizer, for the examples of this module:

>>> import tempfile
>>> import torchcache as tc
>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> words = "the cat sat on a mat dog ran far <eos>".split()
>>> tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 10},
...                                        unk_token="[UNK]"))
>>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
>>> tmp = tempfile.TemporaryDirectory()
>>> docs = ["the cat sat on a mat", "a dog ran far", "the dog sat"] * 4
>>> built = tc.build_cache(iter(docs), f"{tmp.name}/cache", tokenizer, eos="<eos>",
...                        block_tokens=16, num_workers=1, progress=False)
>>> ds = TokenDataset(f"{tmp.name}/cache", seq_len=8)
>>> len(ds), ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
(7, [0, 1, 2, 3, 4, 5, 9, 4], [1, 2, 3, 4, 5, 9, 4, 6])
>>> ds.sample_documents(1)  # window 1: document 1 from token 1, document 2, 3's first (a label)
[{'source': None, 'document': 1, 'start': 1, 'end': 5}, {'source': None, 'document': 2, 'start': 0, 'end': 4}, {'source': None, 'document': 3, 'start': 0, 'end': 1}]
>>> batch = ds.get_batch([0, 6])
>>> batch["input_ids"].shape, batch["labels"].dtype
(torch.Size([2, 8]), torch.int64)
>>> ds.read_windows([0, 1])  # the same windows in the cache's dtype, seq_len + 1 tokens each
array([[0, 1, 2, 3, 4, 5, 9, 4, 6],
       [6, 7, 8, 9, 0, 6, 2, 9, 0]], dtype=uint16)
>>> ds.plan_reads(tc.DistributedSampler(ds, seed=0))  # a local cache: nothing to plan
>>> docs = DocumentDataset(ds.cache)
>>> [ds.cache.decode(d) for d in docs.__getitems__([1, 2])]
['a dog ran far <eos>', 'the dog sat <eos>']
>>> ds.cache.close(); tmp.cleanup()
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .._util.args import (INT64_MAX, POSITION_LIMIT, bool_arg, choice_arg, index_array, int_arg,
                    optional_int_arg, unsigned_max)
from ..read.cache import TokenCache
from ..read.remote_reads import SamplerReads
from .agreement import tokenizer_identity
from .collate import IGNORE_INDEX, padded_rows
from .transfer import item_tensor
from .sampler import SampleView

__all__ = ["DocumentDataset", "GrowingDataset", "TokenDataset", "open_cache"]


def open_cache(cache: TokenCache | str | os.PathLike) -> TokenCache:
    """``cache`` itself, or the cache at that path or URL; TypeError for anything else."""
    if isinstance(cache, TokenCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return TokenCache(cache)
    raise TypeError(f"cache must be a tc.TokenCache or the path/URL of one (str or os.PathLike), "
                    f"got {type(cache).__name__}")


def _content_fields(saved: Any, name: str) -> tuple[int, str]:
    """(blocks, sha256) of a saved :attr:`GrowingDataset.content_identity`; ValueError naming
    ``name`` if it is anything else."""
    shape = "{'blocks': int >= 0, 'sha256': 64 hex digits}"
    if not isinstance(saved, Mapping) or set(saved) != {"blocks", "sha256"}:
        raise ValueError(f"{name} must be {shape} (a dataset's content_identity), got {saved!r}")
    blocks, digest = saved["blocks"], saved["sha256"]
    if (type(blocks) is not int or blocks < 0 or not isinstance(digest, str) or len(digest) != 64
            or digest.strip("0123456789abcdef")):
        raise ValueError(f"{name} must be {shape} (a dataset's content_identity), got {saved!r}")
    return blocks, digest


def knows_content(dataset: Any) -> bool:
    """A dataset whose loader states record the content it reads (``content_identity``, checked
    by ``check_content``): TokenDataset, DocumentDataset, PackedDataset, MixtureDataset."""
    return callable(getattr(dataset, "check_content", None)) and hasattr(dataset, "content_identity")


_WINDOWS = "__torchcache_windows__"  # the key of the token windows in a compact batch


def append_bits(rows: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """`rows` (n, w) with the bits of `masks` (n, m) bool appended to each row, in `rows`' dtype:
    how a worker sends a batch's loss masks with its tokens, in one tensor (1 bit a token)."""
    bits = np.packbits(masks, axis=1)
    width = -(-bits.shape[1] // rows.itemsize)  # whole elements of rows' dtype
    out = np.zeros((len(rows), rows.shape[1] + width), dtype=rows.dtype)
    out[:, :rows.shape[1]] = rows
    out[:, rows.shape[1]:].view(np.uint8)[:, :bits.shape[1]] = bits
    return out


def split_bits(combined: np.ndarray, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows (n, w) and bool masks (n, m) of :func:`append_bits`."""
    bits = np.ascontiguousarray(combined[:, w:]).view(np.uint8)
    return combined[:, :w], np.unpackbits(bits, axis=1, count=m).view(bool)


def token_array_format(cache: TokenCache) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Each per-token array field's (name, dtype, row shape): what a window or a packed row of
    `cache` carries beside ``input_ids``, sliced like it (() in a cache without them)."""
    return tuple((name, str(dtype), trailing) for name in cache.token_array_fields
                 for dtype, trailing in [cache.token_array_layout(name)])


def token_array_keys(cache: TokenCache) -> str:
    """The per-token fields in an item signature: ", weights float32[L]" and such."""
    return "".join(f", {name} {dtype}[L{''.join(f', {d}' for d in trailing)}]"
                   for name, dtype, trailing in token_array_format(cache))


def masked_labels(targets: np.ndarray, trained: np.ndarray | None) -> dict[str, torch.Tensor]:
    """int64 ``labels`` (``targets``, -100 where not ``trained``) and, with a mask, the bool
    ``loss_mask`` (``labels != -100``); without one (``trained`` None) only the labels.

    Token ids straight from the cache (an unsigned dtype) are never -100, so their mask is
    ``trained`` itself; labels that already hold -100 (packed rows) are compared once more."""
    if trained is None:
        return {"labels": torch.from_numpy(targets.astype(np.int64))}
    labels = targets.astype(np.int64)
    np.copyto(labels, IGNORE_INDEX, where=~trained)
    mask = trained if targets.dtype.kind == "u" else labels != IGNORE_INDEX
    return {"labels": torch.from_numpy(labels), "loss_mask": torch.from_numpy(np.ascontiguousarray(mask))}


def array_tensors(views: list[np.ndarray], shapes: np.ndarray, dtype: np.dtype) -> list[torch.Tensor]:
    """Documents' arrays (flat read-only views and their shapes: ``TokenCache.array_pieces``) as
    tensors, copied once. Where only their first dimension differs (speech frames, per-token
    rows), they are the rows of one zero-padded batch (:func:`torchcache.train.collate.
    padded_rows`: ``pad_collate`` then returns that batch as it is, and in a DataLoader worker
    whose collate function it is, the batch is made in shared memory: ``item_tensor``);
    otherwise they lie end to end in one array."""
    n = len(views)
    torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    if n and bool((shapes[:, 1:] == shapes[0, 1:]).all()):
        lengths, trailing = shapes[:, 0].tolist(), shapes[0, 1:].tolist()
        padded = item_tensor((n, max(lengths), *trailing), torch_dtype)
        flat = padded.numpy().reshape(n, padded[0].numel())
        for i, view in enumerate(views):
            flat[i, :view.size] = view
            flat[i, view.size:] = 0
        return padded_rows(padded, lengths)
    values = torch.from_numpy(np.concatenate(views) if views else np.empty(0, dtype))
    return [piece.view(shape) for piece, shape in
            zip(torch.split(values, shapes.prod(axis=1).tolist()), shapes.tolist())]


class GrowingDataset(Dataset):
    """Shared behaviour of the datasets over a cache that may still be growing (not exported)."""

    cache: TokenCache
    _loss_mask: bool = False  # items carry loss_mask (set at init; with_loss_mask() forces it)

    @property
    def has_loss_mask(self) -> bool:
        """True when items carry ``loss_mask`` and masked ``labels``: the cache has a loss mask
        (a chat or instruction cache), or :meth:`with_loss_mask` asked for one.

        >>> tc.TokenDataset("caches/sft", 2048).has_loss_mask  # doctest: +SKIP
        True
        """
        return self._loss_mask

    def with_loss_mask(self) -> "GrowingDataset":
        """This dataset (a copy) with ``loss_mask`` in every item, all True where the cache has
        no mask: so that it batches with a masked source (a mixture does this by itself)."""
        if self._loss_mask:
            return self
        twin = copy.copy(self)
        twin._loss_mask = True
        return twin

    def shuffle(self, seed: int = 0) -> "SampleView":
        """This dataset's items in the order ``tc.DistributedSampler(ds, seed=seed)`` reads them
        on one rank, as an iterable (``.seek(position)`` starts it elsewhere): for scripts and
        notebooks; training uses :class:`torchcache.DataLoader`."""
        return SampleView(self, seed)

    @property
    def complete(self) -> bool:
        """True once the cache's build has finished (the length will not change any more).

        >>> ds.complete  # doctest: +SKIP
        True
        """
        return self.cache.complete

    def refresh(self) -> int:
        """Pick up newly committed blocks; return the new length.

        >>> while not ds.complete:  # doctest: +SKIP
        ...     print(ds.refresh(), "samples so far")
        """
        self.cache.refresh()
        return len(self)

    @property
    def tokenizer_identity(self) -> str:
        """What the token ids mean: the tokenizer's fingerprint, or for pre-tokenized data (no
        tokenizer) the vocabulary size and dtype. :class:`torchcache.MixtureDataset` refuses
        sources that differ, since one id would stand for different text in each.

        >>> ds.tokenizer_identity  # doctest: +SKIP
        'tokenizer fingerprint 5b3c...'
        """
        return tokenizer_identity(self.cache)  # (the check's one place: train/agreement.py)

    @property
    def content_identity(self) -> dict[str, Any]:
        """What the cache holds now: its committed blocks and their
        :meth:`~torchcache.TokenCache.content_digest`. Loader states save it, so that a state is
        refused on a cache of other content even where fingerprint and size agree.

        >>> ds.content_identity  # doctest: +SKIP
        {'blocks': 12, 'sha256': '5d1e...'}
        """
        blocks = self.cache.num_blocks
        return {"blocks": blocks, "sha256": self.cache.content_digest(blocks)}

    def check_content(self, saved: Any, name: str = "content") -> None:
        """ValueError unless the cache starts with the blocks ``saved`` (a
        :attr:`content_identity`, under the name ``name``) describes. The cache may have
        committed more blocks since (a state saved while it was being built).

        >>> ds.check_content(state["content"])  # doctest: +SKIP
        """
        blocks, digest = _content_fields(saved, name)
        cache = self.cache
        if cache.num_blocks < blocks and not cache.complete:
            self.refresh()  # a state saved by a process that saw more of the build
        if cache.num_blocks < blocks:
            raise ValueError(
                f"the cache at {cache.url} has {cache.num_blocks} committed blocks, the state was "
                f"saved on a cache with {blocks}: the state belongs to another cache's content. "
                "Resume on the cache the state was saved on, or start a new run instead of "
                "loading it")
        found = cache.content_digest(blocks)
        if found != digest:
            raise ValueError(
                f"the cache at {cache.url} holds other data than the cache the state was saved on "
                f"(the digest of its first {blocks} committed blocks is {found[:16]}..., the "
                f"state's is {digest[:16]}...): the state belongs to another cache's content, "
                "although fingerprint and size may agree. Resume on the cache the state was "
                "saved on, or start a new run instead of loading it")

    def _check(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as flat int64 positions in ``[0, len)``: one vectorised check per batch.

        TypeError for non-integers (``1.5``, ``"3"``, bools), IndexError out of range.
        """
        idx = index_array(indices, "indices").reshape(-1)
        if idx.size == 0:
            return idx
        n = len(self)
        if unsigned_max(idx) < n:  # the usual case in one pass: all in [0, n)
            return idx
        low, high = int(idx.min()), int(idx.max())
        if high >= n or low < -n:
            if high >= n and not self.cache.complete:
                n = self.refresh()  # a worker's copy may lag the sampler's view of a growing cache
            bad = idx[(idx >= n) | (idx < -n)]
            if bad.size:
                raise IndexError(self._out_of_range(int(bad[0]), n))
        return idx if low >= 0 else np.where(idx < 0, idx + n, idx)

    def _check_index(self, index: int) -> int:
        """One index (any integer type, negative from the end) as a position in ``[0, len)``."""
        i = int_arg(index, "index", minimum=None)
        if not -INT64_MAX - 1 <= i <= INT64_MAX:
            raise IndexError(self._out_of_range(i, len(self)))
        return int(self._check([i])[0])

    def _out_of_range(self, index: int, n: int) -> str:
        return f"index {index} out of range for {type(self).__name__} of length {n}"


class TokenDataset(GrowingDataset):
    """Fixed-length training samples cut from the cache's global token stream.

    Sample s is the window of seq_len + 1 tokens starting at s * seq_len (consecutive windows
    overlap by one token, so every token is a target exactly once); windows cross document and
    block boundaries. `ds[i]` is {"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}
    with labels the next tokens, or equal to input_ids when `labels="same"` (for models that
    shift inside, like Hugging Face's). `document_boundaries=True` adds, computed from the
    stored offsets: `position_ids` restarting at 0 at each document, and `cu_seqlens`
    (int32[max_segments + 1], cumulative lengths of the document pieces inside the sample, padded
    with seq_len) with `num_segments` giving how many entries are valid, for variable-length
    attention. `len()` follows the committed cache; call `refresh()` to pick up new blocks.

    A cache with a loss mask (`cache.has_loss_mask`: chat, instruction or pre-tokenized records
    with a mask) adds `loss_mask` (BoolTensor[seq_len]) and masks the labels: a label is -100
    where its target token is not trained (with `labels="same"`: where the input token itself is
    not), and `loss_mask == (labels != -100)`. Items of other caches are unchanged.
    A finished cache too short for one sample (fewer than seq_len + 1 tokens) is a ValueError
    here; a cache still being built may be that short at first.

    >>> ds = tc.TokenDataset("runs/quickstart/cache", seq_len=2048)  # doctest: +SKIP
    >>> ds[0]["input_ids"].shape, ds[0]["labels"][:3]  # doctest: +SKIP
    (torch.Size([2048]), tensor([4935, 20336, 46566]))
    >>> loader = tc.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)  # doctest: +SKIP
    """

    def __init__(self, cache: TokenCache | str | os.PathLike, seq_len: int, *,
                 labels: str = "shifted", document_boundaries: bool = False,
                 max_segments: int | None = None):
        self.seq_len = int_arg(seq_len, "seq_len", minimum=1, maximum=POSITION_LIMIT)
        self.labels = choice_arg(labels, "labels", ("shifted", "same"))
        self.document_boundaries = bool_arg(document_boundaries, "document_boundaries")
        max_segments = optional_int_arg(max_segments, "max_segments", 1, self.seq_len)
        self.max_segments = self.seq_len if max_segments is None else max_segments
        self.cache = open_cache(cache)
        self._loss_mask = self.cache.has_loss_mask
        self._token_arrays = self.cache.token_array_fields
        self._require_one_sample()

    def _require_one_sample(self) -> None:
        """ValueError if a finished cache is too short for even one sample (a silent empty
        dataset otherwise); a cache still being built may legitimately be short at first."""
        if not self.cache.complete or len(self) > 0:
            return
        tokens = self.cache.num_tokens
        fix = (f"use seq_len <= {tokens - 1}" if tokens >= 2
               else "it is too small for any sample: build it from more data")
        raise ValueError(f"seq_len={self.seq_len} is too long for the cache at {self.cache.url}: "
                         f"it holds {tokens} tokens and one sample needs seq_len + 1 = "
                         f"{self.seq_len + 1}; {fix}")

    @property
    def fingerprint(self) -> str:
        """Identity of the sample stream: the cache's fingerprint and the window length.

        >>> ds.fingerprint  # saved in loader states; a state of another stream is refused  # doctest: +SKIP
        '9c1f.../seq2048'
        """
        return f"{self.cache.fingerprint}/seq{self.seq_len}"

    @property
    def item_signature(self) -> str:
        """The keys and shapes of an item; :class:`torchcache.MixtureDataset` refuses sources
        that differ, since torch's default collate cannot batch them together.

        >>> ds.item_signature  # doctest: +SKIP
        'token windows of seq_len=2048 (input_ids, labels)'
        """
        keys = "input_ids, labels" + (", loss_mask" if self._loss_mask else "")
        keys += token_array_keys(self.cache)
        if self.document_boundaries:
            keys += f", position_ids, cu_seqlens[{self.max_segments + 1}], num_segments"
        return f"token windows of seq_len={self.seq_len} ({keys})"

    def __len__(self) -> int:
        return max(0, (self.cache.num_tokens - 1) // self.seq_len)

    def __repr__(self) -> str:
        return f"TokenDataset({self.cache!r}, seq_len={self.seq_len}, {len(self):,} samples)"

    def plan_reads(self, sampler: Any, num_workers: int = 0) -> None:
        """Plan the cache's reads in the order ``sampler`` (a
        :class:`torchcache.DistributedSampler` over this dataset) will ask for windows, read by
        ``num_workers`` DataLoader worker processes taking turns (0: by this process).

        A remote cache with a ``cache_limit`` then fetches them ahead and keeps the blocks
        needed soonest; other caches ignore it. :class:`torchcache.DataLoader` calls this when
        it starts iterating (before its workers start, so the plan travels into them); the plan
        follows the sampler's moves (``set_position``, resume) by itself, and planning the same
        sampler again changes nothing. Nothing is planned by making a sampler.

        >>> loader_sampler = tc.DistributedSampler(ds, seed=0)  # doctest: +SKIP
        >>> ds.plan_reads(loader_sampler, num_workers=2)  # in DataLoader.__iter__  # doctest: +SKIP
        """
        num_workers = int_arg(num_workers, "num_workers", 0)
        self.cache.plan_reads(SamplerReads(sampler, self.seq_len, workers=num_workers))

    def read_windows(self, indices: Sequence[int]) -> np.ndarray:
        """Token windows (len(indices), seq_len + 1) in the cache's dtype, read in one call:
        window ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len + 1)`` of the cache
        (:meth:`batch_from_windows` makes them a batch).

        >>> ds.read_windows([0, 1]).shape  # doctest: +SKIP
        (2, 9)
        """
        return self._read(self._check(indices))

    def _read(self, idx: np.ndarray) -> np.ndarray:
        """The windows of checked sample positions ``idx``."""
        return self.cache.read_many(idx * self.seq_len, self.seq_len + 1)

    def read_loss_masks(self, indices: Sequence[int]) -> np.ndarray:
        """Which labels of samples ``indices`` are trained, (len(indices), seq_len) bool: the
        flags of the target tokens ``[i * seq_len + 1, (i + 1) * seq_len + 1)`` (of the input
        tokens with ``labels="same"``); all True in a cache without a loss mask.

        >>> ds.read_loss_masks([0]).mean()  # doctest: +SKIP
        0.41
        """
        return self._masks(self._check(indices))

    def _masks(self, idx: np.ndarray) -> np.ndarray:
        """The label masks of checked sample positions ``idx``."""
        shift = 1 if self.labels == "shifted" else 0
        return self.cache.loss_masks(idx * self.seq_len + shift, self.seq_len)

    def sample_documents(self, index: int) -> list[dict[str, Any]]:
        """Which documents the tokens of sample ``index`` come from, in order: ``{"source": None,
        "document": d, "start": a, "end": b}`` for tokens [a, b) of document d (0 = the
        document's first token). The ranges cover every token in ``input_ids`` or ``labels``: with
        ``labels="shifted"`` the whole window of seq_len + 1 tokens (``labels`` ends with the token
        after ``input_ids``, which may be the first token of the next document), with
        ``labels="same"`` its seq_len tokens. Concatenating ``cache.document(d)[a:b]`` over the list
        gives ``input_ids`` followed (shifted) by the last label; see ``cache.document_info(d)``
        for the input file and record. Reads no token data.

        >>> ds.sample_documents(3)  # doctest: +SKIP
        [{'source': None, 'document': 7, 'start': 1840, 'end': 2011},
         {'source': None, 'document': 8, 'start': 0, 'end': 1878}]
        """
        start = self._check_index(index) * self.seq_len
        stop = start + self.seq_len + (1 if self.labels == "shifted" else 0)
        return [{"source": None, "document": d, "start": a, "end": b}
                for d, a, b in self.cache.document_pieces(start, stop)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([self._check_index(index)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Samples ``indices`` as a list of dicts (what torch's fetcher passes to ``collate_fn``).

        Their tensors are rows of :meth:`get_batch`'s, so a batch is read in one call.

        >>> [item["input_ids"].shape for item in ds.__getitems__([0, 5])]  # doctest: +SKIP
        [torch.Size([2048]), torch.Size([2048])]
        """
        batch = self.get_batch(indices)
        return [dict(zip(batch, row)) for row in zip(*batch.values())]

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples ``indices`` already batched: equal to ``default_collate(ds.__getitems__(indices))``.

        All windows are read into one array and converted to int64 once per output, with no
        per-sample Python work (unless ``document_boundaries``). :class:`torchcache.DataLoader`
        uses it with ``prefetch_batches`` when no ``collate_fn`` is given (and ``__getitems__``
        is not overridden).

        >>> batch = ds.get_batch([0, 1, 2, 3])  # doctest: +SKIP
        >>> batch["input_ids"].shape, batch["labels"].dtype  # doctest: +SKIP
        (torch.Size([4, 2048]), torch.int64)
        """
        if self.document_boundaries:
            return self.expand_batch(self.compact_batch(indices))
        idx = self._check(indices)
        masks = self._masks(idx) if self._loss_mask else None
        batch = self.batch_from_windows(self._read(idx), masks)  # the hot path
        if self._token_arrays:
            batch.update(self._array_rows(idx))
        return batch

    def read_token_arrays(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """The per-token array fields of samples ``indices`` (``cache.token_array_fields``), each
        (len(indices), seq_len, *row shape): row t is that of ``input_ids[t]``, tokens
        ``[i * seq_len, (i + 1) * seq_len)``, whatever ``labels`` is.

        >>> ds.read_token_arrays([0])["weights"].shape  # doctest: +SKIP
        (1, 2048)
        """
        return self._arrays(self._check(indices))

    def _arrays(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The per-token array fields of checked sample positions ``idx``."""
        return {name: self.cache.token_arrays(name, idx * self.seq_len, self.seq_len)
                for name in self._token_arrays}

    def _array_rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return {name: torch.from_numpy(rows) for name, rows in self._arrays(idx).items()}

    def batch_from_windows(self, windows: np.ndarray,
                           masks: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Windows (n, seq_len + 1) in the cache's dtype (:meth:`read_windows`) as the batch:
        int64 ``input_ids`` and ``labels`` (see "What a batch holds" in the README); for a
        dataset with :attr:`has_loss_mask`, also ``loss_mask``, from ``masks`` (n, seq_len)
        (:meth:`read_loss_masks` of the same samples; required when the cache has a mask)."""
        inputs = windows[:, :-1]
        input_ids = torch.from_numpy(inputs.astype(np.int64))
        if not self._loss_mask:
            if self.labels == "shifted":
                return {"input_ids": input_ids, "labels": torch.from_numpy(windows[:, 1:].astype(np.int64))}
            return {"input_ids": input_ids, "labels": input_ids.clone()}
        if masks is None:
            if self.cache.has_loss_mask:
                raise ValueError("masks is required: the cache has a loss mask; pass "
                                 "ds.read_loss_masks(indices) of the same samples as the windows")
            masks = np.ones(inputs.shape, dtype=bool)
        elif masks.shape != inputs.shape:
            raise ValueError(f"masks must have shape {inputs.shape} (one flag per label), got "
                             f"{masks.shape}")
        targets = windows[:, 1:] if self.labels == "shifted" else inputs
        return {"input_ids": input_ids, **masked_labels(targets, masks)}

    @property
    def compact_format(self) -> tuple[Any, ...]:
        """What :meth:`expand_batch` depends on: TokenDatasets of equal ``compact_format``
        expand each other's compact batches alike, so a mixture of them reads its sources'
        windows into one array and expands the batch once (see
        :meth:`torchcache.MixtureDataset.get_batch`)."""
        return ("token windows", str(self.cache.dtype), self.seq_len, self.labels,
                self.document_boundaries, self.max_segments) + (("loss_mask",) if self._loss_mask else ()) \
            + token_array_format(self.cache)

    def compact_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch as its token windows in the cache's dtype (2 or 4 bytes a token).

        A DataLoader worker sends this across the process boundary (4-8x less data than two
        int64 tensors) and the main process widens it with :meth:`expand_batch`.

        >>> compact = ds.compact_batch([0, 1])  # in a worker  # doctest: +SKIP
        >>> batch = ds.expand_batch(compact)  # in the training process  # doctest: +SKIP
        """
        idx = self._check(indices)
        windows = self._read(idx)
        if self._loss_mask:  # the mask's bits ride at the end of each row: one tensor to send
            windows = append_bits(windows, self._masks(idx))
        signed = np.int16 if windows.dtype.itemsize == 2 else np.int32  # torch-friendly view
        batch = {_WINDOWS: torch.from_numpy(windows.view(signed)), **self._array_rows(idx)}
        if self.document_boundaries:
            position_ids = np.empty((len(idx), self.seq_len), dtype=np.int64)
            cu_seqlens = np.empty((len(idx), self.max_segments + 1), dtype=np.int32)
            num_segments = np.empty(len(idx), dtype=np.int64)
            for row, s in enumerate(idx.tolist()):
                position_ids[row], cu_seqlens[row], num_segments[row] = self._boundaries(s)
            batch.update(position_ids=torch.from_numpy(position_ids),
                         cu_seqlens=torch.from_numpy(cu_seqlens),
                         num_segments=torch.from_numpy(num_segments))
        return batch

    def expand_batch(self, compact: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A :meth:`compact_batch` as the training batch: int64 ``input_ids`` and ``labels``.

        >>> ds.expand_batch(ds.compact_batch([7]))["input_ids"].dtype  # doctest: +SKIP
        torch.int64
        """
        if not isinstance(compact, dict) or _WINDOWS not in compact:
            raise TypeError(f"compact must be a batch made by compact_batch(), got "
                            f"{type(compact).__name__}")
        compact = dict(compact)
        windows = compact.pop(_WINDOWS).numpy().view(self.cache.dtype)
        masks = None
        if self._loss_mask:
            windows, masks = split_bits(windows, self.seq_len + 1, self.seq_len)
        return {**self.batch_from_windows(windows, masks), **compact}

    def _boundaries(self, sample: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(position_ids, cu_seqlens, num_segments) of one sample."""
        start = sample * self.seq_len
        stop = start + self.seq_len
        inside = self.cache.document_starts_in(start, stop)  # document starts in (start, stop)
        first = self.cache.document_span(self.cache.document_at(start))[0]
        starts = np.concatenate([[first], inside])
        positions = np.arange(start, stop, dtype=np.int64)
        position_ids = positions - starts[np.searchsorted(starts, positions, side="right") - 1]
        cuts = np.concatenate([[0], inside - start, [self.seq_len]])
        if len(cuts) - 1 > self.max_segments:
            raise ValueError(f"sample {sample} holds {len(cuts) - 1} document pieces, more than "
                             f"max_segments={self.max_segments}; raise max_segments")
        cu = np.full(self.max_segments + 1, self.seq_len, dtype=np.int32)
        cu[:len(cuts)] = cuts
        return position_ids, cu, len(cuts) - 1


class DocumentDataset(GrowingDataset):
    """One document per item, as stored (with its BOS/EOS), as a LongTensor.

    Documents differ in length, so batch them with :func:`torchcache.pad_collate` (a padded
    matrix and an attention mask) or :func:`torchcache.packed_collate` (one flat sequence with
    ``cu_seqlens``, for variable-length attention).

    In a cache with a loss mask (``cache.has_loss_mask``) an item is a dict instead:
    ``input_ids`` (LongTensor[n]), ``labels`` (LongTensor[n]: the next token of the document
    where that token is trained, else -100; the last one always -100) and ``loss_mask``
    (BoolTensor[n], ``labels != -100``), as :class:`TokenDataset` labels its windows.

    In a cache with arrays (``cache.array_fields``) an item is a dict too: ``input_ids`` (and
    ``labels``, ``loss_mask`` with a loss mask) plus each array field as a tensor of the
    record's shape and dtype (:func:`torchcache.pad_collate` pads them).

    >>> docs = tc.DocumentDataset("runs/quickstart/cache")  # doctest: +SKIP
    >>> cache.decode(docs[0][:8])  # doctest: +SKIP
    'The Project Gutenberg eBook of Pride and'
    >>> loader = tc.DataLoader(docs, batch_size=4, collate_fn=tc.pad_collate)  # doctest: +SKIP
    """

    def __init__(self, cache: TokenCache | str | os.PathLike):
        self.cache = open_cache(cache)
        self._loss_mask = self.cache.has_loss_mask
        self._arrays = self.cache.array_fields

    @property
    def fingerprint(self) -> str:
        """Identity of the item stream: the cache's fingerprint (saved in loader states)."""
        return f"{self.cache.fingerprint}/documents"

    @property
    def item_signature(self) -> str:
        """The shape of an item (see :attr:`TokenDataset.item_signature`)."""
        arrays = "".join(f", {name}" for name in self._arrays)
        if self._loss_mask:
            return f"whole documents (dicts of input_ids, labels, loss_mask{arrays}; variable length)"
        if arrays:
            return f"whole documents (dicts of input_ids{arrays}; variable length)"
        return "whole documents (one variable-length LongTensor each)"

    def __len__(self) -> int:
        return self.cache.num_documents

    def sample_documents(self, index: int) -> list[dict[str, Any]]:
        """Item ``index`` is all of document ``index``: ``[{"source": None, "document": index,
        "start": 0, "end": its length}]`` (negative ``index`` counted from the end), the form
        of :meth:`TokenDataset.sample_documents`, so that a mixture can name it.

        >>> docs.sample_documents(1)  # doctest: +SKIP
        [{'source': None, 'document': 1, 'start': 0, 'end': 219}]
        """
        i = self._check_index(index)
        start, stop = self.cache.document_span(i)
        return [{"source": None, "document": i, "start": 0, "end": stop - start}]

    def __getitem__(self, index: int) -> Any:
        if self._loss_mask or self._arrays:
            return self.__getitems__([self._check_index(index)])[0]
        return torch.from_numpy(self.cache.document(self._check_index(index)))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Documents ``indices``, read in one gather and widened to int64 once."""
        idx = self._check(indices)
        spans = self.cache.document_spans(idx)
        lengths = spans[:, 1] - spans[:, 0]
        tokens = torch.from_numpy(self.cache.read_ranges(spans[:, 0], lengths).astype(np.int64))
        documents = list(torch.split(tokens, lengths.tolist()))
        if self._arrays:
            items = self._labelled_all(documents, spans, lengths) if self._loss_mask else \
                [{"input_ids": doc} for doc in documents]
            if items:  # each field copied once, out of the map (read-only), for the whole batch
                for name, (views, shapes, dtype) in self.cache.array_pieces(idx).items():
                    for item, array in zip(items, array_tensors(views, shapes, dtype)):
                        item[name] = array
            return items
        if not self._loss_mask:
            return documents
        return self._labelled_all(documents, spans, lengths)

    def _labelled_all(self, documents: list[torch.Tensor], spans: np.ndarray,
                      lengths: np.ndarray) -> list[dict[str, torch.Tensor]]:
        """The documents with their labels and loss masks, the masks read in one go."""
        # label j of a document is its token j + 1 where that is trained (the last has none):
        # the masks of all the documents' next tokens, in one read
        offsets = np.cumsum(lengths) - lengths
        trained = np.zeros(int(lengths.sum()), dtype=bool)
        following = np.maximum(lengths - 1, 0)
        self.cache.loss_mask_ranges(np.where(following > 0, spans[:, 0] + 1, 0), following, trained,
                                    offsets)
        return [self._labelled(doc, flags)
                for doc, flags in zip(documents, np.split(trained, offsets[1:]))]

    def _labelled(self, doc: torch.Tensor, trained: np.ndarray) -> dict[str, torch.Tensor]:
        """Document ``doc`` with next-token labels and loss mask (``trained``: whether each
        token's next token is trained)."""
        targets = np.zeros(len(doc), dtype=np.int64)
        targets[:-1] = doc.numpy()[1:]
        return {"input_ids": doc, **masked_labels(targets, trained)}

    def __repr__(self) -> str:
        return f"DocumentDataset({self.cache!r}, {len(self):,} documents)"
