"""Fine-tune the tiny GPT of train_gpt.py on chat data mixed 80/20 with plain text, with exact resume.

    python examples/sft.py --out runs/sft --steps 40 --save-every 10
    python examples/sft.py --out runs/sft --steps 80 --resume        # continue to step 80

On the first run it writes OUT/chats.jsonl, multi-turn conversations made of the bundled books'
paragraphs (no chat data ships with the repository), and builds two caches with the same
tokenizer (GPT-2 plus the ChatML markers as special tokens):

- OUT/chat: `input_format="messages"`, rendered with a ChatML template; only what the assistant
  writes (its content and <|im_end|>) is trained: `train_on="assistant"`;
- OUT/text: the books as plain text, every token trained.

`tc.MixtureDataset` draws 80% of the windows from the chat cache and 20% from the text cache. Each
batch holds `input_ids`, `labels` (-100 where the target token is not trained) and `loss_mask`,
so the loss is the usual cross-entropy with ignore_index=-100. Each step prints its loss and the
fraction of trained targets; the loader's state is saved with the model, so a resumed run sees
exactly the batches an uninterrupted one would (same losses, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch

import torchcache as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import DATA, GPT, save  # noqa: E402  (the tiny model and the atomic checkpoint)

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}{% generation %}"
    "{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/sft", help="run directory (data, caches, checkpoint)")
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every k steps (and at the end)")
    p.add_argument("--stop-after", type=int, default=None, help="exit after N steps of this process")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if present")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def write_chats(path: Path, count: int = 400, seed: int = 0) -> None:
    """Conversations of 2 to 6 turns whose turns are consecutive paragraphs of a book."""
    with open(DATA / "gutenberg_small.jsonl", encoding="utf-8") as f:
        books = [json.loads(line)["text"] for line in f]
    paragraphs = [[p.strip() for p in b.split("\n\n") if p.strip()] for b in books]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(count):
            book = rng.choice(paragraphs)
            first = rng.randrange(len(book) - 6)
            turns = book[first: first + rng.randint(2, 6)]
            messages = [{"role": ("user", "assistant")[k % 2], "content": text[:400]}
                        for k, text in enumerate(turns)]
            out.write(json.dumps({"messages": messages}) + "\n")


def build(out: Path) -> tuple[Path, Path]:
    """The tokenizer, the conversations and both caches (re-running a finished build is a no-op)."""
    import gzip
    from tokenizers import Tokenizer
    tokenizer = out / "tokenizer" / "tokenizer.json"
    if not tokenizer.exists():
        tokenizer.parent.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer.from_str(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()).decode())
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok.save(str(tokenizer))
    chats = out / "chats.jsonl"
    if not chats.exists():
        write_chats(chats)
    tc.build_cache(str(chats), out / "chat", str(tokenizer), input_format="messages",
                   chat_template=CHATML, train_on="assistant", progress=False)
    tc.build_cache(str(DATA / "gutenberg_small.jsonl"), out / "text", str(tokenizer), progress=False)
    return out / "chat", out / "text"


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same reduction order in every run: bit-identical losses on resume
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chat, text = build(out)
    mixture = tc.MixtureDataset({"chat": tc.TokenDataset(chat, args.seq_len),
                                 "text": tc.TokenDataset(text, args.seq_len)},
                                {"chat": 0.8, "text": 0.2}, seed=args.seed)
    loader = tc.DataLoader(mixture, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                           num_workers=args.num_workers)
    torch.manual_seed(args.seed)
    model = GPT(tc.TokenCache(chat).vocab_size, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step, ckpt_path = 0, out / "checkpoint.pt"
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(json.loads(ckpt["loader"]))
        step = ckpt["step"]
        print(f"resumed at step {step}")
    done_here, trained, targets = 0, 0, 0
    while step < args.steps and done_here != args.stop_after:
        for batch in loader:
            loss = model(batch["input_ids"], batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step, done_here = step + 1, done_here + 1
            trained += int(batch["loss_mask"].sum())
            targets += batch["loss_mask"].numel()
            print(f"step {step} loss {loss.item():.6f} trained {batch['loss_mask'].float().mean().item():.3f}",
                  flush=True)
            if step % args.save_every == 0 or step == args.steps:
                save(ckpt_path, model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                     loader=json.dumps(loader.state_dict()))
            if step >= args.steps or done_here == args.stop_after:
                break
    if done_here:
        print(f"trained-token fraction: {trained / targets:.3f} of {targets} targets")


main()
