"""`torchcache mix plan recipe.yaml`: a run's per-stage, per-source samples, tokens and epochs,
from the caches' indexes alone, as a user runs it before training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import torchcache as tc
from torchcache.train import recipe as recipe_module
from torchcache.read.cache import TokenCache

from conftest import paragraphs, write_jsonl

SEQ = 64


@pytest.fixture(scope="module")
def caches(tmp_path_factory, books, gpt2_tokenizer_path):
    root = tmp_path_factory.mktemp("recipe")
    docs = paragraphs(books, 400)
    out = {}
    for name, part in (("web", docs[:250]), ("code", docs[250:])):
        src = write_jsonl(root / f"{name}.jsonl", part)
        tc.build_cache([src], root / name, tokenizer=gpt2_tokenizer_path, block_tokens=4096,
                       progress=False)
        out[name] = root / name
    return root, out


RECIPE = {
    "seed": 3, "block_size": 16, "seq_len": SEQ, "steps": 40, "global_batch": 8,
    "sources": {"web": {"path": "web"}, "code": {"path": "code"}},
    "schedule": [{"start": 0, "weights": {"web": 3, "code": 1}},
                 {"start": 160, "weights": {"code": 1}}],
}


def _write(root, name, recipe) -> str:
    path = root / name
    if name.endswith(".json"):
        path.write_text(json.dumps(recipe))
    else:
        yaml = pytest.importorskip("yaml")
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))  # source order matters
    return str(path)


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcache", "mix", "plan", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["recipe.json", "recipe.yaml"])
def test_the_plan_matches_the_mixture_it_describes(caches, name):
    root, paths = caches
    out = _run(_write(root, name, RECIPE), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    web = tc.TokenDataset(paths["web"], SEQ)
    code = tc.TokenDataset(paths["code"], SEQ)
    mix = tc.MixtureDataset({"web": web, "code": code}, seed=3, block_size=16,
                            schedule=[(0, {"web": 3, "code": 1}), (160, {"web": 0, "code": 1})])
    assert plan["total_samples"] == 320
    assert {s["name"]: s["samples"] for s in plan["sources"]} == {"web": len(web), "code": len(code)}
    assert {s["name"]: s["read"] for s in plan["sources"]} == mix.source_counts(0, 320)
    epochs = mix.source_epochs(320)
    assert {s["name"]: s["epochs"] for s in plan["sources"]} == pytest.approx(epochs)
    assert [(st["start"], st["stop"]) for st in plan["stages"]] == [(0, 160), (160, 320)]
    assert plan["stages"][0]["samples"] == mix.source_counts(0, 160)
    assert plan["stages"][1]["samples"] == {"web": 0, "code": 160}
    assert plan["stages"][1]["tokens"]["code"] == 160 * SEQ
    # the items the mixture reads agree with the plan's counts
    sources, _ = mix.locate(range(320))
    assert int((sources == 0).sum()) == plan["sources"][0]["read"]

    text = _run(_write(root, name, RECIPE), "--steps", "10")
    assert text.returncode == 0, text.stderr
    assert "10 steps x 8 = 80 samples" in text.stdout
    assert "stage 1" not in text.stdout  # the run ends before stage 1 starts
    assert "per source over the run" in text.stdout


def test_packed_sources_count_rows(caches):
    root, paths = caches
    packed = {**RECIPE, "sources": {name: {"path": name, "kind": "packed"} for name in ("web", "code")}}
    plan = recipe_module.plan_recipe(_write(root, "packed.json", packed))
    rows = {name: len(tc.PackedDataset(paths[name], SEQ)) for name in ("web", "code")}
    assert {s.name: s.samples for s in plan.sources} == rows


def test_planning_reads_no_token(caches, monkeypatch):
    root, _ = caches

    def refuse(*args, **kwargs):
        raise AssertionError("a token was read")

    for method in ("read", "read_many", "read_ranges", "document"):
        monkeypatch.setattr(TokenCache, method, refuse)
    plan = recipe_module.plan_recipe(_write(root, "r.json", RECIPE))
    assert plan.total_samples == 320 and "web" in plan.text()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sources": {"web": {"path": "nowhere"}}}, "sources.web.path: cannot open the cache"),
        ({"sources": {"web": {"path": "web", "kind": "windows"}}}, "sources.web.kind must be one of"),
        ({"stepz": 3}, "unknown key(s) ['stepz']"),
        ({"steps": None, "samples": None}, "say how long the run is"),
        ({"schedule": [{"start": 0, "weights": {"web": 1, "math": 1}}]}, "unknown source(s) ['math']"),
        ({"schedule": [{"start": 0, "weights": {"web": 1}}]}, "['code'] are named in no stage"),
        ({"weights": {"web": 1, "code": 1}}, "either schedule"),
        ({"max_epochs_per_source": 1}, "more than max_epochs_per_source=1"),
        ({"schedule": [{"start": 0, "weights": {"web": 1}, "end": 5}]}, "schedule[0] must be"),
        ({"sources": {"code": {"path": "code", "kind": "packed"}}}, "different kinds of samples"),
    ],
    ids=["no-cache", "kind", "unknown-key", "no-length", "unknown-source", "unnamed-source",
         "both", "over-cap", "bad-stage", "mixed-kinds"],
)
def test_a_bad_recipe_is_one_line_naming_the_file_and_key(caches, change, message):
    root, _ = caches
    bad = {**RECIPE, **change}
    bad = {k: v for k, v in bad.items() if v is not None}
    if "sources" in change:
        bad["sources"] = {**RECIPE["sources"], **change["sources"]}
    path = _write(root, "bad.json", bad)
    out = _run(path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and message in lines[0], out.stderr
