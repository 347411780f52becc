"""The `torchcache` command line: build, convert-webdataset, info, pack, mix plan, verify,
upgrade, show, trace, bench.

Every command that takes a cache or inputs reads them from fsspec URLs too (s3://, gs://...):
`--storage-option KEY=VALUE` (repeatable) passes the store's options, and a refusal by the store
(no or wrong credentials, a missing bucket, an unreachable endpoint) is one line naming the URL.

`torchcache pack CACHE --seq-len N` computes the pack plan a PackedDataset of that seq_len
reads (in parallel, stored under CACHE/packs or --plan-dir), so training starts at once;
`torchcache info CACHE` lists the plans stored for the cache. `torchcache mix plan recipe.yaml`
plans a mixture schedule over caches before the run (samples, tokens, epochs per source).
`torchcache trace RECIPE_OR_CACHE --step N` prints what a training step read: each sample's
documents, input files and records. `torchcache bench CACHE --seq-len N --batch-size B --step-ms S`
says whether a GPU with that step time would wait for the cache's data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

import torchcache

from . import __version__
from ._util.args import POSITION_LIMIT, int_arg, optional_int_arg
from ._util.flags import command_line_spelling
from .builder.api import build_cache
from .builder.commit import acquire_lock
from .builder.convert import convert_webdataset
from .builder.chat import TRAIN_ON
from .builder.engine import default_workers, progress_enabled
from .builder.formats import INPUT_FORMATS
from .builder.repair import repair_cache
from .builder.verify import Problem, check_cache, verify_cache
from .format import blocks as fmt
from .format.ledger import HEAD_NAME, upgrade
from .format.storage import is_remote, open_storage
from .format.store_errors import ENDPOINT_EXAMPLE, store_message
from .order.packing import LONG_DOCS
from .read.cache import TokenCache
from .read.cache_files import locate_cache
from .read.pack_plan import PackPlan, PlanIdentity, default_plan_root, list_plans, plan_identity
from .train.recipe import RecipeError, load_recipe, plan_recipe
from .train.step_bench import bench_steps


def _build(args: argparse.Namespace) -> int:
    result = build_cache(args.inputs, args.output, args.tokenizer, text_key=args.text_key,
                         block_tokens=args.block_tokens, num_workers=args.workers,
                         on_error=args.on_error, eos=_token_arg(args.eos), bos=_token_arg(args.bos),
                         special_tokens_as_text=_special_tokens_as_text(args), progress=None,
                         storage_options=args.storage_options, allow_empty=args.allow_empty,
                         vocab_size=args.vocab_size,
                         input_format=args.input_format, chat_template=args.chat_template,
                         train_on=args.train_on, keep_fields=tuple(args.keep_field))
    return _summary(result)


def _special_tokens_as_text(args: argparse.Namespace) -> bool | None:
    """--keep-special-tokens as build_cache takes it: for messages the rendering's special tokens
    are always tokens (None lets the library decide), for other formats they are text unless given."""
    if args.input_format == "messages":
        return None
    return not args.keep_special_tokens


def _convert(args: argparse.Namespace) -> int:
    options = dict(block_tokens=args.block_tokens, num_workers=args.workers, on_error=args.on_error,
                   progress=None, storage_options=args.storage_options, allow_empty=args.allow_empty)
    if args.tokenizer is None and (args.eos or args.bos) and not all(
            x is None or x.isdigit() for x in (args.eos, args.bos)):
        raise ValueError("without a tokenizer, --eos and --bos must be token ids")
    result = convert_webdataset(args.urls, args.output, tokenizer=args.tokenizer,
                                text_key=args.text_key, vocab_size=args.vocab_size,
                                eos_id=_token_arg(args.eos), bos_id=_token_arg(args.bos), **options)
    return _summary(result)


def _summary(result) -> int:
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items())) or "none"
    print(f"{result.path}: {_plural(result.num_tokens, 'token')}, "
          f"{_plural(result.num_documents, 'document')}, {_plural(result.num_blocks, 'block')}; "
          f"skipped: {skipped}")
    if result.already_complete:
        print("already complete: nothing to do")
    else:
        print(f"tokenized {_plural(result.tokens_built, 'token')} in {result.seconds:.1f} s "
              f"({result.tokens_per_second / 1e6:.2f}M tokens/s)")
    return 0


def _token_arg(value: str | None):
    if value is None or value.lower() == "none":
        return None
    return int(value) if value.isdigit() else value


def _build_state(cache: TokenCache, storage_options: dict[str, Any] | None) -> str:
    """complete, building (a builder holds the cache's lock now) or interrupted."""
    if cache.complete:
        return "complete"
    held = open_storage(cache.url, storage_options).lock().is_held()
    return "building" if held else "interrupted"


def _open_cache(args: argparse.Namespace) -> TokenCache:
    """The command's cache, remote ones through its --storage-option and --local-dir."""
    return TokenCache(args.cache, storage_options=args.storage_options, local_dir=args.local_dir)


def _local_copy(cache: TokenCache) -> str | None:
    """Where a remote cache's local copy lives (None for a local cache, read in place)."""
    return cache.root if is_remote(cache.url) else None


def _info(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    lengths = cache.document_lengths()
    info = {
        "path": cache.url, "local_copy": _local_copy(cache),
        "state": _build_state(cache, args.storage_options), "complete": cache.complete,
        "fingerprint": cache.fingerprint,
        "tokens": cache.num_tokens, "documents": cache.num_documents, "blocks": cache.num_blocks,
        "document_tokens": ({f"p{q}": int(np.percentile(lengths, q)) for q in (0, 10, 50, 90, 99, 100)}
                            | {"mean": round(float(lengths.mean()), 1)}) if len(lengths) else {},
        "skipped": cache.skipped,
        "spec": {k: v for k, v in cache.spec.items() if k != "inputs"},
        "inputs": len(cache.spec["inputs"]),
    }
    if cache.spec.get("documents") is not None:
        info["documents_format"] = _documents_info(cache)
    roots = _plan_roots(cache, args.plan_dir)
    plans, others = _stored_plans(cache, roots)
    info["pack_plans"] = plans
    info["pack_plans_of_other_caches"] = others
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    state = {"complete": "complete", "building": "still building",
             "interrupted": "interrupted: rerun the same build to resume it"}[info["state"]]
    print(f"{info['path']}  ({state})")
    if info["local_copy"] is not None:
        print(f"  local copy {info['local_copy']}")
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
    text_input = (spec.get("documents") or {}).get("input_format", "text") == "text"
    print(f"  inputs     {len(spec['inputs'])}" + (f" (text key {spec['text_key']!r})" if text_input else ""))
    if "documents_format" in info:
        _print_documents(info["documents_format"])
    print(f"  fingerprint {cache.fingerprint}")
    _print_plans(plans, others, roots)
    return 0


def _trained_tokens(cache: TokenCache) -> int:
    """How many tokens of the cache are trained (its loss mask, read block by block)."""
    if not cache.has_loss_mask:
        return cache.num_tokens
    starts = cache.block_token_starts()
    return sum(int(cache.loss_mask(int(starts[b]), int(starts[b + 1])).sum())
               for b in range(cache.num_blocks))


def _documents_info(cache: TokenCache) -> dict[str, Any]:
    """What a format v3 cache's spec says of its documents, and the share of tokens trained."""
    documents = cache.spec["documents"]
    trained = _trained_tokens(cache)
    return {"input_format": documents["input_format"], "loss_mask": documents["loss_mask"],
            "chat_template": documents["chat_template"], "train_on": documents["train_on"],
            "keep_fields": documents["keep_fields"], "trained_tokens": trained,
            "trained_fraction": trained / cache.num_tokens if cache.num_tokens else None}


_SHORT_TEMPLATE = 80  # characters: a template this short (on one line) is shown whole


def _template_summary(template: str) -> str:
    """A chat template in one line: whole if short, else its first non-blank line and its size."""
    if len(template) <= _SHORT_TEMPLATE and "\n" not in template:
        return repr(template)
    first = next((line.strip() for line in template.splitlines() if line.strip()), "")
    if len(first) > _SHORT_TEMPLATE:
        first = first[:_SHORT_TEMPLATE - 3] + "..."
    lines = len(template.splitlines())
    return f"{first!r} ... ({_plural(len(template), 'character')}, {_plural(lines, 'line')})"


def _print_documents(d: dict[str, Any]) -> None:
    """`info`'s lines about a format v3 cache: input format, template, train_on, kept fields, mask."""
    train_on = f" (train on {d['train_on']})" if d["train_on"] else ""
    print(f"  format     v3: input format {d['input_format']}{train_on}")
    if d["chat_template"] is not None:
        print(f"  template   {_template_summary(d['chat_template'])}")
    kept = ", ".join(d["keep_fields"])
    print(f"  fields     {kept + ' (kept with each document)' if kept else 'none kept'}")
    if not d["loss_mask"]:
        print("  trained    every token (no loss mask)")
    elif d["trained_fraction"] is not None:
        print(f"  trained    {d['trained_fraction']:.2%} of tokens ({d['trained_tokens']:,} by the "
              "loss mask)")


def _plan_roots(cache: TokenCache, plan_dir: str | None) -> list[str]:
    """Where `info` looks for pack plans: the cache's default plan root, then --plan-dir."""
    roots = [default_plan_root(cache)]
    if plan_dir is not None and os.path.realpath(plan_dir) != os.path.realpath(roots[0]):
        roots.append(os.path.abspath(plan_dir))
    return roots


def _stored_plans(cache: TokenCache, roots: list[str]) -> tuple[list[dict], int]:
    """The pack plans of this cache stored under ``roots``, and how many of other caches there are.

    Never computes anything: a plan's figures are read from its chunk files only when they cover
    the whole complete cache; otherwise it is "partial".
    """
    plans, others = [], 0
    for root in roots:
        for stored in list_plans(root):
            if stored.get("cache_fingerprint") != cache.fingerprint:
                others += 1  # a plan of a rebuilt cache, or of another cache sharing --plan-dir
                continue
            plans.append(_stored_plan(cache, root, stored))
    return plans, others


def _stored_plan(cache: TokenCache, root: str, stored: dict) -> dict:
    fields = {k: v for k, v in stored.items() if k not in ("format", "version", "path", "chunks")}
    out = {"path": stored["path"], "plan_root": root,
           **{k: fields.get(k) for k in ("seq_len", "long_docs", "max_segments", "seed",
                                         "algorithm", "chunk_blocks")},
           "chunk_files": len(stored["chunks"]), "state": "partial", "rows": None,
           "padding": None, "padding_fraction": None, "split_documents": None,
           "dropped_documents": None, "dropped_tokens": None, "truncated_documents": None,
           "truncated_tokens": None}
    try:
        identity = PlanIdentity(**fields)
        readable = identity.plan_id == os.path.basename(stored["path"]) and identity.chunk_blocks > 0
    except TypeError:
        readable = False
    if not readable:  # another plan format or version, or an edited plan.json
        out["state"] = "unreadable"
        return out
    K = identity.chunk_blocks
    whole = {f"{c:06d}.pack" for c in range(-(-cache.num_blocks // K))}
    if not cache.complete or not whole <= set(stored["chunks"]):
        return out  # opening it would plan the missing blocks: not for `info`
    try:
        plan = PackPlan(cache, identity, root)
    except (ValueError, OSError) as e:  # a damaged chunk file: the message says what to delete
        out["state"], out["problem"] = "damaged", _one_line(e)
        return out
    totals = plan.totals()
    out.update(state="complete", **{k: totals[k] for k in (
        "rows", "padding", "padding_fraction", "split_documents", "dropped_documents",
        "dropped_tokens", "truncated_documents", "truncated_tokens")})
    return out


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _print_plans(plans: list[dict], others: int, roots: list[str]) -> None:
    if not plans:
        print(f"  pack plans none in {', '.join(roots)} (`torchcache pack CACHE --seq-len N` "
              "computes one)")
    for root in roots:
        mine = [p for p in plans if p["plan_root"] == root]
        if mine:
            print(f"  pack plans in {root}")
        for p in mine:
            what = (f"    seq_len {p['seq_len']}, long_docs {p['long_docs']}, max_segments "
                    f"{'none' if p['max_segments'] is None else p['max_segments']}, seed {p['seed']}")
            files = _plural(p["chunk_files"], "chunk file")
            if p["state"] == "complete":
                print(f"{what}: {files}, {p['rows']:,} rows, padding {p['padding_fraction']:.3%}")
            elif p["state"] == "partial":
                print(f"{what}: partial ({files})")
            elif p["state"] == "damaged":
                print(f"{what}: damaged: {p['problem']}")
            else:
                print(f"{what}: unreadable by this version (delete {p['path']})")
    if others:
        print(f"  ({_plural(others, 'pack plan')} of other caches, or of this path before a rebuild, "
              "stored there too)")


def _chunk_files(directory: str) -> set[str]:
    try:
        return {n for n in os.listdir(directory) if n.endswith(".pack")}
    except OSError:
        return set()


# A planning process takes up to a second to start (a fresh interpreter importing numpy and the
# package) and then plans some 100-200M tokens/s: the default --workers gives each at least this
# many tokens, so a small cache is planned in this process (in milliseconds) instead of waiting
# for processes to start.
_TOKENS_PER_PLANNER = 2 ** 28


def _pack(args: argparse.Namespace) -> int:
    # the same checks PackedDataset makes, naming the flags
    seq_len = int_arg(args.seq_len, "--seq-len", minimum=1, maximum=POSITION_LIMIT)
    max_segments = optional_int_arg(args.max_segments, "--max-segments", 1, seq_len)
    seed = int_arg(args.seed, "--seed", minimum=0, maximum=2 ** 63 - 1)
    if args.workers is not None:
        int_arg(args.workers, "--workers", minimum=1, maximum=1024)
    cache = _open_cache(args)
    workers = args.workers or max(1, min(default_workers(), 1024,
                                         cache.num_tokens // _TOKENS_PER_PLANNER))
    # max_segments as given (None when omitted), as PackedDataset names the plan it reads
    identity = plan_identity(cache.fingerprint, seq_len, args.long_docs, max_segments, seed)
    root = default_plan_root(cache) if args.plan_dir is None else os.path.abspath(args.plan_dir)
    before = _chunk_files(os.path.join(root, identity.plan_id))
    bar = None
    if progress_enabled(None):  # on unless TQDM_DISABLE is set, as `torchcache build` does
        bar = tqdm(total=cache.num_blocks, unit="block", desc="planning", dynamic_ncols=True,
                   disable=False)
    started = time.perf_counter()
    try:
        plan = PackPlan(cache, identity, root, workers=workers,
                        progress=None if bar is None else bar.update)
    except BaseException as e:
        if bar is not None:
            _clear(bar)  # no stale bar above the error message
            bar = None
        if not isinstance(e, OSError):
            raise
        where = os.path.abspath(str(e.filename or ""))
        if "plan_dir" in str(e) or not (where == root or where.startswith(root + os.sep)):
            raise  # already says what to do, or not about the plan directory
        # not a directory, a read-only file system, a full disk: name the flag that moves it
        raise OSError(f"cannot store the pack plan in {root} ({e.strerror}: {e.filename}): "
                      "give a writable directory as --plan-dir DIR") from e
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    after = _chunk_files(plan.dir)
    totals = plan.totals()
    K = identity.chunk_blocks
    reused = sum(max(0, min(K, plan.blocks - int(name[:6]) * K)) for name in before
                 if name[:6].isdigit())
    computed = plan.blocks - reused
    rows = totals["rows"]
    result = {
        "cache": cache.url, "plan": plan.dir, "plan_id": identity.plan_id, "seq_len": seq_len,
        "long_docs": identity.long_docs, "max_segments": max_segments, "seed": seed,
        "rows": rows, "padding": totals["padding"],
        "padding_fraction": totals["padding_fraction"],
        "split_documents": totals["split_documents"], "dropped_documents": totals["dropped_documents"],
        "dropped_tokens": totals["dropped_tokens"],
        "truncated_documents": totals["truncated_documents"],
        "truncated_tokens": totals["truncated_tokens"], "blocks": plan.blocks,
        "cache_complete": cache.complete, "chunk_files": len(after), "blocks_computed": computed,
        "already_stored": bool(before) and computed == 0, "seconds": round(seconds, 3),
        "workers": workers,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"pack plan of {cache.url}")
    print(f"  stored in  {plan.dir}  ({_plural(len(after), 'chunk file')})")
    print(f"  seq_len    {seq_len}  (long_docs {identity.long_docs}, max_segments "
          f"{'none' if max_segments is None else max_segments}, seed {seed})")
    print(f"  rows       {rows:,}")
    print(f"  padding    {result['padding_fraction']:.3%}  ({totals['padding']:,} tokens)")
    if identity.long_docs == "split":
        print(f"  split      {_plural(totals['split_documents'], 'document')} longer than seq_len")
    elif identity.long_docs == "truncate":
        print(f"  truncated  {_plural(totals['truncated_documents'], 'document')} longer than "
              f"seq_len ({totals['truncated_tokens']:,} tokens cut)")
    else:
        print(f"  dropped    {_plural(totals['dropped_documents'], 'document')} longer than seq_len "
              f"({totals['dropped_tokens']:,} tokens)")
    print(f"  blocks     {plan.blocks:,} planned")
    if not cache.complete:
        print(f"the cache is {_build_state(cache, args.storage_options)}: only whole chunks of "
              f"{K} blocks are stored; run `torchcache pack` again once its build completes to "
              "store the rest")
    if result["already_stored"]:
        print(f"already stored: read {_plural(len(before), 'chunk file')} in {seconds:.2f} s")
    else:
        print(f"planned {_plural(computed, 'block')} in {seconds:.2f} s (--workers {workers})"
              + (f"; reused {_plural(reused, 'stored block')}" if reused else ""))
    return 0


def _mix_plan(args: argparse.Namespace) -> int:
    plan = plan_recipe(args.recipe, steps=args.steps, global_batch=args.global_batch,
                       samples=args.samples, storage_options=args.storage_options,
                       local_dir=args.local_dir)
    print(json.dumps(plan.as_json(), indent=1) if args.json else plan.text())
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    storage = open_storage(args.cache, args.storage_options)
    fmt.load_manifest(storage)  # not a cache: say so, before a lock file is made there
    lock = acquire_lock(storage)  # no builder may commit while the record is rewritten
    try:
        changed = upgrade(storage)
        _, version, _ = fmt.load_manifest(storage)
    finally:
        lock.release()
    # v3 (documents sidecars) is v2's layout plus a file per block: nothing to convert
    print(f"{args.cache}: {'upgraded to' if changed else 'already in'} format v{version}")
    return 0


def _repair_hint(problems: list[Problem], cache: str) -> str:
    """What `verify --repair` would do about `problems`, or that it cannot help with them."""
    actions = []
    if any(p.entry is not None for p in problems):
        actions.append("rebuilds the damaged blocks from the inputs")
    if any(p.file == HEAD_NAME for p in problems):
        actions.append("restores head.json")
    if not actions:
        return "`torchcache verify --repair` cannot fix this: each message says what to do"
    return f"`torchcache verify --repair {cache}` " + " and ".join(actions)


def _verify(args: argparse.Namespace) -> int:
    if args.repair:
        return _repair(args)
    problems = check_cache(args.cache, args.storage_options, args.local_dir)
    for p in problems:
        print(f"BAD {p.message}", file=sys.stderr)
    if problems:
        print(f"{_plural(len(problems), 'bad file')} in {args.cache}; {_repair_hint(problems, args.cache)}",
              file=sys.stderr)
        return 1
    print(f"{args.cache}: all checksums match")
    if is_remote(args.cache):
        print(f"  local copy {locate_cache(args.cache, args.storage_options, args.local_dir).root}")
    return 0


def _repair(args: argparse.Namespace) -> int:
    result = repair_cache(args.cache, storage_options=args.storage_options,
                          local_dir=args.local_dir)
    for p in result.problems:
        print(f"BAD {p}", file=sys.stderr)
    for rel in result.repaired:
        print(f"restored {rel}" if rel == HEAD_NAME else f"rebuilt {rel}")
    if not result.problems:
        print(f"{args.cache}: all checksums match; nothing to repair")
        return 0
    remaining = verify_cache(args.cache, args.storage_options, args.local_dir)
    if remaining:
        for p in remaining:
            print(f"STILL BAD {p}", file=sys.stderr)
        return 1
    print(f"{args.cache}: repaired {_plural(len(result.repaired), 'file')}; all checksums match now")
    return 0


def _token_range(text: str) -> tuple[int, int]:
    """`START:STOP`, or `N` for the first N tokens."""
    start, colon, stop = text.partition(":")
    try:
        return (int(start), int(stop)) if colon else (0, int(start))
    except ValueError:
        raise ValueError(f"--tokens {text!r}: give a range START:STOP of token positions, or a "
                         "count N for the first N, e.g. --tokens 0:100 or --tokens 100") from None


def _trace(args: argparse.Namespace) -> int:
    """`torchcache trace`: what each sample of a global step read (see train/trace.py)."""
    words = int_arg(args.words, "--words", minimum=0)
    loader = _trace_loader(args)
    step = int_arg(args.step, "--step", minimum=0)
    samples = torchcache.trace_step(loader, step, words=words)
    skipped = any(a <= step < b for a, b in loader.skipped_steps)
    world = loader.sampler.world_size
    if args.json:
        print(json.dumps({"step": step, "skipped": skipped, "world_size": world,
                          "samples": samples}, ensure_ascii=False))
        return 0
    note = "; a skipped step, never trained on" if skipped else ""
    print(f"step {step}: {_plural(len(samples), 'sample')} over {_plural(world, 'rank')}{note}")
    for sample in samples:
        print(f"sample {sample['sample']} (rank {sample['rank']})")
        for piece in sample["documents"]:
            print("  " + _trace_line(piece))
    return 0


def _trace_line(piece: dict[str, Any]) -> str:
    """One document of a traced sample: source, document, tokens, input:line, first words."""
    source = f"{piece['source']}  " if piece.get("source") else ""
    if "document" not in piece:
        return f"{source}item {piece['index']} (not a cache)"
    where = piece["input"] if piece["record"] is None else f"{piece['input']}:{piece['record'] + 1}"
    fields = f"  {json.dumps(piece['fields'], ensure_ascii=False)}" if piece["fields"] else ""
    key = f"  key {piece['key']}" if piece.get("key") is not None else ""
    return (f"{source}document {piece['document']} tokens {piece['start']}:{piece['end']}  "
            f"{where}{key}{fields}  {piece['text']!r}")


def _trace_loader(args: argparse.Namespace) -> Any:
    """The loader whose step is traced: over a recipe's mixture or a cache's windows or rows,
    batched as the saved state (or the arguments) say, at the state's position."""
    state = _json_file(args.state, "--state") if args.state else None
    if state is not None and not isinstance(state, dict):
        raise ValueError(f"--state {args.state}: not a DataLoader state (a JSON object from "
                         "loader.state_dict())")
    is_cache = _is_cache(args.target, args.storage_options)
    # a state saved over a DocumentDataset says so (its fingerprint ends in "/documents")
    saved = (state or {}).get("fingerprint")
    documents = args.documents or (args.seq_len is None and not args.packed and
                                   isinstance(saved, str) and saved.endswith("/documents"))
    if is_cache:
        cache = TokenCache(args.target, storage_options=args.storage_options)
        if documents:
            if args.seq_len is not None or args.packed:
                raise ValueError("--documents reads whole documents: drop --seq-len and --packed")
            dataset = torchcache.DocumentDataset(cache)
        elif args.seq_len is None:
            raise ValueError(f"{args.target} is a cache: give --seq-len (and --packed for "
                             "PackedDataset rows), or --documents for DocumentDataset items")
        else:
            kind = torchcache.PackedDataset if args.packed else torchcache.TokenDataset
            dataset = kind(cache, args.seq_len)
        global_batch = None
    else:
        if args.seq_len is not None or args.packed or args.documents:
            raise ValueError("--seq-len and --packed are for a cache, as is --documents; a "
                             "recipe names its own")
        dataset = torchcache.MixtureDataset.from_recipe(args.target)
        global_batch = plan_recipe(args.target).global_batch
    # (0 is refused, not taken for "not given")
    world = optional_int_arg(args.world_size, "--world-size", minimum=1)
    world = world or (state or {}).get("world_size") or 1
    batch = optional_int_arg(args.batch_size, "--batch-size", minimum=1)
    batch = batch or (state or {}).get("batch_size")
    if not batch and global_batch:  # the recipe's: samples per step, all ranks together
        if global_batch % world:
            raise RecipeError(f"{args.target}: global_batch {global_batch} does not split over "
                             f"{world} ranks: give --batch-size (per rank)")
        batch = global_batch // world
    if not batch:
        if not is_cache:  # (a RecipeError: its message names the recipe's key, as written)
            raise RecipeError(f"{args.target}: give --batch-size (per rank), or --state with a "
                              "saved loader state, or add global_batch to the recipe")
        raise ValueError("give --batch-size (per rank), or --state with a saved loader state")
    seed = args.seed if args.seed is not None else (state or {}).get("seed", 0)
    sampler = torchcache.DistributedSampler(dataset, num_replicas=world, rank=0, seed=seed)
    loader = torchcache.DataLoader(dataset, batch_size=batch, sampler=sampler)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _is_cache(target: str, storage_options: dict[str, Any] | None) -> bool:
    """True for a cache directory (or URL); False for a recipe file."""
    if target.endswith((".json", ".yaml", ".yml")) and os.path.isfile(target):
        return False
    return open_storage(target, storage_options).exists(fmt.MANIFEST_NAME)


def _json_file(path: str, flag: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not valid JSON ({e})") from None


def _show(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    if _local_copy(cache) is not None:
        print(f"{cache.url} (local copy {cache.root})", file=sys.stderr)
    if args.tokens:
        start, stop = _token_range(args.tokens)
        ids = cache.read(start, stop).astype(np.int64)
    else:
        ids = cache.document(args.document)
        start, stop = cache.document_span(args.document)
        key = cache.document_key(args.document)
        if key is not None:
            print(f"document {args.document}: sample key {key!r}", file=sys.stderr)
    trained = None
    if cache.has_loss_mask and not args.no_mask:
        trained = cache.loss_mask(start, stop)
    as_ids = args.ids or cache.spec["tokenizer"] is None
    marks = _DIM if sys.stdout.isatty() else _BRACKETS
    if trained is not None:
        shown = "dimmed" if marks is _DIM else f"in {_BRACKETS[0]}...{_BRACKETS[1]}"
        print(f"tokens not trained (loss mask) are {shown}; {int(trained.sum()):,} of "
              f"{len(ids):,} tokens trained (--no-mask: print as stored)", file=sys.stderr)
    pieces = []
    for a, b, on in _runs(trained, len(ids)):
        part = " ".join(map(str, ids[a:b].tolist())) if as_ids else cache.decode(ids[a:b])
        pieces.append(part if on else f"{marks[0]}{part}{marks[1]}")
    sys.stdout.write((" " if as_ids else "").join(pieces))
    sys.stdout.write("\n")
    return 0


_DIM = ("\x1b[2m", "\x1b[0m")  # ANSI dim, then reset: untrained tokens on a terminal
_BRACKETS = ("\u27e6", "\u27e7")  # ⟦ ⟧: untrained tokens elsewhere (a file, a pipe)


def _runs(trained: np.ndarray | None, n: int) -> list[tuple[int, int, bool]]:
    """[a, b) ranges of equal trained flags covering n tokens (one trained range without a mask)."""
    if trained is None or not n:
        return [(0, n, True)]
    edges = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), n]
    return [(a, b, bool(trained[a])) for a, b in zip(bounds, bounds[1:])]


# A remedy only a Python caller can take (build from an iterator of strings): not on the command line.
_PYTHON_ONLY_REMEDY = re.compile(
    r" \(to build from strings, pass an iterator[^()]*(\([^()]*\))?[^()]*\)")


def _one_line(error: BaseException) -> str:
    """An error as one line for the terminal, in the command line's spelling: the library's
    messages name Python arguments (`chat_template=`), the command line names the flags
    (`--chat-template`). A recipe's errors name the recipe's own keys and stay as they are."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename and str(error.filename) not in text:
        text = f"{error.filename}: {text}"
    text = _PYTHON_ONLY_REMEDY.sub("", text.splitlines()[0])
    return text if isinstance(error, RecipeError) else command_line_spelling(text)


def _clear(bar: tqdm) -> None:
    """Close a progress bar and erase its line (before an error message takes its place)."""
    bar.leave = False
    bar.close()


def _bench(args: argparse.Namespace) -> int:
    """`torchcache bench`: batches of a TokenDataset read under a simulated training step, and
    whether the loop (the GPU) waits for them (see train/step_bench.py)."""
    seq_len = int_arg(args.seq_len, "--seq-len", minimum=1, maximum=POSITION_LIMIT)
    batch_size = int_arg(args.batch_size, "--batch-size", minimum=1)
    workers = int_arg(args.workers, "--workers", minimum=0)
    batches = int_arg(args.batches, "--batches", minimum=2)
    if not 0 <= args.step_ms < float("inf"):  # (NaN too)
        raise ValueError(f"--step-ms {args.step_ms:g}: give the training step's time in "
                         "milliseconds, 0 or more")
    if args.cache_limit is not None and not is_remote(args.cache):
        raise ValueError(f"--cache-limit bounds the local copies of a remote cache; {args.cache} "
                         "is local: leave --cache-limit out")
    cache = TokenCache(args.cache, storage_options=args.storage_options, local_dir=args.local_dir,
                       cache_limit=args.cache_limit)
    dataset = torchcache.TokenDataset(cache, seq_len)
    sampler = torchcache.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True,
                                            seed=args.seed, infinite=True)
    loader = torchcache.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                   num_workers=workers)
    before = cache.stats()
    result = bench_steps(loader, args.step_ms / 1e3, batches)
    after = cache.stats()
    if args.json:
        print(json.dumps(_bench_figures(cache, result, workers, before, after), indent=1))
        return 0
    mode = f"{_plural(workers, 'worker')}" if workers else \
        f"in-process, {loader.prefetch_batches} batches ahead"
    print(f"{cache.url}: {result.batches:,} batches of {batch_size} x {seq_len} tokens "
          f"({mode}), a {args.step_ms:g} ms step after each")
    print(f"  batches/s  {result.batches_per_second:,.1f}")
    print(f"  tokens/s   {result.tokens_per_second:,.0f}")
    print(f"  data wait  {result.wait_per_step * 1e3:.2f} ms per step, "
          f"{result.wait_fraction:.1%} of the time")
    print(f"  start-up   {result.first_wait_seconds * 1e3:.0f} ms to the first batch (not in the "
          "figures above)")
    if is_remote(cache.url):
        done = {k: after[k] - before[k] for k in ("whole_block_downloads", "ranged_reads",
                                                  "bytes_downloaded")}
        itemsize = np.dtype(cache.dtype).itemsize
        cache_bytes, read_bytes = cache.num_tokens * itemsize, result.tokens * itemsize
        print(f"  requests   {done['whole_block_downloads'] + done['ranged_reads']:,} "
              f"({_plural(done['whole_block_downloads'], 'whole block')}, "
              f"{_plural(done['ranged_reads'], 'ranged read')})")
        print(f"  downloaded {done['bytes_downloaded'] / 1e6:,.1f} MB "
              f"({done['bytes_downloaded'] / read_bytes:.2f}x the tokens of the batches, "
              f"{done['bytes_downloaded'] / cache_bytes:.2f}x the cache's "
              f"{cache_bytes / 1e6:,.1f} MB of tokens)")
    print(result.verdict())
    return 0


def _bench_figures(cache: TokenCache, result: Any, workers: int, before: dict[str, Any],
                   after: dict[str, Any]) -> dict[str, Any]:
    """`torchcache bench --json`: the measured figures, and the remote counters' change."""
    figures = {"path": cache.url, "workers": workers, "batches": result.batches,
               "tokens": result.tokens, "step_ms": result.step_seconds * 1e3,
               "seconds": result.seconds, "batches_per_second": result.batches_per_second,
               "tokens_per_second": result.tokens_per_second,
               "first_wait_seconds": result.first_wait_seconds,
               "data_wait_seconds": result.data_wait_seconds,
               "wait_per_step_seconds": result.wait_per_step,
               "wait_fraction": result.wait_fraction, "keeps_up": result.keeps_up,
               "verdict": result.verdict()}
    if is_remote(cache.url):
        figures["remote"] = {k: after[k] - before[k] for k in (
            "whole_block_downloads", "ranged_reads", "bytes_downloaded")}
    return figures


# ---------------------------------------------------------------- remote caches and inputs

def _storage_option(text: str) -> tuple[str, Any]:
    """One `--storage-option KEY=VALUE`: the VALUE as JSON where it parses as JSON, else a string."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KEY=VALUE, e.g. --storage-option key=ACCESS_KEY or --storage-option "
            f"client_kwargs='{ENDPOINT_EXAMPLE}'")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def _storage_options(pairs: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """The --storage-option pairs as the fsspec options of the Python API (None for none)."""
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise ValueError(f"--storage-option {key} is given twice; give each KEY once")
        options[key] = value
    return options or None


def _remote_urls(args: argparse.Namespace) -> list[str]:
    """The remote URLs a command names: inputs, output, cache, or a recipe's sources."""
    names = [*getattr(args, "inputs", []), *getattr(args, "urls", []),
             getattr(args, "output", None), getattr(args, "cache", None)]
    if getattr(args, "recipe", None) is not None:
        names += _recipe_sources(args.recipe)
    return list(dict.fromkeys(os.fspath(n) for n in names if n is not None and is_remote(n)))


def _recipe_sources(recipe: str) -> list[str]:
    try:
        sources = load_recipe(recipe).get("sources")
    except ValueError:  # an unreadable recipe: its own error is the one to report
        return []
    if not isinstance(sources, dict):
        return []
    paths = (spec.get("path") if isinstance(spec, dict) else spec for spec in sources.values())
    return [p for p in paths if isinstance(p, str)]


def _remote_arguments(local_dir: bool) -> argparse.ArgumentParser:
    """--storage-option, shared by every command that takes a cache or inputs, and --local-dir
    for those that read a cache's files."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("remote caches and inputs (fsspec URLs: s3://, gs://, ...)")
    group.add_argument("--storage-option", dest="storage_option", action="append", default=[],
                       type=_storage_option, metavar="KEY=VALUE",
                       help="an option of the store's fsspec filesystem, repeatable: credentials, "
                            "endpoint... A VALUE that parses as JSON is taken as JSON, e.g. "
                            "--storage-option key=ACCESS_KEY --storage-option secret=SECRET_KEY "
                            f"--storage-option client_kwargs='{ENDPOINT_EXAMPLE}'")
    if local_dir:
        group.add_argument("--local-dir", default=None, metavar="DIR",
                           help="where a remote cache's files are copied, in a folder named by its "
                                "fingerprint (default $TORCHCACHE_LOCAL_DIR or "
                                "~/.cache/torchcache/remote)")
    return parent


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchcache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"torchcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    remote, remote_cache = _remote_arguments(local_dir=False), _remote_arguments(local_dir=True)
    workers = (f"(default: the CPUs this process may use, {default_workers()} here; at most one "
               "per input file)")

    b = sub.add_parser("build", help="tokenize inputs into a cache (resumes an interrupted build)",
                       parents=[remote])
    b.add_argument("inputs", nargs="+", help="input files, globs or directories (fsspec URLs)")
    b.add_argument("-o", "--output", required=True, help="cache directory")
    b.add_argument("-t", "--tokenizer", default=None,
                   help="tokenizer.json path, a model folder (its tokenizer_config.json's "
                        "tokens, eos_token and chat template), a SentencePiece .model file, or "
                        "tiktoken:PATH[:PATTERN] (a .tiktoken ranks file; PATTERN: gpt2, the "
                        "default, or a regex); omit it only for pre-tokenized records "
                        "(--input-format tokens, with --vocab-size)")
    b.add_argument("--vocab-size", type=int, default=None,
                   help="without --tokenizer: the vocabulary size of pre-tokenized records (sets "
                        "the dtype, refuses ids outside it)")
    b.add_argument("--text-key", default="text", help="JSON field holding the text (default: text)")
    b.add_argument("--block-tokens", type=int, default=2 ** 24, help="target tokens per block")
    b.add_argument("-j", "--workers", type=int, default=None, help=f"worker processes {workers}")
    b.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="stop at a malformed record (default) or skip and count it")
    b.add_argument("--eos", default="auto", help="EOS token id or string appended to each document, "
                                                  "'auto' (default: the tokenizer's end-of-text; "
                                                  "none without a tokenizer) or 'none'")
    b.add_argument("--bos", default=None, help="BOS token id or string prepended to each document, "
                                                "or 'auto' (the one the tokenizer itself puts "
                                                "before a text, if any)")
    b.add_argument("--keep-special-tokens", action="store_true",
                   help="let special-token strings inside documents become special tokens")
    b.add_argument("--allow-empty", action="store_true",
                   help="accept a build that yields no document (default: an error)")
    b.add_argument("--input-format", choices=INPUT_FORMATS, default="text",
                   help="text (default: one string field, --text-key); messages ({\"messages\": "
                        "[{\"role\", \"content\"}, ...]}, rendered with the chat template); "
                        "prompt_completion ({\"prompt\", \"completion\"}, the completion trained); "
                        "tokens ({\"input_ids\", \"loss_mask\" or \"labels\"}). All but text store "
                        "a loss mask (format v3) and read JSON lines files")
    b.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="for --input-format messages: a Jinja template, as a .jinja or JSON file "
                        "or as text (default: the tokenizer's own, from tokenizer_config.json "
                        "beside tokenizer.json)")
    b.add_argument("--train-on", choices=TRAIN_ON, default="assistant",
                   help="which tokens of a conversation are trained: every assistant turn "
                        "(default), the last assistant turn, or all")
    b.add_argument("--keep-field", action="append", default=[], metavar="NAME",
                   help="a field of each record kept with its document (repeatable; "
                        "cache.document_info shows them; makes the cache format v3)")
    b.set_defaults(func=_build)

    c = sub.add_parser("convert-webdataset", help="convert WebDataset tars into a cache",
                       parents=[remote])
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
    c.add_argument("-j", "--workers", type=int, default=None, help=f"worker processes {workers}")
    c.add_argument("--on-error", choices=("raise", "skip"), default="raise")
    c.add_argument("--allow-empty", action="store_true",
                   help="accept a conversion that yields no document (default: an error)")
    c.set_defaults(func=_convert)

    i = sub.add_parser("info", help="summarise a cache and list its stored pack plans",
                       parents=[remote_cache])
    i.add_argument("cache")
    i.add_argument("--plan-dir", default=None,
                   help="also list the pack plans stored in this directory (beside CACHE/packs)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_info)

    p = sub.add_parser("pack", help="compute and store the pack plan of a PackedDataset "
                                    "(reused if stored; resumes an interrupted one)",
                       description="Compute the pack plan PackedDataset(CACHE, seq_len=N, ...) "
                                   "reads, in parallel, and store it, so opening the dataset "
                                   "later costs about what opening the cache does.",
                       parents=[remote_cache])
    p.add_argument("cache")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
    p.add_argument("--long-docs", choices=LONG_DOCS, default="split",
                   help="documents longer than seq_len: split into seq_len pieces (default), "
                        "drop, or truncate (keep their first seq_len tokens)")
    p.add_argument("--max-segments", type=int, default=None,
                   help="at most this many documents per row (default: seq_len)")
    p.add_argument("--seed", type=int, default=0,
                   help="decides the order of equal-length documents (default 0)")
    p.add_argument("--plan-dir", default=None,
                   help="where plans are stored (default CACHE/packs; give one for a cache you "
                        "cannot write, and the same plan_dir= to PackedDataset)")
    p.add_argument("-j", "--workers", type=int, default=None,
                   help="planning processes (default: all CPUs this process may use, one "
                        "per 268M tokens of the cache at most)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_pack)

    m = sub.add_parser("mix", help="plan a training recipe (a mixture schedule over caches)")
    mix_sub = m.add_subparsers(dest="mix_command", required=True, metavar="COMMAND")
    mp = mix_sub.add_parser(
        "plan", help="per stage and per source: samples, tokens and epochs, without reading tokens",
        description="Read a recipe (JSON, or YAML with the yaml extra; format in "
                    "docs/recipes.md) and print, per stage and per source, the samples and "
                    "tokens the run reads and how many times it goes through each source; for "
                    "a recipe with token budgets, each budget against what the schedule "
                    "delivers; and the recipe's skips.",
        parents=[remote_cache])
    mp.add_argument("recipe", help="recipe.json or recipe.yaml")
    mp.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides the recipe)")
    mp.add_argument("--global-batch", type=int, default=None,
                    help="samples per step, all ranks together (overrides the recipe)")
    mp.add_argument("--samples", type=int, default=None,
                    help="the run's length in samples, instead of steps x global batch")
    mp.add_argument("--json", action="store_true", help="print JSON")
    mp.set_defaults(func=_mix_plan)

    v = sub.add_parser("verify", help="recompute all checksums; non-zero exit on any bad file",
                       parents=[remote_cache])
    v.add_argument("cache")
    v.add_argument("--repair", action="store_true",
                   help="rebuild the damaged blocks from the inputs (byte-identical)")
    v.set_defaults(func=_verify)

    u = sub.add_parser("upgrade", help="convert a format v1 cache to v2 in place (crash-safe; "
                                       "same fingerprint, block files untouched; a v2 or v3 "
                                       "cache is left as it is)",
                       parents=[remote])
    u.add_argument("cache")
    u.set_defaults(func=_upgrade)

    s = sub.add_parser("show", help="decode a document or a token range", parents=[remote_cache])
    s.add_argument("cache")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("-d", "--document", type=int, help="document index")
    what.add_argument("--tokens", help="global token range START:STOP, or N for the first N tokens")
    s.add_argument("--ids", action="store_true", help="print token ids instead of text")
    s.add_argument("--no-mask", action="store_true",
                   help="for a cache with a loss mask: print the tokens as stored, without marking "
                        "the untrained ones (dimmed on a terminal, else in \u27e6...\u27e7)")
    s.set_defaults(func=_show)

    t = sub.add_parser(
        "trace", help="what a training step read: each sample's documents, inputs and records",
        parents=[remote],
        description="Print, for each sample of global step STEP (all ranks), the documents it is "
                    "made of: source, document, token range, input file:line, kept fields and "
                    "first words. From the loader's configuration and state alone: nothing is "
                    "trained or iterated.")
    t.add_argument("target", help="a recipe file (.json, .yaml) or a cache (then give --seq-len)")
    t.add_argument("--step", type=int, required=True, help="the global step (batch of all ranks)")
    t.add_argument("--state", default=None,
                   help="a saved loader state (JSON of loader.state_dict()): its world and batch "
                        "sizes over the run, skips and seed")
    t.add_argument("--seq-len", type=int, default=None, help="for a cache: tokens per sample")
    t.add_argument("--packed", action="store_true",
                   help="for a cache: PackedDataset rows instead of TokenDataset windows")
    t.add_argument("--documents", action="store_true",
                   help="for a cache: whole documents (DocumentDataset items; implied by a "
                        "--state saved over one)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="samples per rank (default: the state's, or the recipe's global_batch)")
    t.add_argument("--world-size", type=int, default=None, help="ranks (default: the state's, or 1)")
    t.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: the state's, or 0)")
    t.add_argument("--words", type=int, default=8, help="first words shown of each document")
    t.add_argument("--json", action="store_true", help="print JSON (for tools)")
    t.set_defaults(func=_trace)

    bench = sub.add_parser(
        "bench", help="would the GPU wait for data? read batches under a simulated training step",
        parents=[remote_cache],
        description="Read BATCHES batches of TokenDataset(CACHE, seq_len) through tc.DataLoader "
                    "(shuffled), sleeping STEP_MS after each as a training step would take, and "
                    "print batches/s, tokens/s, the time the loop waited for data (per step and "
                    "as a share of the time) and a one-line verdict; for a remote cache also the "
                    "requests made and the bytes downloaded.")
    bench.add_argument("cache")
    bench.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    bench.add_argument("--batch-size", type=int, required=True, help="samples per batch")
    bench.add_argument("--step-ms", type=float, required=True,
                       help="the training step's time per batch, in milliseconds")
    bench.add_argument("--workers", type=int, default=0,
                       help="DataLoader worker processes (default 0: in-process read-ahead)")
    bench.add_argument("--batches", type=int, default=100, help="batches read (default 100)")
    bench.add_argument("--cache-limit", default=None, metavar="SIZE",
                       help="for a remote cache: bound its local copies (bytes, or e.g. 2GB)")
    bench.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    bench.add_argument("--json", action="store_true", help="print JSON (for tools)")
    bench.set_defaults(func=_bench)
    return parser


_ONE_LINE_ERRORS = (ValueError, OSError, RuntimeError, IndexError, TypeError, ImportError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    python_format = warnings.formatwarning
    warnings.formatwarning = _warning_format(args.command)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = python_format


def _warning_format(command: str) -> Any:
    """Warnings shown as the command line shows its errors, `torchcache CMD: warning: ...`,
    without Python's `file.py:line: UserWarning:` and source line. (Not respelled: a recipe's
    notes name the recipe's keys.)"""
    def format_warning(message, category, filename, lineno, line=None) -> str:
        return f"torchcache {command}: warning: {message}\n"
    return format_warning


def _run(args: argparse.Namespace) -> int:
    """The command, its failures as one line (exit code 2) and Ctrl-C as a note (130)."""
    args.storage_options = None
    try:
        args.storage_options = _storage_options(args.storage_option)
        return args.func(args)
    except BrokenPipeError:  # `torchcache info CACHE | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        # bad input, a bad cache, a full or read-only disk, a store's refusal: one line, no traceback
        message = store_message(e, lambda: _remote_urls(args), args.storage_options,
                                getattr(args, "output", None), _one_line)
        if message is None and not isinstance(e, _ONE_LINE_ERRORS):
            raise  # a bug: the traceback is what a report needs
        print(f"torchcache {args.command}: error: {message or _one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; committed work is kept and re-running the same command resumes",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
