"""Train the tiny GPT of train_gpt.py with Lightning 2.x; the loader's state is in the checkpoint.

    pip install "torchcache-lm[lightning]"
    python examples/train_lightning.py --out runs/lightning --steps 6            # writes OUT/last.ckpt
    python examples/train_lightning.py --out runs/lightning --steps 12 --resume  # continues to step 12
    torchrun --nproc_per_node 2 examples/train_lightning.py --out runs/lightning2 --steps 6
    python examples/train_lightning.py --out runs/steps --steps 6 --infinite     # step-based

`train_dataloader` returns a `tc.DataLoader` over a `tc.DistributedSampler`. Nothing else is
needed, with Lightning's defaults:

- under DDP, Lightning leaves the sampler in place (it is a `torch.utils.data.DistributedSampler`
  subclass, so `use_distributed_sampler=True` does not wrap it in a second split); it takes its
  rank and world size from the process group Lightning set up before calling `train_dataloader`;
- Lightning's checkpoints hold the loader's `state_dict()` (a count of the samples the training
  loop received), and `fit(ckpt_path=...)` loads it: the resumed run sees exactly the batches an
  uninterrupted one would (same losses, bit for bit), also with another number of processes
  (the global stream continues).
- step-based training (`--infinite`: an infinite sampler, so the loader has no len() and
  Lightning fetches one batch ahead of the training step) resumes exactly too: the loader leaves
  the batch Lightning holds out of its state. The same for checkpoints that a
  `ModelCheckpoint(every_n_train_steps=...)` writes during training.

Each step prints `step N loss X`. Runs in a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

import lightning as L
import torch

import torchcache as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import DATA, GPT  # noqa: E402  (the tiny model)

VOCAB = 50257  # GPT-2's tokenizer, bundled in tests/data


class LitGPT(L.LightningModule):
    def __init__(self, cache: str, seq_len: int, batch_size: int, seed: int, lr: float,
                 infinite: bool = False) -> None:
        super().__init__()
        self.cache, self.seq_len, self.batch_size, self.seed, self.lr = cache, seq_len, batch_size, seed, lr
        self.infinite = infinite
        torch.manual_seed(seed)
        self.model = GPT(VOCAB, seq_len)

    def prepare_data(self) -> None:
        # Lightning calls this on one process (local rank 0) and the others wait for it.
        build(Path(self.cache).parent)

    def train_dataloader(self) -> tc.DataLoader:
        # Called after Lightning set up the process group: the sampler takes rank and world size.
        dataset = tc.TokenDataset(self.cache, self.seq_len)
        sampler = tc.DistributedSampler(dataset, shuffle=True, seed=self.seed, infinite=self.infinite)
        return tc.DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["input_ids"], batch["labels"])
        if self.global_rank == 0:
            print(f"step {self.global_step + 1} loss {loss.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def build(out: Path) -> None:
    """Tokenize the bundled books into OUT/cache once (a no-op afterwards)."""
    tokenizer = out / "gpt2-tokenizer.json"
    if not tokenizer.exists():
        tokenizer.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    tc.build_cache(str(DATA / "gutenberg_small.jsonl"), out / "cache", str(tokenizer), progress=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/lightning")
    p.add_argument("--steps", type=int, default=6, help="train until this global step")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.ckpt")
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--infinite", action="store_true",
                   help="an infinite sampler (step-based training: epochs never end)")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: one device per process
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = LitGPT(str(out / "cache"), args.seq_len, args.batch_size, args.seed, args.lr, args.infinite)
    ckpt = out / "last.ckpt"
    trainer.fit(model, ckpt_path=str(ckpt) if args.resume and ckpt.exists() else None)
    trainer.save_checkpoint(ckpt)  # the loader's state goes in: trainer.fit_loop saves it
    if trainer.global_rank == 0:
        print(f"saved {ckpt} at step {trainer.global_step}, "
              f"{trainer.train_dataloader.consumed} samples consumed")


if __name__ == "__main__":
    main()
