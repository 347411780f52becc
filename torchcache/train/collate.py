"""Collate functions for whole documents (:class:`torchcache.DocumentDataset`): padded or packed.

Documents differ in length, so torch's default collate cannot stack them. Two layouts:

- :func:`pad_collate`: a ``[batch, longest]`` matrix padded on the right, with an attention
  mask; what most models take.
- :func:`packed_collate`: all documents end to end in one flat sequence, with ``cu_seqlens``
  and ``position_ids`` restarting at each document; no padding at all, for variable-length
  attention (flash-attn's ``flash_attn_varlen_func``, PyTorch's nested/jagged kernels).

Both set ``labels`` as the README's "What a batch holds" defines them: by default
``labels="same"``, for models that shift inside (Hugging Face's): the input ids, with -100
(ignored by ``cross_entropy``) where no token should be predicted; ``labels="shifted"`` gives
the next token at each position instead, as :class:`torchcache.TokenDataset` and
:class:`torchcache.PackedDataset` do by default (it is the "same" labels moved one place to the
left). Items of a cache with a loss mask (dicts of ``input_ids``, ``labels``, ``loss_mask``)
collate too: their labels are then also -100 where the token predicted is not trained, and the
batch holds ``loss_mask`` (``labels != -100``). Pass extra options with ``functools.partial``, which DataLoader workers can pickle::

    collate = functools.partial(tc.pad_collate, pad_id=cache.eos_id, max_length=2048)
    loader = tc.DataLoader(docs, batch_size=8, collate_fn=collate, num_workers=2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from .._util.args import choice_arg, int_arg, optional_int_arg
from .transfer import batch_tensor

__all__ = ["IGNORE_INDEX", "packed_collate", "pad_collate"]

#: The label of positions that predict nothing (``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100

#: How ``labels`` line up with ``input_ids``: "same" (the model shifts) or "shifted" (next token).
LABEL_ALIGNMENTS = ("same", "shifted")


def _documents(batch: Sequence[Any],
               max_length: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The batch's documents as 1-D int64 tensors, each cut to ``max_length`` tokens plus one
    (the token after the cut, which only ``labels="shifted"`` uses; see :func:`_cut`), and their
    ``loss_mask`` (whether each next token is trained), cut alike, if the items carry one."""
    if isinstance(batch, (torch.Tensor, str, bytes)) or not isinstance(batch, Sequence):
        raise TypeError(f"batch must be a list of documents (1-D tensors of token ids), got "
                        f"{type(batch).__name__}")
    if not batch:
        raise ValueError("batch is empty: a collate function needs at least one document")
    masked = any(isinstance(b, Mapping) and "loss_mask" in b for b in batch)
    end = None if max_length is None else max_length + 1
    docs, masks = [], []
    for i, item in enumerate(batch):
        mask = None
        if isinstance(item, Mapping):  # a DocumentDataset item of a cache with a loss mask
            if "input_ids" not in item:
                raise TypeError(f"batch[{i}] is a dict without input_ids (keys {sorted(item)}): "
                                "give DocumentDataset items")
            item, mask = item["input_ids"], item.get("loss_mask")
        doc = item if type(item) is torch.Tensor else torch.as_tensor(item)
        if doc.dim() != 1 or doc.is_floating_point() or doc.is_complex() or doc.dtype == torch.bool:
            raise TypeError(f"batch[{i}] must be a 1-D tensor of token ids (a DocumentDataset "
                            f"item), got {doc.dtype} of shape {tuple(doc.shape)}")
        docs.append((doc if end is None else doc[:end]).to(torch.int64))
        if masked:  # (no mask is made for a batch without one)
            masks.append(torch.ones(doc.shape[0], dtype=torch.bool) if mask is None
                         else torch.as_tensor(mask, dtype=torch.bool)[:end])
    return docs, masks if masked else None


def _trained(masks: list[torch.Tensor], docs: list[torch.Tensor], alignment: str) -> list[torch.Tensor]:
    """Per (cut) document, which positions may keep their label: for ``"shifted"`` the item's
    ``loss_mask`` (the next token is trained); for ``"same"`` the token itself is trained (the
    mask one place to the right; the first token's own flag is never used by a shifting model)."""
    out = []
    for mask, doc in zip(masks, docs):
        n = len(doc)
        out.append(mask[:n] if alignment == "shifted" else torch.cat([mask.new_zeros(1), mask[:n - 1]])[:n])
    return out


def _cut(docs: list[torch.Tensor],
         max_length: int | None) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """``docs`` cut to ``max_length`` tokens, and the (cut index, next token) of each cut one."""
    if max_length is None:
        return docs, []
    following = [(i, int(doc[max_length])) for i, doc in enumerate(docs) if len(doc) > max_length]
    return [doc[:max_length] for doc in docs], following


