"""Parquet rows read whole (issue 32): each row is a dict of column -> Python value, as pyarrow's
`to_pylist` makes it (list columns are lists), for `arrays=`, `keep_fields`, the record formats
and `tc.source(...)` pipelines; list columns (rank 1, nested, fixed-size, with empty rows) come
back bit-identical through `document_arrays`; a null in an array field is an error naming
`file:row` (or a counted skip); document_info gives the row; kill -9 resumes at the exact row."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchcache as tc
from conftest import killed_build_resumes_to_the_same_bytes, paragraphs


def speech_like(rows: int, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Per row: a rank-2 float32 array of any shape, a [n, 4] float32 array and int32 ids,
    some of them empty."""
    rng = np.random.default_rng(seed)
    return {"feats": [rng.standard_normal((int(rng.integers(1, 7)), int(rng.integers(1, 4))))
                      .astype(np.float32) for _ in range(rows)],
            "boxes": [rng.uniform(-1e6, 1e6, (int(rng.integers(0, 3)), 4)).astype(np.float32)
                      for _ in range(rows)],
            "ids": [rng.integers(-2**31, 2**31, int(rng.integers(0, 5)), dtype=np.int64).astype(np.int32)
                    for _ in range(rows)]}


def write_arrays(path, texts: list[str], arrays: dict[str, list[np.ndarray]],
                 row_group_size: int = 7) -> str:
    table = pa.table({
        "text": texts,
        "feats": pa.array([a.tolist() for a in arrays["feats"]], pa.list_(pa.list_(pa.float32()))),
        "boxes": pa.array([a.tolist() for a in arrays["boxes"]],
                          pa.large_list(pa.list_(pa.float32(), 4))),
        "ids": pa.array([a.tolist() for a in arrays["ids"]], pa.list_(pa.int32())),
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


DECLARED = {"feats": "float32[*, *]", "boxes": "float32[*, 4]", "ids": "int32"}


def test_list_columns_come_back_bit_identical(tmp_path, books, gpt2, gpt2_tokenizer_path):
    texts = paragraphs(books, 40)
    arrays = speech_like(len(texts))
    assert any(not len(a) for a in arrays["ids"]) and any(not len(a) for a in arrays["boxes"])
    path = write_arrays(tmp_path / "part-0.parquet", texts, arrays)
    result = tc.build_cache(path, tmp_path / "c", gpt2_tokenizer_path, arrays=DECLARED,
                            block_tokens=400, progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert result.num_documents == len(texts) and cache.num_blocks > 1 and result.skipped == {}
    eos = gpt2.token_to_id("<|endoftext|>")
    for d, text in enumerate(texts):
        assert cache.document(d).tolist() == gpt2.encode(text).ids + [eos]
        got = cache.document_arrays(d)
        for name, values in arrays.items():
            assert got[name].dtype == values[d].dtype and got[name].shape == values[d].shape, (d, name)
            assert got[name].tobytes() == values[d].tobytes(), (d, name)
        info = cache.document_info(d)
        assert (info["input"], info["record"]) == (path, d)


def described(record):
    """The record as text (JSON), and its feats as an array."""
    return {"text": json.dumps(record, sort_keys=True), "feats": np.asarray(record["feats"], np.float32)}


def test_a_pipeline_hands_each_row_as_pyarrow_makes_it(tmp_path, books, gpt2_tokenizer_path):
    texts = paragraphs(books, 30)
    arrays = speech_like(len(texts), seed=1)
    path = write_arrays(tmp_path / "rows.parquet", texts, arrays)
    cache = (tc.source(path).map(described)
             .tokenize(gpt2_tokenizer_path, eos=None, arrays=("feats",), progress=False)
             .cache(tmp_path / "c"))
    expected = pq.read_table(path).to_pylist()  # pyarrow's own rows
    assert cache.num_documents == len(expected)
    for d, row in enumerate(expected):
        assert json.loads(cache.decode(cache.document(d))) == row
        assert cache.decode(cache.document(d)) == json.dumps(row, sort_keys=True)
        assert cache.document_arrays(d)["feats"].tobytes() == arrays["feats"][d].tobytes()
        assert cache.document_info(d)["record"] == d
    kept = [i for i, row in enumerate(expected) if len(row["ids"]) % 2 == 0]
    assert 0 < len(kept) < len(expected)
    text = (tc.source(path).filter(even_ids).tokenize(gpt2_tokenizer_path, progress=False)
            .cache(tmp_path / "text"))  # a text cache (format v2): rows named by its record runs
    assert text.skipped == {"filtered": len(expected) - len(kept)}
    assert [text.document_info(d)["record"] for d in range(text.num_documents)] == kept
    assert [text.decode(text.document(d)[:-1]) for d in range(text.num_documents)] == \
        [texts[i] for i in kept]


def even_ids(record):
    return len(record["ids"]) % 2 == 0


def test_token_and_mask_list_columns_build_a_tokens_cache(tmp_path):
    rng = np.random.default_rng(2)
    ids = [rng.integers(0, 1000, int(rng.integers(1, 30))) for _ in range(50)]
    masks = [rng.integers(0, 2, len(x)) for x in ids]
    table = pa.table({"id": [f"r{i}" for i in range(50)],
                      "input_ids": pa.array([x.tolist() for x in ids], pa.list_(pa.int32())),
                      "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.int8()))})
    path = str(tmp_path / "tokens.parquet")
    pq.write_table(table, path, row_group_size=8)
    cache_path = tmp_path / "c"
    tc.build_cache(path, cache_path, None, input_format="tokens", vocab_size=1000, eos=None,
                   keep_fields=("id",), block_tokens=200, progress=False)
    cache = tc.TokenCache(cache_path)
    assert cache.num_documents == 50 and cache.num_blocks > 1
    for d in range(50):
        assert cache.document(d).tolist() == ids[d].tolist()
        assert cache.document_loss_mask(d).tolist() == (masks[d] == 1).tolist()
        assert cache.document_info(d) == {"document": d, "input": path, "record": d,
                                          "fields": {"id": f"r{d}"}}


def test_a_null_in_an_array_field_names_file_and_row(tmp_path, gpt2_tokenizer_path):
    values = [[float(i), float(i) / 2] for i in range(10)]
    values[3] = [3.0, None]  # a null value in the list
    values[6] = None         # a null list
    path = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(10)],
                             "x": pa.array(values, pa.list_(pa.float64()))}), path, row_group_size=4)
    with pytest.raises(tc.InputError, match=re.escape(path) + r":4: array field 'x'.*on_error='skip'"):
        tc.build_cache(path, tmp_path / "raise", gpt2_tokenizer_path, arrays=("x",), progress=False)
    cache = tc.TokenCache(tc.build_cache(path, tmp_path / "skip", gpt2_tokenizer_path, arrays=("x",),
                                         on_error="skip", progress=False).path)
    assert cache.skipped == {"bad_array": 2}
    kept = [i for i in range(10) if i not in (3, 6)]
    assert [cache.document_info(d)["record"] for d in range(cache.num_documents)] == kept
    for d, i in enumerate(kept):
        assert cache.document_arrays(d)["x"].tolist() == values[i]
    values[3] = [3.0, 1.5]
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(10)],
                             "x": pa.array(values, pa.list_(pa.float64()))}), path, row_group_size=4)
    with pytest.raises(tc.InputError, match=re.escape(path) + r":7: array field 'x': is a NoneType"):
        tc.build_cache(path, tmp_path / "null-list", gpt2_tokenizer_path, arrays=("x",),
                       progress=False)


