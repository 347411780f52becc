"""torch's DataLoader contract, checked against torch's own classes on the same inputs.

A drop-in loader takes the user's generator, sampler and batch_sampler, sees a list that grew,
subscripts like a generic class, takes flags for their truth, and says clearly what it does not
take (an IterableDataset). Each test runs torch's DataLoader and tc.DataLoader side by side.
(The sampler's drop_last and per-rank split are in test_torch_names.)
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List

import pytest
import torch
import torch.utils.data as tud

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset  # noqa: E402

import torchcache as tc  # noqa: E402


def batches(loader) -> list[list[int]]:
    return [b.reshape(-1).tolist() for b in loader]


def seeded(seed: int, make):
    """``make()`` right after torch.manual_seed(seed): torch's samplers draw from it."""
    torch.manual_seed(seed)
    return make()


# -- 2. generator ---------------------------------------------------------------------------------

def test_the_generator_decides_the_shuffle_like_torchs():
    data = list(range(50))

    def order(seed: int) -> list[list[int]]:
        return batches(tc.DataLoader(data, batch_size=5, shuffle=True,
                                     generator=torch.Generator().manual_seed(seed)))
    orders = [order(seed) for seed in range(4)]
    assert orders[0] == order(0)  # the same generator state, the same order
    assert len({json.dumps(o) for o in orders}) == 4  # another generator, another order
    for o in orders:
        assert sorted(i for b in o for i in b) == data
    # torch's RandomSampler draws its seed from the generator too: one int64 draw
    g = torch.Generator().manual_seed(7)
    tc.DataLoader(data, shuffle=True, generator=g)
    theirs = torch.Generator().manual_seed(7)
    torch.empty((), dtype=torch.int64).random_(generator=theirs)
    assert torch.equal(g.get_state(), theirs.get_state())


def test_an_explicit_seed_wins_over_the_generator():
    data = list(range(20))
    a = batches(tc.DataLoader(data, batch_size=4, shuffle=True, seed=3,
                              generator=torch.Generator().manual_seed(1)))
    b = batches(tc.DataLoader(data, batch_size=4, shuffle=True, seed=3,
                              generator=torch.Generator().manual_seed(2)))
    assert a == b == batches(tc.DataLoader(data, batch_size=4, shuffle=True, seed=3))


# -- 3. samplers and batch samplers of the user's own ---------------------------------------------

class VariableBatches(tud.Sampler):
    """A batch sampler of the user's own: batches of 1, 2, 3, ... indices, in reverse order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        rest, size = list(range(self.n))[::-1], 1
        while rest:
            yield rest[:size]
            rest, size = rest[size:], size + 1

    def __len__(self) -> int:
        count, left, size = 0, self.n, 1
        while left > 0:
            count, left, size = count + 1, left - size, size + 1
        return count


N = 37


def sampler_cases():
    ds = IdDataset(N)
    weights = torch.linspace(0.1, 1.0, N)
    return {
        "sequential": lambda: dict(batch_size=4, sampler=tud.SequentialSampler(ds)),
        "random": lambda: dict(batch_size=4, sampler=tud.RandomSampler(ds)),
        "random, replacement": lambda: dict(batch_size=3, sampler=tud.RandomSampler(
            ds, replacement=True, num_samples=50)),
        "subset, generator": lambda: dict(batch_size=5, sampler=tud.SubsetRandomSampler(
            list(range(0, N, 2)), generator=torch.Generator().manual_seed(4))),
        "weighted": lambda: dict(batch_size=4, sampler=tud.WeightedRandomSampler(weights, 40)),
        "batch sampler, drop_last": lambda: dict(batch_sampler=tud.BatchSampler(
            tud.RandomSampler(ds), 5, drop_last=True)),
        "batch sampler of one's own": lambda: dict(batch_sampler=VariableBatches(N)),
        "no batching": lambda: dict(batch_size=None, sampler=tud.RandomSampler(ds)),
    }


CASES = sampler_cases()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", [dict(), dict(prefetch_batches=0), dict(num_workers=2)])
def test_a_sampler_of_ones_own_yields_what_torch_yields(case, mode):
    ds = IdDataset(N)
    workers = dict(num_workers=mode["num_workers"]) if "num_workers" in mode else {}
    for seed in (0, 1):
        theirs = seeded(seed, lambda: batches(tud.DataLoader(ds, **CASES[case](), **workers)))
        ours_loader = tc.DataLoader(ds, **CASES[case](), **mode)
        ours = seeded(seed, lambda: batches(ours_loader))
        assert ours == theirs
        assert len(ours_loader) == len(tud.DataLoader(ds, **CASES[case]()))


class Noisy(tud.Dataset):
    """Item ``i`` is ``[i, a random number]``: a transform drawing from torch's generator (in a
    worker, the one torch seeds from the loader's base seed)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 10**6, ()))])


