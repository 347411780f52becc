"""Train a tiny speech-to-text model on webdataset tars of FLAC + transcripts, with exact resume.

    pip install 'torchcache-lm[audio,transformers]'   # soundfile (FLAC), transformers (log-mel)
    python examples/speech.py --out runs/speech --steps 40 --save-every 10
    python examples/speech.py --out runs/speech --steps 80 --resume       # continue to step 80
    python examples/speech.py --data 'my/speech-*.tar' --tokenizer tok/tokenizer.json ...

1. The cache: `tc.source(tars).map(featurize).tokenize(..., arrays=("input_features",))
   .cache(OUT/cache)`. `featurize` decodes each sample's FLAC with soundfile and computes Whisper's
   log-mel features (transformers' WhisperFeatureExtractor, built locally: no download), trimmed to
   the utterance's true frames (not padded to 30 s): float32 [frames, 80], stored beside the
   transcript's tokens (GPT-2's tokenizer by default). Built once; later runs find it complete.
2. Training: `tc.DocumentDataset(cache)` items (input_ids + input_features) batched by
   `tc.pad_collate` (features zero-padded, `input_features_shape` their true sizes), a GRU encoder
   over the features and a GRU decoder attending to it that predicts the transcript's next token
   (teacher-forced cross-entropy). `loader.state_dict()` is saved with the model and optimizer every
   --save-every steps, so `--resume` repeats an uninterrupted run's losses bit for bit (any number
   of DataLoader workers). Each step prints `step N loss X epoch E`; OUT/losses.jsonl keeps them.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchcache as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import DATA, save  # noqa: E402  (the bundled data and the atomic checkpoint)

SAMPLING_RATE = 16000
N_MELS = 80


def featurize(record: dict) -> dict:
    """A webdataset sample {"__key__", "flac": bytes, "txt": bytes, ...} -> {"text", "input_features"}:
    the transcript and Whisper's log-mel features of the audio, float32 [frames, 80] (10 ms frames)."""
    try:
        import soundfile
    except ImportError:
        raise ImportError("examples/speech.py reads FLAC with soundfile: "
                          "pip install 'torchcache-lm[audio]'") from None
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError:
        raise ImportError("examples/speech.py computes log-mel features with transformers: "
                          "pip install 'torchcache-lm[transformers]'") from None

    audio, rate = soundfile.read(io.BytesIO(record["flac"]), dtype="float32")
    if audio.ndim > 1:  # a multi-channel file: average the channels
        audio = audio.mean(axis=1)
    if rate != SAMPLING_RATE:
        raise ValueError(f"{record['__key__']}: {rate} Hz audio; the features expect {SAMPLING_RATE} Hz")
    extractor = WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=SAMPLING_RATE)
    # padding="longest" on one utterance: its own frames only (len(audio) // 160), not 30 s
    features = extractor(audio, sampling_rate=SAMPLING_RATE, padding="longest", truncation=False,
                         return_tensors="np")["input_features"][0]  # [80, frames]
    return {"text": record["txt"].decode("utf-8").strip(),
            "input_features": features.T.astype("float32", copy=True)}  # [frames, 80]


