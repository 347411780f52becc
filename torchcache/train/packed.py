"""PackedDataset: whole documents packed into rows of exactly seq_len tokens, with document masks.

Row ``i`` of a pack plan (best fit decreasing per block, see :mod:`torchcache.order.packing` and
:mod:`torchcache.read.pack_plan`) is read as its documents back to back, then padding. Rows are
map-style, so :class:`torchcache.DistributedSampler` shuffles them over the whole epoch and a
loader's state resumes them exactly, at any world size. A batch is one gather of all its rows'
document pieces, then whole-batch numpy for the labels and positions.

Four documents, built into a tiny cache here (a word-level tokenizer), packed in rows of 8:

>>> import tempfile
>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> vocab = dict(zip("the cat sat on a mat dog ran far <eos> [UNK]".split(), range(11)))
>>> tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
>>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
>>> tmp = tempfile.TemporaryDirectory()
>>> docs = ["the cat sat on a mat", "a dog ran far", "the dog sat", "the cat ran on and on and on far"]
>>> built = tc.build_cache(iter(docs), f"{tmp.name}/cache", tokenizer, eos="<eos>",
...                        num_workers=1, progress=False)
>>> ds = tc.PackedDataset(f"{tmp.name}/cache", seq_len=8)
>>> len(ds), ds.split_documents, ds.padding_fraction  # the 10-token document is cut in two
(4, 1, 0.1875)
>>> ds.row_documents(2)  # (document, start, end): document 1, then the rest of document 3
[(1, 0, 5), (3, 8, 10)]
>>> ds.sample_documents(2)[1]  # the same, in the form every dataset gives (see TokenDataset's)
{'source': None, 'document': 3, 'start': 8, 'end': 10}
>>> batch = ds.get_batch([1, 2])
>>> batch["input_ids"].tolist()  # padded with the EOS id (9)
[[0, 1, 2, 3, 4, 5, 9, 9], [4, 6, 7, 8, 9, 8, 9, 9]]
>>> batch["labels"].tolist()  # the next token inside a document, else -100
[[1, 2, 3, 4, 5, 9, -100, -100], [6, 7, 8, 9, -100, 9, -100, -100]]
>>> batch["position_ids"].tolist(), batch["num_segments"].tolist()
([[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 3, 4, 0, 1, 0]], [1, 2])
>>> batch["cu_seqlens"][:, :3].tolist()  # where each document starts, then where they end
[[0, 7, 8], [0, 5, 7]]
>>> loader = tc.DataLoader(ds, batch_size=2, shuffle=True)  # in-process, 4 batches ahead
>>> [b["input_ids"].shape for b in loader]
[torch.Size([2, 8]), torch.Size([2, 8])]
>>> ds.cache.close(); tmp.cleanup()
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import numpy as np
import torch

from .._util.args import POSITION_LIMIT, choice_arg, int_arg, optional_int_arg, unsigned_max
from .collate import IGNORE_INDEX
from .dataset import (GrowingDataset, append_bits, masked_labels, open_cache, split_bits,
                      token_array_format, token_array_keys)
from ..read.pack_plan import PackPlan, plan_identity
from ..order.packing import LONG_DOCS
from ..read.cache import TokenCache

__all__ = ["PackedDataset"]

_TOKENS = "__torchcache_packed_tokens__"  # a compact batch's tokens, [rows, seq_len + 1]
_CONTINUES = "__torchcache_packed_continues__"  # the row's last token has a next token (split piece)
_NO_ROWS = np.empty(0, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _columns(seq_len: int) -> np.ndarray:
    """0 .. seq_len - 1: a row's positions when it holds one piece (read only, shared)."""
    columns = np.arange(seq_len)
    columns.flags.writeable = False
    return columns