def test_a_changed_array_value_is_a_changed_input(tmp_path, books, gpt2_tokenizer_path):
    """The input's digest covers every value of a list column (hashed from its Arrow buffers):
    one float changed, in a file of the same size, is found when the build is run again."""
    texts = paragraphs(books, 12)
    arrays = speech_like(len(texts), seed=3)
    path = tmp_path / "same-size.parquet"

    def write() -> None:
        table = pa.table({"text": texts, "feats": pa.array([a.tolist() for a in arrays["feats"]],
                                                           pa.list_(pa.list_(pa.float32())))})
        pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)

    write()
    build = dict(arrays=("feats",), progress=False)
    tc.build_cache(str(path), tmp_path / "c", gpt2_tokenizer_path, **build)
    size = path.stat().st_size
    arrays["feats"][5][0, 0] += 1
    write()
    assert path.stat().st_size == size
    with pytest.raises(tc.InputChangedError, match=re.escape(str(path))):
        tc.build_cache(str(path), tmp_path / "c", gpt2_tokenizer_path, **build)


KILLED_SCRIPT = (
    "import numpy as np\n"
    "import torchcache as tc\n"
    "def shaped(r):\n"
    "    return {**r, 'feats': np.asarray(r['feats'], np.float32)}\n"
    "tc.source(json.loads(sys.argv[1])).map(shaped).tokenize(sys.argv[2], \\\n"
    "    arrays={'feats': 'float32[*, *]', 'ids': 'int32'}, \\\n"
    "    keep_fields=('text',), block_tokens=1500, num_workers=2, progress=False).cache(sys.argv[3])\n")