class SpeechToText(nn.Module):
    """GRU encoder over the features (4x fewer frames), GRU decoder with attention to the encoder.
    The vocabulary's embedding is factorised (vocab x 8, then 8 -> d) and tied to the output layer,
    which keeps the model at a few hundred thousand parameters with GPT-2's 50257 tokens."""

    def __init__(self, vocab: int, d: int = 64, e: int = 8):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(N_MELS, d, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Conv1d(d, d, 3, stride=2, padding=1), nn.GELU())
        self.encoder = nn.GRU(d, d, batch_first=True)
        self.tok = nn.Embedding(vocab, e)
        self.up, self.down = nn.Linear(e, d), nn.Linear(d, e)
        self.decoder = nn.GRU(d, d, batch_first=True)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, features: torch.Tensor, frames: torch.Tensor, ids: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        """features [B, F, 80] (zero-padded), frames [B] (true lengths), ids/labels [B, T] -> mean loss."""
        h = self.conv(features.transpose(1, 2)).transpose(1, 2)  # [B, ceil(F/4), d]
        h, _ = self.encoder(h)
        kept = (frames + 3) // 4  # encoder steps of each utterance's true frames
        padding = torch.arange(h.shape[1])[None, :] >= kept[:, None]  # True = ignore
        x, _ = self.decoder(self.up(self.tok(ids)))
        context, _ = self.attn(x, h, h, key_padding_mask=padding, need_weights=False)
        logits = F.linear(self.down(self.ln(x + context)), self.tok.weight)  # tied embedding
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/speech", help="run directory (cache, checkpoint, losses)")
    p.add_argument("--data", default="/work/shared/data/speech/*.tar",
                   help="webdataset tars of <key>.flac + <key>.txt (a glob, brace pattern or path)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the bundled GPT-2 one)")
    p.add_argument("--steps", type=int, default=40, help="train until this global step")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every k steps (and at the end)")
    p.add_argument("--stop-after", type=int, default=None, help="exit after N steps of this process")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if present")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--build-workers", type=int, default=1, help="build worker processes (featurize)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    return p.parse_args()


def build(out: Path, data: str, tokenizer: str | None, workers: int) -> tc.TokenCache:
    """Featurize and tokenize the tars into OUT/cache once; a finished build is found complete."""
    if tokenizer is None:
        tokenizer = str(out / "gpt2-tokenizer.json")
        if not Path(tokenizer).exists():
            Path(tokenizer).write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    return (tc.source(data).map(featurize)
            .tokenize(tokenizer, arrays=("input_features",), num_workers=workers, progress=False)
            .cache(out / "cache"))


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same reduction order in every run: bit-identical losses on resume
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = build(out, args.data, args.tokenizer, args.build_workers)
    print(f"cache: {cache.num_documents} utterances, {cache.num_tokens} tokens, "
          f"features {cache.document_arrays(0)['input_features'].shape} (document 0)")

    dataset = tc.DocumentDataset(cache)
    sampler = tc.DistributedSampler(dataset, shuffle=True, seed=args.seed)
    # pad_collate with next-token labels: the decoder reads a token and predicts the next one
    loader = tc.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                           num_workers=args.num_workers,
                           collate_fn=functools.partial(tc.pad_collate, labels="shifted"))
    torch.manual_seed(args.seed)  # the model's initialisation is the only randomness (no dropout)
    model = SpeechToText(cache.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    step, ckpt_path, losses_path = 0, out / "checkpoint.pt", out / "losses.jsonl"
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(json.loads(ckpt["loader"]))  # next batch: the one after step `step`
        step = ckpt["step"]
        print(f"resumed at step {step}, {loader.state_dict()['consumed']} samples consumed")
    # keep the loss log in step with the checkpoint: drop the lost work after it
    lines = losses_path.read_text().splitlines() if step and losses_path.exists() else []
    losses_path.write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= step))

    done_here, start = 0, time.perf_counter()
    while step < args.steps and done_here != args.stop_after:
        epoch = loader.state_dict()["consumed"] // sampler.epoch_size
        for batch in loader:  # runs to the end of the current loader epoch, then the next one
            loss = model(batch["input_features"], batch["input_features_shape"][:, 0],
                         batch["input_ids"], batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step, done_here = step + 1, done_here + 1
            print(f"step {step} loss {loss.item():.6f} epoch {epoch}", flush=True)
            with losses_path.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if step % args.save_every == 0 or step == args.steps:
                save(ckpt_path, model=model.state_dict(), optimizer=optimizer.state_dict(),
                     step=step, loader=json.dumps(loader.state_dict()))  # consumed samples
            if step >= args.steps or done_here == args.stop_after:
                break  # --stop-after: leave without saving, as a preempted job would
    if done_here:
        seconds = time.perf_counter() - start
        print(f"{done_here} steps in {seconds:.1f} s ({done_here / seconds:.2f} steps/s)")


if __name__ == "__main__":
    main()
