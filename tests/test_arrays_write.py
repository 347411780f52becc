"""A block's arrays sidecar is written from the documents' own arrays, with no concatenated copy
of a field's values (storing arrays costs the write, the checksum and the fsync, not another copy
of the data), and its checksum, computed while the file is written, is the file's sha256."""

from __future__ import annotations

import hashlib
import os
import tracemalloc

import numpy as np

from torchcache.format.arrays import read_arrays_file, write_arrays_file
from torchcache.format.storage import LocalStorage


def test_the_sidecar_is_written_without_a_copy_of_the_values(tmp_path):
    rng = np.random.default_rng(0)
    features = [rng.standard_normal((int(n), 80), dtype=np.float32) for n in rng.integers(0, 2000, 24)]
    flags = [rng.integers(0, 2, int(n)).astype(bool) for n in rng.integers(0, 50, 24)]
    big_endian = [rng.standard_normal(7).astype(">f8") for _ in range(24)]
    data_bytes = sum(a.nbytes for a in features)
    assert data_bytes > 6_000_000
    storage = LocalStorage(str(tmp_path))
    tracemalloc.start()
    try:
        written = write_arrays_file(storage, "blocks/000000-000000.arrays.safetensors",
                                    {"feat": features, "flag": flags, "be": big_endian})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < data_bytes / 10, f"writing {data_bytes:,} B of arrays allocated {peak:,} B"
    path = os.path.join(tmp_path, written.path)
    raw = open(path, "rb").read()
    assert written.checksum == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert written.size == len(raw)
    fd = os.open(path, os.O_RDONLY)
    try:
        back = read_arrays_file(fd, path, 24, ["be", "feat", "flag"])
    finally:
        os.close(fd)
    for d in range(24):
        got = back.document(d)
        assert got["feat"].tobytes() == features[d].tobytes() and got["feat"].shape == features[d].shape
        assert got["flag"].dtype == bool and got["flag"].tolist() == flags[d].tolist()
        assert got["be"].dtype == np.dtype("<f8") and got["be"].tolist() == big_endian[d].tolist()
