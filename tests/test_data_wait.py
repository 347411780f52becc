"""The loader says how long the training loop waited for data (issue 34, item 3a), and the
Lightning and Hugging Face Trainer recipes of the README read it per epoch.

Reads are made slow on purpose by a real mechanism: a dataset whose ``__getitems__`` sleeps a
known time per batch. Every bound asserted follows from those sleeps and from times this test
measures itself (the loop's own time between two ``next()`` calls); the only slack is for the
interpreter's few microseconds per call, so nothing depends on the machine's speed.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import torchcache as tc
from conftest import paragraphs, write_jsonl

DELAY = 0.05  # seconds a slow batch read sleeps
SLACK = 0.001  # seconds per batch of interpreter time outside both the loader's and the test's clocks
MODES = {"synchronous": dict(prefetch_batches=0), "read-ahead": dict(prefetch_batches=2),
         "workers": dict(num_workers=2)}
READERS = {"synchronous": 1, "read-ahead": 1, "workers": 2}  # batches made at once


class SlowReads(torch.utils.data.Dataset):
    """``n`` samples (their index); reading a batch sleeps ``delay`` seconds, as a read from a
    slow store waits."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        time.sleep(self.delay)
        return [torch.tensor(i) for i in indices]


def read_with_steps(iterator, batches: int | None, step: float) -> tuple[list, float]:
    """Take ``batches`` batches (None: all) from ``iterator``, sleeping ``step`` after each;
    -> (batches, the loop's own time between a ``next()`` returning and the next call)."""
    received, between = [], 0.0
    while batches is None or len(received) < batches:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        after = time.perf_counter()
        received.append(batch)
        time.sleep(step)
        between += time.perf_counter() - after
    return received, between


@pytest.mark.parametrize("mode", MODES)
def test_slow_reads_are_counted_as_waiting(mode):
    """The loop waits at least the reads' sleeps, less its own time between batches; the wait
    is counted in this process whatever makes the batches."""
    loader = tc.DataLoader(SlowReads(32, DELAY), batch_size=4, **MODES[mode])
    began = time.perf_counter()
    batches, between = read_with_steps(iter(loader), None, 0.01)
    total = time.perf_counter() - began
    assert len(batches) == 8
    produced = math.ceil(8 / READERS[mode]) * DELAY  # each reader sleeps through its batches
    wait = loader.data_wait_seconds
    assert wait >= produced - between - 8 * SLACK, (wait, produced, between)
    assert wait <= total - between  # inside iter() and next() only
    [stats] = loader.stats()
    assert stats["batches"] == 8 and stats["epoch"] == 0 and stats["data_wait_seconds"] == wait
    assert stats["seconds"] >= wait and stats["wait_fraction"] == wait / stats["seconds"]


@pytest.mark.parametrize("mode", MODES)
def test_the_loops_own_step_is_not_counted(mode):
    """Fast reads under a 50 ms step: after the first batch of each reader (which waits for
    the workers to start), the wait is a small part of the steps' time."""
    start = READERS[mode]
    loader = tc.DataLoader(SlowReads(4 * (start + 8), 0.0), batch_size=4, **MODES[mode])
    iterator = iter(loader)
    read_with_steps(iterator, start, 0.0)
    first = loader.data_wait_seconds
    batches, between = read_with_steps(iterator, None, 0.05)
    assert len(batches) == 8 and between >= 8 * 0.05
    assert loader.data_wait_seconds - first < between / 4, (loader.stats(), between)


def test_the_wait_is_per_pass():
    """Each pass (loader epoch) starts from 0: a fast epoch after a slow one shows its own wait,
    and stats() keeps both."""
    dataset = SlowReads(32, DELAY)
    loader = tc.DataLoader(dataset, batch_size=4)
    assert loader.data_wait_seconds == 0.0 and loader.stats() == []
    read_with_steps(iter(loader), None, 0.0)
    slow = loader.data_wait_seconds
    assert slow >= 8 * DELAY  # synchronous: every sleep is inside next()
    dataset.delay = 0.0
    iterator = iter(loader)
    assert loader.data_wait_seconds < 8 * DELAY  # counting again from iter()
    read_with_steps(iterator, None, 0.0)
    assert loader.data_wait_seconds < 8 * DELAY
    epochs = loader.stats()
    assert [(s["epoch"], s["batches"]) for s in epochs] == [(0, 8), (1, 8)]
    assert epochs[0]["data_wait_seconds"] == slow
    assert epochs[1]["data_wait_seconds"] == loader.data_wait_seconds


