"""Builder throughput against plain `Tokenizer.encode_batch`, in one run on the same machine.

    python tools/bench_build.py [--corpus DIR] [--tokenizer tokenizer.json] [--workers N]
    python tools/bench_build.py --chat CHAT_DIR [--tokenizer tokenizer.json] [--workers N]
    python tools/bench_build.py --backend tiktoken|sentencepiece [--megabytes 20] [--workers 2]

Prints tokens/s of the baseline (whole-document encode_batch, encoding time only, per shard) and of
`build_cache` (everything: reading, tokenizing, writing, fsync), their ratio, whether the ids are
identical, and the builder's peak RSS (whole process tree) on the full corpus and on a fifth of it.

With --chat (a corpus of tools/make_chat_corpus.py): a chat build (input_format="messages", a
ChatML template, the tokenizer with its markers added) against a text build of the same rendered
text, in the same run (two rounds, each order once; the mean time of each): tokens/s of each and
their ratio, whether the ids are identical, the bytes of the loss mask (and of the whole documents
sidecars) against the token bytes, and reading (tc.DataLoader over TokenDataset(cache, 2048),
shuffled batches of 16, in-process and with 2 workers) with the mask against reading the text
cache without one.

With --backend: a tiktoken (GPT-2's ranks) or SentencePiece build (a unigram model of 8,000 pieces
trained first on 2 MB of the corpus, or --sp-model) of the first --megabytes of the corpus, side by
side with that library's own fastest batched encode of the same documents (tiktoken:
encode_ordinary_batch with num_threads=workers; sentencepiece: encode with num_threads=workers,
encoding time only): tokens/s of each, their ratio, and whether every id is the library's own.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
from tokenizers import Tokenizer

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def baseline(shards: list[str], tokenizer: str) -> tuple[float, list[list[list[int]]]]:
    tok = Tokenizer.from_file(tokenizer)
    seconds, ids = 0.0, []
    for path in shards:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        t = time.perf_counter()
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        seconds += time.perf_counter() - t
        ids.append([e.ids for e in encoded])
    return seconds, ids


def build_with_rss(shards: list[str], tokenizer: str, out: str, workers: int | None) -> tuple[float, float]:
    """Run build_cache in a child process; return (seconds, peak RSS of the process tree in MB)."""
    code = ("import sys, json, torchcache as tc; "
            "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
            "num_workers=json.loads(sys.argv[4]), progress=False)")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(shards), out, tokenizer,
                             json.dumps(workers)])
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            rss = 0
        peak = max(peak, rss)
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"build failed with exit code {proc.returncode}")
    return time.perf_counter() - start, peak / 2 ** 20


def cache_ids_by_input(out: str) -> list[list[list[int]]]:
    import torchcache as tc
    from torchcache.format.blocks import read_tensor_file
    from torchcache.format.ledger import read_manifest
    cache = tc.TokenCache(out)
    manifest = read_manifest(out)
    per_input: dict[int, list[list[int]]] = {}
    starts = cache.block_token_starts()
    for b, entry in sorted(enumerate(manifest["blocks"]), key=lambda x: (x[1]["input"], x[1]["index"])):
        tokens = cache.read(int(starts[b]), int(starts[b + 1])).astype(np.int64)
        offsets = read_tensor_file(os.path.join(out, entry["offsets"]), "offsets")
        docs = per_input.setdefault(entry["input"], [])
        docs.extend(tokens[offsets[i]:offsets[i + 1] - 1].tolist() for i in range(len(offsets) - 1))
    return [per_input[i] for i in sorted(per_input)]


CHATML = (  # a ChatML template written for this benchmark (no generation tags: turn renderings)
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def timed_build(inputs: list[str], out: str, tokenizer: str, workers: int | None, **options) -> float:
    """Seconds a build_cache run takes in a child process (interpreter start included)."""
    code = ("import sys, json, torchcache as tc; "
            "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
            "num_workers=json.loads(sys.argv[4]), progress=False, **json.loads(sys.argv[5]))")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, json.dumps(inputs), out, tokenizer,
                    json.dumps(workers), json.dumps(options)], check=True)
    return time.perf_counter() - start


def chat_comparison(chat_dir: str, tokenizer: str, workers: int | None) -> None:
    """A chat build against a text build of the same rendered text; mask storage; masked reads."""
    import torchcache as tc
    from torchcache.builder.chat import ChatTemplate, normalize_messages
    shards = sorted(glob.glob(os.path.join(chat_dir, "*.jsonl")))
    if not shards:
        raise SystemExit(f"no *.jsonl in {chat_dir}")
    template = ChatTemplate(CHATML)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.from_file(tokenizer)
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok_path = os.path.join(tmp, "tokenizer.json")
        tok.save(tok_path)
        rendered = []
        for k, shard in enumerate(shards):  # the text each conversation renders to, as text records
            path = os.path.join(tmp, f"rendered-{k}.jsonl")
            with open(shard, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
                for line in f:
                    text = template.render_text(normalize_messages(json.loads(line), "messages"))
                    out.write(json.dumps({"text": text}) + "\n")
            rendered.append(path)
        chat, text = os.path.join(tmp, "chat"), os.path.join(tmp, "text")
        text_s = chat_s = 0.0
        for first in ("text", "chat"):  # two rounds, each order once (the machine is noisy)
            for out in (chat, text):
                shutil.rmtree(out, ignore_errors=True)
            for kind in (first, "chat" if first == "text" else "text"):
                if kind == "text":
                    text_s += timed_build(rendered, text, tok_path, workers,
                                          special_tokens_as_text=False) / 2
                else:
                    chat_s += timed_build(shards, chat, tok_path, workers, input_format="messages",
                                          chat_template=CHATML) / 2
        chat_cache, text_cache = tc.TokenCache(chat), tc.TokenCache(text)
        n = chat_cache.num_tokens
        same = n == text_cache.num_tokens and bool(np.array_equal(chat_cache.read(0, n),
                                                                   text_cache.read(0, n)))
        for what, seconds in (("text build of the rendered text", text_s),
                              ("chat build (messages, ChatML)  ", chat_s)):
            print(f"{what}: {n:,} tokens in {seconds:.1f} s = {n / seconds / 1e6:.3f} M tokens/s")
        print(f"ids identical: {same}; trained fraction {chat_cache.loss_mask(0, n).mean():.3f}")
        files = [os.path.join(chat, "blocks", f) for f in os.listdir(os.path.join(chat, "blocks"))]
        token_bytes = sum(os.path.getsize(f) for f in files if os.path.basename(f).count(".") == 1)
        sidecars = [f for f in files if f.endswith(".docs.safetensors")]
        mask_bytes = sum(_tensor_bytes(p, "mask") for p in sidecars)
        docs_bytes = sum(os.path.getsize(p) for p in sidecars)
        print(f"mask storage: {mask_bytes:,} bytes = {mask_bytes / token_bytes:.2%} of the {token_bytes:,} "
              f"token bytes (documents sidecars in all: {docs_bytes / token_bytes:.2%})")
        rates = {}
        for workers_read in (0, 2):  # the recommended in-process loader, and 2 workers
            for name, cache in (("text", text_cache), ("chat", chat_cache)):
                rates[name, workers_read] = loader_rate(tc.TokenDataset(cache, 2048), workers_read)
            print(f"reading (tc.DataLoader, batches of 16 x 2048, shuffled, num_workers={workers_read}): "
                  f"without mask {rates['text', workers_read]:.0f} batches/s, with mask "
                  f"{rates['chat', workers_read]:.0f} batches/s")
        print(f"RATIO chat build / text build tokens/s: {text_s / chat_s:.2f}x")
        print(f"RATIO mask storage / token bytes: {mask_bytes / token_bytes:.4f}")
        for w in (0, 2):
            print(f"RATIO reading with mask / without, num_workers={w}: "
                  f"{rates['chat', w] / rates['text', w]:.2f}x")
        if not same:
            raise SystemExit("the chat cache's ids differ from the text cache's")


def loader_rate(ds, workers: int, passes: int = 5) -> float:
    """Batches/s of a shuffled pass of the loader (after its first batch), best of `passes`."""
    import torchcache as tc
    best = 0.0
    for p in range(passes):
        loader = tc.DataLoader(ds, batch_size=16, shuffle=True, seed=p, num_workers=workers)
        batches = iter(loader)
        batch = next(batches)
        start, n = time.perf_counter(), 0
        for batch in batches:
            n += 1
        best = max(best, n / (time.perf_counter() - start))
    assert ("loss_mask" in batch) == ds.has_loss_mask
    return best


def _tensor_bytes(path: str, name: str) -> int:
    """Bytes of tensor `name` in a safetensors file (0 when it has none)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    begin, end = header.get(name, {}).get("data_offsets", (0, 0))
    return end - begin


