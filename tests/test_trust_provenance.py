"""Provenance that can be trusted: every document of a text cache names the record it came from
(also with blank, skipped and empty records between), without a number per document and without
changing the bytes of a cache whose records all became documents; webdataset caches name the
sample's key and index; stored record numbers past their input, and damaged kept fields, are
reported naming the file.

Oracles: the input files themselves (the line a record number names must hold the document's
text), and the tar's own member order.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import build_killed_at_commit, paragraphs, tree_bytes

import torchcache as tc
from torchcache.errors import CacheFormatError
from torchcache.format import blocks as fmt
from torchcache.format.ledger import RECORD, index_chunk_name
from torchcache.format.storage import open_storage


def gappy_lines(texts: list[str], seed: int) -> list[str]:
    """JSON lines of `texts` with blank lines, malformed JSON, empty texts and records without
    text between them (each a record that gives no document), at the start and the end too."""
    rng = np.random.default_rng(seed)
    junk = ["", "   ", "{not json", json.dumps({"text": ""}), json.dumps({"id": 3})]
    out = [junk[0], junk[2]]
    for t in texts:
        out.append(json.dumps({"text": t}))
        if rng.random() < 0.15:
            out += [junk[int(k)] for k in rng.integers(0, len(junk), int(rng.integers(1, 4)))]
    return out + ["", junk[3], ""]


def oracle_text(path: str, record: int) -> str:
    """The text of 0-based record `record` of JSON lines file `path`, read from the file."""
    line = Path(path).read_text().split("\n")[record]
    return json.loads(line)["text"]


def check_every_record(cache: tc.TokenCache) -> int:
    """Every document's record holds its text (the EOS aside); returns how many were checked."""
    eos = cache.decode([cache.eos_id])
    for d in range(cache.num_documents):
        info = cache.document_info(d)
        assert info["record"] is not None, info
        text = cache.decode(cache.document(d))
        assert text.endswith(eos)
        assert oracle_text(info["input"], info["record"]) == text[: -len(eos)], (d, info)
    return cache.num_documents


