"""Weighted mixtures of datasets: exact proportions per block, weight schedules, O(1) indexing.

:class:`MixtureDataset` reads its sources; which source and which of its samples each mixture
index reads is decided by its :class:`~torchcache.MixtureSchedule` (see
:mod:`torchcache.order.schedule` for the algorithm), a pure function of the weights or stages, the
seed, the block size and the sources' lengths.

Any sized map-style datasets mix (here, lists of tensors); a batch is read a source at a time:

>>> web = [torch.tensor([i]) for i in range(1000)]
>>> code = [torch.tensor([-i]) for i in range(100)]
>>> mix = tc.MixtureDataset({"web": web, "code": code}, {"web": 0.75, "code": 0.25}, seed=0,
...                         block_size=8)
>>> mix.source_counts(0, 1000)  # exact shares in every block of 8
{'web': 750, 'code': 250}
>>> [mix.source_of(i) for i in range(8)].count("code")
2
>>> source, local = mix.locate([0, 1, 2])
>>> torch.equal(mix[2], mix.datasets[mix.names[source[2]]][local[2]])
True
>>> mix.sample_documents(2) == [{"source": mix.names[source[2]], "index": int(local[2])}]
True
>>> batch = mix.get_batch(np.arange(8))  # each source read once, the rows put back in order
>>> torch.equal(batch, torch.stack([mix[i] for i in range(8)]))
True
>>> loader = tc.DataLoader(mix, batch_size=4)  # in-process, through get_batch
>>> it = iter(loader)
>>> torch.equal(next(it), batch[:4]), loader.state_dict()["consumed"]
(True, 4)
>>> mix.source_epochs(10_000)["code"]  # samples read / source length: a 25x repeat
25.0
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from .._util.args import POSITION_LIMIT, bool_arg, index_array, int_arg, optional_int_arg
from .._util.lru import LRUCache
from ..order.permutation import PERMUTATION_ALGORITHM
from ..order.schedule import MIXTURE_ALGORITHM, MixtureSchedule, group_by, prefix_difference
from ..read.cache import RowPlan, gather_rows
from .agreement import disagreement, refuse_mixed_templates, refuse_mixed_tokenizers
from .dataset import DocumentDataset, TokenDataset, knows_content
from .loader import batched_reader
from .packed import PackedDataset
from .recipe import mixture_from_recipe
from .sampler import SampleView

_PLANNED_PERIOD_MAX = 1 << 14  # schedule periods up to this many samples are read through a RowPlan
_PLANS = 4  # RowPlans a mixture keeps (one per schedule period; a loader reads one at a time)

__all__ = ["MixtureDataset", "MIXTURE_ALGORITHM"]


def _shared(values: Mapping[str, str]) -> str | None:
    """The one value all ``values`` agree on; a "mixed" marker when they differ; None if empty.

    A mixture passes this on as its own value, so a mixture nested in another is checked too.
    """
    distinct = sorted(set(values.values()))
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    return "mixed: " + " | ".join(distinct)


def _with_loss_masks(datasets: dict[str, Any]) -> dict[str, Any]:
    """``datasets``, each (that can) carrying ``loss_mask`` if any one of them does, so that
    every batch has the same keys; unchanged when none has a mask."""
    if not any(getattr(ds, "has_loss_mask", False) for ds in datasets.values()):
        return datasets
    return {name: ds.with_loss_mask() if callable(getattr(ds, "with_loss_mask", None)) else ds
            for name, ds in datasets.items()}


def _refuse_mixed_items(signatures: Mapping[str, str]) -> None:
    """ValueError if the sources' items have different keys or shapes."""
    pair = disagreement(signatures)
    if pair is None:
        return
    a, b = pair
    raise ValueError(
        f"sources {a!r} and {b!r} give items of different shapes ({a}: {signatures[a]}; {b}: "
        f"{signatures[b]}): torch's default collate cannot batch them, so the first mixed batch "
        "would fail. Use the same dataset class, seq_len, document_boundaries and max_segments "
        "for every source, or pass allow_mixed_items=True with a collate_fn that handles both")