@pytest.mark.slow
def test_a_parquet_build_killed_mid_build_resumes_at_the_same_row(tmp_path, books, gpt2_tokenizer_path):
    docs = paragraphs(books, 240)
    arrays = [speech_like(120, seed=k) for k in range(2)]
    paths = [write_arrays(tmp_path / f"part-{k}.parquet", docs[k::2], arrays[k], row_group_size=16)
             for k in range(2)]

    whole = killed_build_resumes_to_the_same_bytes(KILLED_SCRIPT, json.dumps(paths),
                                                   gpt2_tokenizer_path, root=tmp_path)
    cache = tc.TokenCache(whole)
    assert cache.num_blocks > 3 and cache.num_documents == 240
    for d in range(cache.num_documents):
        info = cache.document_info(d)
        k, row = paths.index(info["input"]), info["record"]
        assert info["fields"] == {"text": docs[k::2][row]}
        got = cache.document_arrays(d)
        assert got["feats"].tobytes() == arrays[k]["feats"][row].tobytes()
        assert got["ids"].tobytes() == arrays[k]["ids"][row].tobytes()


def test_a_damaged_row_group_names_the_file_and_keeps_the_rows_before(tmp_path, gpt2_tokenizer_path):
    """Rows read whole meet damage as text rows do: an InputError naming the file and the row
    group, or (on_error="skip") the rows before it kept and the rest counted as unreadable."""
    values = [[float(i)] * (i % 5) for i in range(40)]
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(40)],
                             "x": pa.array(values, pa.list_(pa.float32()))}), path, row_group_size=10)
    column = pq.ParquetFile(path).metadata.row_group(2).column(1)
    offset = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + 8] = b"\xff" * 8
    open(path, "wb").write(bytes(raw))
    with pytest.raises(tc.InputError, match=re.escape(path) + r": cannot read row group 2 .*truncated "
                                            r"or corrupted"):
        tc.build_cache(path, tmp_path / "raise", gpt2_tokenizer_path, arrays=("x",), progress=False)
    cache = tc.TokenCache(tc.build_cache(path, tmp_path / "skip", gpt2_tokenizer_path, arrays=("x",),
                                         on_error="skip", progress=False).path)
    assert cache.skipped == {"unreadable": 1} and cache.num_documents == 20
    assert [cache.document_arrays(d)["x"].tolist() for d in range(20)] == values[:20]
