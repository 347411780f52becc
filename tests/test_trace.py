"""When a run goes wrong: a recipe-driven run of 3 caches (packed rows, 2 stages) is
resumed at another world size with a skip, and every step's samples, their documents and the
`torchcache trace` of a step are exactly what the loaders of all ranks read."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import torchcache as tc
from conftest import paragraphs

SEQ = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory, books, gpt2_tokenizer_path):
    """Three caches (one keeps each record's "id") and a recipe over them: packed rows, 2 stages
    and a skip."""
    root = tmp_path_factory.mktemp("trace")
    docs = paragraphs(books, 600)
    for name, part in (("web", docs[:250]), ("books", docs[250:450]), ("chat", docs[450:])):
        source = root / f"{name}.jsonl"
        with open(source, "w", encoding="utf-8") as f:
            for k, text in enumerate(part):
                f.write(json.dumps({"text": text, "id": f"{name}-{k}"}) + "\n")
        tc.build_cache([str(source)], root / name, gpt2_tokenizer_path, block_tokens=2048,
                       keep_fields=["id"] if name == "web" else (), progress=False)
    recipe = {"seed": 3, "block_size": 8, "seq_len": SEQ, "global_batch": 12, "steps": 40,
              "sources": {"web": {"path": "web", "kind": "packed"},
                          "books": {"path": "books", "kind": "packed"},
                          "chat": {"path": "chat", "kind": "packed"}},
              "schedule": [{"start": 0, "weights": {"web": 1, "books": 1}},
                           {"start": 96, "weights": {"web": 1, "books": 1, "chat": 2}}],
              "skips": [[12, 15]]}
    path = root / "run.json"
    path.write_text(json.dumps(recipe))
    return root, str(path)


def loaders(recipe: str, world: int, batch: int, state: dict | None = None) -> list[tc.DataLoader]:
    out = []
    for rank in range(world):
        mix = tc.MixtureDataset.from_recipe(recipe)
        loader = tc.DataLoader(mix, batch_size=batch,
                               sampler=tc.DistributedSampler(mix, num_replicas=world, rank=rank, seed=3))
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        out.append(loader)
    return out


def steps_of(group: list[tc.DataLoader], count: int) -> list[list[dict]]:
    iterators = [iter(loader) for loader in group]
    out = []
    for _ in range(count):
        step = []
        for k, loader in enumerate(group):
            try:
                step.append(next(iterators[k]))
            except StopIteration:
                iterators[k] = iter(loader)
                step.append(next(iterators[k]))
        out.append(step)
    return out


def tokens_of(mix: tc.MixtureDataset, index: int) -> np.ndarray:
    """A sample's tokens as the documents it lists say (their ranges, concatenated)."""
    parts = []
    for piece in mix.sample_documents(index):
        cache = mix.datasets[piece["source"]].cache
        parts.append(cache.document(piece["document"])[piece["start"]:piece["end"]])
    return np.concatenate(parts)


def covered(input_ids, labels, cu_seqlens, num_segments) -> np.ndarray:
    """The tokens a packed row's documents must name: each segment's input_ids, plus its last
    label where that is a token (the document goes on after the piece)."""
    ids, labels, cu = np.asarray(input_ids), np.asarray(labels), np.asarray(cu_seqlens).tolist()
    parts = []
    for a, b in zip(cu, cu[1:int(num_segments) + 1]):
        parts += [ids[a:b], labels[b - 1:b][labels[b - 1:b] != -100]]
    return np.concatenate(parts)


def test_a_resumed_run_with_a_skip_is_traced_exactly(run):
    root, recipe = run
    first = loaders(recipe, 2, 6)
    mix = first[0].dataset
    assert mix.skipped_steps == [(12, 15)] and first[0].skipped_steps == [(12, 15)]
    before = steps_of(first, 10)
    state = first[0].state_dict()
    assert state["skips"] == [[12, 15]] and first[0].step == 10
    after_group = loaders(recipe, 3, 4, state)  # another world size, same global batch
    after = steps_of(after_group, 20)
    seen = [(t, s) for t, s in zip(range(10), before)] + \
        [(t, s) for t, s in zip([10, 11, *range(15, 33)], after)]
    reference = after_group[0]
    for t, per_rank in seen:  # every step, as all ranks received it, is what step_samples says
        indices = reference.step_samples(t)
        world = len(per_rank)
        for rank, batch in enumerate(per_rank):
            rows = indices[rank::world]
            assert len(rows) == len(batch["input_ids"])
            for k, row in enumerate(rows):
                np.testing.assert_array_equal(
                    covered(batch["input_ids"][k], batch["labels"][k], batch["cu_seqlens"][k],
                            batch["num_segments"][k]), tokens_of(mix, row))
    # 1,000 random samples of the stream: their documents reproduce their tokens
    rng = np.random.default_rng(0)
    for index in rng.integers(0, 5000, 1000).tolist():
        item = mix[index]
        np.testing.assert_array_equal(covered(item["input_ids"], item["labels"], item["cu_seqlens"],
                                              item["num_segments"]), tokens_of(mix, index))
        for piece in mix.sample_documents(index):
            info = mix.datasets[piece["source"]].cache.document_info(piece["document"])
            assert info["record"] == piece["document"]  # one input, every line a document
            assert (info["fields"] != {}) == (piece["source"] == "web")


def test_trace_prints_a_step_from_the_state(run, tmp_path):
    root, recipe = run
    group = loaders(recipe, 2, 6)
    steps_of(group, 5)
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(group[0].state_dict()))
    done = subprocess.run([sys.executable, "-m", "torchcache", "trace", recipe, "--step", "20",
                           "--state", str(state_file), "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    traced = json.loads(done.stdout)
    want = tc.trace_step(group[0], 20)
    assert traced["samples"] == json.loads(json.dumps(want)) and traced["world_size"] == 2
    assert len(traced["samples"]) == 12
    web = [p for s in traced["samples"] for p in s["documents"] if p["source"] == "web"]
    assert web and all(p["fields"]["id"].startswith("web-") for p in web)
    text = subprocess.run([sys.executable, "-m", "torchcache", "trace", recipe, "--step", "13",
                           "--state", str(state_file)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "a skipped step" in text.stdout.splitlines()[0]
    assert f"{root / 'web.jsonl'}:" in text.stdout  # file:line of the web documents


@pytest.mark.parametrize("args, message", [
    (["--step", "-1"], "--step must be >= 0"),
    (["--step", "1", "--seq-len", "8"], "--seq-len and --packed are for a cache"),
])
def test_trace_errors_are_one_line(run, args, message):
    _, recipe = run
    done = subprocess.run([sys.executable, "-m", "torchcache", "trace", recipe, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_trace_refuses_a_state_of_another_run(run, tmp_path):
    root, recipe = run
    other = tc.DataLoader(tc.TokenDataset(root / "web", SEQ), batch_size=4)
    state_file = tmp_path / "other.json"
    state_file.write_text(json.dumps(other.state_dict()))
    done = subprocess.run([sys.executable, "-m", "torchcache", "trace", recipe, "--step", "1",
                           "--state", str(state_file)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cannot load this state" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_recipe_skip_added_after_the_steps_ran_is_refused(run, tmp_path):
    root, recipe = run
    group = loaders(recipe, 1, 12)
    steps_of(group, 16)
    state = group[0].state_dict()
    edited = json.loads(open(recipe).read())
    edited["skips"] = [[12, 15], [15, 20]]  # steps 15 and after were trained on already
    path = tmp_path / "edited.json"
    text = json.dumps(edited).replace('"path": "', f'"path": "{root}/')
    path.write_text(text)
    with pytest.raises(ValueError, match="were trained on"):
        loaders(str(path), 1, 12, state)
