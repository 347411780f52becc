"""Per-token arrays (issue 32 item 2, DESIGN §9.6): `token_arrays=` keeps fields of pre-tokenized
records with one row per input id (per-token weights, say); they travel with the tokens, so
TokenDataset windows, PackedDataset rows (padding 0) and mixtures carry them sliced exactly like
input_ids. The oracle is the input records themselves, with 0 for the BOS/EOS the build adds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import torchcache as tc

VOCAB = 1000
EOS = 999
BOS = 998


def records(seed: int, count: int = 40, longest: int = 60) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, longest))
        out.append({"input_ids": rng.integers(0, 900, n).tolist(), "loss_mask": [1] * n,
                    "weights": rng.random(n).astype(np.float32).tolist(),
                    "probs": rng.integers(0, 7, (n, 3)).tolist()})
    return out


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def build(tmp_path, rows, name="c", bos=None, **options):
    options.setdefault("token_arrays", {"weights": "float32", "probs": "int8[*, 3]"})
    return tc.build_cache([write_jsonl(tmp_path / f"{name}.jsonl", rows)], tmp_path / name, None,
                          input_format="tokens", vocab_size=VOCAB, eos=EOS, bos=bos,
                          progress=False, **options)


def stream(rows, field, bos=False):
    """The field of every record as the cache's token stream holds it: 0 for BOS and EOS."""
    parts = []
    for r in rows:
        values = np.asarray(r[field], dtype=np.float32 if field == "weights" else np.int8)
        zero = np.zeros((1,) + values.shape[1:], values.dtype)
        parts += ([zero] if bos else []) + [values, zero]
    return np.concatenate(parts)


def test_weights_come_back_per_document_with_zero_for_bos_and_eos(tmp_path):
    rows = records(0)
    build(tmp_path, rows, bos=BOS, block_tokens=300)
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.token_array_fields == ("probs", "weights") and cache.num_blocks > 3
    for d, r in enumerate(rows):
        got = cache.document_arrays(d)
        assert len(got["weights"]) == len(cache.document(d)) == len(r["input_ids"]) + 2
        assert got["weights"][0] == 0 and got["weights"][-1] == 0
        assert got["weights"][1:-1].tobytes() == np.asarray(r["weights"], np.float32).tobytes()
        assert got["probs"].dtype == np.int8 and got["probs"].shape == (len(r["input_ids"]) + 2, 3)
        assert (got["probs"][1:-1] == np.asarray(r["probs"])).all()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 16), seq_len=st.integers(1, 90), block_tokens=st.integers(20, 400),
       labels=st.sampled_from(["shifted", "same"]))
def test_windows_slice_the_weights_exactly_like_input_ids(tmp_path_factory, seed, seq_len, block_tokens, labels):
    tmp_path = tmp_path_factory.mktemp("w")
    rows = records(seed, count=12)
    build(tmp_path, rows, block_tokens=block_tokens)
    weights, probs = stream(rows, "weights"), stream(rows, "probs")
    ds = tc.TokenDataset(tmp_path / "c", seq_len, labels=labels)
    ids = tc.TokenCache(tmp_path / "c").read(0, ds.cache.num_tokens)
    every = list(range(len(ds)))
    batch = ds.get_batch(every)
    for i in every:
        window = slice(i * seq_len, (i + 1) * seq_len)
        assert (batch["input_ids"][i].numpy() == ids[window]).all()
        assert batch["weights"][i].numpy().tobytes() == weights[window].tobytes()
        assert (batch["probs"][i].numpy() == probs[window]).all()
    assert torch.equal(ds.expand_batch(ds.compact_batch(every))["weights"], batch["weights"])
    assert torch.equal(ds[len(ds) - 1]["probs"], batch["probs"][-1])


@pytest.mark.parametrize("long_docs", ["split", "truncate", "drop"])
def test_packed_rows_carry_the_weights_and_padding_carries_zero(tmp_path, long_docs):
    rows = records(1, count=60, longest=70)
    build(tmp_path, rows, block_tokens=500)
    cache = tc.TokenCache(tmp_path / "c")
    weights = stream(rows, "weights")
    ds = tc.PackedDataset(cache, 48, long_docs=long_docs, plan_dir=tmp_path / "plans")
    every = np.arange(len(ds))
    batch = ds.get_batch(every)
    padded = 0
    for i in every.tolist():
        expected = np.zeros(48, np.float32)
        at = 0
        for d, a, b in ds.row_documents(i):
            start = cache.document_span(d)[0]
            expected[at: at + b - a] = weights[start + a: start + b]
            at += b - a
        padded += 48 - at
        assert batch["weights"][i].numpy().tobytes() == expected.tobytes()
        assert not batch["probs"][i, at:].any()  # the padding's rows are 0
    assert padded > 0  # some rows hold padding, which carried 0
    assert torch.equal(ds.expand_batch(ds.compact_batch(every))["weights"], batch["weights"])
    assert torch.equal(ds[3]["weights"], batch["weights"][3])