def pad_collate(batch: Sequence[torch.Tensor], *, pad_id: int = 0, max_length: int | None = None,
                pad_to_multiple_of: int | None = None, labels: str = "same") -> dict[str, torch.Tensor]:
    """Documents as one right-padded batch, with an attention mask.

    Args:
        batch: 1-D tensors of token ids, or dicts with ``input_ids`` and ``loss_mask``
            (:class:`torchcache.DocumentDataset` items); any other key of a dict item is an
            array field (a cache with arrays), padded with zeros to the batch's largest shape in
            every dimension, with ``<field>_shape`` (LongTensor [B, rank]) its true shapes.
        pad_id: the id written in padding positions (the mask and labels make its value
            irrelevant to the loss; ``cache.eos_id`` is a common choice).
        max_length: cut longer documents to their first ``max_length`` tokens.
        pad_to_multiple_of: round the padded length up to a multiple of this (e.g. 8 or 64,
            for tensor-core friendly shapes).
        labels: ``"same"`` (for models that shift inside) or ``"shifted"`` (the next token).

    Returns a dict of int64 tensors: ``input_ids`` ``[B, L]`` (``L`` the longest document,
    rounded up), ``attention_mask`` ``[B, L]`` (1 for tokens, 0 for padding), ``labels``
    ``[B, L]`` and ``lengths`` ``[B]``. ``labels="same"``: ``input_ids`` with -100 at padding;
    ``"shifted"``: the next token of the same document, -100 at a document's last token (unless
    ``max_length`` cut it: then the token after the cut) and at padding.

    >>> out = tc.pad_collate([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    >>> out["input_ids"].tolist(), out["attention_mask"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]])
    >>> out["labels"].tolist(), out["lengths"].tolist()
    ([[5, 6, 7], [8, -100, -100]], [3, 1])
    >>> tc.pad_collate([torch.tensor([5, 6, 7]), torch.tensor([8])], labels="shifted")["labels"].tolist()
    [[6, 7, -100], [-100, -100, -100]]
    """
    pad_id = int_arg(pad_id, "pad_id", minimum=None)
    max_length = optional_int_arg(max_length, "max_length", 1)
    multiple = optional_int_arg(pad_to_multiple_of, "pad_to_multiple_of", 1)
    alignment = choice_arg(labels, "labels", LABEL_ALIGNMENTS)
    docs, masks = _documents(batch, max_length)
    docs, following = _cut(docs, max_length)
    lengths = torch.tensor([d.shape[0] for d in docs], dtype=torch.int64)
    longest = int(lengths.max())
    width = longest if multiple is None else -(-longest // multiple) * multiple
    input_ids = pad_sequence(docs, batch_first=True, padding_value=pad_id)
    if width > longest:
        input_ids = torch.nn.functional.pad(input_ids, (0, width - longest), value=pad_id)
    attention_mask = (torch.arange(width) < lengths[:, None]).to(torch.int64)
    if alignment == "same":
        targets = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    else:  # each position's next token, while it is in the same document
        targets = torch.full_like(input_ids, IGNORE_INDEX)
        targets[:, :-1] = input_ids[:, 1:]
        targets.masked_fill_(torch.arange(width) >= lengths[:, None] - 1, IGNORE_INDEX)
        for i, token in following:
            targets[i, max_length - 1] = token
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": targets,
           "lengths": lengths}
    if masks is not None:
        allowed = torch.zeros(input_ids.shape, dtype=torch.bool)
        for i, trained in enumerate(_trained(masks, docs, alignment)):
            allowed[i, :len(trained)] = trained
        targets.masked_fill_(~allowed, IGNORE_INDEX)
        out["loss_mask"] = targets != IGNORE_INDEX
    out.update(_pad_arrays(batch))
    return out


_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


