"""Training recipes: a mixture schedule over caches, planned before the run starts.

A recipe file (JSON, or YAML with the ``yaml`` extra) names the sources by path and the mixture
by weights, a staged schedule, or a token budget per source; :func:`plan_recipe` says, per stage
and per source, how many samples and tokens the run reads and how many times it goes through each
source, from the caches' indexes alone (no token is read). ``torchcache mix plan recipe.yaml``
prints it, and :func:`mixture_from_recipe` builds the very mixture it printed. Every key, its type
and default: docs/recipes.md. Example::

    seed: 0
    block_size: 1024                    # the schedule's period: each 1024 samples hold exact shares
    seq_len: 2048                       # default for the sources
    global_batch: 512                   # samples per optimizer step (all ranks together)
    max_epochs_per_source: 4            # optional: refuse a recipe that repeats a source more
    sources:                            # token budgets: weights and the run's length follow
      web:  {path: caches/web,  tokens: 30e9}
      code: {path: caches/code, tokens: 5e9, max_epochs: 2}
    skips: [[1200, 1250]]               # optional: global steps [start, end) never trained on

or, with weights (``weights: {web: 0.7, code: 0.3}``) or a schedule, and a length::

    steps: 100000
    global_batch: 512
    sources:
      web:  {path: caches/web}
      code: {path: caches/code}
      math: {path: caches/math, kind: packed}   # kind: tokens (default), packed or documents
    schedule:
      - {start: 0, weights: {web: 0.7, code: 0.3}}
      - {start: 40960000, weights: {web: 0.5, code: 0.3, math: 0.2}}
"""

from __future__ import annotations

import decimal
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping

from .._util.args import POSITION_LIMIT, int_arg
from ..read.pack_plan import PackPlan, plan_identity
from ..read.cache import TokenCache
from ..order.schedule import MixtureSchedule
from .agreement import refuse_mixed_templates, refuse_mixed_tokenizers, tokenizer_identity

__all__ = ["RecipeError", "RecipePlan", "load_recipe", "mixture_from_recipe", "plan_recipe"]

_KINDS = ("tokens", "packed", "documents")
_TOP_KEYS = {"seed", "block_size", "seq_len", "steps", "global_batch", "samples", "sources",
             "schedule", "weights", "max_epochs_per_source", "skips", "allow_mixed_tokenizers",
             "allow_mixed_templates"}
# what the sources must agree on (train/agreement.py), each with its recipe key that allows mixing
_AGREEMENT = {"allow_mixed_tokenizers": refuse_mixed_tokenizers,
              "allow_mixed_templates": refuse_mixed_templates}
_SOURCE_KEYS = ("path", "kind", "seq_len", "tokens", "max_epochs")
# mixture_from_recipe's keyword arguments that change the plan (the rest go to the mixture class)
_PLAN_OPTIONS = ("steps", "global_batch", "samples", "storage_options", "local_dir")
# each kind's dataset class (module, name), with the options plan_recipe counts samples for
class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the key."""


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """The recipe at ``path`` as a dict (JSON; YAML for .yaml/.yml, with the ``yaml`` extra)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the recipe ({e.strerror})") from e
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise RecipeError(f"{path}: reading YAML needs PyYAML: pip install 'torchcache-lm[yaml]' "
                              "(or write the recipe as JSON)") from None
        try:
            recipe = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML: {e}") from None
    else:
        try:
            recipe = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(recipe, Mapping):
        raise RecipeError(f"{path}: a recipe is a mapping (keys sources, schedule or weights, ...), "
                          f"got {type(recipe).__name__}")
    unknown = sorted(set(recipe) - _TOP_KEYS)
    if unknown:
        raise RecipeError(f"{path}: unknown key(s) {unknown}; a recipe has {sorted(_TOP_KEYS)}")
    return dict(recipe)


