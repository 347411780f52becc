"""Train a tiny GPT on a torchcache cache, with exact resume, on one process or many.

    python examples/train_gpt.py --out runs/gpt --steps 100 --save-every 20
    python examples/train_gpt.py --out runs/gpt --steps 200 --resume       # continue to step 200
    torchrun --nproc_per_node 2 examples/train_gpt.py --out runs/gpt2 --steps 100
    python examples/train_gpt.py --out runs/gpt-pack --steps 100 --pack    # whole documents per row

The cache is built from the bundled books (or --data) into OUT/cache on the first run (a no-op
afterwards). The whole data-loading state is `loader.state_dict()`: a count of the samples the
training loop received. Saved next to the model and optimizer, it makes a resumed run see exactly
the batches an uninterrupted one would have: same losses, bit for bit, with any number of
DataLoader workers. A resume with another number of processes (same global --batch-size) continues
the same global stream of samples. Each step prints `step N loss X epoch E`; OUT/losses.jsonl keeps
the losses.

With --pack the rows are `tc.PackedDataset` rows (whole documents packed into seq_len tokens, then
padding) instead of `tc.TokenDataset` windows: the positional embedding takes the rows'
position_ids (restarting at 0 at each document) and attention is document-masked (a token attends
to earlier tokens of its own document only), a dense [B, 1, T, T] mask for
`F.scaled_dot_product_attention` that works on any device (on a GPU, flex_attention's document
mask or a varlen kernel fed `cu_seqlens` avoid the T x T mask). Labels are -100 across documents
and on padding, which the loss ignores. Save and resume work the same way.

On CPU most of a step is the 50257-way softmax over large temporary buffers; with glibc,
`MALLOC_MMAP_MAX_=0` (keep big buffers instead of returning them to the OS) makes it much faster.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchcache as tc

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        if mask is None:  # no dropout: deterministic
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [B, 1, T, T] of packed rows (True = attend): a token sees the
    earlier tokens of its own document (positions restart at 0 at each one; padding is one more)."""
    segment = (position_ids == 0).cumsum(1)  # [B, T]: which document each token belongs to
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)  # small logits at init: loss starts near ln(vocab)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss over labels != -100; position_ids (packed rows) also masks attention to documents."""
        if position_ids is None:  # windows of the token stream: plain causal attention
            x, mask = self.tok(ids) + self.pos(torch.arange(ids.shape[1])), None
        else:
            x, mask = self.tok(ids) + self.pos(position_ids), document_mask(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = F.linear(self.ln(x), self.tok.weight)  # tied input/output embeddings
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/train_gpt", help="run directory (cache, checkpoint, losses)")
    p.add_argument("--data", default=str(DATA / "gutenberg_small.jsonl"), help="jsonl with a 'text' field")
    p.add_argument("--steps", type=int, default=100, help="train until this global step")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every k steps (and at the end)")
    p.add_argument("--stop-after", type=int, default=None, help="exit after N steps of this process")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if present")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (split across processes)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--pack", action="store_true",
                   help="train on whole documents packed into rows (tc.PackedDataset), document-masked")
    p.add_argument("--block-tokens", type=int, default=1 << 16, help="cache block size (tokens)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    return p.parse_args()


def build(out: Path, data: str, block_tokens: int) -> Path:
    """Tokenize `data` into OUT/cache once; re-running a finished build is a cheap no-op."""
    tokenizer = out / "gpt2-tokenizer.json"
    if not tokenizer.exists():
        tokenizer.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    tc.build_cache(data, out / "cache", str(tokenizer), block_tokens=block_tokens, progress=False)
    return out / "cache"


def save(path: Path, **state) -> None:
    """Write to a temporary file, then rename: a kill never leaves a half-written checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same reduction order in every run: bit-identical losses on resume
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {world} processes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        build(out, args.data, args.block_tokens)
        if args.pack:  # plan the packing once (stored in OUT/cache/packs); later opens map the plan
            tc.PackedDataset(out / "cache", args.seq_len)
    if distributed:
        dist.barrier()  # the other ranks wait for rank 0's build

    if args.pack:
        dataset = tc.PackedDataset(out / "cache", args.seq_len)
    else:
        dataset = tc.TokenDataset(out / "cache", args.seq_len)
    # rank and world size from torch.distributed
    sampler = tc.DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = tc.DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                           num_workers=args.num_workers)
    torch.manual_seed(args.seed)  # the model's initialisation is the only randomness (no dropout)
    model = GPT(dataset.cache.vocab_size, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    step, ckpt_path, losses_path = 0, out / "checkpoint.pt", out / "losses.jsonl"
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(json.loads(ckpt["loader"]))  # next batch: the one after step `step`
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step}, {loader.state_dict()['consumed']} samples consumed")
    if rank == 0:  # keep the loss log in step with the checkpoint: drop the lost work after it
        lines = losses_path.read_text().splitlines() if step and losses_path.exists() else []
        losses_path.write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= step))
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model

    done_here, start = 0, time.perf_counter()
    while step < args.steps and done_here != args.stop_after:
        epoch = loader.state_dict()["consumed"] // sampler.epoch_size
        for batch in loader:  # runs to the end of the current loader epoch, then the next one
            loss = ddp(batch["input_ids"], batch["labels"], batch.get("position_ids"))  # positions: --pack rows only
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step, done_here = step + 1, done_here + 1
            loss = loss.detach()
            if distributed:  # the mean of the ranks' losses (per-rank batches have equal sizes)
                dist.all_reduce(loss)
                loss /= world
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f} epoch {epoch}", flush=True)
                with losses_path.open("a") as f:
                    f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if rank == 0 and (step % args.save_every == 0 or step == args.steps):
                save(ckpt_path, model=model.state_dict(), optimizer=optimizer.state_dict(),
                     step=step, loader=json.dumps(loader.state_dict()))  # consumed samples
            if step >= args.steps or done_here == args.stop_after:
                break  # --stop-after: leave without saving, as a preempted job would
    if rank == 0 and done_here:
        seconds = time.perf_counter() - start
        print(f"{done_here} steps in {seconds:.1f} s ({done_here / seconds:.2f} steps/s)")
    if distributed:
        dist.barrier()  # leave together: a rank still saving must not lose its peers mid-call
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
