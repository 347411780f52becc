"""Recipes with token budgets, repetition caps and skips; a recipe that builds the mixture it
planned (`mixture_from_recipe`), over real caches built from the bundled books."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest

import torchcache as tc
from torchcache.train.recipe import RecipeError, mixture_from_recipe, plan_recipe

from conftest import paragraphs, write_jsonl

SEQ = 64
BLOCK = 16


@pytest.fixture(scope="module")
def caches(tmp_path_factory, books, gpt2_tokenizer_path):
    root = tmp_path_factory.mktemp("budgets")
    docs = paragraphs(books, 400)
    for name, part in (("web", docs[:250]), ("code", docs[250:])):
        src = write_jsonl(root / f"{name}.jsonl", part)
        tc.build_cache([src], root / name, tokenizer=gpt2_tokenizer_path, block_tokens=4096,
                       progress=False)
    lengths = {name: len(tc.TokenDataset(root / name, SEQ)) for name in ("web", "code")}
    return root, lengths


def _budgets(lengths):
    """Budgets that are not proportional to the sources' lengths, nor whole samples."""
    return {"web": lengths["web"] * SEQ * 3 // 4 + 17, "code": lengths["code"] * SEQ * 3 // 2 + 5}


def _recipe(lengths, **change):
    budgets = _budgets(lengths)
    recipe = {"seed": 5, "block_size": BLOCK, "seq_len": SEQ,
              "sources": {"web": {"path": "web", "tokens": budgets["web"]},
                          "code": {"path": "code", "tokens": float(budgets["code"])}}}
    recipe.update(change)
    return {k: v for k, v in recipe.items() if v is not None}


def _write(root, name, recipe) -> str:
    path = root / name
    path.write_text(json.dumps(recipe))
    return str(path)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcache", "mix", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def test_budgets_are_delivered_within_one_block(caches):
    root, lengths = caches
    budgets = _budgets(lengths)
    path = _write(root, "budgets.json", _recipe(lengths))
    plan = plan_recipe(path)
    needed = sum(Fraction(b, SEQ) for b in budgets.values())
    assert plan.total_samples == math.ceil(needed) and plan.steps is None
    mix = tc.MixtureDataset.from_recipe(path)
    counts = mix.source_counts(0, plan.total_samples)
    assert {s.name: s.read for s in plan.sources} == counts
    for name, budget in budgets.items():
        assert abs(counts[name] * SEQ - budget) <= BLOCK * SEQ, (name, counts, budgets)
    # the weights are the budgets, exactly
    assert mix.stages[0][1] == {n: Fraction(b, SEQ) / needed for n, b in budgets.items()}
    assert {s.name: s.budget for s in plan.sources} == budgets
    assert mix.seed == 5 and mix.block_size == BLOCK


def test_a_global_batch_rounds_the_run_up_to_whole_steps(caches):
    root, lengths = caches
    budgets = _budgets(lengths)
    plan = plan_recipe(_write(root, "steps.json", _recipe(lengths, global_batch=24)))
    needed = sum(Fraction(b, SEQ) for b in budgets.values())
    assert plan.steps == math.ceil(needed / 24) and plan.total_samples == plan.steps * 24
    for s in plan.sources:  # one block, plus the share of the rounding up to a whole step
        assert abs(s.read * SEQ - budgets[s.name]) <= (BLOCK + 24) * SEQ
    shorter = plan_recipe(_write(root, "steps.json", _recipe(lengths, global_batch=24)), steps=3)
    assert shorter.total_samples == 72  # an argument still plans another length


def test_yaml_budgets_written_as_30e9(caches):
    yaml = pytest.importorskip("yaml")
    root, lengths = caches
    text = (f"block_size: {BLOCK}\nseq_len: {SEQ}\nsources:\n"
            "  web: {path: web, tokens: 6.4e3}\n"   # PyYAML reads these as strings
            "  code: {path: code, tokens: 32e2}\n")
    assert isinstance(yaml.safe_load(text)["sources"]["web"]["tokens"], str)
    path = root / "budgets.yaml"
    path.write_text(text)
    plan = plan_recipe(path)
    assert {s.name: s.budget for s in plan.sources} == {"web": 6400, "code": 3200}
    assert plan.total_samples == 150
    assert {s.name: s.read for s in plan.sources} == {"web": 100, "code": 50}


def test_packed_budgets_build_the_planned_mixture(caches):
    root, lengths = caches
    recipe = _recipe(lengths)
    for name in ("web", "code"):
        recipe["sources"][name]["kind"] = "packed"
    path = _write(root, "packed.json", recipe)
    plan = plan_recipe(path)
    mix = tc.MixtureDataset.from_recipe(path)
    assert all(isinstance(ds, tc.PackedDataset) for ds in mix.datasets.values())
    assert {s.name: s.samples for s in plan.sources} == {n: len(ds) for n, ds in mix.datasets.items()}
    assert {s.name: s.read for s in plan.sources} == mix.source_counts(0, plan.total_samples)


@pytest.mark.parametrize("caps, key", [
    ({"code": {"max_epochs": 1.25}}, "sources.code.max_epochs is 1.25"),
    ({"max_epochs_per_source": 1}, "max_epochs_per_source is 1"),
    ({"max_epochs_per_source": {"code": 1.4, "web": 9}}, "max_epochs_per_source is 1.4"),
])
def test_a_budget_that_repeats_a_source_too_often_is_refused(caches, caps, key):
    root, lengths = caches
    recipe = _recipe(lengths, max_epochs_per_source=caps.get("max_epochs_per_source"))
    if "code" in caps:
        recipe["sources"]["code"].update(caps["code"])
    path = _write(root, "capped.json", recipe)
    with pytest.raises(RecipeError) as error:
        plan_recipe(path)
    message = str(error.value)
    epochs = next(s.epochs for s in plan_recipe(_write(root, "free.json", _recipe(lengths))).sources
                  if s.name == "code")
    assert path in message and f"source 'code' would be read {epochs:.3g} times" in message
    assert key in message
    assert f"{_budgets(lengths)['code']:,} tokens budget" in message
    assert f"{lengths['code'] * SEQ:,} tokens" in message
    with pytest.raises(RecipeError, match="source 'code' would be read"):
        tc.MixtureDataset.from_recipe(path)
    out = _cli(path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_a_budget_within_its_cap_passes_and_the_mixture_keeps_the_cap(caches):
    root, lengths = caches
    recipe = _recipe(lengths, max_epochs_per_source=1)
    recipe["sources"]["code"]["max_epochs"] = 2
    path = _write(root, "within.json", recipe)
    plan = plan_recipe(path)
    assert [s.max_epochs for s in plan.sources] == [1.0, 2.0]
    seen = {}

    def spy(datasets, **kwargs):
        seen.update(kwargs)
        return tc.MixtureDataset(datasets, **kwargs)

    mixture_from_recipe(path, spy, {"tokens": tc.TokenDataset, "packed": tc.PackedDataset,
                                    "documents": tc.DocumentDataset})
    assert seen["max_epochs_per_source"] == {"web": 1, "code": 2}
    assert seen["total_samples"] == plan.total_samples


def test_a_weight_recipe_with_a_per_source_cap_is_refused(caches):
    root, lengths = caches
    recipe = {"block_size": BLOCK, "seq_len": SEQ, "samples": BLOCK * 20,
              "sources": {"web": {"path": "web"}, "code": {"path": "code", "max_epochs": 1}},
              "weights": {"web": 1, "code": 1}}
    with pytest.raises(RecipeError, match=r"source 'code' \(81 samples\) would be read 1\.975 times"):
        plan_recipe(_write(root, "weights-cap.json", recipe))


@pytest.mark.parametrize("change, message", [
    ({"weights": {"web": 1, "code": 1}}, "source(s) ['web', 'code'] give tokens budgets and the "
                                         "recipe also gives weights"),
    ({"schedule": [{"start": 0, "weights": {"web": 1}}]}, "also gives schedule"),
    ({"sources": {"code": {"path": "code"}}}, "['web'] give tokens budgets but ['code'] do not"),
    ({"sources": {"code": {"path": "code", "tokens": 1.5}}}, "sources.code.tokens must be a whole"),
    ({"sources": {"code": {"path": "code", "tokens": -64}}}, "sources.code.tokens must be a whole"),
    ({"sources": {"code": {"path": "code", "tokens": True}}}, "sources.code.tokens must be a whole"),
    ({"sources": {"code": {"path": "code", "tokens": "lots"}}}, "sources.code.tokens must be a whole"),
    ({"sources": {"code": {"path": "code", "tokens": 640, "max_epochs": 0}}},
     "sources.code.max_epochs must be > 0"),
    ({"steps": 10, "global_batch": 8}, "['steps']: a recipe with token budgets takes the run's length"),
    ({"sources": {"web": {"path": "web", "kind": "documents", "tokens": 640},
                  "code": {"path": "code", "kind": "documents", "tokens": 640}}},
     "sources.web.tokens: a documents source has no fixed tokens per sample"),
], ids=["weights", "schedule", "some-without", "fraction", "negative", "bool", "text",
        "zero-cap", "steps", "documents"])
def test_a_bad_budget_recipe_names_the_file_and_key(caches, change, message):
    root, lengths = caches
    recipe = _recipe(lengths)
    sources = {**recipe["sources"], **change.pop("sources", {})}
    recipe.update(change, sources=sources)
    path = _write(root, "bad.json", recipe)
    out = _cli(path)
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and message in lines[0], out.stderr


def test_mix_plan_shows_budgets_against_what_is_delivered(caches):
    root, lengths = caches
    budgets = _budgets(lengths)
    path = _write(root, "shown.json", _recipe(lengths, global_batch=8, skips=[[2, 4], [4, 5]]))
    plan = plan_recipe(path)
    out = _cli(path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    table = lines.index("budgets against what the schedule delivers (tokens count seq_len per sample):")
    for s in plan.sources:
        row = next(line for line in lines[table:] if line.split()[0] == s.name)
        want = Fraction(budgets[s.name], SEQ)
        assert row.split() == [s.name, f"{budgets[s.name]:,}", f"{s.read * SEQ:,}",
                               f"{float(want):,.1f}", f"{s.read:,}", f"{s.epochs:.3f}"]
    assert f"run: {plan.steps:,} steps x 8 = {plan.total_samples:,} samples" in out.stdout
    assert "skips: steps [2, 4), [4, 5) (3 steps, 24 samples never trained on" in out.stdout
    data = json.loads(_cli(path, "--json").stdout)
    assert {s["name"]: s["budget"] for s in data["sources"]} == budgets
    assert data["skips"] == [[2, 4], [4, 5]]


def test_a_weight_recipe_prints_no_budget_table_and_builds_its_mixture(caches):
    root, lengths = caches
    recipe = {"seed": 2, "block_size": BLOCK, "seq_len": SEQ, "steps": 30, "global_batch": 8,
              "sources": {"web": {"path": "web"}, "code": {"path": "code"}},
              "schedule": [{"start": 0, "weights": {"web": 3, "code": 1}},
                           {"start": 128, "weights": {"code": 1}}]}
    path = _write(root, "weights.json", recipe)
    out = _cli(path)
    assert out.returncode == 0, out.stderr
    assert "budgets against" not in out.stdout and "\nskips:" not in out.stdout
    plan = plan_recipe(path)
    mix = tc.MixtureDataset.from_recipe(path, num_samples=100)
    assert len(mix) == 100  # a mixture keyword goes to the class
    assert {s.name: s.read for s in plan.sources} == mix.source_counts(0, 240)
    assert [st["samples"] for st in plan.stages] == [mix.source_counts(0, 128),
                                                     mix.source_counts(128, 240)]
    by_hand = tc.MixtureDataset({n: tc.TokenDataset(root / n, SEQ) for n in ("web", "code")},
                                schedule=[(0, {"web": 3, "code": 1}), (128, {"code": 1})],
                                seed=2, block_size=BLOCK)
    assert mix.fingerprint == by_hand.fingerprint
    with pytest.raises(RecipeError, match=r"\['seed'\] come\(s\) from the recipe"):
        tc.MixtureDataset.from_recipe(path, seed=3)


@pytest.mark.parametrize("skips, message", [
    ({"a": 1}, "skips must be a list of [start, end]"),
    ([[5]], "skips[0] must be [start, end]"),
    ([[5, 5]], "skips[0] = [5, 5] is empty or reversed"),
    ([[7, 3]], "skips[0] = [7, 3] is empty or reversed"),
    ([[-1, 3]], "skips[0][0] must be >= 0"),
    ([[1.5, 3]], "skips[0][0] must be an integer"),
    ([[1, 10], [5, 12]], "skips[1] = [5, 12] starts before skips[0] = [1, 10] ends"),
    ([[20, 30], [1, 5]], "skips[1] = [1, 5] starts before skips[0] = [20, 30] ends"),
], ids=["mapping", "short", "empty", "reversed", "negative", "float", "overlap", "unsorted"])
def test_skips_are_validated(caches, skips, message):
    root, lengths = caches
    path = _write(root, "skips.json", _recipe(lengths, skips=skips))
    with pytest.raises(RecipeError) as error:
        plan_recipe(path)
    assert path in str(error.value) and message in str(error.value)


def test_valid_skips_are_exposed(caches):
    root, lengths = caches
    plan = plan_recipe(_write(root, "skips.json", _recipe(lengths, skips=[[0, 1], [3, 9]])))
    assert plan.skips == [(0, 1), (3, 9)]
    assert plan_recipe(_write(root, "none.json", _recipe(lengths))).skips == []


def test_the_public_api_exports_the_recipe_functions():
    assert tc.plan_recipe is plan_recipe and tc.RecipeError is RecipeError
    assert {"load_recipe", "plan_recipe", "RecipePlan", "RecipeError"} <= set(tc.__all__)
