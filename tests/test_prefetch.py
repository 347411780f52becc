"""tc.DataLoader(prefetch_batches=N): a read-ahead thread that keeps exact resume, errors and no leaks."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback

import pytest
import torch
from conftest import paragraphs, write_jsonl
from torch.utils.data import Dataset, default_collate

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset, ids, make_loader, run_until  # noqa: E402

import torchcache as tc  # noqa: E402
from torchcache.read.prefetch import BatchReader  # noqa: E402

THREAD = "torchcache-prefetch"


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD}


def join_all(threads: set[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=30)
    assert not [t for t in threads if t.is_alive()], "a prefetch thread outlived its iterator"


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = prefetch_threads()
    yield
    gc.collect()
    join_all(prefetch_threads() - before)


@pytest.mark.parametrize("n, b, drop_last, k", [
    (23, 4, False, 3),   # resume mid-epoch; the rest crosses two epoch boundaries
    (23, 4, False, 6),   # resume right after a loader epoch's last (short) batch
    (23, 4, True, 5),    # drop_last: the epoch ends at its last full batch
    (10, 3, False, 1),
    (7, None, False, 4),  # batch_size=None: one sample per "batch"
])
def test_resume_with_prefetch_equals_uninterrupted(n, b, drop_last, k):
    full = run_until(make_loader(n, b, drop_last=drop_last), 3 * 9)  # the plain loader's stream
    assert run_until(make_loader(n, b, drop_last=drop_last, prefetch_batches=2), len(full)) == full

    first = make_loader(n, b, drop_last=drop_last, prefetch_batches=3)
    head = run_until(first, k)  # the thread has read further ahead than k batches
    state = json.loads(json.dumps(first.state_dict()))
    plain = make_loader(n, b, drop_last=drop_last)
    run_until(plain, k)
    assert state == plain.state_dict()  # counts what was received, not what was prefetched
    second = make_loader(n, b, drop_last=drop_last, prefetch_batches=3)
    second.load_state_dict(state)
    assert head + run_until(second, len(full) - k) == full


def test_resume_across_prefetch_settings_and_step_loops():
    """Step loop (infinite sampler) with prefetch, resumed without it and the other way round."""
    def steps(loader, count):
        it = iter(loader)
        return [ids(next(it)) for _ in range(count)]

    full = steps(make_loader(13, 5, infinite=True), 12)
    for before, after in ((4, 0), (0, 4), (1, 1)):
        first = make_loader(13, 5, infinite=True, prefetch_batches=before)
        head = steps(first, 7)
        assert first.state_dict()["consumed"] == 35
        second = make_loader(13, 5, infinite=True, prefetch_batches=after)
        second.load_state_dict(first.state_dict())
        assert head + steps(second, 5) == full


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory, books, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("prefetch")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 300))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=500, progress=False)
    return d / "cache"


@pytest.mark.parametrize("options", [{}, {"labels": "same"},
                                     {"document_boundaries": True, "max_segments": 40}])
def test_token_batches_equal_the_plain_loader(cache_path, options):
    """The fast path (TokenDataset.get_batch) gives what torch's fetch + default_collate gives."""
    ds = tc.TokenDataset(cache_path, 96, **options)

    def batches(prefetch):
        loader = tc.DataLoader(ds, batch_size=5, sampler=tc.DistributedSampler(ds, seed=1),
                               prefetch_batches=prefetch)
        return [batch for _ in range(2) for batch in loader]

    plain, fast = batches(0), batches(2)
    assert len(plain) == len(fast) == 2 * -(-len(ds) // 5)
    for p, f in zip(plain, fast):
        assert p.keys() == f.keys()
        for key in p:
            assert p[key].dtype == f[key].dtype and torch.equal(p[key], f[key]), key
    idx = [3, 0, len(ds) - 1, 3]
    for key, value in ds.get_batch(idx).items():
        assert torch.equal(value, default_collate(ds.__getitems__(idx))[key]), key
        assert value.is_contiguous()


@pytest.mark.parametrize("labels", ["shifted", "same"])
def test_batches_widened_into_given_tensors_equal_get_batch(cache_path, labels):
    """What the loader does with pin_memory=True: the int64 batch is written straight into the
    (pinned) tensors it allocates, with no second copy."""
    ds = tc.TokenDataset(cache_path, 96, labels=labels)
    made = []

    def allocate(shape):
        made.append(torch.empty(shape, dtype=torch.int64))
        return made[-1]
    idx = [3, 0, len(ds) - 1, 3]
    batch, want = ds._get_batch_into(idx, allocate), ds.get_batch(idx)
    assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want)
    assert batch["input_ids"] is made[0] and batch["labels"] is made[1]


def _accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return torch.cuda.is_available() if accelerator is None else accelerator.is_available()


