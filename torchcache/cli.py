"""The `torchcache` command line: build, convert-webdataset, info, verify, upgrade, show."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from . import __version__
from .build import build_cache
from .commit import acquire_lock
from .convert import convert_webdataset
from .ledger import upgrade
from .read import TokenCache
from .repair import repair_cache
from .storage import open_storage
from .verify import verify_cache


def _build(args: argparse.Namespace) -> int:
    result = build_cache(args.inputs, args.output, args.tokenizer, text_key=args.text_key,
                         block_tokens=args.block_tokens, num_workers=args.workers,
                         on_error=args.on_error, eos=_token_arg(args.eos), bos=_token_arg(args.bos),
                         special_tokens_as_text=not args.keep_special_tokens, progress=None,
                         allow_empty=args.allow_empty)
    return _summary(result)


def _convert(args: argparse.Namespace) -> int:
    options = dict(block_tokens=args.block_tokens, num_workers=args.workers, on_error=args.on_error,
                   progress=None, allow_empty=args.allow_empty)
    if args.tokenizer is None and (args.eos or args.bos) and not all(
            x is None or x.isdigit() for x in (args.eos, args.bos)):
        raise ValueError("without a tokenizer, --eos and --bos must be token ids")
    result = convert_webdataset(args.urls, args.output, tokenizer=args.tokenizer,
                                text_key=args.text_key, vocab_size=args.vocab_size,
                                eos_id=_token_arg(args.eos), bos_id=_token_arg(args.bos), **options)
    return _summary(result)


def _summary(result) -> int:
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items())) or "none"
    print(f"{result.path}: {result.num_tokens:,} tokens, {result.num_documents:,} documents, "
          f"{result.num_blocks} blocks; skipped: {skipped}")
    if result.already_complete:
        print("already complete: nothing to do")
    else:
        print(f"tokenized {result.tokens_built:,} tokens in {result.seconds:.1f} s "
              f"({result.tokens_per_second / 1e6:.2f}M tokens/s)")
    return 0


def _token_arg(value: str | None):
    if value is None or value.lower() == "none":
        return None
    return int(value) if value.isdigit() else value


def _build_state(cache: TokenCache) -> str:
    """complete, building (a builder holds the cache's lock now) or interrupted."""
    if cache.complete:
        return "complete"
    return "building" if open_storage(cache.url).lock().is_held() else "interrupted"


def _info(args: argparse.Namespace) -> int:
    cache = TokenCache(args.cache)
    lengths = cache.document_lengths()
    info = {
        "path": cache.root, "state": _build_state(cache), "complete": cache.complete, "fingerprint": cache.fingerprint,
        "tokens": cache.num_tokens, "documents": cache.num_documents, "blocks": cache.num_blocks,
        "document_tokens": ({f"p{q}": int(np.percentile(lengths, q)) for q in (0, 10, 50, 90, 99, 100)}
                            | {"mean": round(float(lengths.mean()), 1)}) if len(lengths) else {},
        "skipped": cache.skipped,
        "spec": {k: v for k, v in cache.spec.items() if k != "inputs"},
        "inputs": len(cache.spec["inputs"]),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    state = {"complete": "complete", "building": "still building",
             "interrupted": "interrupted: rerun the same build to resume it"}[info["state"]]
    print(f"{info['path']}  ({state})")
    print(f"  tokens     {cache.num_tokens:,}")
    print(f"  documents  {cache.num_documents:,}")
    print(f"  blocks     {cache.num_blocks}")
    if info["document_tokens"]:
        pct = "  ".join(f"{k}={v:,}" for k, v in info["document_tokens"].items())
        print(f"  doc length {pct}")
    print(f"  skipped    {info['skipped'] or 'none'}")
    spec = cache.spec
    tokenizer = spec["tokenizer"]["fingerprint"][:23] if spec["tokenizer"] else "none (pre-tokenized)"
    print(f"  tokenizer  {tokenizer}  vocab {spec['vocab_size']}  dtype {spec['dtype']}  "
          f"bos {spec['bos_id']}  eos {spec['eos_id']}")
    print(f"  inputs     {len(spec['inputs'])} (text key {spec['text_key']!r})")
    print(f"  fingerprint {cache.fingerprint}")
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    storage = open_storage(args.cache)
    lock = acquire_lock(storage)  # no builder may commit while the record is rewritten
    try:
        changed = upgrade(storage)
    finally:
        lock.release()
    print(f"{args.cache}: {'upgraded to' if changed else 'already in'} format v2")
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.repair:
        return _repair(args)
    problems = verify_cache(args.cache)
    for p in problems:
        print(f"BAD {p}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} bad file(s) in {args.cache}; `torchcache verify --repair "
              f"{args.cache}` rebuilds the damaged blocks from the inputs", file=sys.stderr)
        return 1
    print(f"{args.cache}: all checksums match")
    return 0


def _repair(args: argparse.Namespace) -> int:
    result = repair_cache(args.cache)
    for p in result.problems:
        print(f"BAD {p}", file=sys.stderr)
    for rel in result.repaired:
        print(f"rebuilt {rel}")
    if not result.problems:
        print(f"{args.cache}: all checksums match; nothing to repair")
        return 0
    remaining = verify_cache(args.cache)
    if remaining:
        for p in remaining:
            print(f"STILL BAD {p}", file=sys.stderr)
        return 1
    print(f"{args.cache}: repaired {len(result.repaired)} file(s); all checksums match now")
    return 0


def _token_range(text: str) -> tuple[int, int]:
    """`START:STOP`, or `N` for the first N tokens."""
    start, colon, stop = text.partition(":")
    try:
        return (int(start), int(stop)) if colon else (0, int(start))
    except ValueError:
        raise ValueError(f"--tokens {text!r}: give a range START:STOP of token positions, or a "
                         "count N for the first N, e.g. --tokens 0:100 or --tokens 100") from None


def _show(args: argparse.Namespace) -> int:
    cache = TokenCache(args.cache)
    if args.tokens:
        start, stop = _token_range(args.tokens)
        ids = cache.read(start, stop).astype(np.int64)
    else:
        ids = cache.document(args.document)
        key = cache.document_key(args.document)
        if key is not None:
            print(f"document {args.document}: sample key {key!r}", file=sys.stderr)
    if args.ids or cache.spec["tokenizer"] is None:
        print(" ".join(map(str, ids.tolist())))
    else:
        sys.stdout.write(cache.decode(ids))
        sys.stdout.write("\n")
    return 0


# The library's messages name Python arguments; on the command line, name the flags instead.
_FLAG_SPELLINGS = {"on_error='skip'": "--on-error skip", "allow_empty=True": "--allow-empty",
                   "text_key": "--text-key", "block_tokens": "--block-tokens",
                   "num_workers": "--workers"}


def _one_line(error: BaseException) -> str:
    """An error as one line for the terminal, in the command line's spelling."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename and str(error.filename) not in text:
        text = f"{error.filename}: {text}"
    text = text.splitlines()[0]
    for python, flag in _FLAG_SPELLINGS.items():
        text = text.replace(python, flag)
    return text


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchcache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torchcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="tokenize inputs into a cache (resumes an interrupted build)")
    b.add_argument("inputs", nargs="+", help="input files, globs or directories (fsspec URLs)")
    b.add_argument("-o", "--output", required=True, help="cache directory")
    b.add_argument("-t", "--tokenizer", required=True, help="tokenizer.json path")
    b.add_argument("--text-key", default="text", help="JSON field holding the text (default: text)")
    b.add_argument("--block-tokens", type=int, default=2 ** 24, help="target tokens per block")
    b.add_argument("-j", "--workers", type=int, default=None, help="worker processes (default: all cores)")
    b.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="stop at a malformed record (default) or skip and count it")
    b.add_argument("--eos", default="auto", help="EOS token id or string appended to each document, "
                                                  "'auto' (default) or 'none'")
    b.add_argument("--bos", default=None, help="BOS token id or string prepended to each document")
    b.add_argument("--keep-special-tokens", action="store_true",
                   help="let special-token strings inside documents become special tokens")
    b.add_argument("--allow-empty", action="store_true",
                   help="accept a build that yields no document (default: an error)")
    b.set_defaults(func=_build)

    c = sub.add_parser("convert-webdataset", help="convert WebDataset tars into a cache")
    c.add_argument("urls", nargs="+", help="shard URLs or paths; brace patterns like "
                                           "'shard-{000000..000099}.tar' are expanded")
    c.add_argument("-o", "--output", required=True, help="cache directory")
    c.add_argument("-t", "--tokenizer", default=None,
                   help="tokenizer.json for text samples; omit for pre-tokenized samples")
    c.add_argument("--text-key", default=None,
                   help="member holding the text (default txt; txt.gz, json:FIELD) or, without a "
                        "tokenizer, the token ids (default npy; safetensors, json, json:FIELD)")
    c.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size of pre-tokenized samples (sets the dtype, checks ids)")
    c.add_argument("--eos", default=None, help="EOS id (or string, with a tokenizer) to append")
    c.add_argument("--bos", default=None, help="BOS id (or string, with a tokenizer) to prepend")
    c.add_argument("--block-tokens", type=int, default=2 ** 24, help="target tokens per block")
    c.add_argument("-j", "--workers", type=int, default=None, help="worker processes")
    c.add_argument("--on-error", choices=("raise", "skip"), default="raise")
    c.add_argument("--allow-empty", action="store_true",
                   help="accept a conversion that yields no document (default: an error)")
    c.set_defaults(func=_convert)

    i = sub.add_parser("info", help="summarise a cache")
    i.add_argument("cache")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_info)

    v = sub.add_parser("verify", help="recompute all checksums; non-zero exit on any bad file")
    v.add_argument("cache")
    v.add_argument("--repair", action="store_true",
                   help="rebuild the damaged blocks from the inputs (byte-identical)")
    v.set_defaults(func=_verify)

    u = sub.add_parser("upgrade", help="convert a format v1 cache to v2 in place (crash-safe; "
                                       "same fingerprint, block files untouched)")
    u.add_argument("cache")
    u.set_defaults(func=_upgrade)

    s = sub.add_parser("show", help="decode a document or a token range")
    s.add_argument("cache")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("-d", "--document", type=int, help="document index")
    what.add_argument("--tokens", help="global token range START:STOP, or N for the first N tokens")
    s.add_argument("--ids", action="store_true", help="print token ids instead of text")
    s.set_defaults(func=_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, IndexError, TypeError, ImportError) as e:
        # bad input, a bad cache, a full or read-only disk: one line, no traceback
        print(f"torchcache {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; committed work is kept and re-running the same command resumes",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