@pytest.mark.parametrize("mode", ["synchronous", "workers"])
def test_a_resumed_pass_counts_from_the_resume(mode):
    """A loader given a state counts only the batches after it; a state loaded into a loader
    mid-pass starts a new pass."""
    loader = tc.DataLoader(SlowReads(32, DELAY), batch_size=4, shuffle=True, **MODES[mode])
    read_with_steps(iter(loader), 3, 0.0)
    state = loader.state_dict()
    resumed = tc.DataLoader(SlowReads(32, DELAY), batch_size=4, shuffle=True, **MODES[mode])
    resumed.load_state_dict(state)
    assert resumed.data_wait_seconds == 0.0 and resumed.stats() == []
    batches, between = read_with_steps(iter(resumed), None, 0.0)
    assert len(batches) == 5
    [stats] = resumed.stats()
    assert stats["epoch"] == 0 and stats["batches"] == 5
    produced = math.ceil(5 / READERS[mode]) * DELAY
    assert resumed.data_wait_seconds >= produced - between - 5 * SLACK
    loader.load_state_dict(state)  # the same loader, mid-pass
    read_with_steps(iter(loader), None, 0.0)
    assert [s["batches"] for s in loader.stats()] == [3, 5]


def test_a_sampler_of_your_own_is_timed_per_pass():
    """With a sampler of your own, passes are timed too; their epoch is unknown (None)."""
    dataset = SlowReads(16, DELAY)
    loader = tc.DataLoader(dataset, batch_size=4, sampler=torch.utils.data.RandomSampler(dataset))
    read_with_steps(iter(loader), None, 0.0)
    [stats] = loader.stats()
    assert stats["epoch"] is None and stats["batches"] == 4
    assert stats["data_wait_seconds"] >= 4 * DELAY


def test_an_iterable_dataset_is_refused_by_name():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = tc.DataLoader(Stream(), batch_size=4)
    with pytest.raises(TypeError, match="data_wait_seconds: .*IterableDataset \\(Stream\\)"):
        loader.data_wait_seconds
    with pytest.raises(TypeError, match="stats\\(\\): .*IterableDataset"):
        loader.stats()


def test_lightning_logs_each_epochs_wait_from_the_trainers_loader(tmp_path):
    """As the README says: in on_train_epoch_end, self.trainer.train_dataloader is the loader,
    and its wait is that epoch's (Lightning's fetcher calls next(): every sleep is in it)."""
    L = pytest.importorskip("lightning")
    seen = []

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self):
            return tc.DataLoader(SlowReads(16, DELAY), batch_size=4, prefetch_batches=0)

        def training_step(self, batch, batch_idx):
            return self.layer(batch.float()[:, None]).mean()

        def on_train_epoch_end(self):
            loader = self.trainer.train_dataloader
            self.log("data_wait_s", loader.data_wait_seconds)
            seen.append(loader.stats()[-1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Model())
    assert [(s["epoch"], s["batches"]) for s in seen] == [(0, 4), (1, 4)]
    assert all(s["data_wait_seconds"] >= 4 * DELAY for s in seen), seen
    assert float(trainer.callback_metrics["data_wait_s"]) == pytest.approx(seen[-1]["data_wait_seconds"])


def test_a_hf_trainer_callback_reads_each_epochs_wait(tmp_path, books, gpt2_tokenizer_path):
    """As the README says: the Trainer passes its loader to a callback's on_epoch_end as
    train_dataloader, and its stats are that epoch's."""
    pytest.importorskip("transformers")
    from transformers import TrainerCallback, TrainingArguments

    from torchcache.integrations.transformers import Trainer

    docs = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books)[:12])
    tc.build_cache(docs, tmp_path / "cache", gpt2_tokenizer_path, progress=False)

    class SlowTokens(tc.TokenDataset):
        def get_batch(self, indices):
            time.sleep(DELAY)
            return super().get_batch(indices)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, input_ids, labels=None):
            return {"loss": (self.scale * input_ids.float() / 50000).mean()}

    class Log(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_epoch_end(self, args, state, control, train_dataloader=None, **kwargs):
            assert isinstance(train_dataloader, tc.DataLoader)
            self.seen.append((train_dataloader.data_wait_seconds, train_dataloader.stats()[-1]))

    ds = SlowTokens(tmp_path / "cache", seq_len=16, labels="same")
    per_epoch = math.ceil(len(ds) / 8)
    log = Log()
    trainer = Trainer(model=Model(), train_dataset=ds, callbacks=[log], args=TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_train_epochs=2,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True))
    trainer.train()
    assert [(s["epoch"], s["batches"]) for _, s in log.seen] == [(0, per_epoch), (1, per_epoch)]
    assert all(wait == s["data_wait_seconds"] > 0 for wait, s in log.seen)