class MixtureDataset(Dataset):
    """A weighted, shuffled mixture of map-style datasets with exact proportions per block.

    ``mix[i]`` is the chosen source's item, unchanged; :meth:`locate` / :meth:`source_of` say which
    source (and which of its indices) it came from.

    Args:
        datasets: dict name -> map-style dataset (``len`` and ``__getitem__``): a
            :class:`~torchcache.TokenDataset`, :class:`~torchcache.DocumentDataset`, another
            ``MixtureDataset`` or any sized torch ``Dataset``. Its order is the tie-break order of
            the apportionment and the layout order inside a block. Sources must be complete (a
            cache still being built would change its length, and so the mixture).
        weights: dict name -> non-negative number, one entry per source (0 excludes a source).
            Only the ratios matter, computed exactly: ints, ``Fraction``s and ``Decimal``s as
            they are, a float as its shortest decimal form (as written: ``0.7`` is exactly 7/10).
            Default (neither ``weights`` nor ``schedule``): proportional to the sources' lengths.
        schedule: instead of ``weights``: a list of ``(start_sample, weights)`` stages, the first at
            0, starts increasing and each a multiple of ``block_size``. Stage ``s`` applies to
            mixture indices ``[start_s, start_{s+1})``. Each stage apportions the samples *since
            its start* by its own weights, on top of the per-source totals reached when it began:
            those totals carry on, so sources continue their streams where they were (nothing is
            restarted or replayed), and a source with weight 0 in a stage gets no sample in it.
        seed: keys the block order and the sources' per-epoch permutations.
        block_size: ``B``. Every block of ``B`` consecutive mixture samples ``[b*B, (b+1)*B)`` holds
            each source's exact largest-remainder share. Every source with a non-zero weight must
            have ``B * p >= 1`` (``p`` its proportion in that stage), else ValueError saying which
            block size would work.
        num_samples: ``len(mix)``.
        allow_mixed_tokenizers: accept sources whose token ids come from different tokenizers
            (their ``tokenizer_identity``: the tokenizer's fingerprint, or vocabulary size and
            dtype for pre-tokenized caches). Refused by default: one id would mean different
            text in each source.
        max_epochs_per_source: refuse (ValueError naming the source and the mixture index) a
            schedule that reads some source more than this many times (a number, or a dict
            name -> number) in the first ``total_samples`` mixture samples.
        total_samples: how many mixture samples the run will read in all (needed by
            ``max_epochs_per_source``; see also :meth:`source_epochs`).
        allow_mixed_templates: accept chat caches rendered with different chat templates
            (their ``cache.chat_template``, where both have one). Refused by default.
        allow_mixed_items: accept sources whose items differ in keys or shapes (their
            ``item_signature``: e.g. TokenDatasets with different ``seq_len``, or a
            TokenDataset with a DocumentDataset); the DataLoader then needs a ``collate_fn``
            that handles both. Sources without these attributes (plain torch datasets) are
            not checked.

    Loss masks: when a source carries ``loss_mask`` (a chat or instruction cache), every source
    that can (the datasets of this package) is read through its ``with_loss_mask()`` copy, so
    all batches hold ``labels`` and ``loss_mask`` (all True for a source without a mask);
    :attr:`datasets` holds those copies.

    Length: mixture indices are unbounded: ``mix[i]`` is defined for every ``i >= 0`` (sources
    that run out start a new, differently permuted pass), and the class sets
    ``unbounded_indices = True``. ``len(mix)`` only says how many samples one loader epoch covers:
    ``num_samples`` when given, otherwise the sum of the sources' lengths. With
    :class:`torchcache.DistributedSampler` (which then reads the mixture in order, whatever its
    ``shuffle`` says, since the mixture is already shuffled) the global stream position ``p`` is
    mixture index ``p``, and the next loader epoch continues the stream instead of replaying it.
    Exact, elastic resume through :class:`torchcache.DataLoader` works as for one dataset; the
    loader's state records :attr:`fingerprint`, so a state saved with other weights, schedule,
    seed, block size or sources is refused. :attr:`schedule` (a :class:`~torchcache.MixtureSchedule`)
    is the index mapping alone, without the sources.

    >>> web, code = tc.TokenDataset("web", 2048), tc.TokenDataset("code", 2048)  # doctest: +SKIP
    >>> mix = tc.MixtureDataset({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=0)  # doctest: +SKIP
    >>> loader = tc.DataLoader(mix, batch_size=8)  # doctest: +SKIP
    >>> mix.source_of(0), mix.source_counts(0, 1024)  # doctest: +SKIP
    ('web', {'web': 717, 'code': 307})

    (The module's docstring has a runnable example.)
    """

    #: Every index ``i >= 0`` is valid; ``len()`` is only the size of one loader epoch.
    unbounded_indices = True

    def __init__(
        self,
        datasets: Mapping[str, Any],
        weights: Mapping[str, Any] | None = None,
        *,
        schedule: Iterable[tuple[int, Mapping[str, Any]]] | None = None,
        seed: int = 0,
        block_size: int = 1024,
        num_samples: int | None = None,
        allow_mixed_tokenizers: bool = False,
        allow_mixed_items: bool = False,
        allow_mixed_templates: bool = False,
        max_epochs_per_source: Any = None,
        total_samples: int | None = None,
    ) -> None:
        if not isinstance(datasets, Mapping):
            raise TypeError(f"datasets must be a dict name -> dataset, got {type(datasets).__name__}")
        if not datasets:
            raise ValueError("datasets is empty: a mixture needs at least one source")
        for name, ds in datasets.items():
            if not isinstance(name, str):
                raise TypeError(f"source names must be str, got {name!r}")
            if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
                raise TypeError(f"source {name!r} must be a map-style dataset with len() and "
                                f"__getitem__, got {type(ds).__name__}")
            if getattr(ds, "complete", True) is False:
                raise ValueError(
                    f"source {name!r} is a cache still being built; a mixture needs fixed source "
                    "lengths (they define each source's permutations): wait for its build to finish")
        self.datasets: dict[str, Any] = _with_loss_masks(dict(datasets))
        self.names: tuple[str, ...] = tuple(self.datasets)
        self._datasets = tuple(self.datasets.values())
        lengths = {n: int_arg(len(ds), f"len(datasets[{n!r}])", 0) for n, ds in self.datasets.items()}
        int_arg(seed, "seed", 0)  # checked in this order: seed, block_size, num_samples, sources
        int_arg(block_size, "block_size", 1, POSITION_LIMIT)
        self.num_samples = optional_int_arg(num_samples, "num_samples", 1, POSITION_LIMIT)
        self._check_sources_agree(bool_arg(allow_mixed_tokenizers, "allow_mixed_tokenizers"),
                                  bool_arg(allow_mixed_items, "allow_mixed_items"))
        if not bool_arg(allow_mixed_templates, "allow_mixed_templates"):
            refuse_mixed_templates(self._chat_templates())
        #: Which source and which of its samples each index reads (pure, immutable).
        self.schedule = MixtureSchedule(lengths, weights, schedule=schedule, seed=seed,
                                        block_size=block_size)
        if max_epochs_per_source is not None:
            if total_samples is None:
                raise ValueError("max_epochs_per_source needs total_samples= (the samples the run "
                                 "will read in all): the last stage has no end to check up to")
            self.schedule.check_epochs(max_epochs_per_source, total_samples)
        elif total_samples is not None:
            int_arg(total_samples, "total_samples", 1)
        self._fingerprint: str | None = None  # computed on first use (sources are fixed)
        self._expander = self._shared_expander()
        self._windows = self._shared_windows()
        self._plans: LRUCache[RowPlan] = LRUCache(_PLANS)  # schedule period -> its rows, planned

    def __getstate__(self) -> dict[str, Any]:
        """What travels to a DataLoader worker: not the row plans (they hold this process's caches)."""
        state = self.__dict__.copy()
        state["_plans"] = LRUCache(_PLANS)
        return state

    def _check_sources_agree(self, mixed_tokenizers: bool, mixed_items: bool) -> None:
        """Refuse sources with different tokenizers or item shapes (unless allowed); record the
        shared values as this mixture's ``tokenizer_identity`` and ``item_signature``."""
        identities = self._source_values("tokenizer_identity")
        signatures = self._source_values("item_signature")
        if not mixed_tokenizers:
            refuse_mixed_tokenizers(identities)
        if not mixed_items:
            _refuse_mixed_items(signatures)
        self.tokenizer_identity = _shared(identities)
        self.item_signature = _shared(signatures)

    def _chat_templates(self) -> dict[str, str]:
        """Each source's chat template, for the sources over a cache that has one."""
        templates = {}
        for name, ds in self.datasets.items():
            template = getattr(getattr(ds, "cache", None), "chat_template", None)
            if template is not None:
                templates[name] = str(template)
        return templates

    @property
    def has_loss_mask(self) -> bool:
        """True when the batches carry ``loss_mask`` (some source has a loss mask)."""
        return any(getattr(ds, "has_loss_mask", False) for ds in self._datasets)

    def _source_values(self, attribute: str) -> dict[str, str]:
        """Each source's ``attribute``, for the sources that have one (not None)."""
        values = {}
        for name, ds in self.datasets.items():
            value = getattr(ds, attribute, None)
            if value is not None:
                values[name] = str(value)
        return values

    # -- public description ---------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """The seed of the block order and the sources' permutations."""
        return self.schedule.seed

    @property
    def block_size(self) -> int:
        """``B``: every ``B`` consecutive samples hold each source's exact share."""
        return self.schedule.block_size

    @property
    def stages(self) -> tuple[tuple[int, dict[str, Fraction]], ...]:
        """The schedule as ``((start_sample, {name: proportion}), ...)``, exact, summing to 1.

        >>> mix.stages  # doctest: +SKIP
        ((0, {'web': Fraction(7, 10), 'code': Fraction(3, 10)}),)
        """
        return self.schedule.stages

    @property
    def fingerprint(self) -> str:
        """Identity of the mixture stream: schedule (exact proportions), seed, block size, sources.

        A source contributes its own ``fingerprint`` attribute, or its class name and length when
        it has none. :class:`torchcache.DataLoader` saves it in its state and refuses a state
        with another one.

        >>> mix.fingerprint  # doctest: +SKIP
        'mixture-3f1c...'
        """
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        sources = []
        for name, ds, n in zip(self.names, self._datasets, self.schedule.lengths):
            fp = getattr(ds, "fingerprint", None)
            sources.append([name, str(fp) if fp is not None else f"{type(ds).__qualname__}:len={n}"])
        identity = {
            "algorithm": MIXTURE_ALGORITHM,
            "permutation": PERMUTATION_ALGORITHM,
            "seed": self.seed,
            "block_size": self.block_size,
            "stages": [[start, [str(p) for p in props.values()]] for start, props in self.stages],
            "sources": sources,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return f"mixture-{digest[:32]}"

    def resume_prefix(self, position: int) -> dict[str, Any]:
        """What mixture indices ``[0, position)`` depend on (see :meth:`MixtureSchedule.prefix`),
        with each source's identity. :class:`torchcache.DataLoader` saves it in its state, so a
        state saved at ``position`` loads into a mixture whose schedule was edited after it.

        >>> mix.resume_prefix(4096)["stages"]  # doctest: +SKIP
        [[0, [['web', '7/10'], ['code', '3/10']]]]
        """
        prefix = self.schedule.prefix(position)
        for name in prefix["sources"]:
            ds = self.datasets[name]
            fp = getattr(ds, "fingerprint", None)
            prefix["sources"][name].append(str(fp) if fp is not None else type(ds).__qualname__)
        return prefix

    def resume_fingerprint(self, position: int) -> str:
        """A digest of :meth:`resume_prefix`: equal for schedules that agree before ``position``."""
        text = json.dumps(self.resume_prefix(position), sort_keys=True)
        return f"mixture-prefix-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def check_resume(self, saved_prefix: Any, position: int) -> None:
        """ValueError unless this mixture reads indices ``[0, position)`` exactly as the one whose
        :meth:`resume_prefix` was ``saved_prefix``; the message names the first index where they
        differ. Edits after ``position`` (stages changed, added or removed, sources added) pass.

        >>> mix.check_resume(saved_state["schedule"], saved_state["consumed"])  # doctest: +SKIP
        """
        if not isinstance(saved_prefix, Mapping):
            raise ValueError(f"the saved schedule must be a dict (from resume_prefix()), got "
                             f"{type(saved_prefix).__name__}")
        difference = prefix_difference(saved_prefix, self.resume_prefix(position))
        if difference is not None:
            index, why = difference
            raise ValueError(
                f"this mixture does not read mixture indices [0, {position}) as the saved run did: "
                f"they first differ at mixture index {index} ({why}). Only what comes at or after "
                f"the saved position ({position}) may change: edit or add stages starting at "
                f"{-(-position // self.block_size) * self.block_size} or later")

    @property
    def content_identity(self) -> dict[str, Any]:
        """Each source's ``content_identity`` (the sources that have one: datasets over a cache,
        mixtures), under ``"sources"``. Loader states save it; see :meth:`check_content`.

        >>> mix.content_identity["sources"]["web"]  # doctest: +SKIP
        {'blocks': 12, 'sha256': '5d1e...'}
        """
        return {"sources": {name: ds.content_identity for name, ds in self.datasets.items()
                            if knows_content(ds)}}

    def check_content(self, saved: Any, name: str = "content", position: int | None = None) -> None:
        """ValueError (naming the source) unless every source ``saved`` (a
        :attr:`content_identity`) describes still reads the same content. With ``position``
        (the saved position), only the sources read before it are checked, so that sources
        used only later may change, as :meth:`check_resume` allows.

        >>> mix.check_content(state["content"], position=state["consumed"])  # doctest: +SKIP
        """
        well_formed = isinstance(saved, Mapping) and set(saved) == {"sources"}
        sources = saved["sources"] if well_formed else None
        if not isinstance(sources, Mapping):
            raise ValueError(f"{name} must be {{'sources': {{name: content_identity}}}} (a "
                             f"mixture's content_identity), got {saved!r}")
        read = None if position is None else self.schedule.prefix(position)["sources"]
        for source, content in sources.items():
            if source not in self.datasets or (read is not None and source not in read):
                continue  # not read before the saved position: free to change
            ds = self.datasets[source]
            if not knows_content(ds):
                raise ValueError(f"source {source!r}: the state records the content of the cache "
                                 f"it read, this source ({type(ds).__name__}) reads no cache: the "
                                 "state belongs to another mixture")
            try:
                ds.check_content(content, f"{name}['sources'][{source!r}]")
            except ValueError as error:
                raise ValueError(f"source {source!r}: {error}") from error

    def source_epochs(self, position: int) -> dict[str, float]:
        """How many times each source has been read through by mixture indices ``[0, position)``
        (samples taken / its length): the number to check against repetition caps.

        >>> mix.source_epochs(loader.consumed)  # doctest: +SKIP
        {'web': 0.41, 'code': 2.07}
        """
        return self.schedule.source_epochs(position)

    def __len__(self) -> int:
        """``num_samples`` when given, else the sum of the sources' lengths (one loader epoch)."""
        return self.num_samples if self.num_samples is not None else sum(self.schedule.lengths)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={float(p):.3g}" for n, p in self.stages[0][1].items())
        more = f", {len(self.stages)} stages" if len(self.stages) > 1 else ""
        return (f"MixtureDataset({parts}{more}, block_size={self.block_size}, seed={self.seed}, "
                f"len={len(self)})")

    # -- the stream (see MixtureSchedule) -------------------------------------------------------

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(source_ids, local_indices)`` of mixture ``indices`` (int or array-like, any shape).

        ``source_ids`` index :attr:`names`; ``local_indices`` are indices into that source's
        dataset. Both are int64 arrays of the input's shape. O(1) per index, whatever its size.

        >>> source, local = mix.locate([0, 1, 2])  # doctest: +SKIP
        >>> mix.datasets[mix.names[source[0]]][local[0]]  # the same item as mix[0]  # doctest: +SKIP
        """
        return self.schedule.locate(indices)

    #: Global steps a :class:`torchcache.DataLoader` over this mixture never trains on (a
    #: recipe's ``skips``; see :meth:`from_recipe`).
    skipped_steps: Sequence[tuple[int, int]] = ()

    def shuffle(self, seed: int = 0) -> "SampleView":
        """The mixture's items in order, as an iterable from position 0 (``.seek(position)``
        starts elsewhere). A mixture is already shuffled (its own `seed`): `seed` here is
        accepted for symmetry with the other datasets and changes nothing."""
        return SampleView(self, seed)

    @classmethod
    def from_recipe(cls, path: Any, **overrides: Any) -> "MixtureDataset":
        """The mixture a recipe file describes (docs/recipes.md): the very datasets, schedule,
        seed and block size that ``torchcache mix plan`` printed for it, and ``len()`` its
        planned run (``total_samples``: one loader epoch is the run). The recipe's ``skips``
        come with it (:attr:`skipped_steps`): a :class:`torchcache.DataLoader` over it never
        trains on those steps. ``overrides``: ``steps``, ``global_batch``, ``samples``,
        ``storage_options``, ``local_dir`` change the plan; other keywords go to the mixture.

        >>> mix = tc.MixtureDataset.from_recipe("run.yaml")  # doctest: +SKIP
        >>> loader = tc.DataLoader(mix, batch_size=plan.global_batch // world_size)  # doctest: +SKIP
        """
        return mixture_from_recipe(path, cls, {"tokens": TokenDataset, "packed": PackedDataset,
                                               "documents": DocumentDataset}, **overrides)

    def source_of(self, index: int) -> str:
        """Name of the source that mixture index ``index`` comes from.

        >>> mix.source_of(0)  # doctest: +SKIP
        'web'
        """
        return self.schedule.source_of(index)

    def source_counts(self, start: int, stop: int) -> dict[str, int]:
        """Exact number of samples each source contributes to mixture indices ``[start, stop)``.

        O(1) in the range's length and position (see :meth:`MixtureSchedule.source_counts`).

        >>> mix.source_counts(0, 1000)  # doctest: +SKIP
        {'web': 700, 'code': 300}
        """
        return self.schedule.source_counts(start, stop)

    def sample_documents(self, index: int) -> list[dict[str, Any]]:
        """Which documents mixture sample ``index`` (any ``index >= 0``) is made of, in order:
        its source's own :meth:`~torchcache.TokenDataset.sample_documents` of the local index
        :meth:`locate` gives, each entry's ``"source"`` set to the source's name (for a nested
        mixture, ``"outer/inner"``): ``{"source": name, "document": d, "start": a, "end": b}``,
        tokens [a, b) of document d of ``mix.datasets[name].cache``.

        A source without ``sample_documents`` (a plain torch dataset) has no documents to name:
        it gives one entry ``{"source": name, "index": k}``, with k its own index of the sample.

        >>> mix.sample_documents(0)  # doctest: +SKIP
        [{'source': 'web', 'document': 412, 'start': 96, 'end': 2145}]
        """
        k, local = self.schedule.locate_one(index)
        name, ds = self.names[k], self._datasets[k]
        describe = getattr(ds, "sample_documents", None)
        if not callable(describe):
            return [{"source": name, "index": local}]
        return [{**entry, "source": name if entry["source"] is None else f"{name}/{entry['source']}"}
                for entry in describe(local)]

    # -- reading --------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Any:
        source, local = self.schedule.locate_one(index)
        return self._datasets[source][local]

    def __getitems__(self, indices: Any) -> list[Any]:
        """Items of ``indices`` in order; each source is read once (its ``__getitems__`` if any).

        >>> mix = tc.MixtureDataset({"a": [torch.tensor([i]) for i in range(10)],
        ...                          "b": [torch.tensor([-i]) for i in range(10)]}, block_size=2)
        >>> [mix.source_of(i) for i in range(4)], len(mix.__getitems__([0, 1, 2, 3]))
        (['b', 'a', 'b', 'a'], 4)
        """
        source, local = self.schedule.locate(indices)
        source, local = source.reshape(-1), local.reshape(-1)
        out: list[Any] = [None] * source.size
        for k, where in group_by(source):
            items = self._source_items(k, local[where].tolist())
            for pos, item in zip(where.tolist(), items):
                out[pos] = item
        return out

    def get_batch(self, indices: Sequence[int]) -> Any:
        """Items ``indices`` already batched: equal to ``default_collate(mix.__getitems__(indices))``.

        The indices are grouped by source and each group is read in one call: the source's own
        ``get_batch`` where it has one (else its items, collated by torch's
        ``default_collate``); the rows then go back in the order of ``indices``. Sources of one
        ``compact_format`` (TokenDatasets of one seq_len and labels over caches of one dtype,
        say) are read as compact rows instead, put in order, and expanded once for the whole
        batch: about the cost of one source's batch. This is the batched protocol
        :class:`torchcache.DataLoader` reads a dataset with (see its docs), so a mixture takes
        the same fast path as its sources.

        >>> mix = tc.MixtureDataset({"a": [{"ids": torch.tensor([i])} for i in range(10)],
        ...                          "b": [{"ids": torch.tensor([-i])} for i in range(10)]},
        ...                         block_size=2)
        >>> batch = mix.get_batch([0, 1, 2, 3])
        >>> batch["ids"].shape, [mix.source_of(i) for i in range(4)]
        (torch.Size([4, 1]), ['b', 'a', 'b', 'a'])
        >>> torch.equal(batch["ids"], torch.utils.data.default_collate(mix.__getitems__([0, 1, 2, 3]))["ids"])
        True
        """
        if self._windows is not None:  # every source's token windows in one array, widened once
            return self._windows.batch_from_windows(self._read_windows(indices))
        source, local = self.schedule.locate(indices)
        source, local = source.reshape(-1), local.reshape(-1)
        groups = list(group_by(source))
        if len(groups) <= 1:  # all from one source: its batch as it is
            return self._source_batch(groups[0][0] if groups else 0, local)
        if self._expander is not None:  # the rows compact, expanded once for the whole batch
            parts = [(where, self._datasets[k].compact_batch(local[where])) for k, where in groups]
            return self._expander.expand_batch(_merge_rows(parts, source.size, self.names))
        parts = [(where, self._source_batch(k, local[where])) for k, where in groups]
        return _merge_rows(parts, source.size, self.names)

    def _read_windows(self, indices: Sequence[int]) -> np.ndarray:
        """The token windows of mixture ``indices`` (all sources TokenDatasets of one format), in
        one array. Indices inside one period of the schedule read a RowPlan of that period (the
        loader reads the mixture in order: a period is located and planned once, vectorised,
        for all its batches); others are located and gathered at once. (Local indices are in
        range: the schedule's lengths.)"""
        first, caches = self._windows, [ds.cache for ds in self._datasets]
        idx = index_array(indices, "indices").reshape(-1)
        B = self.schedule.block_size
        if idx.size and B <= _PLANNED_PERIOD_MAX:
            low, high = int(idx.min()), int(idx.max())
            period = low // B
            if low >= 0 and high < (period + 1) * B:
                plan = self._plans.get(period)
                if plan is None or any(a is not b for a, b in zip(plan.caches, caches)):
                    source, local = self.schedule.locate(np.arange(period * B, (period + 1) * B))
                    plan = RowPlan(caches, source, local * first.seq_len, first.seq_len + 1)
                    self._plans.put(period, plan)
                first_row = low - period * B
                if high - low + 1 == idx.size and idx.tolist() == list(range(low, high + 1)):
                    return plan.read(slice(first_row, first_row + idx.size))  # the loader's batches
                return plan.read(idx - period * B)
        source, local = self.schedule.locate(idx)
        return gather_rows(caches, source, local * first.seq_len, first.seq_len + 1)

    def _shared_windows(self) -> TokenDataset | None:
        """The first source, if every source is a TokenDataset read
        as such (its batches not redefined by a subclass) of one ``compact_format`` without
        document boundaries: then a batch is their windows read into one array by one
        :func:`gather_rows` call and widened once by the first source."""
        first = self._datasets[0]
        if getattr(first, "has_loss_mask", False):  # masks come per source: see _shared_expander
            return None
        for ds in self._datasets:
            if not (isinstance(ds, TokenDataset) and type(ds).get_batch is TokenDataset.get_batch
                    and batched_reader(ds) is not None and not ds.document_boundaries
                    and ds.compact_format == first.compact_format):
                return None
        return first

    def _shared_expander(self) -> Any:
        """The first source, if every source makes whole batches and compact ones of one
        ``compact_format`` (so any source's ``expand_batch`` expands the rows of all); else None."""
        formats = {getattr(ds, "compact_format", None) for ds in self._datasets}
        if len(formats) != 1 or None in formats:
            return None
        for ds in self._datasets:
            if batched_reader(ds) is None or not (callable(getattr(ds, "compact_batch", None))
                                                  and callable(getattr(ds, "expand_batch", None))):
                return None
        return self._datasets[0]

    def _source_items(self, k: int, wanted: list[int]) -> list[Any]:
        """Items ``wanted`` of source ``k`` (its ``__getitems__`` if any)."""
        ds = self._datasets[k]
        get_items = getattr(ds, "__getitems__", None)
        items = get_items(wanted) if get_items is not None else [ds[i] for i in wanted]
        if len(items) != len(wanted):
            raise RuntimeError(f"source {self.names[k]!r}.__getitems__ returned {len(items)} "
                               f"items for {len(wanted)} indices")
        return items

    def _source_batch(self, k: int, local: np.ndarray) -> Any:
        """Samples ``local`` of source ``k`` as one batch, read in one call."""
        get_batch = batched_reader(self._datasets[k])
        if get_batch is not None:
            return get_batch(local)
        return default_collate(self._source_items(k, local.tolist()))


def _merge_rows(parts: list[tuple[np.ndarray, Any]], n: int, names: tuple[str, ...]) -> Any:
    """One batch of ``n`` rows from ``(positions, batch of the rows at those positions)`` parts:
    tensors row by row (their first dimension), dicts and tuples field by field, lists of
    strings (what ``default_collate`` makes of str items) item by item."""
    first = parts[0][1]
    if isinstance(first, torch.Tensor):
        shape = first.shape[1:]
        out = first.new_empty((n, *shape))
        for where, part in parts:
            if not isinstance(part, torch.Tensor) or part.shape[1:] != shape:
                raise ValueError(
                    f"the sources' batches differ ({tuple(first.shape)} and "
                    f"{tuple(getattr(part, 'shape', ()))} for {len(where)} rows): a mixture of "
                    f"{', '.join(map(repr, names))} cannot be batched by default; pass a "
                    "collate_fn to the DataLoader that handles both")
            _put_rows(out, where, part)
        return out
    if isinstance(first, Mapping):
        return {key: _merge_rows([(w, p[key]) for w, p in parts], n, names) for key in first}
    if isinstance(first, (tuple, list)) and first and not isinstance(first[0], (str, bytes)):
        fields = [_merge_rows([(w, p[i]) for w, p in parts], n, names) for i in range(len(first))]
        if isinstance(first, tuple):
            return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
        return fields
    if isinstance(first, list):
        out_items: list[Any] = [None] * n
        for where, part in parts:
            for pos, item in zip(where.tolist(), part):
                out_items[pos] = item
        return out_items
    raise TypeError(f"cannot put the rows of a {type(first).__name__} batch back in order; pass a "
                    "collate_fn to the DataLoader (the mixture's items are then collated)")


def _put_rows(out: torch.Tensor, where: np.ndarray, part: torch.Tensor) -> None:
    """``out[where] = part`` (rows): through numpy where it can (several times faster than
    torch's indexing for a batch's few rows), else with torch."""
    try:
        out.numpy()[where] = part.numpy()
    except (TypeError, RuntimeError):  # not on the CPU, no numpy dtype (bfloat16), needs grad
        out.index_copy_(0, torch.from_numpy(where).to(out.device), part.to(out.dtype))