def corpus_slice(corpus: str, megabytes: float, out_dir: str) -> list[str]:
    """The corpus's first `megabytes` of documents, as two JSON lines inputs (one per worker)."""
    docs, size = [], 0
    for path in sorted(glob.glob(os.path.join(corpus, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                docs.append(text)
                size += len(text.encode("utf-8"))
                if size >= megabytes * 1e6:
                    break
        if size >= megabytes * 1e6:
            break
    half, at, paths = size / 2, 0, []
    cut = next((i for i, d in enumerate(docs) if (at := at + len(d.encode("utf-8"))) >= half), len(docs) - 1) + 1
    for k, part in enumerate((docs[:cut], docs[cut:])):
        paths.append(os.path.join(out_dir, f"part-{k}.jsonl"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in part)
    print(f"corpus slice: {len(docs):,} documents, {size / 1e6:.1f} MB of text in 2 inputs")
    return paths


def backend_comparison(args: argparse.Namespace) -> None:
    workers = args.workers or 2
    with tempfile.TemporaryDirectory() as tmp:
        inputs = corpus_slice(args.corpus, args.megabytes, tmp)
        texts = [[json.loads(line)["text"] for line in open(p, encoding="utf-8")] for p in inputs]
        if args.backend == "tiktoken":
            import tiktoken
            import torchcache as tc
            ranks = os.path.join(SHARED, "tokenizers", "gpt2", "gpt2.tiktoken")
            tok = tc.tiktoken_tokenizer(ranks, special_tokens={"<|endoftext|>": 50256})
            enc = tiktoken.Encoding("gpt2", pat_str=tok.pattern, mergeable_ranks=tok.ranks,
                                    special_tokens=tok.specials)
            spec, what = f"tiktoken:{ranks}", f"tiktoken {tiktoken.__version__} encode_ordinary_batch"
            encode = lambda docs: enc.encode_ordinary_batch(docs, num_threads=workers)  # noqa: E731
        else:
            import sentencepiece as spm
            spec = args.sp_model
            if spec is None:
                spec = os.path.join(tmp, "sp.model")
                with open(os.path.join(tmp, "train.txt"), "w", encoding="utf-8") as f:
                    f.write("\n".join(texts[0])[:2_000_000])
                spm.SentencePieceTrainer.train(input=os.path.join(tmp, "train.txt"),
                                               model_prefix=spec[:-6], vocab_size=8000,
                                               model_type="unigram", minloglevel=2)
            sp = spm.SentencePieceProcessor(model_file=spec)
            what = f"sentencepiece {spm.__version__} encode(num_threads={workers})"
            encode = lambda docs: sp.encode(docs, num_threads=workers)  # noqa: E731
        seconds, ids = 0.0, []
        for docs in texts:
            t = time.perf_counter()
            ids.append(encode(docs))
            seconds += time.perf_counter() - t
        n_tokens = sum(len(d) for part in ids for d in part)
        print(f"baseline {what}: {n_tokens:,} tokens in {seconds:.2f} s = "
              f"{n_tokens / seconds / 1e6:.3f} M tokens/s (encoding time only)")
        out = os.path.join(tmp, "cache")
        code = ("import sys, json, torchcache as tc; r = tc.build_cache(json.loads(sys.argv[1]), "
                "sys.argv[2], sys.argv[3], num_workers=int(sys.argv[4]), progress=False); "
                "print(r.seconds)")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code, json.dumps(inputs), out, spec,
                               str(workers)], check=True, capture_output=True, text=True)
        build_s, inner_s = time.perf_counter() - start, float(done.stdout.split()[-1])
        print(f"build_cache ({args.backend}, {workers} workers): {n_tokens:,} tokens in {build_s:.2f} s "
              f"= {n_tokens / build_s / 1e6:.3f} M tokens/s (wall clock incl. interpreter start, "
              f"reading, writing, fsync); {inner_s:.2f} s = {n_tokens / inner_s / 1e6:.3f} M "
              f"tokens/s inside build_cache (workers' start included, the interpreter's not)")
        identical = cache_ids_by_input(out) == ids
        print(f"ids identical to {args.backend}'s own encode: {identical}")
    print(f"RATIO builder / baseline tokens/s: {seconds / build_s:.2f}x (wall clock), "
          f"{seconds / inner_s:.2f}x (inside build_cache)")
    if not identical:
        raise SystemExit(f"ids differ from {args.backend}'s own encode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    parser.add_argument("--workers", type=int, default=None, help="builder workers (default: all cores)")
    parser.add_argument("--chat", default=None, help="a chat corpus (tools/make_chat_corpus.py): "
                                                     "compare a chat build with a text build")
    parser.add_argument("--backend", choices=["tiktoken", "sentencepiece"], default=None,
                        help="compare a tiktoken or SentencePiece build with that library's own "
                             "batched encode")
    parser.add_argument("--megabytes", type=float, default=20, help="for --backend: corpus MB")
    parser.add_argument("--sp-model", default=None, help="for --backend sentencepiece: a .model "
                                                         "(default: one trained here)")
    args = parser.parse_args()
    if args.backend:
        return backend_comparison(args)
    if args.chat:
        return chat_comparison(args.chat, args.tokenizer, args.workers)
    shards = sorted(glob.glob(os.path.join(args.corpus, "*.jsonl")))
    if not shards:
        raise SystemExit(f"no *.jsonl in {args.corpus}")
    size = sum(os.path.getsize(s) for s in shards)
    print(f"corpus: {len(shards)} shards, {size / 1e6:.1f} MB; cores: {os.cpu_count()}")

    base_s, base_ids = baseline(shards, args.tokenizer)
    n_tokens = sum(len(d) for shard in base_ids for d in shard)
    print(f"baseline encode_batch (whole documents): {n_tokens:,} tokens in {base_s:.1f} s = "
          f"{n_tokens / base_s / 1e6:.3f} M tokens/s")

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cache")
        build_s, peak = build_with_rss(shards, args.tokenizer, out, args.workers)
        print(f"build_cache: {n_tokens:,} tokens in {build_s:.1f} s = {n_tokens / build_s / 1e6:.3f} M "
              f"tokens/s (wall clock incl. process start), peak RSS {peak:.0f} MB")
        identical = cache_ids_by_input(out) == base_ids
        print(f"ids identical to whole-document encoding: {identical}")
        small = shards[: max(1, len(shards) // 5)]
        _, small_peak = build_with_rss(small, args.tokenizer, os.path.join(tmp, "small"), args.workers)
    print(f"peak RSS on {len(small)} shard(s): {small_peak:.0f} MB; on {len(shards)}: {peak:.0f} MB "
          f"(ratio {peak / small_peak:.2f})")
    print(f"RATIO builder / baseline tokens/s: {base_s / build_s:.2f}x")
    if not identical:
        raise SystemExit("ids differ from whole-document encoding")


if __name__ == "__main__":
    main()
