"""tc.DataLoader(prefetch_batches=N): a read-ahead thread that keeps exact resume, errors and no leaks."""

from __future__ import annotations

import collections
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
from torchcache.read import prefetch  # noqa: E402
from torchcache.read.prefetch import BatchReader  # noqa: E402
from torchcache.train.loader import pin_batch  # noqa: E402

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


class Pinnable:
    """Stands for a tensor-like value with its own pin_memory()."""

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned

    def pin_memory(self) -> "Pinnable":
        return Pinnable(pinned=True)


Pair = collections.namedtuple("Pair", "left right")


def test_pin_batch_walks_dicts_lists_and_tuples_keeping_their_types():
    batch = {"a": [Pinnable(), ("text", Pinnable())], "b": Pair(Pinnable(), 3),
             "c": collections.OrderedDict(x=Pinnable()), "d": "name"}
    pinned = pin_batch(batch)
    assert type(pinned) is dict and pinned["d"] == "name"
    assert isinstance(pinned["a"], list) and pinned["a"][0].pinned
    assert pinned["a"][1][0] == "text" and pinned["a"][1][1].pinned and type(pinned["a"][1]) is tuple
    assert type(pinned["b"]) is Pair and pinned["b"].left.pinned and pinned["b"].right == 3
    assert type(pinned["c"]) is collections.OrderedDict and pinned["c"]["x"].pinned
    assert not batch["a"][0].pinned  # the batch given is left as it was


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


def test_a_finished_epoch_ends_its_thread(monkeypatch):
    started = []

    class Recorded(threading.Thread):
        def start(self):
            started.append(self)
            super().start()
    monkeypatch.setattr(prefetch.threading, "Thread", Recorded)
    loader = make_loader(9, 4, prefetch_batches=8)
    it = iter(loader)
    assert [ids(b) for b in it] and [t.name for t in started] == [THREAD]
    join_all(set(started))
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
        if step:  # a busy step: it lasts until the thread has read the next batch ahead
            deadline = time.monotonic() + 60  # (fails only on a hang)
            while k + 1 < batches and k + 1 not in readers:
                assert time.monotonic() < deadline, "the reader thread never read ahead"
                time.sleep(0.001)
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
    assert readers[1:] == [THREAD] * 39, readers


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


# ---------------------------------------------------------------- the batched protocol (get_batch)

class Squares(Dataset):
    """A user's dataset that makes whole batches (get_batch); counts the calls of each kind."""

    fingerprint = "squares"

    def __init__(self, n: int = 30) -> None:
        self.n, self.batch_calls, self.item_calls = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.item_calls += 1
        return {"x": torch.tensor(i * i), "pair": torch.tensor([i, -i])}

    def get_batch(self, indices):
        self.batch_calls += 1
        idx = torch.as_tensor(indices)
        info = torch.utils.data.get_worker_info()  # in a worker: the view of whole batches
        assert info is None or info.dataset.dataset is self
        return {"x": idx * idx, "pair": torch.stack([idx, -idx], dim=1)}


class Cubes(Squares):
    """Redefines its items but not get_batch: the inherited get_batch would be wrong for it."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(i ** 3), "pair": torch.tensor([i, i])}


def batches_of(ds, **options):
    loader = tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, seed=2), **options)
    return [{k: v.tolist() for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize("mode", [{}, {"prefetch_batches": 0}, {"num_workers": 2},
                                  {"num_workers": 2, "persistent_workers": True}])
def test_any_dataset_with_get_batch_takes_the_fast_path_in_every_mode(mode):
    items = batches_of(Squares(), collate_fn=default_collate)  # items, then torch's collate
    ds = Squares()
    assert batches_of(ds, **mode) == items and len(items) == 8
    if not mode.get("num_workers"):
        assert ds.batch_calls == 8 and ds.item_calls == 0
    assert tc.DataLoader(ds, batch_size=4).prefetch_batches == 4  # the default: read ahead


def test_a_subclass_that_redefines_items_is_read_through_them():
    cubes = Cubes()
    got = batches_of(cubes)
    assert cubes.batch_calls == 0 and got == batches_of(Cubes(), collate_fn=default_collate)
    assert got[0]["x"] == [p[0] ** 3 for p in got[0]["pair"]]
    assert tc.DataLoader(cubes, batch_size=4).prefetch_batches == 0


class Exclusive(Dataset):
    """Fails if two threads are inside __getitem__ at once."""

    fingerprint = "exclusive"

    def __init__(self) -> None:
        self.inside = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.inside += 1
            assert self.inside == 1, "two threads read the dataset at once"
        time.sleep(0.001)  # leaves room for another thread to come in, were it allowed to
        with self.lock:
            self.inside -= 1
        return torch.tensor([i])


def test_datasets_without_get_batch_are_read_by_one_thread_at_a_time():
    ds = Exclusive()
    loader = tc.DataLoader(ds, batch_size=2, sampler=tc.DistributedSampler(ds, shuffle=False),
                           prefetch_batches=3)
    assert [ids(b) for b in loader] == [[i, i + 1] for i in range(0, 64, 2)]


def test_timeout_needs_a_reader_thread_or_workers():
    with pytest.raises(ValueError, match="timeout"):
        tc.DataLoader(IdDataset(10), batch_size=2, timeout=5)
    tc.DataLoader(IdDataset(10), batch_size=2, timeout=5, prefetch_batches=2)


class MapBudget(Dataset):
    """Item i: the map budget of the cache it reads, where it is read."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        self.cache.read(i, i + 1)
        return torch.tensor(self.cache.map_bytes)


def test_workers_read_their_caches_with_pread_only(cache_path):
    cache = tc.TokenCache(cache_path)
    plain = MapBudget(cache)
    mixed = tc.MixtureDataset({"a": MapBudget(cache), "b": MapBudget(cache)}, block_size=4)

    def budgets(ds, **options):
        loader = tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, seed=0), **options)
        return {int(x) for batch in loader for x in batch}
    assert budgets(plain) == {cache.map_bytes} and cache.map_bytes > 0
    assert budgets(plain, num_workers=2) == {0} and budgets(mixed, num_workers=2) == {0}
    assert plain.cache is cache and cache.map_bytes > 0  # this process's dataset is unchanged


class Planned(IdDataset):
    """Records the plan_reads calls a loader makes."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.plans: list[tuple[object, int]] = []

    def plan_reads(self, sampler, num_workers: int) -> None:
        self.plans.append((sampler, num_workers))


@pytest.mark.parametrize("workers", [0, 2])
def test_each_iterator_plans_the_reads_of_its_sampler_first(workers):
    ds = Planned(12)
    loader = tc.DataLoader(ds, batch_size=4, num_workers=workers)
    assert ds.plans == []  # making a loader (or a sampler) plans nothing
    assert [ids(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    iter(loader)
    assert ds.plans == [(loader.sampler, workers)] * 2