def _pad_arrays(batch: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The items' array fields (DocumentDataset items of a cache with arrays: every key beside
    the token ones), each zero-padded to the batch's largest shape in every dimension, with
    ``<field>_shape`` (LongTensor [B, rank]: each item's true shape)."""
    if not isinstance(batch[0], Mapping):
        return {}
    names = [k for k in batch[0] if k not in _TOKEN_KEYS]
    out = {}
    for name in names:
        arrays = []
        for i, item in enumerate(batch):
            if not isinstance(item, Mapping) or name not in item:
                raise TypeError(f"batch[{i}] has no array field {name!r}, which batch[0] has: "
                                "give items of one DocumentDataset")
            arrays.append(torch.as_tensor(item[name]))
        ranks = {a.dim() for a in arrays}
        dtypes = {a.dtype for a in arrays}
        if len(ranks) != 1 or len(dtypes) != 1:
            raise TypeError(f"array field {name!r}: the items differ in rank or dtype "
                            f"({sorted(map(str, dtypes))}, ranks {sorted(ranks)})")
        sizes = [list(a.shape) for a in arrays]
        shapes = torch.tensor(sizes, dtype=torch.int64).reshape(len(arrays), -1)
        largest = shapes.max(dim=0).values.tolist()
        padded = _rows_base(arrays, largest)
        if padded is not None:  # the items are the rows of one padded batch already
            out[name], out[f"{name}_shape"] = padded, shapes
            continue
        padded = batch_tensor((len(arrays), *largest), arrays[0].dtype)
        for i, (a, size) in enumerate(zip(arrays, sizes)):
            row = padded[i]
            row[tuple(slice(0, n) for n in size)] = a
            for d, n in enumerate(size):  # the padding: one slab per dimension, zeroed once
                if n < largest[d]:
                    row[(*(slice(0, m) for m in size[:d]), slice(n, None))] = 0
        out[name], out[f"{name}_shape"] = padded, shapes
    return out


def padded_rows(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Rows ``padded[i, :lengths[i]]`` of a batch whose padding is zero (contiguous views), each
    marked as a row of ``padded``: :func:`pad_collate` of items holding these rows, in this order
    and all of them, returns ``padded`` itself instead of copying them into a new batch.
    :class:`torchcache.DocumentDataset` reads a batch's arrays so, in one copy."""
    rows = []
    for i, n in enumerate(lengths):
        row = padded[i, :n]
        row._torchcache_rows_of = padded  # (a tensor takes attributes; a copy or a slice has none)
        rows.append(row)
    return rows


def _rows_base(arrays: list[torch.Tensor], largest: list[int]) -> torch.Tensor | None:
    """The padded batch ``arrays`` are the rows of (:func:`padded_rows`), when they are all of its
    rows, in order, and it is exactly as large as the largest of them; else None."""
    base = getattr(arrays[0], "_torchcache_rows_of", None)
    if not isinstance(base, torch.Tensor) or list(base.shape) != [len(arrays), *largest] \
            or not base.is_contiguous():
        return None
    step, start = base.stride(0), base.storage_offset()
    memory = base.untyped_storage().data_ptr()
    for i, a in enumerate(arrays):  # (an empty row's data_ptr() is 0: its offset in the storage)
        if getattr(a, "_torchcache_rows_of", None) is not base or a.storage_offset() != start + i * step \
                or a.untyped_storage().data_ptr() != memory or a.shape[1:] != base.shape[2:] \
                or not a.is_contiguous():
            return None
    return base


def packed_collate(batch: Sequence[torch.Tensor], *, max_length: int | None = None,
                   labels: str = "same") -> dict[str, Any]:
    """Documents end to end in one flat sequence, for variable-length attention (no padding).

    Args:
        batch: 1-D tensors of token ids, or dicts with ``input_ids`` and ``loss_mask``
            (:class:`torchcache.DocumentDataset` items); any other key of a dict item is an
            array field (a cache with arrays), padded with zeros to the batch's largest shape in
            every dimension, with ``<field>_shape`` (LongTensor [B, rank]) its true shapes.
        max_length: cut longer documents to their first ``max_length`` tokens.
        labels: ``"same"`` (for models that shift inside) or ``"shifted"`` (the next token).

    Returns ``input_ids`` int64 ``[T]`` (``T`` the total tokens), ``position_ids`` int64 ``[T]``
    (0, 1, ... restarting at each document), ``cu_seqlens`` int32 ``[B + 1]`` (where each
    document starts, then ``T``), ``max_seqlen`` (int, the longest document) and ``labels``
    int64 ``[T]``. ``labels="same"``: ``input_ids`` with -100 at each document's first token,
    so that, once the model shifts, no token is trained to predict the next document;
    ``"shifted"``: the next token of the same document, -100 at a document's last token (unless
    ``max_length`` cut it: then the token after the cut). Add a batch dimension
    (``input_ids[None]``) for models that expect one.

    >>> out = tc.packed_collate([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    >>> out["input_ids"].tolist(), out["position_ids"].tolist()
    ([5, 6, 7, 8, 9], [0, 1, 2, 0, 1])
    >>> out["cu_seqlens"].tolist(), out["max_seqlen"], out["labels"].tolist()
    ([0, 3, 5], 3, [-100, 6, 7, -100, 9])
    >>> tc.packed_collate([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], labels="shifted")["labels"].tolist()
    [6, 7, -100, 9, -100]
    """
    max_length = optional_int_arg(max_length, "max_length", 1)
    alignment = choice_arg(labels, "labels", LABEL_ALIGNMENTS)
    docs, masks = _documents(batch, max_length)
    docs, following = _cut(docs, max_length)
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    input_ids = torch.cat(docs)
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    position_ids = torch.arange(len(input_ids), dtype=torch.int64) - starts
    if alignment == "same":
        targets = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
    else:  # each position's next token, while it is in the same document
        targets = torch.full_like(input_ids, IGNORE_INDEX)
        targets[:-1] = input_ids[1:]
        ends = cu_seqlens[1:][lengths > 0] - 1
        targets[ends] = IGNORE_INDEX
        for i, token in following:
            targets[cu_seqlens[i + 1] - 1] = token
    out = {"input_ids": input_ids, "position_ids": position_ids,
           "cu_seqlens": cu_seqlens.to(torch.int32), "max_seqlen": int(lengths.max()),
           "labels": targets}
    if masks is not None:
        targets.masked_fill_(~torch.cat(_trained(masks, docs, alignment)), IGNORE_INDEX)
        out["loss_mask"] = targets != IGNORE_INDEX
    return out
