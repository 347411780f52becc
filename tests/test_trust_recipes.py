"""Trust, round 4 (issue 31), items 13, 16 and the `mix plan` part of 17:

- a pipeline step that reads a module of the user's own code (a file beside the script) is
  fingerprinted by that module's source: an edit makes another cache, an unchanged file reuses it;
  installed modules count by name and version;
- a recipe's token budgets set the mixture's length (the loader's epoch) to the planned run;
  `trace RECIPE` takes the recipe's global_batch; a skip past the run's end is noted;
- `mix plan` refuses what `MixtureDataset.from_recipe` refuses (chat caches rendered with different
  templates), through the same check.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

import torchcache as tc
from torchcache.builder.functions import describe_module, function_fingerprint
from torchcache.train.recipe import RecipeError, plan_recipe

from conftest import paragraphs, tree_bytes, write_jsonl

# ---------------------------------------------------------------- item 13: user modules

HELPERS = """\
SUFFIX = {suffix!r}


def shout(text):
    return text.upper() + SUFFIX
"""

SCRIPT = """\
import json, sys
import torchcache as tc
import helpers_e13 as helpers


def step(record):
    return {"text": helpers.shout(record["text"])}


pipe = tc.source(json.loads(sys.argv[1])).map(step).tokenize(sys.argv[2], progress=False,
                                                               num_workers=2, block_tokens=2000)
print("FINGERPRINT", pipe.fingerprints[0]["function"])
try:
    cache = pipe.cache(sys.argv[3])
except tc.BuildError as error:
    print("REFUSED", error)
    sys.exit(3)
print("LAST", json.dumps(cache.decode(cache.document(0)[:-1])[-3:]))
"""


def _project(tmp_path, suffix: str):
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "helpers_e13.py").write_text(HELPERS.format(suffix=suffix))
    (project / "run.py").write_text(SCRIPT)
    return project


def test_a_user_module_a_step_reads_is_part_of_the_cache_identity(tmp_path, books,
                                                                  gpt2_tokenizer_path):
    """A real script beside its own helpers module, run from another folder (so the build workers
    find the module only where the script's process found it): editing a constant of the module
    changes the fingerprint and building into the old cache is refused; unchanged, it is reused."""
    inputs = [write_jsonl(tmp_path / f"in-{k}.jsonl", paragraphs(books, 120)[k::2]) for k in range(2)]
    project = _project(tmp_path, "!")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()

    def run(out):
        result = subprocess.run([sys.executable, str(project / "run.py"), json.dumps(inputs),
                                 gpt2_tokenizer_path, str(tmp_path / out)], cwd=elsewhere,
                                capture_output=True, text=True, timeout=300)
        lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
        return result, lines

    first, seen = run("cache")
    assert first.returncode == 0, first.stderr
    assert json.loads(seen["LAST"]).endswith("!")
    before = tree_bytes(str(tmp_path / "cache"))
    again, seen_again = run("cache")  # unchanged module: the same cache, reused as it is
    assert again.returncode == 0, again.stderr
    assert seen_again["FINGERPRINT"] == seen["FINGERPRINT"]
    assert tree_bytes(str(tmp_path / "cache")) == before
    _project(tmp_path, "?")  # the user edits a constant of helpers_e13.py
    edited, seen_edited = run("cache")
    assert seen_edited["FINGERPRINT"] != seen["FINGERPRINT"]
    assert edited.returncode == 3 and "pipeline" in seen_edited["REFUSED"], edited.stdout + edited.stderr
    assert tree_bytes(str(tmp_path / "cache")) == before
    fresh, seen_fresh = run("edited")  # the edited module is what the workers run
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(seen_fresh["LAST"]).endswith("?")


def test_a_user_module_counts_by_its_source_and_an_installed_one_by_name(tmp_path, monkeypatch):
    """In one process: the fingerprint follows the module file's source (what the workers will
    import), a module the user's module imports included; installed modules count by name
    and version, whatever is on disk elsewhere."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "helpers_e13b.py").write_text("import json\nimport inner_e13b\nLIMIT = 10\n")
    (code / "inner_e13b.py").write_text("WORD = 'a'\n")
    monkeypatch.syspath_prepend(str(code))
    helpers = importlib.import_module("helpers_e13b")
    import numpy

    def step(record):
        return {"text": record["text"][:helpers.LIMIT] + str(numpy.pi)}

    assert describe_module(numpy) == {"module": "numpy", "version": f"numpy {numpy.__version__}"}
    assert describe_module(json) == {"module": "json"}  # the standard library: by name
    installed = importlib.metadata.version("torchcache-lm")  # (an editable install too)
    assert describe_module(tc) == {"module": "torchcache", "version": f"torchcache-lm {installed}"}
    assert set(describe_module(helpers)) == {"module", "source"}
    base = function_fingerprint(step)
    assert function_fingerprint(step) == base
    (code / "helpers_e13b.py").write_text("import json\nimport inner_e13b\nLIMIT = 11\n")
    edited = function_fingerprint(step)
    assert edited != base
    (code / "inner_e13b.py").write_text("WORD = 'b'\n")  # reached through helpers' namespace
    assert function_fingerprint(step) not in (base, edited)
    # the same description in fresh interpreters with other hash seeds (deterministic)
    script = textwrap.dedent("""
        import sys, numpy; sys.path.insert(0, sys.argv[1])
        import helpers_e13b as helpers
        from torchcache.builder.functions import describe_module, function_fingerprint
        def step(record):
            return {"text": record["text"][:helpers.LIMIT] + str(numpy.pi)}
        print(function_fingerprint(step))
    """)
    probes = [subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, PYTHONHASHSEED=seed))
              for seed in ("1", "2")]
    assert [p.returncode for p in probes] == [0, 0], probes[0].stderr
    assert probes[0].stdout == probes[1].stdout and len(probes[0].stdout.strip()) == 64


