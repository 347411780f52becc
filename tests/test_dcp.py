"""torch.distributed.checkpoint: tc.DataLoader is a DCP `Stateful` (DESIGN.md §9.4).

`dcp.save({"loader": loader})` stores the loader's state (DCP flattens its nested dicts and
pickles the non-tensor leaves) and `dcp.load({"loader": fresh})` loads it in place into the fresh
loader's `state_dict()` and calls `load_state_dict`: the state comes back equal, with the same
types, and the loaders continue with exactly the batches the saved one would have yielded, in
one process and under `torchrun --nproc_per_node 2` (gloo, CPU), also loaded on 1 process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchcache as tc
from conftest import paragraphs

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

SEQ, BATCH, SEED, SAVE_AT = 16, 4, 7, 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    out = tmp_path_factory.mktemp("dcp") / "cache"
    tc.build_cache(iter(paragraphs(books, 60)), out, gpt2_tokenizer_path, progress=False)
    return str(out)


def make_loader(cache: str, **kwargs) -> tc.DataLoader:
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    return tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=SEED, **kwargs))


def ids(batch) -> list:
    return batch["input_ids"].tolist()


def round_trip(loader, fresh, path: Path) -> None:
    with warnings.catch_warnings():  # "torch.distributed ... uninitialized, assuming ... single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"loader": loader}, checkpoint_id=str(path))
        dcp.load({"loader": fresh}, checkpoint_id=str(path))


def test_the_loader_is_a_dcp_stateful(cache):
    assert isinstance(make_loader(cache), Stateful)


def test_one_process_round_trip_is_exact(cache, tmp_path):
    loader = make_loader(cache)
    it = iter(loader)
    for _ in range(SAVE_AT):
        next(it)
    state = loader.state_dict()
    fresh = make_loader(cache)
    round_trip(loader, fresh, tmp_path / "ckpt")
    loaded = fresh.state_dict()
    assert json.dumps(loaded) == json.dumps(state)  # the same values, types and key order
    assert fresh.consumed == loader.consumed == SAVE_AT * BATCH
    assert [ids(b) for b in fresh] == [ids(b) for b in it]  # the rest of the epoch, exactly


def test_round_trip_of_a_loader_over_a_sampler_of_your_own(tmp_path):
    """The counted state (batches received, the random state of the pass as base64)."""
    def make():
        g = torch.Generator().manual_seed(3)
        return tc.DataLoader(list(range(40)), batch_size=4, shuffle=True, generator=g)
    loader = make()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    fresh = make()
    round_trip(loader, fresh, tmp_path / "ckpt")
    assert json.dumps(fresh.state_dict()) == json.dumps(state)
    assert [b.tolist() for b in fresh] == [b.tolist() for b in it]


def test_round_trip_of_a_mixture_loader(tmp_path):
    """DCP loads into the keys of a fresh loader's state_dict(): a mixture's saved schedule (its
    sources, which depend on the position) is a list there, so nothing is dropped."""
    def make():
        a = [torch.tensor([i]) for i in range(10)]
        b = [torch.tensor([100 + i]) for i in range(10)]
        mix = tc.MixtureDataset({"a": a, "b": b}, schedule=[(0, {"a": 1}), (8, {"a": 1, "b": 1})],
                                block_size=2, seed=0)
        return tc.DataLoader(mix, batch_size=2)
    loader = make()
    it = iter(loader)
    for _ in range(6):
        next(it)
    fresh = make()
    round_trip(loader, fresh, tmp_path / "ckpt")
    assert [b.tolist() for b in fresh] == [b.tolist() for b in it]


SCRIPT = textwrap.dedent(f"""\
    import json
    import os
    import sys
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import torchcache as tc

    warnings.simplefilter("ignore", UserWarning)
    cache, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    ds = tc.TokenDataset(cache, seq_len={SEQ})
    loader = tc.DataLoader(ds, batch_size={BATCH}, sampler=tc.DistributedSampler(ds, seed={SEED}))
    rows = []
    if phase == "save":
        it = iter(loader)
        for _ in range({SAVE_AT}):
            rows.append(next(it)["input_ids"].tolist())
        dcp.save({{"loader": loader}}, checkpoint_id=os.path.join(out, "ckpt"))
        rows += [b["input_ids"].tolist() for b in it]  # what the run would have read after it
    else:
        dcp.load({{"loader": loader}}, checkpoint_id=os.path.join(out, "ckpt"))
        rows = [b["input_ids"].tolist() for b in loader]
    with open(os.path.join(out, f"{{phase}}-rank{{rank}}.json"), "w") as f:
        json.dump({{"rows": rows, "consumed": loader.consumed}}, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as in test_accelerate: gloo may abort in the interpreter's teardown
""")


def run_script(tmp_path: Path, cache: str, phase: str, world_size: int) -> list[dict]:
    script = tmp_path / "dcp_script.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(tmp_path), phase]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return [json.loads((tmp_path / f"{phase}-rank{r}.json").read_text()) for r in range(world_size)]


def stream_from(cache: str, start: int, world_size: int, rank: int) -> list:
    """The rest of the loader epoch from global position ``start``, for ``rank`` of ``world_size``."""
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    sampler = tc.DistributedSampler(ds, world_size, rank, seed=SEED)
    loader = tc.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    sampler.set_position(start)  # moved after the loader is made: its next iter() starts there
    return [ids(b) for b in loader]


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_torchrun_two_processes_round_trip_and_load_on_one(tmp_path, cache):
    saved = run_script(tmp_path, cache, "save", world_size=2)
    loaded = run_script(tmp_path, cache, "load", world_size=2)
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        assert l["rows"] == s["rows"][SAVE_AT:], f"rank {rank}"
        assert l["consumed"] == s["consumed"]
    # no sample lost or doubled: the two ranks' epoch is the whole dataset
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    seen = [tuple(row) for s in saved for batch in s["rows"] for row in batch]
    assert set(seen) == {tuple(row) for row in ds.get_batch(range(len(ds)))["input_ids"].tolist()}
    # the checkpoint of 2 ranks loaded by 1 process: the stream continues where they stopped
    [one] = run_script(tmp_path, cache, "load", world_size=1)
    assert one["rows"] == stream_from(cache, SAVE_AT * BATCH * 2, 1, 0)


@pytest.mark.slow
def test_one_process_script_round_trip(tmp_path, cache):
    [saved] = run_script(tmp_path, cache, "save", world_size=1)
    [loaded] = run_script(tmp_path, cache, "load", world_size=1)
    assert loaded["rows"] == saved["rows"][SAVE_AT:]
