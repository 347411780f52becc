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
from functools import partial
from typing import Any

import torch

from ..train.loader import DataLoader
from ..train.sampler import DistributedSampler

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "torchcache.integrations.transformers needs the transformers package: "
        "pip install 'torchcache-lm[transformers]' (or pip install transformers)") from error

__all__ = ["LOADER_STATE_NAME", "Trainer"]

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(transformers.Trainer.__init__).bind_partial(None, *args, **kwargs)
        self._train_collate = bound.arguments.get("data_collator")  # only one passed explicitly
        self._train_loader: DataLoader | None = None
        self._resume_position: tuple[int, int, int, int] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------ loading
    def get_train_dataloader(self) -> DataLoader:
        """A ``tc.DataLoader`` over ``train_dataset`` with a ``tc.DistributedSampler`` for this rank."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampler = DistributedSampler(self.train_dataset, num_replicas=args.world_size,
                                     rank=args.process_index, shuffle=True, seed=seed,
                                     drop_last=args.dataloader_drop_last)
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
        pin = bool(args.dataloader_pin_memory) and _accelerator_available()
        self._train_loader = DataLoader(self.train_dataset, batch_size=self._train_batch_size,
                                        sampler=sampler, num_workers=workers, collate_fn=self._train_collate,
                                        pin_memory=pin, generator=generator, **options)
        return self._train_loader

    def _prepare_inputs(self, inputs: Any) -> Any:
        if self.args.remove_unused_columns and isinstance(inputs, dict):
            self._set_signature_columns_if_needed()
            accepted = set(self._signature_columns or ())
            if accepted:
                inputs = {key: value for key, value in inputs.items() if key in accepted}
        return super()._prepare_inputs(inputs)

    # ------------------------------------------------------------------------------ resume
    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch,
                   trial, ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        """The resumed epoch continues from the loaded loader state instead of skipping batches:
        the Trainer is told the epoch's remaining batches, with nothing to skip (it then restores
        its RNG state before the first batch, as at an epoch's start)."""
        done = 0
        if (resume_from_checkpoint is not None and epoch == epochs_trained
                and train_dataloader is self._train_loader and not self.args.ignore_data_skip):
            self._load_loader_state(resume_from_checkpoint)
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

    def _load_loader_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, LOADER_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found: this checkpoint was not saved by "
                "torchcache.integrations.transformers.Trainer, so the data position is unknown. "
                "Pass ignore_data_skip=True in TrainingArguments to start the data stream over.")
        with open(path, encoding="utf-8") as f:
            self._train_loader.load_state_dict(json.load(f))

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


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()
