"""Training recipes: a mixture schedule over caches, planned before the run starts.

A recipe file (JSON, or YAML with the ``yaml`` extra) names the sources by path and the schedule
by weights; :func:`plan_recipe` says, per stage and per source, how many samples and tokens the
run reads and how many times it goes through each source, from the caches' indexes alone
(no token is read). ``torchcache mix plan recipe.yaml`` prints it. Example::

    seed: 0
    block_size: 1024                    # the schedule's period: each 1024 samples hold exact shares
    seq_len: 2048                       # default for the sources
    steps: 100000                       # optimizer steps ...
    global_batch: 512                   # ... of this many samples (all ranks together)
    max_epochs_per_source: 4            # optional: refuse a recipe that repeats a source more
    sources:
      web:  {path: caches/web}
      code: {path: caches/code}
      math: {path: caches/math, kind: packed}   # kind: tokens (default), packed or documents
    schedule:                           # or `weights: {web: 0.7, code: 0.3}` for one stage
      - {start: 0, weights: {web: 0.7, code: 0.3}}
      - {start: 40960000, weights: {web: 0.5, code: 0.3, math: 0.2}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._util.args import POSITION_LIMIT, int_arg
from ..read.pack_plan import PackPlan, plan_identity
from ..read.cache import TokenCache
from ..order.schedule import MixtureSchedule

__all__ = ["RecipePlan", "load_recipe", "plan_recipe"]

_KINDS = ("tokens", "packed", "documents")
_TOP_KEYS = {"seed", "block_size", "seq_len", "steps", "global_batch", "samples", "sources",
             "schedule", "weights", "max_epochs_per_source"}


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


@dataclass
class RecipePlan:
    """What a recipe reads: per stage and per source, samples, tokens and epochs.

    ``block_size`` is the mixture schedule's period (see :class:`torchcache.MixtureSchedule`),
    in samples; it has nothing to do with the block files of the caches.
    """

    path: str
    seed: int
    block_size: int
    total_samples: int
    steps: int | None
    global_batch: int | None
    sources: list[SourcePlan]
    stages: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"recipe": self.path, "seed": self.seed, "block_size": self.block_size,
                "total_samples": self.total_samples, "steps": self.steps,
                "global_batch": self.global_batch,
                "sources": [vars(s) for s in self.sources], "stages": self.stages}

    def text(self) -> str:
        out = [f"recipe {self.path}: seed {self.seed}, block_size {self.block_size:,}"]
        run = f"{self.total_samples:,} samples"
        if self.steps is not None:
            run = f"{self.steps:,} steps x {self.global_batch:,} = " + run
        tokens = sum(s.read * s.tokens_per_sample for s in self.sources)
        out.append(f"run: {run} ({tokens:,.0f} tokens)")
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
        return "\n".join(out)


def plan_recipe(path: str | os.PathLike, *, steps: int | None = None,
                global_batch: int | None = None, samples: int | None = None,
                storage_options: dict[str, Any] | None = None,
                local_dir: str | None = None) -> RecipePlan:
    """Plan the recipe at ``path`` (arguments override the file's ``steps``, ``global_batch``,
    ``samples``). Opens each source's index, never its tokens; a ``packed`` source computes (or
    reuses) its pack plan. RecipeError (a ValueError) names the file and key of a bad entry.
    ``storage_options`` and ``local_dir`` open remote sources, as in :class:`TokenCache`.

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
    path = os.fspath(path)
    recipe = load_recipe(path)

    def key_int(key: str, value: Any, minimum: int = 0) -> int:
        try:
            return int_arg(value, key, minimum, POSITION_LIMIT)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"{path}: {e}") from None

    seed = key_int("seed", recipe.get("seed", 0))
    period = key_int("block_size", recipe.get("block_size", 1024), 1)  # the schedule's period
    default_seq = recipe.get("seq_len")
    steps = steps if steps is not None else recipe.get("steps")
    global_batch = global_batch if global_batch is not None else recipe.get("global_batch")
    samples = samples if samples is not None else recipe.get("samples")
    if samples is None:
        if steps is None or global_batch is None:
            raise RecipeError(f"{path}: say how long the run is: steps and global_batch, or samples")
        steps, global_batch = key_int("steps", steps, 1), key_int("global_batch", global_batch, 1)
        total = steps * global_batch
    else:
        total = key_int("samples", samples, 1)
        steps = global_batch = None

    sources_in = recipe.get("sources")
    if not isinstance(sources_in, Mapping) or not sources_in:
        raise RecipeError(f"{path}: sources must be a mapping name -> {{path: ...}} with at least "
                          "one source")
    sources = [_open_source(path, name, spec, default_seq, storage_options, local_dir)
               for name, spec in sources_in.items()]
    shapes = {(s.kind, s.seq_len) for s in sources}
    if len(shapes) > 1:
        described = ", ".join(f"{s.name}: {s.kind}" + (f" of seq_len {s.seq_len}" if s.seq_len else "")
                              for s in sources)
        raise RecipeError(f"{path}: sources give different kinds of samples ({described}); a "
                          "MixtureDataset batches them only with the same kind and seq_len")
    lengths = {s.name: s.samples for s in sources}
    if ("schedule" in recipe) == ("weights" in recipe):
        raise RecipeError(f"{path}: give either schedule (a list of {{start, weights}}) or weights")
    try:
        if "weights" in recipe:
            schedule = MixtureSchedule(lengths, recipe["weights"], seed=seed, block_size=period)
        else:
            stages = recipe["schedule"]
            if not isinstance(stages, list):
                raise RecipeError(f"{path}: schedule must be a list of {{start, weights}}")
            pairs = []
            for i, stage in enumerate(stages):
                if not isinstance(stage, Mapping) or set(stage) != {"start", "weights"}:
                    raise RecipeError(f"{path}: schedule[{i}] must be {{start: N, weights: {{...}}}}, "
                                      f"got {stage!r}")
                pairs.append((stage["start"], stage["weights"]))
            schedule = MixtureSchedule(lengths, schedule=pairs, seed=seed, block_size=period)
        if recipe.get("max_epochs_per_source") is not None:
            schedule.check_epochs(recipe["max_epochs_per_source"], total)
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{path}: {e}") from None

    plan = RecipePlan(path, seed, period, total, steps, global_batch, sources)
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
    return plan


def _open_source(path: str, name: str, spec: Any, default_seq: Any,
                 storage_options: dict[str, Any] | None, local_dir: str | None) -> SourcePlan:
    where = f"{path}: sources.{name}"
    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, Mapping) or "path" not in spec:
        raise RecipeError(f"{where} must be {{path: CACHE}} (with optional kind, seq_len)")
    unknown = sorted(set(spec) - {"path", "kind", "seq_len"})
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; a source has path, kind, seq_len")
    kind = spec.get("kind", "tokens")
    if kind not in _KINDS:
        raise RecipeError(f"{where}.kind must be one of {list(_KINDS)}, got {kind!r}")
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
                              cache.num_tokens / max(1, cache.num_documents))
        if seq_len is None:
            raise RecipeError(f"{where}: give seq_len (here or at the top of the recipe)")
        seq_len = int_arg(seq_len, "seq_len", 1, POSITION_LIMIT)
        if kind == "tokens":  # TokenDataset's windows
            samples = max(0, (cache.num_tokens - 1) // seq_len)
        else:  # PackedDataset's rows (the default options): the stored plan, or computed now
            samples = PackPlan(cache, plan_identity(cache.fingerprint, seq_len, "split", None, 0)).rows
        return SourcePlan(name, cache_path, kind, seq_len, samples, seq_len)
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None