@pytest.fixture(scope="module")
def gappy(tmp_path_factory, books, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("gappy")
    texts = paragraphs(books, 500)
    inputs = []
    for k in range(3):
        path = d / f"part-{k}.jsonl"
        path.write_text("\n".join(gappy_lines(texts[k::3], seed=k)) + "\n")
        inputs.append(str(path))
    return d, inputs


def test_text_cache_records_name_the_input_lines(gappy, gpt2_tokenizer_path, tmp_path):
    _, inputs = gappy
    built = tc.build_cache(inputs, tmp_path / "c", gpt2_tokenizer_path, block_tokens=3000,
                           on_error="skip", num_workers=2, progress=False)
    assert built.skipped["malformed_json"] > 0 and built.skipped["empty"] > 0
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.num_blocks > 10
    assert check_every_record(cache) == cache.num_documents > 400
    assert tc.verify_cache(tmp_path / "c") == []


def test_trace_prints_file_and_line_of_a_text_cache(gappy, gpt2_tokenizer_path, tmp_path):
    _, inputs = gappy
    tc.build_cache(inputs[:1], tmp_path / "c", gpt2_tokenizer_path, block_tokens=2000,
                   on_error="skip", progress=False)
    done = subprocess.run([sys.executable, "-m", "torchcache", "trace", str(tmp_path / "c"),
                           "--step", "3", "--seq-len", "64", "--batch-size", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    named = re.findall(rf"{re.escape(inputs[0])}:(\d+)", done.stdout)
    assert len(named) >= 4, done.stdout
    lines = Path(inputs[0]).read_text().split("\n")
    for line in map(int, named):  # 1-based, as error messages: a record with text
        assert json.loads(lines[line - 1])["text"]


def test_a_cache_without_gaps_keeps_its_bytes_and_derives_records(tmp_path, books, gpt2_tokenizer_path):
    src = tmp_path / "d.jsonl"
    texts = paragraphs(books, 300)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tc.build_cache([str(src)], tmp_path / "c", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    head = json.loads((tmp_path / "c" / "head.json").read_text())
    assert "record_runs" not in head  # nothing new written: the same bytes as before
    for offsets in (tmp_path / "c" / "blocks").glob("*.offsets.safetensors"):
        header = json.loads(offsets.read_bytes()[8:8 + int.from_bytes(offsets.read_bytes()[:8], "little")])
        assert set(header) == {"__metadata__", "offsets"}
    cache = tc.TokenCache(tmp_path / "c")
    assert [cache.document_info(d)["record"] for d in range(cache.num_documents)] == list(range(len(texts)))
    check_every_record(cache)


def test_an_interrupted_build_resumes_to_the_same_records(gappy, gpt2_tokenizer_path, tmp_path):
    _, inputs = gappy
    whole = tmp_path / "whole"
    tc.build_cache(inputs, whole, gpt2_tokenizer_path, block_tokens=2000, on_error="skip",
                   num_workers=1, progress=False)
    # the child builds with on_error="raise": give it inputs with only blank lines as gaps
    blanks = []
    for k, path in enumerate(inputs):
        kept = [ln for ln in Path(path).read_text().split("\n")
                if not ln.strip() or json.loads(ln if ln.startswith("{\"text") else "{}").get("text")]
        blanks.append(str(tmp_path / f"blank-{k}.jsonl"))
        Path(blanks[-1]).write_text("\n".join(kept) + "\n")
    killed = tmp_path / "killed"
    assert build_killed_at_commit(blanks, killed, gpt2_tokenizer_path, commits=4) == -9
    tc.build_cache(blanks, killed, gpt2_tokenizer_path, block_tokens=2000, num_workers=1, progress=False)
    fresh = tmp_path / "fresh"
    tc.build_cache(blanks, fresh, gpt2_tokenizer_path, block_tokens=2000, num_workers=2, progress=False)
    assert tree_bytes(str(killed)) == tree_bytes(str(fresh))
    check_every_record(tc.TokenCache(killed))
    check_every_record(tc.TokenCache(whole))


def test_a_cache_made_before_runs_were_kept_says_it_does_not_know(gappy, gpt2_tokenizer_path, tmp_path):
    """Without the head's word that runs are kept, a gap-holding input's blocks without runs
    (those before its first gap) give None, never a guessed number; blocks with runs still know."""
    _, inputs = gappy
    tc.build_cache(inputs[:1], tmp_path / "c", gpt2_tokenizer_path, block_tokens=2000,
                   on_error="skip", progress=False)
    head_path = tmp_path / "c" / "head.json"
    head = json.loads(head_path.read_text())
    assert head.pop("record_runs") is True
    head_path.write_text(json.dumps(head))
    cache = tc.TokenCache(tmp_path / "c")
    records = [cache.document_info(d)["record"] for d in range(cache.num_documents)]
    assert all(r is not None for r in records)  # the input starts with a blank line: runs everywhere
    lines = Path(inputs[0]).read_text().split("\n")
    first_text = next(k for k, ln in enumerate(lines) if ln.startswith('{"text": "') and len(ln) > 12)
    assert records[0] == first_text


def test_a_late_gap_leaves_earlier_blocks_derived(tmp_path, books, gpt2_tokenizer_path):
    texts = paragraphs(books, 200)
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:150]) + "\n\n"
                   + "".join(json.dumps({"text": t}) + "\n" for t in texts[150:]))
    tc.build_cache([str(src)], tmp_path / "c", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    check_every_record(cache)
    expected = list(range(150)) + list(range(152, 202))
    assert [cache.document_info(d)["record"] for d in range(cache.num_documents)] == expected
    with_runs = [p for p in (tmp_path / "c" / "blocks").glob("*.offsets.safetensors")
                 if b"record_runs" in p.read_bytes()[:4096]]
    assert 0 < len(with_runs) < cache.num_blocks
    # a reader that cannot tell (no word in the head) reports None for the blocks before the gap
    head_path = tmp_path / "c" / "head.json"
    head = json.loads(head_path.read_text())
    head.pop("record_runs")
    head_path.write_text(json.dumps(head))
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.document_info(0)["record"] is None
    assert cache.document_info(cache.num_documents - 1)["record"] == 201


def write_tar(path: Path, samples: list[tuple[str, str]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, text in samples:
            data = text.encode()
            member = tarfile.TarInfo(f"{key}.txt")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_webdataset_documents_name_key_and_sample_index(tmp_path, books, gpt2_tokenizer_path):
    texts = paragraphs(books, 60)
    samples = [(f"s{k:03d}", "" if k % 9 == 4 else texts[k]) for k in range(60)]  # empty: skipped
    write_tar(tmp_path / "a.tar", samples)
    tc.convert_webdataset(str(tmp_path / "a.tar"), tmp_path / "c", tokenizer=gpt2_tokenizer_path,
                          text_key="txt", progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    kept = [k for k, (_, text) in enumerate(samples) if text]
    assert cache.num_documents == len(kept)
    for d, k in enumerate(kept):
        info = cache.document_info(d)
        assert (info["key"], info["record"]) == (samples[k][0], k)
    # tars as build inputs, too
    tc.build_cache([str(tmp_path / "a.tar")], tmp_path / "b", gpt2_tokenizer_path, text_key="txt",
                   progress=False)
    built = tc.TokenCache(tmp_path / "b")
    assert [(built.document_info(d)["key"], built.document_info(d)["record"])
            for d in range(built.num_documents)] == [(samples[k][0], k) for k in kept]


# ---------------------------------------------------------------- damage a checksum cannot see

def rewrite_block_file(cache: Path, rel: str, tensors: dict[str, np.ndarray], metadata: dict,
                       slot: str) -> None:
    """Replace a block's file with other content and commit its checksum in the index, as a
    buggy or hostile writer would: verify's checksums pass, only the content checks can tell."""
    written = fmt.write_tensors_file(open_storage(str(cache)), rel, tensors, metadata)
    index = cache / index_chunk_name(0)
    records = np.frombuffer(bytearray(index.read_bytes()), dtype=RECORD)
    name = Path(rel).name.split(".")[0]
    i, k = (int(x) for x in name.split("-"))
    row = int(np.flatnonzero((records["input"] == i) & (records["index"] == k))[0])
    records[row][slot] = np.frombuffer(bytes.fromhex(written.checksum.split(":")[1]), np.uint8)
    index.write_bytes(records.tobytes())


def read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a: 8 + n + b], dtype=fmt.DTYPES[entry["dtype"]]).copy()
    return out, header["__metadata__"]


@pytest.fixture()
def v3(tmp_path, books, gpt2_tokenizer_path):
    src = tmp_path / "d.jsonl"
    texts = paragraphs(books, 40)
    src.write_text("".join(json.dumps({"text": t, "id": f"doc-{k}"}) + "\n" for k, t in enumerate(texts)))
    tc.build_cache([str(src)], tmp_path / "c", gpt2_tokenizer_path, keep_fields=("id",), progress=False)
    return tmp_path / "c"


def test_a_documents_sidecar_record_past_its_input_is_reported(v3, tmp_path):
    side = next((v3 / "blocks").glob("*.docs.safetensors"))
    tensors, meta = read_tensors(side)
    tensors["records"][-1] = 40  # the input has 40 records: 0..39
    rewrite_block_file(v3, f"blocks/{side.name}", tensors, meta, "keys_checksum")
    problems = tc.verify_cache(v3)
    assert len(problems) == 1 and "record number 40 is past the 40 records" in problems[0], problems
    assert side.name in problems[0]
    cache = tc.TokenCache(v3)
    assert cache.document_info(0)["record"] == 0
    with pytest.raises(CacheFormatError, match=rf"{side.name}: a document's record number 40 is past"):
        cache.document_info(cache.num_documents - 1)
    loader = tc.DataLoader(tc.DocumentDataset(cache), batch_size=cache.num_documents)
    with pytest.raises(CacheFormatError, match="past the 40 records"):
        tc.trace_step(loader, 0)  # one step: every document


def test_text_record_runs_past_the_input_are_reported(tmp_path, books, gpt2_tokenizer_path):
    src = tmp_path / "d.jsonl"
    src.write_text("\n" + "".join(json.dumps({"text": t}) + "\n" for t in paragraphs(books, 30)))
    tc.build_cache([str(src)], tmp_path / "c", gpt2_tokenizer_path, progress=False)
    side = tmp_path / "c" / "blocks" / "000000-000000.offsets.safetensors"
    tensors, meta = read_tensors(side)
    assert tensors["record_runs"].tolist() == [1, 30]
    tensors["record_runs"] = np.array([1, 29, 40, 1], dtype=np.int64)
    rewrite_block_file(tmp_path / "c", "blocks/000000-000000.offsets.safetensors", tensors, meta,
                       "offsets_checksum")
    problems = tc.verify_cache(tmp_path / "c")
    assert len(problems) == 1 and "record number 40 is past the 31 records" in problems[0], problems
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.document_info(28)["record"] == 29
    with pytest.raises(CacheFormatError, match="offsets.safetensors: a document's record number 40"):
        cache.document_info(29)


@pytest.mark.parametrize("damage", [b"\xff\xfe", b'{"id": ', b"[1, 2]"])
def test_damaged_kept_fields_are_a_format_error_naming_the_file(v3, damage):
    side = next((v3 / "blocks").glob("*.docs.safetensors"))
    tensors, meta = read_tensors(side)
    fields, offsets = tensors["fields"].tobytes(), tensors["field_offsets"]
    a, b = int(offsets[1]), int(offsets[2])
    new = fields[:a] + damage + fields[b:]
    tensors["fields"] = np.frombuffer(new, np.uint8)
    tensors["field_offsets"] = np.concatenate([offsets[:2], offsets[2:] + len(damage) - (b - a)])
    rewrite_block_file(v3, f"blocks/{side.name}", tensors, meta, "keys_checksum")
    cache = tc.TokenCache(v3)
    assert cache.document_info(0)["fields"] == {"id": "doc-0"}
    with pytest.raises(CacheFormatError, match=rf"{side.name}: the kept fields of document 1"):
        cache.document_info(1)
    problems = tc.verify_cache(v3)
    assert len(problems) == 1 and "the kept fields of document 1" in problems[0], problems


# ---------------------------------------------------------------- loader states that disagree

def saved_state(n: int = 100, batch: int = 4, world: int = 2, batches: int = 3, **sampler) -> dict:
    """The state of rank 0 of `world` after `batches` batches (a real loader's)."""
    ds = list(range(n))
    loader = tc.DataLoader(ds, batch_size=batch,
                           sampler=tc.DistributedSampler(ds, world, 0, seed=5, **sampler))
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(loader.state_dict()))


def fresh_loader(n: int = 100, batch: int = 4, world: int = 2, **sampler) -> tc.DataLoader:
    ds = list(range(n))
    return tc.DataLoader(ds, batch_size=batch, sampler=tc.DistributedSampler(ds, world, 0, seed=5, **sampler))


@pytest.mark.parametrize("edit, match", [
    (dict(batch_size=8), r"state\['steps'\] reads step 3 \(position 24\) with world_size 2 and "
                         r"batch_size 4, but state\['world_size'\] is 2 and state\['batch_size'\] 8"),
    (dict(world_size=4), r"state\['world_size'\] is 4"),
    (dict(consumed=26), r"state\['consumed'\] is 26, inside global step 3 .* of state\['steps'\]"),
    (dict(steps=[[0, 0, 2, 4, 102, False]]), r"state\['steps'\]\[0\] has loader epochs of 102 "
                                             r"positions, but state\['num_samples'\] 100"),
])
def test_a_state_whose_steps_disagree_with_its_fields_is_refused(edit, match):
    state = saved_state()
    assert (state["consumed"], state["steps"]) == (24, [[0, 0, 2, 4, 100, False]])
    loader = fresh_loader()
    before = [int(x) for x in loader.step_samples(7)]
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(dict(state, **edit))
    assert loader.consumed == 0 and [int(x) for x in loader.step_samples(7)] == before  # unchanged


def test_states_that_agree_still_load_at_any_batching():
    """Real states load: after a change of batch size and world size, at a short last batch of a
    loader epoch, with drop_last, and an endless sampler's."""
    state = saved_state(batches=3)
    again = fresh_loader(batch=5, world=1)
    again.load_state_dict(state)
    it = iter(again)
    next(it), next(it)
    state = json.loads(json.dumps(again.state_dict()))
    assert state["consumed"] == 34 and len(state["steps"]) == 2
    fresh_loader(batch=3, world=4).load_state_dict(state)
    end_of_epoch = saved_state(n=10, batch=4, world=1, batches=3)  # 4 + 4 + 2
    assert end_of_epoch["consumed"] == 10
    fresh_loader(n=10, batch=4, world=1).load_state_dict(end_of_epoch)
    dropped = saved_state(n=10, batch=4, world=1, batches=2, drop_last=True)
    fresh_loader(n=10, batch=4, world=1, drop_last=True).load_state_dict(dropped)
    endless = saved_state(n=10, batch=4, world=2, batches=5, infinite=True)
    assert endless["consumed"] == 40
    fresh_loader(n=10, batch=4, world=2, infinite=True).load_state_dict(endless)


def test_repair_rebuilds_record_runs_and_restores_the_heads_word(gappy, gpt2_tokenizer_path, tmp_path):
    _, inputs = gappy
    out = tmp_path / "c"
    tc.build_cache(inputs[:2], out, gpt2_tokenizer_path, block_tokens=2000, on_error="skip",
                   progress=False)
    before = tree_bytes(str(out))
    with_runs = sorted(p for p in (out / "blocks").glob("*.offsets.safetensors")
                       if b"record_runs" in p.read_bytes()[:4096])
    assert with_runs
    with_runs[0].unlink()
    (out / "head.json").unlink()
    result = tc.repair_cache(out)
    assert set(result.repaired) == {"head.json", f"blocks/{with_runs[0].name}"}
    assert tree_bytes(str(out)) == before  # the head's "record_runs" too
    check_every_record(tc.TokenCache(out))


def test_a_build_an_older_builder_started_goes_on_without_runs(tmp_path, books, gpt2_tokenizer_path):
    """Resuming a cache whose head and log do not say that runs are kept (an older builder's)
    makes the rest of its blocks as that builder did, without runs; its records with gaps are
    then unknown (None), never guessed."""
    texts = paragraphs(books, 300)
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:240]) + "\n"
                   + "".join(json.dumps({"text": t}) + "\n\n" for t in texts[240:]))
    out = tmp_path / "c"
    assert build_killed_at_commit([str(src)], out, gpt2_tokenizer_path, commits=3) == -9
    assert not [p for p in (out / "blocks").glob("*.offsets.safetensors")
                if b"record_runs" in p.read_bytes()[:4096]]  # killed before the gaps
    head = json.loads((out / "head.json").read_text())
    head.pop("record_runs")
    (out / "head.json").write_text(json.dumps(head))
    for chunk in (out / "log").glob("*.jsonl"):
        records = [json.loads(line) for line in chunk.read_text().splitlines()]
        for r in records:
            r.get("progress", {}).pop("documents", None)
        chunk.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tc.build_cache([str(src)], out, gpt2_tokenizer_path, block_tokens=2000, progress=False)
    assert not [p for p in (out / "blocks").glob("*.offsets.safetensors")
                if b"record_runs" in p.read_bytes()[:4096]]
    assert "record_runs" not in json.loads((out / "head.json").read_text())
    cache = tc.TokenCache(out)
    assert cache.complete and cache.num_documents == 300
    assert {cache.document_info(d)["record"] for d in range(cache.num_documents)} == {None}
    assert tc.verify_cache(out) == []
