"""A small least-recently-used cache of values that are expensive to make and never change.

The read side keeps a few of these: block offsets and document keys of a TokenCache, the
permutations of a sampler, the block layouts and source permutations of a mixture. Each entry
is immutable, so a lost race only means a value is made twice. No lock: single OrderedDict
operations are atomic under the GIL, so it is safe with a loader's read-ahead thread and safe
to fork (there is no lock a child could inherit held). It pickles empty, so a dataset sent to
DataLoader workers carries no cached arrays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["LRUCache"]

V = TypeVar("V")


class LRUCache(Generic[V]):
    """At most ``maxsize`` values by key; the least recently used one goes first.

    >>> squares = LRUCache(2)
    >>> squares.get_or_make(3, lambda: 9)
    9
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, made by ``make()`` and kept if it is not cached."""
        value = self.get(key)
        if value is not None:
            return value
        value = make()
        self.put(key, value)
        return value

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` if cached (marked as just used), else None."""
        value = self._items.get(key)
        if value is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return value

    def put(self, key: Hashable, value: V) -> None:
        """Keep ``value`` for ``key``, forgetting the least recently used values above maxsize."""
        items = self._items
        items[key] = value
        items.move_to_end(key)
        while len(items) > self.maxsize:
            try:
                items.popitem(last=False)
            except KeyError:  # another thread emptied it
                break

    def clear(self) -> None:
        """Forget every value (e.g. once what they were made from has changed)."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __getstate__(self) -> dict[str, Any]:
        return {"maxsize": self.maxsize}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["maxsize"])
