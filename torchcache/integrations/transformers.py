"""A ``transformers.Trainer`` that trains on torchcache's sampler and DataLoader (DESIGN.md §9.4).

    from torchcache.integrations.transformers import Trainer   # instead of: from transformers import Trainer

    ds = tc.TokenDataset("caches/web", seq_len=1024, labels="same")   # HF causal LMs shift labels inside
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)

The training batches come from ``tc.DataLoader(train_dataset, sampler=tc.DistributedSampler(...))``:
the whole-epoch keyed shuffle (seed ``args.data_seed``, else ``args.seed``), each rank its share
under torchrun, ``per_device_train_batch_size`` per rank, ``dataloader_num_workers`` workers.
Every checkpoint folder gets ``torchcache_loader.json`` (the loader's ``state_dict()``), and
``resume_from_checkpoint`` loads it instead of fast-forwarding the data: the resumed run receives
exactly the batches the uninterrupted run would have, in O(1), also on another number of processes
(same global batch). The loader takes no random numbers from torch's global generator (its workers'
seeds come from a generator of its own), so the Trainer's restored RNG state, and with it dropout,
continues exactly: a resumed run's losses equal the uninterrupted run's.

Evaluation and prediction use the Trainer's own loaders, unchanged. ``ignore_data_skip=True`` on
resume starts the data stream over from its beginning instead of loading the saved state.

transformers is an optional extra (``pip install 'torchcache-lm[transformers]'``), imported here
only. Tested with transformers 5.24.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch

from ..train.dataset import DocumentDataset, TokenDataset
from ..train.loader import DataLoader
from ..train.mix import MixtureDataset
from ..train.packed import PackedDataset
from ..train.sampler import DistributedSampler

try:
    import transformers
    from accelerate.data_loader import DataLoaderStateMixin
    from accelerate.state import GradientState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "torchcache.integrations.transformers needs the transformers package: "
        "pip install 'torchcache-lm[transformers]' (or pip install transformers)") from error

__all__ = ["LOADER_STATE_NAME", "TORCHCACHE_DATASETS", "Trainer", "TrainerDataLoader", "is_torchcache_dataset"]

LOADER_STATE_NAME = "torchcache_loader.json"

# The Trainer's hooks this class overrides: their parameters in the transformers versions it was
# tested with (5.24). Another layout is refused at import, with a message, rather than misread.
_RUN_EPOCH_PARAMETERS = ["self", "model", "epoch", "train_dataloader", "steps_in_epoch",
                         "num_update_steps_per_epoch", "trial", "ignore_keys_for_eval", "start_time",
                         "resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch"]


def _check_transformers() -> None:
    run_epoch = getattr(transformers.Trainer, "_run_epoch", None)
    found = list(inspect.signature(run_epoch).parameters) if run_epoch is not None else None
    if found != _RUN_EPOCH_PARAMETERS or not hasattr(transformers.Trainer, "_save_checkpoint"):
        raise ImportError(
            f"torchcache.integrations.transformers supports transformers>=5.24,<6 (this is "
            f"transformers {transformers.__version__}, whose Trainer loop differs): "
            "pip install 'torchcache-lm[transformers]'")


_check_transformers()


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on torchcache's sampler and DataLoader, with O(1) exact resume.

    Takes the same arguments as ``transformers.Trainer``. The train dataset is read as it is: a
    torchcache dataset's batches (``input_ids``, ``labels`` and, for a cache with a loss mask,
    ``loss_mask``) go to the model, so use ``tc.TokenDataset(cache, seq_len, labels="same")`` for
    Hugging Face causal LMs, which shift the labels themselves. Keys the model's ``forward`` does
    not take are dropped when ``args.remove_unused_columns`` (the default). A ``data_collator``
    you pass collates the training items; by default whole batches are read in one call.
    """

    def __init__(self, *args: Any, missing_loader_state: str = "raise", **kwargs: Any) -> None:
        if missing_loader_state not in ("raise", "step"):
            raise ValueError(f"missing_loader_state={missing_loader_state!r}: use 'raise' (a checkpoint "
                             f"without {LOADER_STATE_NAME} is refused) or 'step' (start at its step)")
        self._missing_loader_state = missing_loader_state
        bound = inspect.signature(transformers.Trainer.__init__).bind_partial(None, *args, **kwargs)
        self._train_collate = bound.arguments.get("data_collator")  # only one passed explicitly
        self._train_loader: DataLoader | None = None
        self._resume_position: tuple[int, int, int, int] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------ loading
    def get_train_dataloader(self) -> Any:
        """For a torchcache dataset (:data:`TORCHCACHE_DATASETS`), a ``tc.DataLoader`` with a
        ``tc.DistributedSampler`` for this rank; for any other dataset, ``transformers.Trainer``'s
        own loader, unchanged (its sampler, collator, drop_last and seed)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if not is_torchcache_dataset(self.train_dataset):
            self._train_loader = None
            return super().get_train_dataloader()
        args = self.args
        _check_arguments(args, self.train_dataset)
        seed = args.data_seed if args.data_seed is not None else args.seed
        drop_last = bool(args.dataloader_drop_last)
        sampler = DistributedSampler(self.train_dataset, num_replicas=args.world_size,
                                     rank=args.process_index, shuffle=True, seed=seed, drop_last=drop_last)
        # The workers' base seed is drawn from this generator, not from torch's global one: the
        # Trainer's RNG state (dropout) is then the same whether a run was resumed or not.
        generator = torch.Generator()
        generator.manual_seed(seed)
        workers = args.dataloader_num_workers
        options: dict[str, Any] = {}
        if workers > 0:
            options.update(persistent_workers=args.dataloader_persistent_workers,
                           multiprocessing_context=args.dataloader_multiprocessing_context,
                           worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index))
            if args.dataloader_prefetch_factor is not None:
                options["prefetch_factor"] = args.dataloader_prefetch_factor
        collate = self._train_collate
        keep = None
        if collate is not None:  # the user's collator, with the Trainer's own column removal
            collate = self._get_collator_with_removed_columns(collate, description="training")
        elif args.remove_unused_columns:  # whole batches from get_batch: drop what forward() does not take
            self._set_signature_columns_if_needed()
            keep = frozenset(self._signature_columns or ()) or None
        pin = bool(args.dataloader_pin_memory) and _accelerator_available()
        loader = TrainerDataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                                   num_workers=workers, collate_fn=collate, pin_memory=pin,
                                   drop_last=drop_last, generator=generator, keep_keys=keep,
                                   num_processes=args.world_size, **options)
        # accelerate keeps it as it is (it is already per rank) and registers it with the others
        self._train_loader = self.accelerator.prepare(loader)
        return self._train_loader

    # ------------------------------------------------------------------------------ resume
    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch,
                   trial, ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        """The resumed epoch continues from the loaded loader state instead of skipping batches:
        the Trainer is told the epoch's remaining batches, with nothing to skip (it then restores
        its RNG state before the first batch, as at an epoch's start). Any other loader (a dataset
        that is not torchcache's) goes through ``transformers.Trainer._run_epoch`` unchanged."""
        done = 0
        if (resume_from_checkpoint is not None and epoch == epochs_trained
                and self._train_loader is not None and train_dataloader is self._train_loader
                and not self.args.ignore_data_skip):
            batches = epochs_trained * steps_in_epoch + steps_trained_in_current_epoch
            self._restore_loader(resume_from_checkpoint, batches, steps_in_epoch, num_update_steps_per_epoch)
            done = steps_trained_in_current_epoch  # batches of this epoch trained before the save
        if done:
            accumulation = self.args.gradient_accumulation_steps
            self._resume_position = (epoch, done, steps_in_epoch, self.state.global_step)
            steps_in_epoch -= done
            num_update_steps_per_epoch -= done // accumulation
            steps_trained_in_current_epoch = 0
        try:
            return super()._run_epoch(
                model=model, epoch=epoch, train_dataloader=train_dataloader, steps_in_epoch=steps_in_epoch,
                num_update_steps_per_epoch=num_update_steps_per_epoch, trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval, start_time=start_time,
                resume_from_checkpoint=resume_from_checkpoint, epochs_trained=epochs_trained,
                steps_trained_in_current_epoch=steps_trained_in_current_epoch)
        finally:
            self._resume_position = None

    def _restore_loader(self, checkpoint: str, batches: int, steps_in_epoch: int, steps_per_epoch: int) -> None:
        """Load the checkpoint's loader state and check that it is at data batch ``batches``, the
        one the checkpoint's ``global_step`` says (times gradient accumulation, over epochs of
        ``steps_in_epoch`` batches); without a state, ``missing_loader_state`` decides."""
        loader = self._train_loader
        path = os.path.join(checkpoint, LOADER_STATE_NAME)
        if not os.path.isfile(path):
            if self._missing_loader_state == "raise":
                raise FileNotFoundError(
                    f"{path} not found: this checkpoint was not saved by "
                    "torchcache.integrations.transformers.Trainer (a transformers.Trainer checkpoint), "
                    "so the data position is unknown. Pass ignore_data_skip=True in TrainingArguments "
                    "to start the data stream over, or Trainer(..., missing_loader_state='step') to "
                    f"start torchcache's stream at the checkpoint's step ({self.state.global_step}).")
            if loader.sampler.growing:
                raise ValueError(f"{path} not found, and missing_loader_state='step' needs the "
                                 "cache's final size to place the stream at a step: wait for the "
                                 "build to finish, or pass ignore_data_skip=True")
            position = _position_of_batch(loader, batches, steps_in_epoch)
            loader.sampler.set_position(position)
            return
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not a loader state ({error}); the file is damaged or "
                             "truncated: resume from another checkpoint, or pass "
                             "ignore_data_skip=True to start the data stream over") from error
        try:
            loader.load_state_dict(state)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{path}: {error}") from error
        if loader.sampler.growing:
            return  # the cache is still being built: its loader epochs (steps) are not fixed yet
        found = loader.step
        if found != batches:
            accumulation = self.args.gradient_accumulation_steps
            epochs, into = divmod(found, steps_in_epoch)
            step = epochs * steps_per_epoch + into // accumulation
            raise ValueError(
                f"{path} is at data batch {found} (global step {step}), but "
                f"{os.path.join(checkpoint, 'trainer_state.json')} says global_step "
                f"{self.state.global_step}, which is data batch {batches} (gradient_accumulation_steps="
                f"{accumulation}, {steps_in_epoch} batches per epoch): the loader state belongs to "
                "another checkpoint. Resume from a checkpoint folder as it was saved, or pass "
                "ignore_data_skip=True to start the data stream over.")

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        self._fix_epoch()
        super().log(logs, *args, **kwargs)

    def _fix_epoch(self) -> None:
        """In the resumed epoch, ``state.epoch`` as the uninterrupted run computes it (the Trainer
        counted the epoch's batches from the resume)."""
        if self._resume_position is None or self.state.epoch is None:
            return
        epoch, done, steps_in_epoch, start_step = self._resume_position
        since = (self.state.global_step - start_step) * self.args.gradient_accumulation_steps
        self.state.epoch = epoch + min(done + since, steps_in_epoch) / steps_in_epoch

    # ------------------------------------------------------------------------------ save
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._fix_epoch()
        super()._save_checkpoint(model, trial)
        if self._train_loader is None or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        # the loader has counted exactly the batches trained so far: the Trainer fetches a step's
        # gradient_accumulation_steps batches, trains them, then saves
        tmp = os.path.join(folder, LOADER_STATE_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._train_loader.state_dict(), f)
        os.replace(tmp, os.path.join(folder, LOADER_STATE_NAME))