@pytest.mark.skipif(not _accelerator(), reason="pinned memory needs an accelerator")
def test_pinned_batches_are_read_into_pinned_memory(cache_path):
    ds = tc.TokenDataset(cache_path, 96)

    def batches(**options):
        return list(tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, seed=0), **options))
    pinned, plain = batches(pin_memory=True), batches()
    assert len(pinned) == len(plain) > 0
    for p, q in zip(pinned, plain):
        assert p["input_ids"].is_pinned() and p["labels"].is_pinned()
        assert all(torch.equal(p[k], q[k]) for k in q)


def test_fast_path_is_used_and_subclass_items_are_respected(cache_path):
    ds = tc.TokenDataset(cache_path, 64)
    calls = []
    ds.get_batch = lambda indices: calls.append(indices) or tc.TokenDataset.get_batch(ds, indices)
    batches = list(tc.DataLoader(ds, batch_size=4, prefetch_batches=2))
    assert len(calls) == len(batches) > 0

    class Tagged(tc.TokenDataset):
        def __getitems__(self, indices):
            return [{**item, "tag": torch.tensor(1)} for item in super().__getitems__(indices)]

    tagged = Tagged(cache_path, 64)
    batch = next(iter(tc.DataLoader(tagged, batch_size=4, prefetch_batches=2)))
    assert batch["tag"].tolist() == [1, 1, 1, 1]
    # a custom collate_fn is honoured too
    loader = tc.DataLoader(ds, batch_size=4, prefetch_batches=2, collate_fn=lambda items: len(items))
    assert next(iter(loader)) == 4


class Failing(Dataset):
    fingerprint = "failing"

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            raise ValueError("sample 13 is unreadable")
        return torch.tensor([i])


def test_errors_in_the_thread_reach_the_training_loop_with_their_traceback():
    ds = Failing()
    loader = tc.DataLoader(ds, batch_size=2, sampler=tc.DistributedSampler(ds, shuffle=False),
                           prefetch_batches=3)
    received = []
    with pytest.raises(ValueError, match="sample 13 is unreadable") as info:
        for batch in loader:
            received.append(ids(batch))
    assert received == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert "__getitem__" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert loader.state_dict()["consumed"] == 12


def test_refused_with_worker_processes():
    ds = IdDataset(10)
    with pytest.raises(ValueError, match="num_workers=0"):
        tc.DataLoader(ds, batch_size=2, num_workers=2, prefetch_batches=2)
    with pytest.raises(ValueError, match="prefetch_batches"):
        tc.DataLoader(ds, batch_size=2, prefetch_batches=-1)


class Recording(Dataset):
    """Records which samples were read, so a test can wait for the thread to get somewhere."""

    fingerprint = "recording"

    def __init__(self, n: int) -> None:
        self.n, self.read = n, []
        self.cond = threading.Condition()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.cond:
            self.read.append(i)
            self.cond.notify_all()
        return torch.tensor([i])

    def wait_for_reads(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.read) >= count, timeout=30)


def test_reads_run_ahead_and_only_received_batches_count():
    ds = Recording(100)
    loader = tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, shuffle=False),
                           prefetch_batches=2)
    it = iter(loader)
    assert ids(next(it)) == [0, 1, 2, 3]
    ds.wait_for_reads(3 * 4)  # the thread fills the queue while the loop holds batch 0
    assert loader.state_dict()["consumed"] == 4
    assert ids(next(it)) == [4, 5, 6, 7]
    assert loader.state_dict()["consumed"] == 8


def test_abandoned_iterators_stop_their_threads():
    loader = make_loader(50, 2, prefetch_batches=2)
    before = prefetch_threads()
    it = iter(loader)
    next(it)
    started = prefetch_threads() - before
    assert len(started) == 1
    del it
    gc.collect()
    join_all(started)


def test_a_new_iter_or_load_state_dict_stops_the_old_iterator():
    loader = make_loader(50, 2, prefetch_batches=2)
    old = iter(loader)
    next(old)
    thread = prefetch_threads()
    new = iter(loader)  # stops and discards old's read-ahead
    join_all(thread)
    with pytest.raises(RuntimeError, match="replaced"):
        next(old)
    next(new)
    state = loader.state_dict()
    thread = prefetch_threads()
    loader.load_state_dict(state)
    join_all(thread)
    with pytest.raises(RuntimeError, match="replaced"):
        next(new)
    assert loader.state_dict() == state


def test_a_finished_epoch_ends_its_thread():
    loader = make_loader(9, 4, prefetch_batches=8)
    it = iter(loader)
    threads = prefetch_threads()
    assert [ids(b) for b in it] and len(threads) == 1
    join_all(threads)
    with pytest.raises(StopIteration):
        next(it)


# ---------------------------------------------------------------- our own batches (BatchReader)

