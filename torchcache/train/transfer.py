"""How a DataLoader worker's batch crosses to the training process: tensors of up to
:data:`INLINE_BYTES` travel inside the pickle, larger ones in shared memory as torch sends them.

torch sends every CPU tensor of a worker's batch as a shared-memory segment of its own: a new
segment, its descriptor passed through a socket, mapped again in the training process. That
costs a few hundred microseconds a tensor, whatever its size, far more than copying a small
tensor through the pipe; and a batch often holds several small tensors (token ids, lengths,
masks, array shapes) beside one large one. The tensors arrive as tensors in both ways, with
their dtype, shape and values. A large batch tensor made in a worker by :func:`batch_tensor` is
in shared memory from the start, so torch sends it without copying it into a new segment.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from torch.utils.data import get_worker_info

__all__ = ["INLINE_BYTES", "batch_tensor", "inline_small_tensors", "item_tensor", "items_become_the_batch"]

#: Tensors of at most this many bytes are copied through the pipe instead of shared memory
#: (measured on 2 CPUs: 5 tensors of 128 KiB a batch arrive 2.7x faster inline, 5 of 512 KiB
#: 1.7x slower).
INLINE_BYTES = 128 << 10


def inline_small_tensors(batch: Any) -> Any:
    """``batch`` (a worker's, about to be sent) with each small CPU tensor wrapped so that it
    pickles as its bytes; dicts, lists and tuples (of exactly those types) are walked, anything
    else is left to torch.

    >>> import pickle
    >>> sent = inline_small_tensors({"lengths": torch.tensor([3, 1]), "names": ["a"]})
    >>> pickle.loads(pickle.dumps(sent))
    {'lengths': tensor([3, 1]), 'names': ['a']}
    """
    if isinstance(batch, torch.Tensor):
        return _Inline(batch) if _inlined(batch) else batch
    kind = type(batch)
    if kind is dict:
        return {key: inline_small_tensors(value) for key, value in batch.items()}
    if kind is list:
        return [inline_small_tensors(value) for value in batch]
    if kind is tuple:
        return tuple(inline_small_tensors(value) for value in batch)
    return batch


_ITEMS_ARE_THE_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchcache_items_are_the_batch", default=False)


@contextlib.contextmanager
def items_become_the_batch(yes: bool) -> Iterator[None]:
    """Within: the items read are made into the batch as they are (a DataLoader worker whose
    collate function is ``pad_collate``, which returns the padded rows a DocumentDataset reads),
    so a dataset may make them with :func:`batch_tensor` (in shared memory); any other collate
    function copies them, and a shared-memory segment would be paid for and never sent."""
    token = _ITEMS_ARE_THE_BATCH.set(yes)
    try:
        yield
    finally:
        _ITEMS_ARE_THE_BATCH.reset(token)


def item_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch's items: :func:`batch_tensor` where they become the
    batch as they are (:func:`items_become_the_batch`), else in ordinary memory."""
    if _ITEMS_ARE_THE_BATCH.get():
        return batch_tensor(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch; in a DataLoader worker process, in shared memory (as
    torch's default_collate makes its batches there): sending it to the training process then
    passes its segment instead of copying the whole batch into a new one."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for n in shape:
        numel *= n
    if not numel:
        return torch.empty(shape, dtype=dtype)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel)
    return torch.empty(0, dtype=dtype).new(storage).view(shape)


def _inlined(tensor: torch.Tensor) -> bool:
    """A plain, small, dense CPU tensor outside autograd: what goes through the pipe."""
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and not tensor.requires_grad
            and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg()
            and tensor.is_contiguous() and tensor.nbytes <= INLINE_BYTES)


class _Inline:
    """A tensor that pickles as (its bytes, dtype, shape) and unpickles as a new tensor."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, ...]:
        t = self.tensor
        data = bytearray(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else bytearray()
        return (_rebuild, (data, t.dtype, tuple(t.shape)))


def _rebuild(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of an :class:`_Inline` (its own writable memory: the bytes unpickled)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