class TrainerDataLoader(DataLoaderStateMixin, DataLoader):
    """The Trainer's ``tc.DataLoader``, with what the Trainer and accelerate read from the loaders
    ``accelerator.prepare`` makes (``DataLoaderShard``): ``total_batch_size``,
    ``total_dataset_length``, ``set_epoch``, and the accelerator's ``gradient_state``, in which it
    registers while iterated (``end_of_dataloader`` is set with the pass's last batch, known from
    its length: nothing is read ahead, so the state counts only the batches the Trainer got).

    ``keep_keys``: the batch keys to keep (the model's ``forward`` arguments), None: all.
    ``set_epoch`` records the Trainer's epoch only: the stream moves on by itself and the loaded
    state, not the epoch number, says where it is.
    """

    def __init__(self, *args: Any, keep_keys: frozenset[str] | None = None, num_processes: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gradient_state = GradientState()
        self._keep_keys = keep_keys
        self._num_processes = num_processes
        self._drop_last = self.drop_last  # (read by accelerate's DataLoaderStateMixin.begin)
        self.iteration = 0

    @property
    def total_batch_size(self) -> int:
        """Samples per step on all processes together, as accelerate's loaders say."""
        return self.batch_size * self._num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Record the Trainer's epoch (``iteration``); the data position is the loader's own."""
        self.iteration = epoch

    def __iter__(self) -> Iterator[Any]:
        inner = super().__iter__()
        unbounded = self.sampler.growing or self.sampler.infinite  # (no len(): no known last batch)
        return self._tracked(inner, None if unbounded else len(inner))

    def _tracked(self, inner: Iterator[Any], count: int | None) -> Iterator[Any]:
        self.begin()
        try:
            for index, batch in enumerate(inner):
                if index == count - 1:
                    self.end_of_dataloader = True
                if self._keep_keys is not None and isinstance(batch, Mapping):
                    batch = {key: value for key, value in batch.items() if key in self._keep_keys}
                yield batch
            self.iteration += 1
        finally:
            self.end()


TORCHCACHE_DATASETS = (TokenDataset, PackedDataset, DocumentDataset, MixtureDataset)


def is_torchcache_dataset(dataset: Any) -> bool:
    """True for torchcache's datasets (:data:`TORCHCACHE_DATASETS` and their subclasses), which
    the Trainer reads with its own sampler and loader; everything else goes to transformers'."""
    return isinstance(dataset, TORCHCACHE_DATASETS)


def _check_arguments(args: Any, dataset: Any) -> None:
    """TrainingArguments that torchcache's loader cannot honour are refused, not ignored."""
    name = type(dataset).__name__
    if getattr(args, "train_sampling_strategy", "random") != "random":
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: a torchcache {name} is read "
            "in its own keyed whole-epoch order (its samples have one length), so only 'random' "
            "(the default) applies; set train_sampling_strategy='random'")
    if not getattr(args, "dataloader_in_order", True):
        raise ValueError(f"dataloader_in_order=False: a torchcache {name}'s loader counts batches in "
                         "order for exact resume; leave dataloader_in_order=True (the default)")


def _position_of_batch(loader: DataLoader, batch: int, steps_in_epoch: int) -> int:
    """The stream position of data batch ``batch`` of a run started at 0 with this loader's
    batching: ``steps_in_epoch`` batches per loader epoch."""
    epochs, into = divmod(batch, steps_in_epoch)
    sampler = loader.sampler
    return epochs * sampler.epoch_size + into * loader.batch_size * sampler.world_size


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()