class ThreadRecording(tc.TokenDataset):
    """A TokenDataset that records which thread made each batch (get_batch, not __getitems__,
    so the loader still takes the fast path)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []
        self.lock = threading.Lock()

    def get_batch(self, indices):
        with self.lock:
            self.threads.append(threading.current_thread().name)
        return super().get_batch(indices)


def test_the_fast_mode_is_the_default_for_token_and_packed_data(cache_path):
    ds = tc.TokenDataset(cache_path, 64)
    assert tc.DataLoader(ds, batch_size=4).prefetch_batches == 4
    assert tc.DataLoader(ds, batch_size=4, prefetch_batches=0).prefetch_batches == 0
    assert tc.DataLoader(ds, batch_size=4, num_workers=2).prefetch_batches == 0
    assert tc.DataLoader(ds, batch_size=4, collate_fn=default_collate).prefetch_batches == 0
    assert tc.DataLoader(IdDataset(10), batch_size=4).prefetch_batches == 0
    packed = tc.PackedDataset(cache_path, 64)
    assert tc.DataLoader(packed, batch_size=4).prefetch_batches == 4


class FakeClock:
    """Time that moves only when told: a read takes 1 unit; the loop's step takes `step` units."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, dt: float) -> None:
        with self.lock:
            self.now += dt


def reader_run(step: float, batches: int = 40, depth: int = 3):
    """Batches 0..batches-1 through a BatchReader whose loop spends `step` units per batch;
    -> (batches received, the thread that read each batch)."""
    clock = FakeClock()
    numbers = iter(range(batches))
    readers: dict[int, str] = {}

    def take():
        return next(numbers, None)

    def read(k):
        readers[k] = threading.current_thread().name
        clock.advance(1.0)
        return k

    received = []
    for k in BatchReader(take, read, depth, clock=clock):
        received.append(k)
        clock.advance(step)
        if step:
            time.sleep(0.002)  # real time for the thread to read ahead meanwhile
    return received, [readers[k] for k in range(batches)]


def test_a_waiting_loop_reads_its_batches_itself():
    """The loop asks for batches faster than they are read (no step): after the first few (read
    ahead by default), the thread stops claiming and the loop's own thread reads the rest."""
    received, readers = reader_run(step=0.0)
    assert received == list(range(40))
    assert readers[-30:] == ["MainThread"] * 30, readers


def test_a_busy_loop_has_its_batches_read_ahead():
    """The loop spends longer between batches than a read takes: the thread reads ahead."""
    received, readers = reader_run(step=10.0)
    assert received == list(range(40))
    assert readers.count(THREAD) >= 20, readers


def test_the_fast_mode_gives_the_same_batches_whichever_thread_reads(cache_path):
    reference = [b["input_ids"] for b in tc.DataLoader(tc.TokenDataset(cache_path, 32),
                                                        batch_size=4, prefetch_batches=0)]
    for step in (0.0, 0.003):
        ds = ThreadRecording(cache_path, 32)
        got = []
        for batch in tc.DataLoader(ds, batch_size=4):
            got.append(batch["input_ids"])
            time.sleep(step)
        assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))


def test_batch_reader_resume_stops_and_errors(cache_path):
    ds = tc.TokenDataset(cache_path, 32)
    full = [b["input_ids"] for b in tc.DataLoader(ds, batch_size=3, shuffle=True, prefetch_batches=0)]
    loader = tc.DataLoader(ds, batch_size=3, shuffle=True)
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    thread = prefetch_threads()
    again = tc.DataLoader(ds, batch_size=3, shuffle=True)
    again.load_state_dict(state)
    tail = [b["input_ids"] for b in again]
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full)) and len(head + tail) == len(full)
    loader.load_state_dict(state)  # stops the live iterator's thread
    join_all(thread)
    with pytest.raises(RuntimeError, match="replaced"):
        next(it)

    class Broken(tc.TokenDataset):
        def get_batch(self, indices):
            if 7 in list(indices):
                raise ValueError("window 7 is unreadable")
            return super().get_batch(indices)

    broken = Broken(cache_path, 32)
    seen = []
    with pytest.raises(ValueError, match="window 7") as info:
        for batch in tc.DataLoader(broken, batch_size=2, prefetch_batches=3):
            seen.append(batch["input_ids"])
    assert len(seen) == 3  # batches before the failing one arrive, in order
    assert "get_batch" in "".join(traceback.format_tb(info.value.__traceback__))


@pytest.mark.parametrize("step", [0.0, 10.0])
def test_a_failure_to_take_indices_reaches_the_loop_in_order(step):
    """Taking a batch's indices can fail (a growing cache that stopped growing): whichever
    thread takes them, the loop receives the batches before, then the error."""
    clock = FakeClock()
    calls = iter(range(100))

    def take():
        k = next(calls)
        if k == 5:
            raise TimeoutError("the cache did not grow")
        return k

    def read(k):
        clock.advance(1.0)
        return k

    received = []
    with pytest.raises(TimeoutError, match="did not grow"):
        for k in BatchReader(take, read, 3, clock=clock):
            received.append(k)
            clock.advance(step)
            if step:
                time.sleep(0.002)
    assert received == [0, 1, 2, 3, 4]
