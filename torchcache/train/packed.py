"""PackedDataset: whole documents packed into rows of exactly seq_len tokens, with document masks.

Row ``i`` of a pack plan (best fit decreasing per block, see :mod:`torchcache.order.packing` and
:mod:`torchcache.read.pack_plan`) is read as its documents back to back, then padding. Rows are
map-style, so :class:`torchcache.DistributedSampler` shuffles them over the whole epoch and a
loader's state resumes them exactly, at any world size.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from .._util.args import POSITION_LIMIT, choice_arg, int_arg, optional_int_arg
from .dataset import GrowingDataset, open_cache
from ..read.pack_plan import PackPlan, plan_identity
from ..order.packing import LONG_DOCS
from ..read.cache import TokenCache

__all__ = ["PackedDataset"]

_TOKENS = "__torchcache_packed_tokens__"  # a compact batch's tokens, [rows, seq_len + 1]
_CONTINUES = "__torchcache_packed_continues__"  # the row's last token has a next token (split piece)
IGNORE_INDEX = -100


class PackedDataset(GrowingDataset):
    """Rows of exactly ``seq_len`` tokens, each holding whole documents (and padding), map-style.

    ``ds[i]`` is a dict of:

    - ``input_ids`` (LongTensor[seq_len]): the row's documents back to back, then ``pad_id``;
    - ``labels`` (LongTensor[seq_len]): the next token where it belongs to the same document,
      else -100 (a document's last token and all padding);
    - ``position_ids`` (LongTensor[seq_len]): 0, 1, 2, ... restarting at every document (and
      at the padding, which counts as one more segment);
    - ``cu_seqlens`` (IntTensor[max_segments + 1]): where each document starts in the row, then
      where the last one ends; entries past ``num_segments`` are ``seq_len``;
    - ``num_segments`` (a 0-d LongTensor): how many documents the row holds.

    Documents are packed best fit decreasing within each block of the cache (they never move
    between blocks), so the plan extends as a growing cache commits blocks. The plan is a pure
    function of (cache fingerprint, seq_len, long_docs, max_segments, seed); it is computed once
    and stored under ``plan_dir`` (default ``CACHE/packs``; give another directory for a cache
    you cannot write), and later opens map it (opening then costs about what opening the cache
    does). ``torchcache pack CACHE --seq-len N`` computes it ahead, in parallel.

    Args:
        cache: a :class:`torchcache.TokenCache` or its path or URL.
        seq_len: tokens per row.
        long_docs: ``"split"`` cuts a document longer than ``seq_len`` into pieces of
            ``seq_len`` tokens (each a row of its own, whose last label is the document's next
            token) and packs the rest like a document; ``"drop"`` leaves such documents out
            (counted in :attr:`dropped_documents`).
        max_segments: at most this many documents per row (variable-length attention kernels
            need a cap); default ``seq_len``. ``cu_seqlens`` has ``max_segments + 1`` entries.
        pad_id: the id padding tokens get (default the cache's EOS id). Padding never has a label.
        seed: decides, among documents of equal length, which go first (part of the plan).
        plan_dir: where plans are stored (default ``CACHE/packs``).
        workers: processes that compute a missing plan (default 1; the CLI uses all CPUs).

    >>> ds = tc.PackedDataset("runs/quickstart/cache", seq_len=2048)  # doctest: +SKIP
    >>> len(ds), round(ds.padding_fraction, 4)  # 14 books, one block each  # doctest: +SKIP
    (43, 0.1423)
    >>> ds.row_documents(5)  # (document, start, end): tokens 2048-4096 of book 3  # doctest: +SKIP
    [(3, 2048, 4096)]
    >>> loader = tc.DataLoader(ds, batch_size=8, shuffle=True)  # in-process, 4 ahead  # doctest: +SKIP
    """

    def __init__(self, cache: TokenCache | str | os.PathLike, seq_len: int, *,
                 long_docs: str = "split", max_segments: int | None = None,
                 pad_id: int | None = None, seed: int = 0, plan_dir: str | os.PathLike | None = None,
                 workers: int = 1):
        self.seq_len = int_arg(seq_len, "seq_len", minimum=1, maximum=POSITION_LIMIT)
        self.long_docs = choice_arg(long_docs, "long_docs", LONG_DOCS)
        max_segments = optional_int_arg(max_segments, "max_segments", 1, self.seq_len)
        self.max_segments = self.seq_len if max_segments is None else max_segments
        self.seed = int_arg(seed, "seed", minimum=0, maximum=2 ** 63 - 1)
        workers = int_arg(workers, "workers", minimum=1, maximum=1024)
        self.cache = open_cache(cache)
        if pad_id is None:
            pad_id = self.cache.eos_id
            if pad_id is None:
                raise ValueError(f"the cache at {self.cache.url} has no EOS id to pad with: give "
                                 "pad_id= (any id; padding never has a label)")
        self.pad_id = int_arg(pad_id, "pad_id", minimum=None)
        identity = plan_identity(self.cache.fingerprint, self.seq_len, self.long_docs, max_segments,
                                 self.seed)
        plan_root = None if plan_dir is None else os.fspath(plan_dir)
        self.plan = PackPlan(self.cache, identity, plan_root, workers=workers)

    # ------------------------------------------------------------ identity and size
    @property
    def fingerprint(self) -> str:
        """Identity of the row stream (saved in loader states): the cache and the plan.

        >>> ds.fingerprint  # doctest: +SKIP
        'fcbf0c4f.../packed-cb7843bf...'
        """
        return f"{self.cache.fingerprint}/packed-{self.plan.identity.plan_id}"

    @property
    def item_signature(self) -> str:
        """The keys and shapes of a row (see :attr:`torchcache.TokenDataset.item_signature`)."""
        return (f"packed rows of seq_len={self.seq_len} (input_ids, labels, position_ids, "
                f"cu_seqlens[{self.max_segments + 1}], num_segments)")

    def __len__(self) -> int:
        return self.plan.rows

    def __repr__(self) -> str:
        return (f"PackedDataset({self.cache!r}, seq_len={self.seq_len}, {len(self):,} rows, "
                f"padding {self.padding_fraction:.4%})")

    def refresh(self) -> int:
        """Pick up newly committed blocks (planning them); return the new number of rows."""
        self.cache.refresh()
        self.plan.extend()
        return len(self)

    def stats(self) -> dict[str, Any]:
        """``rows``, ``blocks`` planned, ``padding`` tokens, ``padding_fraction``,
        ``split_documents``, ``dropped_documents`` and ``dropped_tokens``.

        >>> ds.stats()["split_documents"]  # doctest: +SKIP
        13
        """
        return self.plan.totals()

    @property
    def padding_fraction(self) -> float:
        """Padding tokens / (rows * seq_len), exact (0.0 with no rows)."""
        return self.plan.totals()["padding_fraction"]

    @property
    def dropped_documents(self) -> int:
        """Documents longer than seq_len left out (``long_docs="drop"``)."""
        return self.plan.totals()["dropped_documents"]

    @property
    def split_documents(self) -> int:
        """Documents longer than seq_len cut into pieces (``long_docs="split"``)."""
        return self.plan.totals()["split_documents"]

    # ------------------------------------------------------------ rows
    def row_documents(self, index: int) -> list[tuple[int, int, int]]:
        """``[(document index, start, end), ...]`` of row ``index``, in order: tokens
        ``[start, end)`` of each document (a whole document unless it was split).

        >>> ds.row_documents(5)  # doctest: +SKIP
        [(3, 2048, 4096)]
        """
        i = self._check_index(index)
        segments = self.plan.segments(np.array([i], dtype=np.int64))
        out = []
        for start, length in zip(segments.start.tolist(), segments.length.tolist()):
            doc = self.cache.document_at(start)
            doc_start = self.cache.document_span(doc)[0]
            out.append((doc, start - doc_start, start - doc_start + length))
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([self._check_index(index)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Rows ``indices`` as a list of dicts, read in one call (see :meth:`get_batch`)."""
        batch = self.get_batch(indices)
        return [dict(zip(batch, row)) for row in zip(*batch.values())]

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``indices`` already batched: equal to ``default_collate(ds.__getitems__(indices))``.

        >>> batch = ds.get_batch([0, 1, 2, 3])  # doctest: +SKIP
        >>> batch["input_ids"].shape, batch["cu_seqlens"].shape  # doctest: +SKIP
        (torch.Size([4, 2048]), torch.Size([4, 2049]))
        """
        return self.expand_batch(self.compact_batch(indices))

    def compact_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows as stored tokens in the cache's dtype plus their segment table: what a
        DataLoader worker sends (4-8x less than the int64 batch); :meth:`expand_batch` widens it.
        """
        idx = self._check(indices)
        n, C, cap = len(idx), self.seq_len, self.max_segments
        segments = self.plan.segments(idx)
        tokens = np.zeros((n, C + 1), dtype=self.cache.dtype)
        first = np.cumsum(segments.count) - segments.count  # each row's first segment
        within = np.arange(len(segments.row)) - np.repeat(first, segments.count)
        total = np.cumsum(segments.length)
        ends = total - np.repeat((total - segments.length)[first], segments.count)  # in the row
        offset_in_row = ends - segments.length
        # a split piece fills its row; its document's next token goes in the extra last column
        read_len = segments.length + segments.continues
        self.cache.read_ranges(segments.start, read_len, tokens, segments.row * (C + 1) + offset_in_row)
        cu = np.full((n, cap + 1), C, dtype=np.int32)
        cu[:, 0] = 0
        cu[segments.row, within + 1] = ends
        continues = np.zeros(n, dtype=bool)
        continues[segments.row[segments.continues]] = True
        signed = np.int16 if tokens.dtype.itemsize == 2 else np.int32
        return {_TOKENS: torch.from_numpy(tokens.view(signed)),
                _CONTINUES: torch.from_numpy(continues),
                "cu_seqlens": torch.from_numpy(cu),
                "num_segments": torch.from_numpy(segments.count.astype(np.int64))}

    def expand_batch(self, compact: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A :meth:`compact_batch` as the training batch (int64 ids, labels and positions)."""
        if not isinstance(compact, dict) or _TOKENS not in compact:
            raise TypeError(f"compact must be a batch made by compact_batch(), got "
                            f"{type(compact).__name__}")
        tokens = compact[_TOKENS].numpy().view(self.cache.dtype)
        cu = compact["cu_seqlens"].numpy()
        num_segments = compact["num_segments"].numpy()
        continues = compact[_CONTINUES].numpy()
        n, C = tokens.shape[0], self.seq_len
        # every row as segments: its documents, then the padding (maybe empty) up to C; flat
        ext = np.concatenate([cu, np.full((n, 1), C, dtype=cu.dtype)], axis=1).astype(np.int64)
        bounds = ext[np.arange(ext.shape[1])[None, :] <= num_segments[:, None] + 1]
        per_row = num_segments + 2
        last = np.cumsum(per_row) - 1  # each row's final bound (C): no segment starts there
        starts = np.delete(bounds, last)
        lengths = np.delete(bounds[1:], last[:-1]) - starts if n else starts
        row = np.repeat(np.arange(n), per_row - 1)
        flat_starts = row * C + starts
        padding = np.zeros(len(starts), dtype=bool)
        padding[np.cumsum(per_row - 1) - 1] = True  # the last segment of each row
        position_ids = np.arange(n * C, dtype=np.int64) - np.repeat(flat_starts, lengths)
        input_ids = tokens[:, :C].astype(np.int64).reshape(-1)
        labels = tokens[:, 1:].astype(np.int64).reshape(-1)
        ends = (flat_starts + lengths - 1)[~padding]  # a document's last token: no next token
        labels[ends] = IGNORE_INDEX
        if lengths[padding].any():  # (most rows are full: no mask over the whole batch then)
            is_pad = np.repeat(padding, lengths)
            input_ids[is_pad] = self.pad_id
            labels[is_pad] = IGNORE_INDEX
        cut = np.flatnonzero(continues)  # a split piece: its last label is the document's next token
        labels[cut * C + C - 1] = tokens[cut, C].astype(np.int64)
        input_ids, labels = input_ids.reshape(n, C), labels.reshape(n, C)
        position_ids = position_ids.reshape(n, C)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(position_ids),
                "cu_seqlens": compact["cu_seqlens"], "num_segments": compact["num_segments"]}
