"""tc.DistributedSampler inside torchdata's StatefulDataLoader: exact resume, epoch ends included.

StatefulDataLoader wraps the sampler in its own BatchSampler and, each time a batch of indices is
*dispatched*, snapshots ``sampler.state_dict()`` together with the live sampler iterator's
``state_dict()``; it keeps that snapshot until the batch is *yielded* (with workers, plus
``_steps_since_snapshot`` batches it replays on load). On resume it calls
``sampler.load_state_dict``, ``iter(sampler)`` and then ``iterator.load_state_dict``. The sampler's
own state counts dispatched positions (``"counts": "dispatched"``); the snapshot timing makes it
exact for torchdata, and the iterator state makes a resume at an epoch's end finish that epoch
(empty) before the next ``iter()`` starts the next one, as the uninterrupted run does.
"""

from __future__ import annotations

import json

import pytest

import torchcache as tc
from _helpers_resume import IdDataset, ids

N = 50          # not a multiple of the batch size: every epoch ends with a short batch
BATCH = 4
SEED = 3
EPOCHS = 3
PER_EPOCH = -(-N // BATCH)  # 13 batches


@pytest.fixture(scope="module")
def StatefulDataLoader():
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def make_loader(sdl, num_workers, *, rank=0, world_size=1, **kwargs):
    ds = IdDataset(N)
    sampler = tc.DistributedSampler(ds, seed=SEED, rank=rank, world_size=world_size)
    return sdl(ds, batch_size=BATCH, sampler=sampler, num_workers=num_workers, **kwargs)


def run_epochs(loader, epochs, head=()):
    """``epochs`` full ``for batch in loader`` loops; ``head`` is prepended to the first one."""
    out = [list(head)]
    for e in range(epochs):
        if e:
            out.append([])
        out[-1].extend(ids(b) for b in loader)
    return out


def interrupted(sdl, num_workers, k, *, drain=False, **kwargs):
    """Read ``k`` batches (a new ``iter()`` after each exhausted epoch), save, resume in a fresh
    loader + sampler, and finish ``EPOCHS`` epochs there; -> batches per epoch.

    ``drain``: when ``k`` ends an epoch, also see that iterator's StopIteration before saving.
    """
    loader = make_loader(sdl, num_workers, **kwargs)
    done, current, it = [], [], iter(loader)
    while len(done) * PER_EPOCH + len(current) < k:
        try:
            current.append(ids(next(it)))
        except StopIteration:
            done.append(current)
            current, it = [], iter(loader)
    if drain:
        assert len(current) == PER_EPOCH
        with pytest.raises(StopIteration):
            next(it)
        done.append(current)
        current = []
    state = json.loads(json.dumps(loader.state_dict()))  # plain ints and dicts: JSON round trip
    del it, loader

    resumed = make_loader(sdl, num_workers, **kwargs)
    resumed.load_state_dict(state)
    return done + run_epochs(resumed, EPOCHS - len(done), head=current)


_REFERENCE: dict = {}


def reference(sdl, num_workers, **kwargs):
    key = (num_workers, tuple(sorted(kwargs.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = run_epochs(make_loader(sdl, num_workers, **kwargs), EPOCHS)
    return _REFERENCE[key]


def test_reference_stream_is_the_sampler_stream(StatefulDataLoader):
    epochs = reference(StatefulDataLoader, 0)
    assert [len(e) for e in epochs] == [PER_EPOCH] * EPOCHS
    flat = [i for e in epochs for b in e for i in b]
    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED)
    assert flat == sampler.indices_for_positions(range(EPOCHS * N)).tolist()
    for e in range(EPOCHS):  # every epoch is a permutation, a different one each time
        assert sorted(flat[e * N:(e + 1) * N]) == list(range(N))
    assert flat[:N] != flat[N:2 * N]


# k = 13 and 26 are exact epoch ends; 14 and 27 the first batch after one.
@pytest.mark.parametrize("k", [0, 1, 5, 12, 13, 14, 20, 26, 27, EPOCHS * PER_EPOCH])
def test_resume_exact_single_process(StatefulDataLoader, k):
    assert interrupted(StatefulDataLoader, 0, k) == reference(StatefulDataLoader, 0)


@pytest.mark.parametrize("k", [0, 3, 13, 14, 26])
def test_resume_exact_with_workers(StatefulDataLoader, k):
    assert interrupted(StatefulDataLoader, 2, k) == reference(StatefulDataLoader, 2)


@pytest.mark.parametrize("k", [5, 13])
def test_resume_exact_with_sparse_snapshots_and_persistent_workers(StatefulDataLoader, k):
    # a snapshot every 3 steps: torchdata replays the batches since the last one on load
    kw = dict(snapshot_every_n_steps=3, persistent_workers=True)
    assert interrupted(StatefulDataLoader, 2, k, **kw) == reference(StatefulDataLoader, 2, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_after_epoch_end_was_seen(StatefulDataLoader, num_workers):
    """Saved between epochs (after StopIteration): the resumed loader starts the next epoch."""
    got = interrupted(StatefulDataLoader, num_workers, PER_EPOCH, drain=True)
    assert got == reference(StatefulDataLoader, num_workers)


@pytest.mark.parametrize("k", [6, 13])
def test_resume_exact_per_rank(StatefulDataLoader, k):
    """Two simulated ranks, each resumed from its own state, keep their shares of the stream."""
    for rank in range(2):
        kw = dict(rank=rank, world_size=2)
        per_epoch = -(-N // 2 // BATCH)  # 25 indices per rank -> 7 batches
        want = run_epochs(make_loader(StatefulDataLoader, 0, **kw), EPOCHS)
        assert [len(e) for e in want] == [per_epoch] * EPOCHS
        loader = make_loader(StatefulDataLoader, 0, **kw)
        it = iter(loader)
        head = [ids(next(it)) for _ in range(k if k < per_epoch else per_epoch)]
        state = loader.state_dict()
        resumed = make_loader(StatefulDataLoader, 0, **kw)
        resumed.load_state_dict(state)
        assert run_epochs(resumed, EPOCHS, head=head) == want


def _find(obj, fmt):
    """Every dict with ``"format": fmt`` nested anywhere in ``obj``."""
    if isinstance(obj, dict):
        if obj.get("format") == fmt:
            yield obj
        for v in obj.values():
            yield from _find(v, fmt)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find(v, fmt)


def test_sampler_state_counts_dispatched_positions(StatefulDataLoader):
    loader = make_loader(StatefulDataLoader, 2, prefetch_factor=2)
    sampler = loader.sampler
    it = iter(loader)
    consumed = 3
    for _ in range(consumed):
        next(it)
    own = sampler.state_dict()
    assert own["counts"] == "dispatched"
    # workers prefetch: the sampler has dispatched more than the training loop received
    assert own["position"] > consumed * BATCH
    # torchdata's snapshot was taken when batch `consumed` was dispatched: it matches what was
    # consumed, and says that what it counts is dispatched positions
    saved = list(_find(loader.state_dict(), "torchcache.sampler"))
    assert saved and all(s["counts"] == "dispatched" for s in saved)
    assert [s["position"] for s in saved] == [consumed * BATCH] * len(saved)
    del it

    # torchcache's own loader counts consumed positions, and will not take a sampler state
    ds = IdDataset(N)
    tc_loader = tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=SEED))
    assert tc_loader.state_dict()["counts"] == "consumed"
    with pytest.raises(ValueError, match="dispatched"):
        tc_loader.load_state_dict(own)


# -- the sampler iterator's own state (what torchdata saves next to the sampler's) --------------

def _resume_iterator(state_sampler, state_iter, **kw):
    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED, **kw)
    sampler.load_state_dict(state_sampler)
    it = iter(sampler)
    it.load_state_dict(json.loads(json.dumps(state_iter)))
    return sampler, it


def test_sampler_iterator_state_round_trip():
    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED)
    full = list(sampler) + list(sampler)

    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED)
    it = iter(sampler)
    head = [next(it) for _ in range(17)]
    st = it.state_dict()
    assert st["counts"] == "dispatched" and st["position"] == 17 and st["remaining"] == N - 17
    resumed_sampler, resumed = _resume_iterator(sampler.state_dict(), st)
    assert head + list(resumed) + list(resumed_sampler) == full

    # at the epoch's end the interrupted iteration has nothing left; the next iter() goes on
    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED)
    it = iter(sampler)
    head = [next(it) for _ in range(N)]
    st = it.state_dict()
    assert st["remaining"] == 0
    resumed_sampler, resumed = _resume_iterator(sampler.state_dict(), st)
    assert list(resumed) == []
    assert head + list(resumed_sampler) == full
    # the sampler's own state alone means "between iterations": iter() starts the next epoch
    alone = tc.DistributedSampler(IdDataset(N), seed=SEED)
    alone.load_state_dict(sampler.state_dict())
    assert list(alone) == full[N:]


def test_sampler_iterator_state_other_world_size_and_refusals():
    sampler = tc.DistributedSampler(IdDataset(N), seed=SEED)
    it = iter(sampler)
    for _ in range(20):
        next(it)
    st_sampler, st_iter = sampler.state_dict(), it.state_dict()
    # rank 1 of 2 continues the same loader epoch from global position 20: 21, 23, ..., 49
    _, resumed = _resume_iterator(st_sampler, st_iter, rank=1, world_size=2)
    assert list(resumed) == sampler.indices_for_positions(range(21, N, 2)).tolist()

    other_seed = iter(tc.DistributedSampler(IdDataset(N), seed=SEED + 1))
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(st_iter)
    with pytest.raises(ValueError, match="format"):
        iter(tc.DistributedSampler(IdDataset(N), seed=SEED)).load_state_dict(st_sampler)
