"""Quick start on bundled data: build a cache in the background and read it while it grows.

    python examples/quickstart.py [--out runs/quickstart]
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time
from pathlib import Path

import torchcache as tc

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data"


def bundled_tokenizer(out: Path) -> str:
    path = out / "gpt2-tokenizer.json"
    if not path.exists():
        path.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/quickstart", help="working directory")
    parser.add_argument("--fresh", action="store_true", help="delete the working directory first")
    args = parser.parse_args()
    out = Path(args.out)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = bundled_tokenizer(out)
    cache_dir = out / "cache"

    print(f"building {cache_dir} in the background from {DATA / 'gutenberg_small.jsonl'}")
    handle = tc.build_cache(str(DATA / "gutenberg_small.jsonl"), cache_dir, tokenizer,
                            block_tokens=4096, background=True)
    while not (cache_dir / "manifest.json").exists():
        if handle.done:
            break
        time.sleep(0.05)
    cache = tc.TokenCache(cache_dir)
    while not handle.done:
        if cache.refresh():
            print(f"  reader sees {cache.num_blocks} committed blocks, {cache.num_tokens:,} tokens")
        time.sleep(0.05)
    result = handle.wait()
    cache.refresh()
    print(f"built: {result.num_tokens:,} tokens, {result.num_documents} documents, "
          f"{result.num_blocks} blocks in {result.seconds:.1f} s")
    problems = tc.verify_cache(cache_dir)
    print(f"verify: {'ok' if not problems else problems}")
    text = cache.decode(cache.document(1)[:40])
    print(f"document 1 starts: {text!r}")
    again = tc.build_cache(str(DATA / "gutenberg_small.jsonl"), cache_dir, tokenizer,
                           block_tokens=4096, progress=False)
    print(f"re-running the same build is a no-op: tokenized {again.tokens_built} tokens")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