# ---------------------------------------------------------------- item 16: budgets set the run

SEQ = 64


@pytest.fixture(scope="module")
def caches(tmp_path_factory, books, gpt2_tokenizer_path):
    root = tmp_path_factory.mktemp("trust-recipes")
    docs = paragraphs(books)
    for name, part in (("web", docs[:600]), ("code", docs[600:])):
        source = write_jsonl(root / f"{name}.jsonl", part)
        tc.build_cache([source], root / name, tokenizer=gpt2_tokenizer_path, block_tokens=4096,
                       progress=False)
    return root


def _write(root, name: str, recipe: dict) -> str:
    path = root / name
    path.write_text(json.dumps(recipe))
    return str(path)


def _budget_recipe(**change) -> dict:
    recipe = {"seed": 1, "block_size": 16, "seq_len": SEQ,
              "sources": {"web": {"path": "web", "tokens": 19200, "max_epochs": 1},
                          "code": {"path": "code", "tokens": 6400, "max_epochs": 1}}}
    recipe.update(change)
    return recipe


def _trace(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcache", "trace", *args],
                          capture_output=True, text=True, timeout=120)


def test_token_budgets_set_the_mixture_length_and_the_loader_epoch(caches):
    """Budgets of 19,200 and 6,400 tokens at seq_len 64: the run is 400 samples, and so are the
    mixture's len() and one loader epoch, which reads each source within its max_epochs."""
    path = _write(caches, "budgets.json", _budget_recipe())
    plan = plan_recipe(path)
    assert plan.total_samples == (19200 + 6400) // SEQ == 400
    mix = tc.MixtureDataset.from_recipe(path)
    lengths = {n: len(ds) for n, ds in mix.datasets.items()}
    assert sum(lengths.values()) > 400  # (what len() was: one pass over every source)
    assert len(mix) == 400
    sampler = tc.DistributedSampler(mix, seed=1)
    positions = list(sampler)
    assert positions == list(range(400))  # one loader epoch is the planned run
    loader = tc.DataLoader(mix, batch_size=8, sampler=sampler)
    assert len(loader) == 50 and sum(len(batch["input_ids"]) for batch in loader) == 400
    read = mix.source_counts(0, len(positions))
    assert read == {s.name: s.read for s in plan.sources} == {"web": 300, "code": 100}
    epochs = mix.source_epochs(len(positions))
    for s in plan.sources:  # the max_epochs arithmetic is the one of the run the loader reads
        assert epochs[s.name] == pytest.approx(s.epochs) == pytest.approx(read[s.name] / lengths[s.name])
        assert epochs[s.name] <= s.max_epochs
    # with a global batch the run is rounded up to whole steps, and so is the loader's epoch
    stepped = _write(caches, "stepped.json", _budget_recipe(global_batch=12))
    mix = tc.MixtureDataset.from_recipe(stepped)
    assert plan_recipe(stepped).total_samples == len(mix) == 34 * 12
    assert len(tc.DataLoader(mix, batch_size=12)) == 34
    assert len(tc.MixtureDataset.from_recipe(path, num_samples=100)) == 100  # still overridable


