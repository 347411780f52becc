"""Tests for torchcache.order.permutation: bijection, large domains, shuffling quality, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.order.permutation import (
    PERMUTATION_ALGORITHM,
    Permutation,
    derive_key,
    permute,
)

KEY = derive_key(0, "sample", 0)
keys = st.integers(0, 2**64 - 1)


def assert_bijection(n: int, key: int, rounds: int = 8) -> None:
    p = Permutation(n, key, rounds)
    idx = np.arange(n)
    out = p(idx)
    assert out.dtype == np.int64 and out.shape == (n,)
    assert np.array_equal(np.sort(out), idx), f"not a bijection for n={n}"
    assert np.array_equal(p.inverse(out), idx)


SMALL_NS = sorted({1, 2, 3} | {m for k in range(1, 17) for m in (2**k - 1, 2**k, 2**k + 1)})


@pytest.mark.parametrize("n", SMALL_NS)
def test_bijection_enumerated(n):
    assert_bijection(n, KEY)


@pytest.mark.parametrize("rounds", [6, 7, 9])
@pytest.mark.parametrize("n", [1, 2, 5, 1000, 4097])
def test_bijection_other_round_counts(n, rounds):
    assert_bijection(n, KEY ^ 0xDEADBEEF, rounds)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 100_000), key=keys)
def test_bijection_random_n_and_key(n, key):
    assert_bijection(n, key)


@pytest.mark.parametrize("n", [2**32 + 1, 2**40 + 3, 2**62 - 5, 2**63 - 1, 2**63])
def test_large_domains(n):
    rng = np.random.default_rng(n % 1000)
    idx = np.unique(rng.integers(0, n, size=3000, dtype=np.uint64))
    idx = np.concatenate([idx[idx != n - 1], np.array([n - 1], dtype=np.uint64)])
    p = Permutation(n, KEY)
    out = p(idx)
    assert out.dtype == np.int64
    assert out.min() >= 0 and int(out.max()) < n
    assert len(np.unique(out)) == len(idx)
    assert np.array_equal(p.inverse(out).astype(np.uint64), idx)
    assert p.inverse(p(n - 1)) == n - 1
    # Outputs should spread over the whole domain, not stay near the inputs.
    assert int(out.max()) > n // 2 and int(out.min()) < n // 2


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 2**63), key=keys)
def test_scalar_roundtrip_any_n(data, n, key):
    i = data.draw(st.integers(0, n - 1))
    p = Permutation(n, key)
    v = p(i)
    assert type(v) is int and 0 <= v < n
    assert p.inverse(v) == i
    assert p(np.array([i], dtype=np.uint64))[0] == v


def test_vectorised_equals_scalar():
    for n in (7, 1000, 2**40 + 3):
        p = Permutation(n, KEY)
        idx = np.random.default_rng(1).integers(0, n, size=200)
        out = p(idx)
        assert [p(int(i)) for i in idx] == out.tolist()
        assert [p.inverse(int(v)) for v in out] == idx.tolist()


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 2**63), key=keys)
def test_vectorised_equals_scalar_any_n_and_size(data, n, key):
    """Arrays of any size take the vectorised walk and finish its last walks on Python ints:
    every value equals the single-index one."""
    p = Permutation(n, key)
    idx = data.draw(st.lists(st.integers(0, n - 1), max_size=300))
    assert p(np.array(idx, dtype=np.uint64)).tolist() == [p(i) for i in idx]


def test_accepted_index_types_and_shapes():
    p = Permutation(1000, KEY)
    expected = p(np.arange(12)).reshape(3, 4)
    assert np.array_equal(p(np.arange(12).reshape(3, 4)), expected)
    for dtype in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64):
        assert np.array_equal(p(np.arange(12, dtype=dtype)).reshape(3, 4), expected)
    assert p(list(range(12))).tolist() == expected.ravel().tolist()
    assert p(np.int32(5)) == p(5) == expected.ravel()[5]
    assert p(np.uint64(5)) == p(5)
    assert p([]).shape == (0,) and p([]).dtype == np.int64


def test_determinism():
    a = Permutation(10_000, KEY)(np.arange(10_000))
    b = Permutation(10_000, derive_key(0, "sample", 0))(np.arange(10_000))
    assert np.array_equal(a, b)
    assert np.array_equal(permute(10_000, 0, "sample", 0, np.arange(10_000)), a)
    assert permute(10_000, 0, "sample", 0, 17) == a[17]


@pytest.mark.parametrize("n", [10, 11, 1000])
def test_different_keys_give_different_permutations(n):
    idx = np.arange(n)
    perms = {
        tuple(permute(n, seed, purpose, epoch, idx))
        for seed, purpose, epoch in [
            (0, "sample", 0), (0, "sample", 1), (0, "sample", 2), (1, "sample", 0),
            (2**70, "sample", 0), (0, "shard", 0), (0, "sample", 10**12),
        ]
    }
    assert len(perms) == 7


def test_derive_key():
    k = derive_key(0, "sample", 0)
    assert isinstance(k, int) and 0 <= k < 2**64
    assert derive_key(0, "sample", 0) == k
    triples = [
        (s, p, e) for s in (0, 1, 12, 2**64) for p in ("", "a", "ab", "1") for e in (0, 1, 2, 12)
    ]
    assert len({derive_key(*t) for t in triples}) == len(triples)
    # Length-prefixed encoding: no ambiguity when fields could be concatenated.
    assert derive_key(1, "2", 3) != derive_key(12, "", 3) != derive_key(1, "", 23)


def _quality_checks(perm: np.ndarray) -> None:
    n = len(perm)
    i = np.arange(n)
    diffs = np.diff(perm)
    assert len(np.unique(diffs)) > n // 4, "successive differences look structured"
    assert len(np.unique(diffs % n)) > n // 2, "looks affine mod n"
    assert np.bincount(diffs % n).max() < 16  # ~Poisson(1) cell counts; max is typically 6-9
    # perm is a permutation of i, so Pearson on the values is Spearman's rank correlation.
    assert abs(np.corrcoef(i, perm)[0, 1]) < 0.05
    assert np.sum(perm == i) < 10, "too many fixed points"


@pytest.mark.parametrize("n", [10_000, 2**14, 2**13 + 1])
def test_actually_shuffled(n):
    for epoch in range(3):
        _quality_checks(permute(n, 42, "sample", epoch, np.arange(n)))


def test_epochs_not_related_by_shift():
    n = 10_000
    p0 = Permutation(n, derive_key(7, "sample", 0))
    p1 = Permutation(n, derive_key(7, "sample", 1))
    i = np.arange(n)
    a, b = p0(i), p1(i)
    # Not an output shift: b != (a + c) mod n.
    assert len(np.unique((b - a) % n)) > n // 2
    # Not an input shift: b != a[(i + c) mod n], i.e. p0^-1(p1(i)) - i is not constant.
    assert len(np.unique((p0.inverse(b) - i) % n)) > n // 2
    # The composition p1 . p0^-1 itself looks random.
    _quality_checks(p1(p0.inverse(i)))


def test_errors():
    with pytest.raises(ValueError, match="n must be"):
        Permutation(0, 1)
    with pytest.raises(ValueError, match="n must be"):
        Permutation(-3, 1)
    with pytest.raises(ValueError, match="n must be"):
        Permutation(2**63 + 1, 1)
    with pytest.raises(ValueError, match="key"):
        Permutation(10, -1)
    with pytest.raises(ValueError, match="key"):
        Permutation(10, 2**64)
    with pytest.raises(ValueError, match="rounds"):
        Permutation(10, 1, rounds=4)
    p = Permutation(10, KEY)
    for bad in (-1, 10, 2**64, [0, 10], np.array([3, -1]), np.array([10], dtype=np.uint64)):
        with pytest.raises(IndexError, match="out of range for permutation of n=10"):
            p(bad)
        with pytest.raises(IndexError):
            p.inverse(bad)
    for bad in (1.5, np.array([1.0]), True, np.array([True])):
        with pytest.raises(TypeError):
            p(bad)
    with pytest.raises(ValueError, match="seed"):
        derive_key(-1, "sample", 0)
    with pytest.raises(ValueError, match="epoch"):
        derive_key(0, "sample", -1)
    with pytest.raises(ValueError, match="seed"):
        permute(10, -5, "sample", 0, 1)
    with pytest.raises(TypeError):
        derive_key(0, b"sample", 0)


def test_known_answers():
    """Pins outputs: if this fails the algorithm changed; bump PERMUTATION_ALGORITHM."""
    assert PERMUTATION_ALGORITHM == "feistel-fmix64-v1"
    assert KEY == 0x35D548C9BE7CDAAE
    assert Permutation(1000, KEY)(np.arange(8)).tolist() == [969, 194, 328, 647, 532, 301, 453, 86]
    big = Permutation(2**62 - 5, KEY)
    assert big(10**12) == 1035519371452644803
    assert big.inverse(1035519371452644803) == 10**12