def _restarts(cu: np.ndarray, seq_len: int) -> np.ndarray:
    """The rows of a segment table where something (a piece, or padding) follows the first piece."""
    return (cu[:, 1] < seq_len).nonzero()[0]


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
    - ``num_segments`` (a 0-d LongTensor): how many documents the row holds;
    - ``loss_mask`` (BoolTensor[seq_len], ``labels != -100``), only for a cache with a loss mask
      (``cache.has_loss_mask``): there a label is also -100 where its target token is not trained.

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
            (counted in :attr:`dropped_documents`); ``"truncate"`` keeps a long document's first
            ``seq_len`` tokens, one row of its own whose last label is the document's next
            token (counted in :attr:`truncated_documents` and :attr:`truncated_tokens`).
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
        self._loss_mask = self.cache.has_loss_mask
        self._token_arrays = self.cache.token_array_fields
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
        mask = ", loss_mask" if self._loss_mask else ""
        return (f"packed rows of seq_len={self.seq_len} (input_ids, labels{mask}, position_ids, "
                f"cu_seqlens[{self.max_segments + 1}], num_segments{token_array_keys(self.cache)})")

    @property
    def compact_format(self) -> tuple[Any, ...]:
        """What :meth:`expand_batch` depends on: PackedDatasets of equal ``compact_format``
        expand each other's compact batches (one row per sample) alike, so a mixture of them
        expands its batch's rows once (see :meth:`torchcache.MixtureDataset.get_batch`)."""
        return (("packed rows", str(self.cache.dtype), self.seq_len, self.max_segments, self.pad_id)
                + (("loss_mask",) if self._loss_mask else ()) + token_array_format(self.cache))

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
        ``split_documents``, ``dropped_documents``, ``dropped_tokens``, ``truncated_documents``
        and ``truncated_tokens``.

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
    def truncated_documents(self) -> int:
        """Documents longer than seq_len cut to their first seq_len tokens (``long_docs="truncate"``)."""
        return self.plan.totals()["truncated_documents"]

    @property
    def truncated_tokens(self) -> int:
        """Tokens cut off the end of those documents (``long_docs="truncate"``)."""
        return self.plan.totals()["truncated_tokens"]

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

    def sample_documents(self, index: int) -> list[dict[str, Any]]:
        """:meth:`row_documents` of row ``index`` in the form every dataset of this package
        gives (see :meth:`torchcache.TokenDataset.sample_documents`): ``{"source": None,
        "document": d, "start": a, "end": b}`` for tokens [a, b) of document d, in row order.
        The ranges cover every token in the row's ``input_ids`` or ``labels``: a piece of a
        document that goes on after it (a full piece of a split document, or a truncated one)
        has the document's next token as its last label, so its range takes that token too; other
        pieces are exactly their ``input_ids`` (their last label is -100). Reads the pack plan, no
        token data.

        >>> ds.sample_documents(2)  # doctest: +SKIP
        [{'source': None, 'document': 1, 'start': 0, 'end': 5},
         {'source': None, 'document': 3, 'start': 8, 'end': 10}]
        """
        i = self._check_index(index)
        segments = self.plan.segments(np.array([i], dtype=np.int64))
        goes_on = segments.continues.tolist()
        return [{"source": None, "document": d, "start": a, "end": b + int(more)}
                for (d, a, b), more in zip(self.row_documents(i), goes_on)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([self._check_index(index)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Rows ``indices`` as a list of dicts, read in one call (see :meth:`get_batch`)."""
        batch = self.get_batch(indices)
        return [dict(zip(batch, row)) for row in zip(*batch.values())]

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``indices`` already batched: equal to ``default_collate(ds.__getitems__(indices))``.

        One gather of all the rows' document ranges, then a few whole-batch numpy operations
        for the labels and positions (nothing per row or per document in Python).
        """
        tokens, cu, num_segments, continues, stops, restarts, masks, arrays = self._read_rows(self._check(indices))
        return self._training_batch(tokens, cu, num_segments, stops, restarts, masks) | arrays

    def compact_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows as stored tokens in the cache's dtype plus their segment table: what a
        DataLoader worker sends (4-8x less than the int64 batch); :meth:`expand_batch` widens it.
        """
        tokens, cu, num_segments, continues, _, _, masks, arrays = self._read_rows(self._check(indices))
        if masks is not None:  # the mask's bits ride at the end of each row (one tensor to send)
            tokens = append_bits(tokens, masks)
        signed = np.int16 if tokens.dtype.itemsize == 2 else np.int32
        return {_TOKENS: torch.from_numpy(tokens.view(signed)),
                _CONTINUES: torch.from_numpy(continues),
                "cu_seqlens": torch.from_numpy(cu),
                "num_segments": torch.from_numpy(num_segments), **arrays}

    def expand_batch(self, compact: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A :meth:`compact_batch` as the training batch (int64 ids, labels and positions)."""
        if not isinstance(compact, dict) or _TOKENS not in compact:
            raise TypeError(f"compact must be a batch made by compact_batch(), got "
                            f"{type(compact).__name__}")
        tokens = compact[_TOKENS].numpy().view(self.cache.dtype)
        cu, num_segments = compact["cu_seqlens"].numpy(), compact["num_segments"].numpy()
        C = self.seq_len
        masks = None
        if self._loss_mask:
            tokens, masks = split_bits(tokens, C + 1, C)
        # the pieces back from the table: row r's ends are cu[r, 1:num_segments[r] + 1]; each
        # ends its document but a split piece, the one piece of a continuing row, ending at C
        most = int(num_segments.max()) if len(num_segments) else 0
        ends = cu[:, 1:most + 1].astype(np.int64)
        document_ends = ((np.arange(most) < num_segments[:, None])
                         & ~(compact[_CONTINUES].numpy()[:, None] & (ends == C)))
        ends += np.arange(0, len(cu) * C, C)[:, None]
        return self._training_batch(tokens, cu, num_segments, ends[document_ends], _restarts(cu, C),
                                    masks) | {name: compact[name] for name in self._token_arrays}

    def _read_rows(self, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(tokens, cu_seqlens, num_segments, continues, stops, restarts, masks, arrays)`` of checked rows ``idx``.

        ``tokens`` (rows, seq_len + 1) holds each row's documents back to back (zeros after
        them), read in one gather; a split piece fills its row, and its document's next token
        goes in the extra last column (``continues`` marks those rows). ``stops``: where each
        piece that ends its document ends, as a position in the flat (rows, seq_len) batch.
        ``restarts``: the rows where something (a piece, or padding) follows the first piece.
        ``masks`` (rows, seq_len): whether each label's target token is trained (meaningful where
        the label is a next token of the same document), or None without :attr:`has_loss_mask`.
        ``arrays``: each per-token array field (``cache.token_array_fields``) as a tensor
        (rows, seq_len, *row shape), row t that of ``input_ids[t]``, zeros in the padding.
        """
        n, C = len(idx), self.seq_len
        cu = np.full((n, self.max_segments + 1), C, dtype=np.int32)
        cu[:, 0] = 0
        full = self.plan.full_rows(idx)
        if full is not None and unsigned_max(full[0]) + C < self.cache.num_tokens:
            # every row one full piece (most batches of long documents): equal reads of C + 1 tokens
            starts, piece_continues = full
            tokens = self.cache.read_many(starts, C + 1)
            ends = (~piece_continues).nonzero()[0]  # rows whose piece ends its document
            tokens[ends, C] = 0  # nothing follows it
            masks = self.cache.loss_masks(starts + 1, C) if self._loss_mask else None
            arrays = self._arrays(starts, np.full(n, C), np.arange(0, n * C, C), n)
            return (tokens, cu, np.ones(n, dtype=np.int64), piece_continues, (ends + 1) * C, _NO_ROWS,
                    masks, arrays)
        segments = self.plan.segments(idx)
        row, length, count, piece_continues = segments.row, segments.length, segments.count, segments.continues
        if len(length) == n:  # one piece in every row (a plan has no empty row): most rows of books
            tokens = np.empty((n, C + 1), dtype=self.cache.dtype)
            filled = length + piece_continues
            self.cache.read_ranges(segments.start, filled, tokens, np.arange(0, n * (C + 1), C + 1))
            for r in np.flatnonzero(filled <= C).tolist():  # zeros after a row's piece
                tokens[r, filled[r]:] = 0
            cu[:, 1] = length
            continues = piece_continues
            stops = np.arange(0, n * C, C) + length
            at = np.arange(0, n * C, C)
        else:
            tokens = np.zeros((n, C + 1), dtype=self.cache.dtype)
            first = np.cumsum(count) - count  # each row's first piece
            total = np.cumsum(length)
            end = total - (total - length)[first][row]  # where each piece ends, in its row
            self.cache.read_ranges(segments.start, length + piece_continues, tokens,
                                   row * (C + 1) + end - length)
            cu[row, np.arange(len(end)) - first[row] + 1] = end
            continues = np.zeros(n, dtype=bool)
            continues[row[piece_continues]] = True
            stops = row * C + end
            at = row * C + end - length
        masks = None
        if self._loss_mask:  # label j of a piece: is token j + 1 of it (or the one after) trained
            masks = np.zeros((n, C), dtype=bool)
            self.cache.loss_mask_ranges(segments.start + 1, length - 1 + piece_continues, masks, at)
        arrays = self._arrays(segments.start, length, at, n)
        return (tokens, cu, count.astype(np.int64, copy=False), continues, stops[~piece_continues],
                _restarts(cu, C), masks, arrays)

    def _arrays(self, starts: np.ndarray, lengths: np.ndarray, at: np.ndarray,
                n: int) -> dict[str, torch.Tensor]:
        """The per-token array fields of ``n`` rows whose pieces (token ranges ``starts``,
        ``lengths``) go to flat positions ``at`` of the (n, seq_len) batch; zeros elsewhere."""
        out = {}
        for name in self._token_arrays:
            dtype, trailing = self.cache.token_array_layout(name)
            rows = np.zeros((n, self.seq_len) + trailing, dtype=dtype)
            out[name] = torch.from_numpy(self.cache.token_array_ranges(name, starts, lengths, rows, at))
        return out

    def _training_batch(self, tokens: np.ndarray, cu: np.ndarray, num_segments: np.ndarray,
                        stops: np.ndarray, restarts: np.ndarray,
                        masks: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The int64 batch of rows read by :meth:`_read_rows`: ids (padding set to ``pad_id``),
        labels (the next token inside a document, else -100; also -100 where ``masks`` says
        the target is not trained) and positions (restarting at every document and at the
        padding); with ``masks``, ``loss_mask`` too."""
        n, C = tokens.shape[0], self.seq_len
        input_ids = tokens[:, :C].astype(np.int64)
        labels = tokens[:, 1:].astype(np.int64)
        flat_labels = labels.reshape(-1)
        flat_labels[stops - 1] = IGNORE_INDEX  # a document's last token has no next token
        position_ids = np.empty((n, C), dtype=np.int64)
        columns = _columns(C)
        position_ids[:] = columns
        if 0 < restarts.size <= 4:  # a few such rows (the usual batch): a slice per run
            padded, used_at = [], []
            for r in restarts.tolist():
                ends = cu[r, :int(num_segments[r]) + 1].tolist()  # 0, then where each piece ends
                for start, end in zip(ends[1:-1], ends[2:]):  # (the first run is already right)
                    position_ids[r, start:end] = columns[:end - start]
                if ends[-1] < C:  # padding after the last piece: positions restart there too
                    position_ids[r, ends[-1]:] = columns[:C - ends[-1]]
                    padded.append(r)
                    used_at.append(ends[-1])
            if padded:
                self._pad(input_ids, labels, np.array(padded), np.array(used_at))
        elif restarts.size:  # most rows hold one full piece: nothing more to do then
            # their runs (the pieces, then the padding) from the table, with a column past the last
            most = int(num_segments[restarts].max())
            bounds = np.full((restarts.size, most + 2), C, dtype=np.int64)
            bounds[:, :-1] = cu[restarts, :most + 1]
            used = bounds[np.arange(restarts.size), num_segments[restarts]]  # where padding starts
            padded = used < C
            self._pad(input_ids, labels, restarts[padded], used[padded])
            # a position is its column less its run's start
            starts = bounds[:, :-1] + np.arange(0, restarts.size * C, C)[:, None]
            within = np.arange(restarts.size * C)
            within -= starts.reshape(-1).repeat((bounds[:, 1:] - bounds[:, :-1]).reshape(-1))
            position_ids[restarts] = within.reshape(-1, C)
        if self._loss_mask and masks is None:  # with_loss_mask() of a cache without a mask
            masks = np.ones((n, C), dtype=bool)
        return {"input_ids": torch.from_numpy(input_ids), **masked_labels(labels, masks),
                "position_ids": torch.from_numpy(position_ids),
                "cu_seqlens": torch.from_numpy(cu), "num_segments": torch.from_numpy(num_segments)}

    def _pad(self, input_ids: np.ndarray, labels: np.ndarray, rows: np.ndarray, used: np.ndarray) -> None:
        """Set ``pad_id`` and -100 in rows ``rows`` from column ``used`` on: a slice per row for
        a few rows (the usual batch of long documents), else one scatter for all of them."""
        if len(rows) <= 8:
            for r, u in zip(rows.tolist(), used.tolist()):
                input_ids[r, u:] = self.pad_id
                labels[r, u:] = IGNORE_INDEX
        else:
            C = self.seq_len
            pad_len = C - used
            at = np.repeat(rows * C + used - (np.cumsum(pad_len) - pad_len), pad_len)
            at += np.arange(len(at))
            input_ids.reshape(-1)[at] = self.pad_id
            labels.reshape(-1)[at] = IGNORE_INDEX