def test_mixtures_carry_each_sources_weights(tmp_path):
    a, b = records(2), records(3)
    build(tmp_path, a, name="a")
    build(tmp_path, b, name="b")
    every = list(range(40))
    for sources in ({k: tc.TokenDataset(tmp_path / k, 32) for k in "ab"},
                    {k: tc.PackedDataset(tmp_path / k, 32, plan_dir=tmp_path / f"p{k}") for k in "ab"}):
        mix = tc.MixtureDataset(sources, weights={"a": 0.3, "b": 0.7})
        batch = mix.get_batch(every)
        which, local = mix.locate(every)
        names = mix.names
        assert len(set(which.tolist())) == 2
        for row, (k, j) in enumerate(zip(which.tolist(), local.tolist())):
            item = sources[names[k]][j]
            assert torch.equal(batch["weights"][row], item["weights"])
            assert torch.equal(batch["probs"][row], item["probs"])
            assert torch.equal(batch["input_ids"][row], item["input_ids"])


def test_a_loader_with_two_workers_gives_the_in_process_batches_and_resumes(tmp_path):
    build(tmp_path, records(4, count=80))
    ds = tc.TokenDataset(tmp_path / "c", 40)

    def loader(workers):
        return tc.DataLoader(ds, batch_size=4, num_workers=workers, sampler=tc.DistributedSampler(ds, seed=5))

    whole = list(loader(0))
    assert len(whole) > 6
    first = loader(2)
    seen = []
    for k, batch in enumerate(first):
        seen.append(batch)
        if k == 2:
            state = first.state_dict()
            break
    resumed = loader(2)
    resumed.load_state_dict(state)
    for got, want in zip(seen + list(resumed), whole, strict=True):
        assert got["weights"].dtype == torch.float32 and torch.equal(got["weights"], want["weights"])
        assert torch.equal(got["probs"], want["probs"])


def test_a_wrong_length_names_file_line_or_is_a_counted_skip(tmp_path):
    rows = records(5, count=5)
    rows[3]["weights"] = rows[3]["weights"][:-1]
    with pytest.raises(tc.InputError, match=r"c\.jsonl:4.*'weights' has \d+ rows, the record has \d+ input_ids"):
        build(tmp_path, rows)
    result = build(tmp_path, rows, name="skip", on_error="skip")
    assert result.skipped == {"bad_array": 1} and result.num_documents == 4


def test_token_arrays_are_refused_where_the_token_count_is_unknown(tmp_path, gpt2_tokenizer_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi", "weights": [1.0]}])
    with pytest.raises(ValueError, match="token_arrays needs input_format='tokens'"):
        tc.build_cache([path], tmp_path / "c", gpt2_tokenizer_path, token_arrays=("weights",))
    with pytest.raises(ValueError, match=r"token_arrays\['w'\].*first dimension is the document's token count"):
        build(tmp_path, records(0), token_arrays={"w": "float32[4, *]"})
    with pytest.raises(ValueError, match="'weights' is in both arrays and token_arrays"):
        build(tmp_path, records(0), arrays=("weights",), token_arrays=("weights",))
    assert not (tmp_path / "c").exists()


def test_verify_finds_a_damaged_token_array_and_repair_restores_it(tmp_path):
    build(tmp_path, records(6), block_tokens=400)
    cache_dir = tmp_path / "c"
    before = tc.TokenDataset(cache_dir, 16).get_batch(range(20))["weights"]
    name = tc.TokenCache(cache_dir).block_table.path(1).replace(".safetensors", ".arrays.safetensors")
    path = cache_dir / name
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0xFF
    path.write_bytes(bytes(damaged))
    problems = tc.verify_cache(cache_dir)
    assert len(problems) == 1 and name in problems[0]
    assert tc.repair_cache(cache_dir).repaired == [name] and tc.verify_cache(cache_dir) == []
    assert torch.equal(tc.TokenDataset(cache_dir, 16).get_batch(range(20))["weights"], before)


def test_a_pipeline_map_gives_per_token_numpy_arrays(tmp_path, gpt2_tokenizer_path):
    rows = records(7, count=6)

    def with_positions(r):  # a map step returning numpy, as users write them
        return {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                "position_weight": np.linspace(0, 1, len(r["input_ids"]), dtype=np.float16)}

    cache = (tc.source(write_jsonl(tmp_path / "p.jsonl", rows)).map(with_positions)
             .tokenize(gpt2_tokenizer_path, input_format="tokens", token_arrays=("position_weight",),
                       progress=False).cache(tmp_path / "c"))
    assert cache.token_array_fields == ("position_weight",)
    for d, r in enumerate(rows):
        got = cache.document_arrays(d)["position_weight"]
        want = np.append(np.linspace(0, 1, len(r["input_ids"]), dtype=np.float16), np.float16(0))
        assert got.dtype == np.float16 and got.tobytes() == want.tobytes()  # EOS (GPT-2's) gets 0
