"""Collate functions for whole documents (:class:`torchcache.DocumentDataset`): padded or packed.

Documents differ in length, so torch's default collate cannot stack them. Two layouts:

- :func:`pad_collate`: a ``[batch, longest]`` matrix padded on the right, with an attention
  mask; what most models take.
- :func:`packed_collate`: all documents end to end in one flat sequence, with ``cu_seqlens``
  and ``position_ids`` restarting at each document; no padding at all, for variable-length
  attention (flash-attn's ``flash_attn_varlen_func``, PyTorch's nested/jagged kernels).

Both set ``labels`` for models that shift inside (Hugging Face's): the input ids, with -100
(ignored by ``cross_entropy``) where no token should be predicted. Pass extra options with
``functools.partial``, which DataLoader workers can pickle::

    collate = functools.partial(tc.pad_collate, pad_id=cache.eos_id, max_length=2048)
    loader = tc.DataLoader(docs, batch_size=8, collate_fn=collate, num_workers=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from .._util.args import int_arg, optional_int_arg

__all__ = ["IGNORE_INDEX", "packed_collate", "pad_collate"]

#: The label of positions that predict nothing (``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100


def _documents(batch: Sequence[Any], max_length: int | None) -> list[torch.Tensor]:
    """The batch's documents as 1-D int64 tensors, each cut to ``max_length`` tokens."""
    if isinstance(batch, (torch.Tensor, str, bytes)) or not isinstance(batch, Sequence):
        raise TypeError(f"batch must be a list of documents (1-D tensors of token ids), got "
                        f"{type(batch).__name__}")
    if not batch:
        raise ValueError("batch is empty: a collate function needs at least one document")
    docs = []
    for i, item in enumerate(batch):
        doc = torch.as_tensor(item)
        if doc.dim() != 1 or doc.is_floating_point() or doc.is_complex() or doc.dtype == torch.bool:
            raise TypeError(f"batch[{i}] must be a 1-D tensor of token ids (a DocumentDataset "
                            f"item), got {doc.dtype} of shape {tuple(doc.shape)}")
        docs.append(doc[:max_length].to(torch.int64))
    return docs


def pad_collate(batch: Sequence[torch.Tensor], *, pad_id: int = 0, max_length: int | None = None,
                pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Documents as one right-padded batch, with an attention mask.

    Args:
        batch: 1-D tensors of token ids (:class:`torchcache.DocumentDataset` items).
        pad_id: the id written in padding positions (the mask and labels make its value
            irrelevant to the loss; ``cache.eos_id`` is a common choice).
        max_length: cut longer documents to their first ``max_length`` tokens.
        pad_to_multiple_of: round the padded length up to a multiple of this (e.g. 8 or 64,
            for tensor-core friendly shapes).

    Returns a dict of int64 tensors: ``input_ids`` ``[B, L]`` (``L`` the longest document,
    rounded up), ``attention_mask`` ``[B, L]`` (1 for tokens, 0 for padding), ``labels``
    ``[B, L]`` (``input_ids``, with -100 at padding) and ``lengths`` ``[B]``.

    >>> out = tc.pad_collate([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    >>> out["input_ids"].tolist(), out["attention_mask"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]])
    >>> out["labels"].tolist(), out["lengths"].tolist()
    ([[5, 6, 7], [8, -100, -100]], [3, 1])
    """
    pad_id = int_arg(pad_id, "pad_id", minimum=None)
    max_length = optional_int_arg(max_length, "max_length", 1)
    multiple = optional_int_arg(pad_to_multiple_of, "pad_to_multiple_of", 1)
    docs = _documents(batch, max_length)
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.int64)
    width = int(lengths.max())
    if multiple is not None:
        width = -(-width // multiple) * multiple
    input_ids = torch.full((len(docs), width), pad_id, dtype=torch.int64)
    if width:
        input_ids[:, :int(lengths.max())] = pad_sequence(docs, batch_first=True, padding_value=pad_id)
    attention_mask = (torch.arange(width) < lengths[:, None]).to(torch.int64)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "lengths": lengths}


def packed_collate(batch: Sequence[torch.Tensor], *,
                   max_length: int | None = None) -> dict[str, Any]:
    """Documents end to end in one flat sequence, for variable-length attention (no padding).

    Args:
        batch: 1-D tensors of token ids (:class:`torchcache.DocumentDataset` items).
        max_length: cut longer documents to their first ``max_length`` tokens.

    Returns ``input_ids`` int64 ``[T]`` (``T`` the total tokens), ``position_ids`` int64 ``[T]``
    (0, 1, ... restarting at each document), ``cu_seqlens`` int32 ``[B + 1]`` (where each
    document starts, then ``T``), ``max_seqlen`` (int, the longest document) and ``labels``
    int64 ``[T]`` (``input_ids`` with -100 at each document's first token, so that, once the
    model shifts, no token is trained to predict the next document). Add a batch dimension
    (``input_ids[None]``) for models that expect one.

    >>> out = tc.packed_collate([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    >>> out["input_ids"].tolist(), out["position_ids"].tolist()
    ([5, 6, 7, 8, 9], [0, 1, 2, 0, 1])
    >>> out["cu_seqlens"].tolist(), out["max_seqlen"], out["labels"].tolist()
    ([0, 3, 5], 3, [-100, 6, 7, -100, 9])
    """
    max_length = optional_int_arg(max_length, "max_length", 1)
    docs = _documents(batch, max_length)
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    input_ids = torch.cat(docs)
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    position_ids = torch.arange(len(input_ids), dtype=torch.int64) - starts
    labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "position_ids": position_ids,
            "cu_seqlens": cu_seqlens.to(torch.int32), "max_seqlen": int(lengths.max()),
            "labels": labels}