@pytest.mark.parametrize("workers", [0, 2])
def test_random_transforms_draw_what_they_draw_under_torch(workers):
    ds = Noisy()
    for seed in (0, 1):
        theirs = seeded(seed, lambda: batches(tud.DataLoader(
            ds, batch_size=4, sampler=tud.RandomSampler(ds), num_workers=workers)))
        ours = seeded(seed, lambda: batches(tc.DataLoader(
            ds, batch_size=4, sampler=tud.RandomSampler(ds), num_workers=workers)))
        assert ours == theirs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("received", [0, 3])
def test_a_sampler_of_ones_own_resumes_exactly(case, received):
    ds = IdDataset(N)
    full = seeded(5, lambda: batches(tc.DataLoader(ds, **CASES[case]())))
    # received batches of the pass, then saved (JSON) while the pass goes on
    loader = tc.DataLoader(ds, **CASES[case]())
    it = seeded(5, lambda: iter(loader))
    head = [next(it).reshape(-1).tolist() for _ in range(received)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["counts"] == "batches" and state["batches"] == received
    head += [b.reshape(-1).tolist() for b in it]  # the run goes on: the state does not change it
    assert head == full
    # a new process: another global random state, other workers; the same pass resumes
    for mode in (dict(), dict(num_workers=2)):
        resumed = tc.DataLoader(ds, **CASES[case](), **mode)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # loaded, not started: the state as loaded
        rest = seeded(99, lambda: batches(resumed))
        assert full[:received] + rest == full


def test_resume_between_passes_starts_the_next_pass_of_the_samplers_generator():
    ds = IdDataset(N)

    def make():
        return tc.DataLoader(ds, batch_size=4, sampler=tud.RandomSampler(
            ds, generator=torch.Generator().manual_seed(3)))
    loader = make()
    first, second = batches(loader), batches(loader)
    assert first != second  # the generator moved on
    again = make()
    assert batches(again) == first
    state = json.loads(json.dumps(again.state_dict()))  # after a whole pass
    resumed = make()
    resumed.load_state_dict(state)
    assert batches(resumed) == second


def test_a_state_of_one_kind_of_sampler_is_refused_by_the_other():
    ds = IdDataset(N)
    ours = tc.DataLoader(ds, batch_size=4, shuffle=True)
    own = tc.DataLoader(ds, batch_size=4, sampler=tud.RandomSampler(ds))
    next(iter(ours))
    next(iter(own))
    with pytest.raises(ValueError, match="counts 'consumed'"):
        own.load_state_dict(ours.state_dict())
    with pytest.raises(ValueError, match="counts 'batches'"):
        ours.load_state_dict(own.state_dict())
    other_size = tc.DataLoader(ds, batch_size=5, sampler=tud.RandomSampler(ds))
    with pytest.raises(ValueError, match="batch_size"):
        other_size.load_state_dict(own.state_dict())
    other_sampler = tc.DataLoader(ds, batch_size=4, sampler=tud.SequentialSampler(ds))
    with pytest.raises(ValueError, match="sampler"):
        other_sampler.load_state_dict(own.state_dict())


def test_a_state_with_more_batches_than_the_pass_has_is_refused_at_iter():
    ds = IdDataset(8)
    loader = tc.DataLoader(ds, batch_size=4, sampler=tud.SequentialSampler(ds))
    state = loader.state_dict()
    loader.load_state_dict({**state, "batches": 5})
    with pytest.raises(ValueError, match="only 2"):
        next(iter(loader))


def test_torchs_rules_for_batch_sampler_still_apply():
    ds = IdDataset(N)
    with pytest.raises(ValueError, match="mutually exclusive"):
        tc.DataLoader(ds, batch_size=4, batch_sampler=VariableBatches(N))
    with pytest.raises(ValueError, match="seed"):
        tc.DataLoader(ds, sampler=tud.RandomSampler(ds), seed=1)


# -- 4. a list that grows or shrinks between passes -----------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
def test_a_list_that_grows_or_shrinks_is_read_at_its_new_length(shuffle):
    data = list(range(10))
    ours = tc.DataLoader(data, batch_size=4, shuffle=shuffle)
    theirs = tud.DataLoader(data, batch_size=4, shuffle=shuffle)
    def shrink() -> None:
        del data[6:]
    for change in (lambda: data.extend(range(10, 15)), shrink, lambda: data.append(99)):
        first = batches(ours)
        assert sorted(i for b in first for i in b) == sorted(data)
        if not shuffle:
            assert first == batches(theirs)
        change()
        assert len(ours) == len(theirs)
    assert sorted(i for b in batches(ours) for i in b) == sorted(data)
    # the state says the new length; a loader over the same list resumes it
    state = ours.state_dict()
    assert state["num_samples"] == len(data)


# -- 5-7. typing, flags, IterableDataset ----------------------------------------------------------

def test_the_loader_subscripts_as_a_generic_class_like_torchs():
    alias = tc.DataLoader[List[torch.Tensor]]
    assert alias.__origin__ is tc.DataLoader
    assert tc.DataLoader[Dict[str, torch.Tensor]] is not None
    assert issubclass(tc.DataLoader, tud.DataLoader)

    def annotated(loader: tc.DataLoader[torch.Tensor]) -> int:
        return len(loader)
    assert annotated(tc.DataLoader(range(4), batch_size=2)) == 2


@pytest.mark.parametrize("flags", [dict(shuffle=1), dict(shuffle=0), dict(pin_memory=0),
                                   dict(pin_memory=1)])
def test_flags_are_taken_for_their_truth_as_torch_takes_them(flags):
    data = list(range(12))
    ours = seeded(0, lambda: batches(tc.DataLoader(data, batch_size=4, **flags)))
    theirs = seeded(0, lambda: batches(tud.DataLoader(data, batch_size=4, **flags)))
    if flags.get("shuffle"):
        assert sorted(i for b in ours for i in b) == data  # shuffled (by its own permutation)
        assert ours != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    else:
        assert ours == theirs


def test_a_flag_given_as_a_string_is_refused_not_taken_as_true():
    with pytest.raises(TypeError, match="shuffle.*string 'no'"):
        tc.DataLoader(list(range(4)), shuffle="no")
    with pytest.raises(TypeError, match="pin_memory"):
        tc.DataLoader(list(range(4)), pin_memory="False")


class Stream(tud.IterableDataset):
    """An iterable dataset that splits its items among workers, as torch's docs show."""

    def __iter__(self):
        info = tud.get_worker_info()
        items = range(11)
        return iter(items if info is None else items[info.id::info.num_workers])

    def __len__(self) -> int:
        return 11


@pytest.mark.parametrize("kwargs", [dict(batch_size=2), dict(batch_size=3, num_workers=2),
                                    dict(batch_size=None)])
def test_an_iterable_dataset_reads_as_with_torch_and_has_no_state(kwargs):
    ours, theirs = tc.DataLoader(Stream(), **kwargs), tud.DataLoader(Stream(), **kwargs)
    assert [torch.as_tensor(b).tolist() for b in ours] == [torch.as_tensor(b).tolist() for b in theirs]
    assert len(ours) == len(theirs)
    for call in (ours.state_dict, lambda: ours.load_state_dict({}), lambda: ours.consumed):
        with pytest.raises(TypeError, match=r"IterableDataset \(Stream\).*no state"):
            call()
    with pytest.raises(ValueError, match="expected unspecified shuffle"):  # torch's own check
        tc.DataLoader(Stream(), shuffle=True)


class Failing(tud.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in (5, 13):
            raise ValueError(f"sample {i} is unreadable")
        return torch.tensor([i])


def outcomes(loader) -> list:
    """Each next() of a pass: the batch's indices, or the error's message."""
    got, it = [], iter(loader)
    while True:
        try:
            got.append(next(it).reshape(-1).tolist())
        except ValueError as error:  # (from a worker, torch's message holds the original's)
            got.append(re.search(r"sample \d+ is unreadable", str(error)).group())
        except StopIteration:
            return got


@pytest.mark.parametrize("mode", [dict(), dict(prefetch_batches=3), dict(num_workers=2)])
def test_after_a_batch_that_fails_the_next_ones_follow_as_with_torch(mode):
    workers = dict(num_workers=mode["num_workers"]) if "num_workers" in mode else {}
    theirs = outcomes(tud.DataLoader(Failing(), batch_size=2, **workers))
    assert theirs[2] == "sample 5 is unreadable" and len(theirs) == 10
    loader = tc.DataLoader(Failing(), batch_size=2, **mode)
    assert outcomes(loader) == theirs
    # a state saved right at the error resumes at that batch (to make it again); once the loop
    # went on past it, it counts as received
    loader = tc.DataLoader(Failing(), batch_size=2, **mode)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(ValueError, match="sample 5"):
        next(it)
    assert loader.consumed == 4
    assert next(it).tolist() == [[6], [7]] and loader.consumed == 8


@pytest.mark.parametrize("mode", [dict(), dict(prefetch_batches=0), dict(num_workers=2)])
def test_a_pass_draws_from_torchs_generator_what_torchs_loader_draws(mode):
    # a training loop's own random numbers after each pass are the same under either loader
    data = list(range(12))
    workers = dict(num_workers=mode["num_workers"]) if "num_workers" in mode else {}
    torch.manual_seed(0)
    for _ in tud.DataLoader(data, batch_size=4, **workers):
        pass
    theirs = torch.rand(3)
    torch.manual_seed(0)
    for _ in tc.DataLoader(data, batch_size=4, **mode):
        pass
    assert torch.equal(torch.rand(3), theirs)


class _SamplerAsDataset(tud.Dataset):
    """The pattern of Lightning's DistributedSamplerWrapper: a sampler's indices as a dataset."""

    def __init__(self, sampler) -> None:
        self._sampler = sampler
        self._indices = None

    def __getitem__(self, i: int) -> int:
        if self._indices is None:
            self._indices = list(self._sampler)
        return self._indices[i]

    def __len__(self) -> int:
        return len(self._sampler)


class SplittingWrapper(tud.DistributedSampler):
    """A torch DistributedSampler over another sampler's indices (as Lightning wraps samplers)."""

    def __init__(self, sampler, *args, **kwargs) -> None:
        super().__init__(_SamplerAsDataset(sampler), *args, **kwargs)

    def __iter__(self):
        self.dataset._indices = None
        return (self.dataset[i] for i in super().__iter__())


def test_a_sampler_that_splits_an_already_split_one_again_is_refused():
    ds = IdDataset(40)
    split = tc.DistributedSampler(ds, 2, 1, shuffle=False)  # rank 1 of 2
    with pytest.raises(ValueError, match="split across 2 ranks already.*use_distributed_sampler=False"):
        tc.DataLoader(ds, batch_size=4, sampler=SplittingWrapper(split, 2, 1, shuffle=False))
    # a wrapper over a sampler of one rank splits it once: what torch does
    whole = tc.DistributedSampler(ds, 1, 0, shuffle=False)
    wrapped = SplittingWrapper(whole, 2, 1, shuffle=False)
    assert batches(tc.DataLoader(ds, batch_size=4, sampler=wrapped)) == batches(
        tud.DataLoader(ds, batch_size=4, sampler=wrapped))