@dataclass
class SourcePlan:
    name: str
    path: str
    kind: str
    seq_len: int | None
    samples: int  # in the source (its length)
    tokens_per_sample: float
    read: int = 0  # samples the run reads from it
    epochs: float = 0.0
    budget: int | None = None  # its `tokens:` budget, if the recipe gives budgets
    max_epochs: float | None = None  # its repetition cap (its own, or max_epochs_per_source)


@dataclass
class RecipePlan:
    """What a recipe reads: per stage and per source, samples, tokens and epochs.

    ``block_size`` is the mixture schedule's period (see :class:`torchcache.MixtureSchedule`),
    in samples; it has nothing to do with the block files of the caches. ``skips`` are the
    recipe's global step ranges ``[start, end)`` never trained on (sorted, disjoint).
    """

    path: str
    seed: int
    block_size: int
    total_samples: int
    steps: int | None
    global_batch: int | None
    sources: list[SourcePlan]
    stages: list[dict[str, Any]] = field(default_factory=list)
    skips: list[tuple[int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what deserves a look (a skip past the end)

    @property
    def budgeted(self) -> bool:
        """True when the recipe gives token budgets (weights and length come from them)."""
        return any(s.budget is not None for s in self.sources)

    def as_json(self) -> dict[str, Any]:
        return {"recipe": self.path, "seed": self.seed, "block_size": self.block_size,
                "total_samples": self.total_samples, "steps": self.steps,
                "global_batch": self.global_batch,
                "sources": [vars(s) for s in self.sources], "stages": self.stages,
                "skips": [list(s) for s in self.skips], "notes": list(self.notes)}

    def text(self) -> str:
        out = [f"recipe {self.path}: seed {self.seed}, block_size {self.block_size:,}"]
        run = f"{self.total_samples:,} samples"
        if self.steps is not None:
            run = f"{self.steps:,} steps x {self.global_batch:,} = " + run
        tokens = sum(s.read * s.tokens_per_sample for s in self.sources)
        out.append(f"run: {run} ({tokens:,.0f} tokens)")
        out += self._skips_text()
        out += [f"note: {note}" for note in self.notes]
        out.append("sources:")
        width = max(len(s.name) for s in self.sources)
        for s in self.sources:
            shape = f"{s.kind}, seq_len {s.seq_len}" if s.seq_len else s.kind
            out.append(f"  {s.name:<{width}}  {s.samples:>14,} samples  {shape}  {s.path}")
        for st in self.stages:
            steps = ""
            if self.global_batch:
                steps = f", steps [{st['start'] // self.global_batch:,}, {-(-st['stop'] // self.global_batch):,})"
            weights = ", ".join(f"{n} {p}" for n, p in st["proportions"].items() if p != "0")
            out.append(f"stage {st['index']}: samples [{st['start']:,}, {st['stop']:,}){steps}: {weights}")
            for name, n in st["samples"].items():
                if n:
                    out.append(f"    {name:<{width}}  {n:>14,} samples  {st['tokens'][name]:>18,.0f} tokens")
        out.append("per source over the run:")
        out.append(f"  {'source':<{width}}  {'samples':>14}  {'tokens':>18}  {'epochs':>8}")
        for s in self.sources:
            out.append(f"  {s.name:<{width}}  {s.read:>14,}  {s.read * s.tokens_per_sample:>18,.0f}  "
                       f"{s.epochs:>8.3f}")
        if self.budgeted:
            out += self._budget_text(width)
        return "\n".join(out)

    def _skips_text(self) -> list[str]:
        if not self.skips:
            return []
        ranges = ", ".join(f"[{a:,}, {b:,})" for a, b in self.skips)
        steps = sum(b - a for a, b in self.skips)
        skipped = f"{steps:,} steps"
        if self.global_batch:
            skipped += f", {steps * self.global_batch:,} samples"
        return [f"skips: steps {ranges} ({skipped} never trained on; the plan counts them)"]

    def _budget_text(self, width: int) -> list[str]:
        """Each source's token budget against what the schedule delivers, in tokens and samples."""
        out = ["budgets against what the schedule delivers (tokens count seq_len per sample):",
               f"  {'source':<{width}}  {'budget tokens':>18}  {'delivered tokens':>18}  "
               f"{'budget samples':>16}  {'delivered':>14}  {'epochs':>8}"]
        for s in self.sources:
            want = Fraction(s.budget, s.seq_len)
            out.append(f"  {s.name:<{width}}  {s.budget:>18,}  {s.read * s.seq_len:>18,}  "
                       f"{_samples_text(want):>16}  {s.read:>14,}  {s.epochs:>8.3f}")
        return out


@dataclass
class _Built:
    """A planned recipe, with what building its mixture needs."""

    plan: RecipePlan
    caches: dict[str, TokenCache]
    schedule_args: dict[str, Any]  # weights= or schedule=, as given to MixtureSchedule
    caps: dict[str, Any]  # source -> max epochs, as written in the recipe
    allowed: dict[str, bool]  # the allow_mixed_* keys in effect (argument, else recipe)


def plan_recipe(path: str | os.PathLike, *, steps: int | None = None,
                global_batch: int | None = None, samples: int | None = None,
                storage_options: dict[str, Any] | None = None,
                local_dir: str | None = None, allow_mixed_tokenizers: bool | None = None,
                allow_mixed_templates: bool | None = None) -> RecipePlan:
    """Plan the recipe at ``path`` (arguments override the file's ``steps``, ``global_batch``,
    ``samples``). Opens each source's index, never its tokens; a ``packed`` source computes (or
    reuses) its pack plan. RecipeError (a ValueError) names the file and key of a bad entry.
    ``storage_options`` and ``local_dir`` open remote sources, as in :class:`TokenCache`.
    Sources tokenized differently, or chat caches rendered with different templates, are refused
    as :class:`torchcache.MixtureDataset` refuses them, unless the recipe's
    ``allow_mixed_tokenizers`` / ``allow_mixed_templates`` (or these arguments) allow it.

    >>> import json, tokenizers
    >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
    ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
    >>> tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    >>> for name, text in [("web", "hello world hello"), ("code", "world world")]:
    ...     _ = tc.build_cache(iter([text] * 60), f"caches/{name}", tokenizer, progress=False)
    >>> with open("recipe.json", "w") as f:
    ...     json.dump({"seed": 0, "block_size": 10, "seq_len": 3, "samples": 100,
    ...                "sources": {"web": {"path": "caches/web"}, "code": {"path": "caches/code"}},
    ...                "weights": {"web": 0.7, "code": 0.3}}, f)
    >>> plan = plan_recipe("recipe.json")
    >>> plan.stages[0]["samples"], [s.samples for s in plan.sources]
    ({'web': 70, 'code': 30}, [79, 59])
    >>> print(plan.text().splitlines()[-2])  # read 70 of web's 79 samples: 0.886 epochs
      web             70                 210     0.886
    """
    allow = {"allow_mixed_tokenizers": allow_mixed_tokenizers,
             "allow_mixed_templates": allow_mixed_templates}
    return _build(os.fspath(path), steps, global_batch, samples, storage_options, local_dir,
                  allow).plan


def mixture_from_recipe(path: str | os.PathLike, mixture_class: Callable[..., Any],
                        dataset_classes: Mapping[str, Callable[..., Any]], **overrides: Any) -> Any:
    """The mixture the recipe at ``path`` describes: ``mixture_class(datasets, weights= or
    schedule=, seed=, block_size=, total_samples=, max_epochs_per_source=)`` over the very
    datasets and schedule that :func:`plan_recipe` (and ``torchcache mix plan``) planned.

    The mixture's ``num_samples`` (its ``len()``, one loader epoch) is the plan's
    ``total_samples``: a loader epoch is the planned run, no more.

    ``overrides``: ``steps``, ``global_batch``, ``samples``, ``storage_options`` and ``local_dir``
    change the plan as in :func:`plan_recipe`; ``allow_mixed_tokenizers`` and
    ``allow_mixed_templates`` override the recipe's (for the plan's check and the mixture); any
    other keyword (``num_samples``, ...) goes to ``mixture_class``. The classes are passed in
    (:meth:`torchcache.MixtureDataset.from_recipe` passes its own and the package's datasets) so
    that this module needs no torch: ``dataset_classes`` maps each kind to its class, read as
    ``tokens(cache, seq_len)``, ``packed(cache, seq_len)`` (default options, as planned) or
    ``documents(cache)``.
    """
    path = os.fspath(path)
    plan_options = {key: overrides.pop(key) for key in _PLAN_OPTIONS if key in overrides}
    allow = {key: overrides.get(key) for key in _AGREEMENT}
    built = _build(path, plan_options.get("steps"), plan_options.get("global_batch"),
                   plan_options.get("samples"), plan_options.get("storage_options"),
                   plan_options.get("local_dir"), allow)
    overrides.update({key: True for key, on in built.allowed.items() if on})  # the mixture's too
    plan = built.plan
    kwargs: dict[str, Any] = {"seed": plan.seed, "block_size": plan.block_size,
                              "total_samples": plan.total_samples, **built.schedule_args}
    if "num_samples" not in overrides:  # one loader epoch is the planned run, no more
        kwargs["num_samples"] = plan.total_samples
    for note in plan.notes:
        warnings.warn(f"{path}: {note}", stacklevel=3)
    if built.caps:
        kwargs["max_epochs_per_source"] = built.caps
    clash = sorted(set(overrides) & set(kwargs))
    if clash:
        raise RecipeError(f"{path}: {clash} come(s) from the recipe; edit the recipe file instead "
                          "of passing them")
    datasets = {s.name: _dataset(dataset_classes[s.kind], s, built.caches[s.name])
                for s in plan.sources}
    mixture = mixture_class(datasets, **kwargs, **overrides)
    mixture.skipped_steps = list(plan.skips)  # a tc.DataLoader over it never trains on them
    return mixture


def _dataset(dataset_class: Callable[..., Any], source: SourcePlan, cache: TokenCache) -> Any:
    """The dataset a source is read through, as planned."""
    if source.kind == "documents":
        return dataset_class(cache)
    return dataset_class(cache, source.seq_len)


def _build(path: str, steps: int | None, global_batch: int | None, samples: int | None,
           storage_options: dict[str, Any] | None, local_dir: str | None,
           allow: Mapping[str, bool | None]) -> _Built:
    """Read, check and plan the recipe at ``path``: the plan and what its mixture needs."""
    recipe = load_recipe(path)
    seed = _int(path, "seed", recipe.get("seed", 0))
    period = _int(path, "block_size", recipe.get("block_size", 1024), 1)  # the schedule's period
    skips = _skips(path, recipe.get("skips", []))
    opened = _open_sources(path, recipe, storage_options, local_dir)
    sources = [s for s, _ in opened]
    caches = {s.name: cache for s, cache in opened}
    _check_shapes(path, sources)
    allowed = _check_agreement(path, recipe, caches, allow)
    budgets = _budgets(path, recipe, sources)
    if budgets is None:
        total, steps, global_batch = _run_length(path, recipe, steps, global_batch, samples)
        schedule_args = _schedule_args(path, recipe)
    else:
        total, steps, global_batch = _budget_length(path, recipe, budgets, steps, global_batch,
                                                    samples)
        schedule_args = {"weights": budgets}
    caps = _caps(path, recipe, sources)
    lengths = {s.name: s.samples for s in sources}
    try:
        schedule = MixtureSchedule(lengths, **schedule_args, seed=seed, block_size=period)
        if caps and budgets is None:
            schedule.check_epochs(caps, total)
    except (TypeError, ValueError) as e:
        why = " (with token budgets, the weights are the budgets in samples)" if budgets else ""
        raise RecipeError(f"{path}: {e}{why}") from None
    plan = RecipePlan(path, seed, period, total, steps, global_batch, sources, skips=skips,
                      notes=_skip_notes(skips, total, global_batch))
    _fill(plan, schedule)
    if budgets is not None:
        _check_budget_epochs(path, recipe, sources, caps)
    return _Built(plan, caches, schedule_args, caps, allowed)


def _int(path: str, key: str, value: Any, minimum: int = 0) -> int:
    """``value`` of ``key`` as an int >= ``minimum``, or RecipeError naming the file and key."""
    try:
        return int_arg(value, key, minimum, POSITION_LIMIT)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{path}: {e}") from None


def _open_sources(path: str, recipe: Mapping[str, Any], storage_options: dict[str, Any] | None,
                  local_dir: str | None) -> list[tuple[SourcePlan, TokenCache]]:
    sources_in = recipe.get("sources")
    if not isinstance(sources_in, Mapping) or not sources_in:
        raise RecipeError(f"{path}: sources must be a mapping name -> {{path: ...}} with at least "
                          "one source")
    return [_open_source(path, name, spec, recipe.get("seq_len"), storage_options, local_dir)
            for name, spec in sources_in.items()]


def _check_shapes(path: str, sources: list[SourcePlan]) -> None:
    shapes = {(s.kind, s.seq_len) for s in sources}
    if len(shapes) > 1:
        described = ", ".join(f"{s.name}: {s.kind}" + (f" of seq_len {s.seq_len}" if s.seq_len else "")
                              for s in sources)
        raise RecipeError(f"{path}: sources give different kinds of samples ({described}); a "
                          "MixtureDataset batches them only with the same kind and seq_len")


def _check_agreement(path: str, recipe: Mapping[str, Any], caches: Mapping[str, TokenCache],
                     allow: Mapping[str, bool | None]) -> dict[str, bool]:
    """Refuse sources a mixture refuses (train/agreement.py's checks: tokenizers, chat
    templates) unless allowed: by ``allow`` (a caller's argument), else the recipe's key.
    Returns the allow_mixed_* settings in effect, for the mixture."""
    values = {"allow_mixed_tokenizers": {n: tokenizer_identity(c) for n, c in caches.items()},
              "allow_mixed_templates": {n: str(c.chat_template) for n, c in caches.items()
                                        if c.chat_template is not None}}
    allowed = {}
    for key, refuse in _AGREEMENT.items():
        given = allow.get(key)
        if given is None:
            given = recipe.get(key, False)
        if not isinstance(given, bool):
            raise RecipeError(f"{path}: {key} must be true or false, got {given!r}")
        allowed[key] = given
        if given:
            continue
        try:
            refuse(values[key], f"add {key}: true to the recipe")
        except ValueError as e:
            raise RecipeError(f"{path}: {e}") from None
    return allowed


def _run_length(path: str, recipe: Mapping[str, Any], steps: Any, global_batch: Any,
                samples: Any) -> tuple[int, int | None, int | None]:
    """``(total samples, steps, global batch)`` of a weights or schedule recipe."""
    steps = steps if steps is not None else recipe.get("steps")
    global_batch = global_batch if global_batch is not None else recipe.get("global_batch")
    samples = samples if samples is not None else recipe.get("samples")
    if samples is None:
        if steps is None or global_batch is None:
            raise RecipeError(f"{path}: say how long the run is: steps and global_batch, or samples")
        steps, global_batch = _int(path, "steps", steps, 1), _int(path, "global_batch", global_batch, 1)
        return steps * global_batch, steps, global_batch
    # a global batch given with samples still says how samples make steps (trace, skips)
    batch = None if global_batch is None else _int(path, "global_batch", global_batch, 1)
    return _int(path, "samples", samples, 1), None, batch


def _budget_length(path: str, recipe: Mapping[str, Any], budgets: Mapping[str, Fraction],
                   steps: Any, global_batch: Any, samples: Any) -> tuple[int, int | None, int | None]:
    """``(total samples, steps, global batch)`` of a budget recipe: the budgets' samples summed
    and rounded up (to whole steps with a global batch). Arguments may still override them."""
    given = [key for key in ("steps", "samples") if recipe.get(key) is not None]
    if given:
        raise RecipeError(f"{path}: {given}: a recipe with token budgets takes the run's length "
                          "from them (their tokens / seq_len); remove steps and samples (keep "
                          "global_batch to count steps), or plan another length with --steps / "
                          "--samples")
    if samples is not None or steps is not None:
        return _run_length(path, {"global_batch": recipe.get("global_batch")}, steps,
                           global_batch, samples)
    needed = sum(budgets.values())
    global_batch = global_batch if global_batch is not None else recipe.get("global_batch")
    if global_batch is None:
        return _int(path, "samples", math.ceil(needed), 1), None, None
    global_batch = _int(path, "global_batch", global_batch, 1)
    steps = _int(path, "steps", math.ceil(needed / global_batch), 1)
    return steps * global_batch, steps, global_batch


def _schedule_args(path: str, recipe: Mapping[str, Any]) -> dict[str, Any]:
    """``{"weights": ...}`` or ``{"schedule": [(start, weights), ...]}`` from the recipe."""
    if ("schedule" in recipe) == ("weights" in recipe):
        raise RecipeError(f"{path}: give either schedule (a list of {{start, weights}}) or weights, "
                          "or a tokens budget for every source")
    if "weights" in recipe:
        return {"weights": recipe["weights"]}
    stages = recipe["schedule"]
    if not isinstance(stages, list):
        raise RecipeError(f"{path}: schedule must be a list of {{start, weights}}")
    pairs = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, Mapping) or set(stage) != {"start", "weights"}:
            raise RecipeError(f"{path}: schedule[{i}] must be {{start: N, weights: {{...}}}}, "
                              f"got {stage!r}")
        pairs.append((stage["start"], stage["weights"]))
    return {"schedule": pairs}


def _budgets(path: str, recipe: Mapping[str, Any],
             sources: list[SourcePlan]) -> dict[str, Fraction] | None:
    """Each source's budget in samples (tokens / seq_len, exact), or None without budgets."""
    have = [s.name for s in sources if s.budget is not None]
    if not have:
        return None
    lacking = [s.name for s in sources if s.budget is None]
    mixed = [key for key in ("weights", "schedule") if key in recipe]
    if mixed:
        raise RecipeError(
            f"{path}: source(s) {have} give tokens budgets and the recipe also gives {mixed[0]}: "
            f"either give every source tokens: N and drop {mixed[0]} (the weights come from the "
            f"budgets), or drop tokens from {have}")
    if lacking:
        raise RecipeError(
            f"{path}: source(s) {have} give tokens budgets but {lacking} do not: give every source "
            "tokens: N (the weights and the run's length come from the budgets), or none and "
            "give weights or schedule")
    return {s.name: Fraction(s.budget, s.seq_len) for s in sources}


def _caps(path: str, recipe: Mapping[str, Any], sources: list[SourcePlan]) -> dict[str, Any]:
    """Source -> max epochs: its own ``max_epochs``, else ``max_epochs_per_source`` (a number,
    or a mapping name -> number). Records each cap on its SourcePlan."""
    every = recipe.get("max_epochs_per_source")
    names = [s.name for s in sources]
    if isinstance(every, Mapping):
        unknown = [n for n in every if n not in names]
        if unknown:
            raise RecipeError(f"{path}: max_epochs_per_source names unknown source(s) {unknown}; "
                              f"the sources are {names}")
        caps = {n: every[n] for n in names if every.get(n) is not None}
    else:
        caps = {} if every is None else dict.fromkeys(names, every)
    caps.update({s.name: s.max_epochs for s in sources if s.max_epochs is not None})
    for s in sources:
        if s.name in caps:
            key = f"sources.{s.name}.max_epochs" if s.max_epochs is not None else "max_epochs_per_source"
            s.max_epochs = float(_positive(path, key, caps[s.name]))
    return caps


def _check_budget_epochs(path: str, recipe: Mapping[str, Any], sources: list[SourcePlan],
                         caps: Mapping[str, Any]) -> None:
    """RecipeError if a budget reads its source more than its cap: names the source, the epochs
    it would need, its budget and the tokens in its cache."""
    own = (recipe.get("sources") or {})
    for s in sources:
        if s.name not in caps or s.read <= _positive(path, "max_epochs", caps[s.name]) * s.samples:
            continue
        spec = own.get(s.name)
        key = (f"sources.{s.name}.max_epochs" if isinstance(spec, Mapping) and "max_epochs" in spec
               else "max_epochs_per_source")
        raise RecipeError(
            f"{path}: source {s.name!r} would be read {s.epochs:.3g} times (its {s.budget:,} tokens "
            f"budget over the {s.samples * s.seq_len:,} tokens of its {s.samples:,} samples of "
            f"seq_len {s.seq_len}); {key} is {s.max_epochs:g}: lower sources.{s.name}.tokens, "
            f"raise {key}, or add data to its cache")


def _fill(plan: RecipePlan, schedule: MixtureSchedule) -> None:
    """The plan's stages and per-source reads and epochs, from the schedule."""
    total, sources = plan.total_samples, plan.sources
    starts = [start for start, _ in schedule.stages] + [None]
    for i, ((start, proportions), stop) in enumerate(zip(schedule.stages, starts[1:])):
        if start >= total:
            break
        stop = total if stop is None else min(stop, total)
        counts = schedule.source_counts(start, stop)
        plan.stages.append({
            "index": i, "start": start, "stop": stop,
            "proportions": {n: str(p) for n, p in proportions.items()},
            "samples": counts,
            "tokens": {s.name: counts[s.name] * s.tokens_per_sample for s in sources},
        })
    counts = schedule.source_counts(0, total)
    epochs = schedule.source_epochs(total)
    for s in sources:
        s.read, s.epochs = counts[s.name], epochs[s.name]


def _skip_notes(skips: list[tuple[int, int]], total: int, global_batch: int | None) -> list[str]:
    """A note for each skip that reaches past the run's last step (known with a global batch):
    such steps are never part of the run, so the skip does nothing there."""
    if not global_batch:
        return []
    run_steps = -(-total // global_batch)
    notes = []
    for start, end in skips:
        if start >= run_steps:
            notes.append(f"skip [{start:,}, {end:,}) starts after the run's last step "
                         f"({run_steps - 1:,}; the run has {run_steps:,} steps): it never applies")
        elif end > run_steps:
            notes.append(f"skip [{start:,}, {end:,}) runs past the run's last step "
                         f"({run_steps - 1:,}): only steps [{start:,}, {run_steps:,}) are in the run")
    return notes


def _skips(path: str, value: Any) -> list[tuple[int, int]]:
    """The recipe's ``skips``: ``[[start, end], ...]`` global step ranges, start < end, sorted and
    disjoint (ranges may touch)."""
    if not isinstance(value, list):
        raise RecipeError(f"{path}: skips must be a list of [start, end] step ranges, got "
                          f"{type(value).__name__}")
    out: list[tuple[int, int]] = []
    for i, item in enumerate(value):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise RecipeError(f"{path}: skips[{i}] must be [start, end] (global steps, end "
                              f"excluded), got {item!r}")
        start, end = (_int(path, f"skips[{i}][{j}]", x) for j, x in enumerate(item))
        if start >= end:
            raise RecipeError(f"{path}: skips[{i}] = [{start}, {end}] is empty or reversed: start "
                              "must be < end (end is excluded)")
        if out and start < out[-1][1]:
            raise RecipeError(f"{path}: skips[{i}] = [{start}, {end}] starts before skips[{i - 1}] "
                              f"= [{out[-1][0]}, {out[-1][1]}] ends: list the ranges sorted and "
                              "disjoint (merge overlapping ones)")
        out.append((start, end))
    return out


def _tokens(where: str, value: Any) -> int:
    """A ``tokens:`` budget as an int > 0: an int, a float with an integral value (30e9), or such
    a number written as a string (YAML reads ``30e9``, without a dot, as a string)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise RecipeError(f"{where} must be a whole number of tokens (like 30000000000 or 30e9), "
                          f"got {value!r}")
    try:
        number = decimal.Decimal(value.strip() if isinstance(value, str) else repr(value))
    except decimal.InvalidOperation:
        raise RecipeError(f"{where} must be a whole number of tokens (like 30000000000 or 30e9), "
                          f"got {value!r}") from None
    if not number.is_finite() or number != number.to_integral_value() or number <= 0:
        raise RecipeError(f"{where} must be a whole number of tokens > 0, got {value!r}")
    return int(number)


def _positive(path: str, key: str, value: Any) -> Fraction:
    """A repetition cap as an exact number > 0 (a float as written)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RecipeError(f"{path}: {key} must be a number of epochs, got {value!r}")
    cap = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    if cap <= 0:
        raise RecipeError(f"{path}: {key} must be > 0, got {value!r}")
    return cap


def _samples_text(samples: Fraction) -> str:
    """A number of samples: an int with commas, or one decimal when the budget is fractional."""
    if samples.denominator == 1:
        return f"{samples.numerator:,}"
    return f"{float(samples):,.1f}"


def _open_source(path: str, name: str, spec: Any, default_seq: Any,
                 storage_options: dict[str, Any] | None,
                 local_dir: str | None) -> tuple[SourcePlan, TokenCache]:
    where = f"{path}: sources.{name}"
    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, Mapping) or "path" not in spec:
        raise RecipeError(f"{where} must be {{path: CACHE}} (with optional kind, seq_len, tokens, "
                          "max_epochs)")
    unknown = sorted(set(spec) - set(_SOURCE_KEYS))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; a source has {', '.join(_SOURCE_KEYS)}")
    kind = spec.get("kind", "tokens")
    if kind not in _KINDS:
        raise RecipeError(f"{where}.kind must be one of {list(_KINDS)}, got {kind!r}")
    budget = None if spec.get("tokens") is None else _tokens(f"{where}.tokens", spec["tokens"])
    if budget is not None and kind == "documents":
        raise RecipeError(f"{where}.tokens: a documents source has no fixed tokens per sample "
                          "(documents differ in length), so a token budget cannot be turned into "
                          "samples; use kind tokens or packed, or weights instead of budgets")
    cap = spec.get("max_epochs")
    if cap is not None:
        _positive(path, f"sources.{name}.max_epochs", cap)
    cache_path = os.path.join(os.path.dirname(os.path.abspath(path)), spec["path"]) if not (
        "://" in str(spec["path"]) or os.path.isabs(str(spec["path"]))) else str(spec["path"])
    try:
        cache = TokenCache(cache_path, storage_options=storage_options, local_dir=local_dir)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{where}.path: cannot open the cache at {cache_path}: {e}") from None
    seq_len = spec.get("seq_len", default_seq)
    try:
        if kind == "documents":
            return SourcePlan(name, cache_path, kind, None, cache.num_documents,
                              cache.num_tokens / max(1, cache.num_documents), max_epochs=cap), cache
        if seq_len is None:
            raise RecipeError(f"{where}: give seq_len (here or at the top of the recipe)")
        seq_len = int_arg(seq_len, "seq_len", 1, POSITION_LIMIT)
        if kind == "tokens":  # TokenDataset's windows
            samples = max(0, (cache.num_tokens - 1) // seq_len)
        else:  # PackedDataset's rows (the default options): the stored plan, or computed now
            samples = PackPlan(cache, plan_identity(cache.fingerprint, seq_len, "split", None, 0)).rows
        return SourcePlan(name, cache_path, kind, seq_len, samples, seq_len, budget=budget,
                          max_epochs=cap), cache
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None