def test_trace_takes_the_recipe_global_batch(caches):
    """A recipe with samples and global_batch (and a budget one with global_batch) is traced
    without --batch-size; without a global batch, the error says where to give one."""
    weights = {"seed": 2, "block_size": 16, "seq_len": SEQ, "samples": 400, "global_batch": 8,
               "sources": {"web": {"path": "web"}, "code": {"path": "code"}},
               "weights": {"web": 3, "code": 1}}
    for name, recipe in (("samples.json", weights), ("gb.json", _budget_recipe(global_batch=8))):
        path = _write(caches, name, recipe)
        assert plan_recipe(path).global_batch == 8
        out = _trace(path, "--step", "3", "--json")
        assert out.returncode == 0, out.stderr
        traced = json.loads(out.stdout)
        assert [s["sample"] for s in traced["samples"]] == list(range(24, 32))
        two = json.loads(_trace(path, "--step", "3", "--json", "--world-size", "2").stdout)
        assert sorted(s["sample"] for s in two["samples"]) == list(range(24, 32))
    out = _trace(_write(caches, "nobatch.json", _budget_recipe()), "--step", "0")
    assert out.returncode == 2
    assert "--batch-size" in out.stderr and "add global_batch to the recipe" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_skip_past_the_run_end_is_noted(caches):
    path = _write(caches, "skips.json", _budget_recipe(global_batch=8, skips=[[10, 12], [45, 60],
                                                                            [70, 80]]))
    plan = plan_recipe(path)
    assert plan.steps == 50
    assert plan.notes == [
        "skip [45, 60) runs past the run's last step (49): only steps [45, 50) are in the run",
        "skip [70, 80) starts after the run's last step (49; the run has 50 steps): it never applies"]
    out = subprocess.run([sys.executable, "-m", "torchcache", "mix", "plan", path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("note: ")] == \
        [f"note: {note}" for note in plan.notes]
    assert json.loads(subprocess.run([sys.executable, "-m", "torchcache", "mix", "plan", path,
                                      "--json"], capture_output=True, text=True,
                                     timeout=120).stdout)["notes"] == plan.notes
    with pytest.warns(UserWarning) as warned:
        tc.MixtureDataset.from_recipe(path)
    assert [str(w.message) for w in warned] == [f"{path}: {note}" for note in plan.notes]


# ---------------------------------------------------------------- item 17: plan checks as the mixture

TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
         "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
         "<|im_end|>{% endif %}SEP{% endfor %}")


def _chat_cache(out, tokenizer: str, texts: list[str], separator: str) -> str:
    records = [{"messages": [{"role": "user", "content": texts[k]},
                             {"role": "assistant", "content": texts[k + 1]}]}
               for k in range(0, len(texts) - 1, 2)]
    tc.build_cache(iter(records), str(out), tokenizer, input_format="messages",
                   chat_template=TURNS.replace("SEP", separator), num_workers=1, progress=False)
    return str(out)


def test_mix_plan_refuses_the_sources_a_mixture_refuses(caches, books, chatml_tokenizer_path):
    """Chat caches rendered with different templates (and caches of different tokenizers): `mix
    plan`, plan_recipe and from_recipe all refuse them, through the same check, until the recipe
    (or from_recipe's argument) allows it."""
    texts = paragraphs(books, 200)
    one = _chat_cache(caches / "chat-one", chatml_tokenizer_path, texts[:100], "\n")
    two = _chat_cache(caches / "chat-two", chatml_tokenizer_path, texts[100:], "\n\n")
    assert tc.TokenCache(one).chat_template != tc.TokenCache(two).chat_template
    recipe = {"seq_len": 16, "block_size": 4, "samples": 64, "weights": {"one": 1, "two": 1},
              "sources": {"one": {"path": one}, "two": {"path": two}}}
    path = _write(caches, "templates.json", recipe)
    with pytest.raises(ValueError, match="'one' and 'two' were rendered with different chat "
                                         "templates") as mixture_error:
        tc.MixtureDataset({n: tc.TokenDataset(p, 16) for n, p in (("one", one), ("two", two))})
    assert "pass allow_mixed_templates=True" in str(mixture_error.value)
    with pytest.raises(RecipeError) as plan_error:
        plan_recipe(path)
    message = str(plan_error.value)
    assert message.startswith(f"{path}: sources 'one' and 'two' were rendered with different chat "
                              "templates") and "add allow_mixed_templates: true to the recipe" in message
    with pytest.raises(RecipeError, match="different chat templates"):
        tc.MixtureDataset.from_recipe(path)
    out = subprocess.run([sys.executable, "-m", "torchcache", "mix", "plan", path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == \
        [f"torchcache mix: error: {message}"], out.stderr
    # allowed by the argument, or by the recipe (then the mixture is allowed too)
    assert len(tc.MixtureDataset.from_recipe(path, allow_mixed_templates=True)) == 64
    allowed = _write(caches, "templates-allowed.json", dict(recipe, allow_mixed_templates=True))
    assert plan_recipe(allowed).total_samples == 64
    assert len(tc.MixtureDataset.from_recipe(allowed)) == 64
    with pytest.raises(RecipeError, match="allow_mixed_templates must be true or false"):
        plan_recipe(_write(caches, "bad-allow.json", dict(recipe, allow_mixed_templates="yes")))
    # a text cache of GPT-2 beside a chat cache of the ChatML tokenizer: tokenized differently
    other = dict(recipe, sources={"one": {"path": one}, "web": {"path": str(caches / "web")}},
                 weights={"one": 1, "web": 1})
    tokenizers = _write(caches, "tokenizers.json", other)
    with pytest.raises(RecipeError, match="'one' and 'web' were tokenized differently.*add "
                                          "allow_mixed_tokenizers: true to the recipe"):
        plan_recipe(tokenizers)
    allowed = _write(caches, "tokenizers-allowed.json", dict(other, allow_mixed_tokenizers=True))
    assert plan_recipe(allowed).total_samples == len(tc.MixtureDataset.from_recipe(allowed)) == 64
