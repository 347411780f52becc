"""Pre-train a tiny GPT-2 with the Hugging Face Trainer on a torchcache cache, with exact resume.

    python examples/hf_trainer.py --out runs/hf --max-steps 12                # trains, saves every 6 steps
    python examples/hf_trainer.py --out runs/hf --max-steps 24 --resume       # continues from the last checkpoint
    torchrun --nproc_per_node 2 examples/hf_trainer.py --out runs/hf2 --max-steps 12

The one change to a Trainer script: `from torchcache.integrations.transformers import Trainer`
instead of `from transformers import Trainer` (pip install 'torchcache-lm[transformers]'). The
Trainer then trains on tc.DistributedSampler + tc.DataLoader (a keyed whole-epoch shuffle, each rank
its share), writes the loader's state into every checkpoint folder (torchcache_loader.json), and on
resume_from_checkpoint loads it instead of skipping batches: the resumed run sees exactly the
batches, and gets exactly the losses, of an uninterrupted one.

The cache is built from the bundled books (or --data) into OUT/cache on the first run (a no-op
afterwards). Hugging Face causal LMs shift the labels themselves, so the windows are read with
labels="same".
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

import torchcache as tc
from torchcache.integrations.transformers import Trainer

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", default="runs/hf", help="run directory (cache, checkpoints)")
p.add_argument("--data", default=str(DATA / "gutenberg_small.jsonl"), help="JSONL input(s) with a 'text' field")
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--save-steps", type=int, default=6)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--batch-size", type=int, default=8, help="per process")
p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
p.add_argument("--seed", type=int, default=0, help="model initialisation, dropout and the shuffle")
p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
args = p.parse_args()

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
tokenizer = out / "gpt2-tokenizer.json"
if not tokenizer.exists():
    tokenizer.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
# Under torchrun every process runs this line: the first builds, the others wait for the cache.
tc.build_cache(args.data, out / "cache", str(tokenizer), progress=False)

dataset = tc.TokenDataset(out / "cache", seq_len=args.seq_len, labels="same")
# Seed before building the model: its initial weights come from torch's global generator, so two
# fresh runs (or a fresh run and the one it is compared with after a resume) start alike.
set_seed(args.seed)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=args.seq_len))
training_args = TrainingArguments(
    output_dir=str(out / "checkpoints"),
    max_steps=args.max_steps,
    per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.accumulation,
    dataloader_num_workers=args.workers,
    learning_rate=1e-3,
    logging_steps=1,
    save_steps=args.save_steps,
    seed=args.seed,              # also the shuffle's seed (data_seed, if set, takes precedence)
    report_to="none",
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
trainer.train(resume_from_checkpoint=True if args.resume else None)
