"""Read-side throughput, resume latency, worker RSS and pickled size, in one run on one machine.

    python tools/bench_read.py [--cache runs/bench-cache] [--corpus DIR] [--tokenizer tokenizer.json]
                               [--quick]

Builds (once; a re-run is a no-op) a GPT-2 cache of the Gutenberg corpus, then measures against a
raw baseline: a plain ``torch.utils.data.Dataset`` over an ``np.memmap`` of the same tokens, with
``RandomSampler`` and torch's ``DataLoader`` (batch 16, seq 2048, default collate):

1. samples/s of ``tc.DataLoader(tc.TokenDataset(cache, 2048), batch_size=16, sampler=
   tc.DistributedSampler(ds, seed=0), num_workers=2)`` against the raw baseline with 2 workers;
2. the raw baseline with ``num_workers=0`` (reference);
3. the recommended configuration (the default ``tc.DataLoader(ds, batch_size=16, sampler=...)``:
   ``num_workers=0`` and the fast mode, ``prefetch_batches=4``) against the raw 2-worker
   baseline, the raw baseline with 0 workers, and the limit: the same windows (the sampler's
   order, computed beforehand) copied from the memmap into one batch and widened, in this thread
   with no DataLoader; plus a check that it overlaps reads with a (simulated, GIL-free) step;
4. time to first batch after ``load_state_dict`` at consumed = 0 and about 10**12 (the start of an epoch there);
5. worker RSS over a long run (and the main process's in fast mode, with how much of it is
   mapped block files: at most the cache's ``map_bytes``, shared page cache);
6. ``len(pickle.dumps(dataset))``;
7. packed rows/s: ``tc.PackedDataset(cache, 2048)`` against ``tc.TokenDataset(cache, 2048)``
   windows/s on the same cache, both through the recommended ``tc.DataLoader(ds, batch_size=16,
   shuffle=True, num_workers=0, prefetch_batches=4)`` and with ``num_workers=2`` (the pack plan
   is computed on the first run, stored under CACHE/packs, and mapped afterwards);
8. a 2-source mixture: ``tc.MixtureDataset`` of the cache and a second cache (``CACHE-part``,
   built from the corpus's last two shards) against ``tc.TokenDataset(cache, 2048)`` alone, both
   through the recommended loader (same configuration);
9. the pread path: the recommended loader over ``tc.TokenCache(cache, map_bytes=B)`` with ``B``
   a quarter of the cache's bytes (so most blocks are read with pread), against the raw
   in-process memmap gather of 3 (the limit) and the same loader over the cache opened as by
   default (all of it mapped), in interleaved rounds. Where ``tc.TokenCache`` has no
   ``map_bytes`` argument (older versions), each timing of that row runs in a child process
   with ``TORCHCACHE_MAP_BYTES=B`` instead (the budget is per process).

``--only`` runs some of the sections (e.g. ``--only packed,mixture,pread``); the summary then
shows their rows alone.

Throughput is timed over a fixed number of batches after the first one (worker start-up
excluded), in interleaved rounds (the machine is shared: only same-run ratios count). Each round
times the raw 2-worker baseline before and after the other configurations; a ratio is the median
over rounds of the configuration's rate over the mean of its round's two baseline rates. The
ratios of 7-9 are the median over rounds of the configuration's samples/s over its baseline's
(TokenDataset windows, mapped cache) in the same round (which of the two goes first alternates
between rounds).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

import numpy as np
import psutil
import torch
import torch.utils.data as tud

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torchcache as tc  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
SEQ, BATCH, WORKERS, PREFETCH = 2048, 16, 2, 4
SECTIONS = ("throughput", "resume", "rss", "pickle", "packed", "mixture", "pread")


class RawDataset(tud.Dataset):
    """The baseline: windows of a flat uint16 token file through np.memmap (opened per process)."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.tokens = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: int) -> dict[str, torch.Tensor]:
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = self.tokens[s * self.seq_len:s * self.seq_len + self.seq_len + 1]
        return {"input_ids": torch.from_numpy(window[:-1].astype(np.int64)),
                "labels": torch.from_numpy(window[1:].astype(np.int64))}


def flat_tokens(cache: tc.TokenCache, cache_dir: str) -> str:
    """The cache's token stream as one flat uint16 file (written once, next to the cache)."""
    path = f"{cache_dir.rstrip('/')}.{cache.fingerprint[:16]}.tokens.bin"
    if not os.path.exists(path) or os.path.getsize(path) != cache.num_tokens * 2:
        tokens = cache.read(0, cache.num_tokens)
        assert tokens.dtype == np.uint16
        tokens.tofile(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


# -- loaders -------------------------------------------------------------------------------------

def raw_loader(raw: RawDataset, workers: int) -> tud.DataLoader:
    return tud.DataLoader(raw, batch_size=BATCH, sampler=tud.RandomSampler(raw), num_workers=workers)


def tc_loader(ds, workers: int, prefetch: int = 0, **sampler_kw) -> tc.DataLoader:
    return tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=0, **sampler_kw),
                         num_workers=workers, prefetch_batches=prefetch)


def recommended_loader(ds, workers: int, prefetch: int = 0) -> tc.DataLoader:
    """The README's configuration: shuffle=True (a tc.DistributedSampler of seed 0 underneath)."""
    return tc.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, prefetch_batches=prefetch)


def samples_per_s(loader, batches: int, step_s: float = 0.0) -> float:
    """Samples/s over ``batches`` batches after the first (worker start-up excluded)."""
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
        if step_s:
            time.sleep(step_s)  # a GIL-free "training step" (like waiting for the GPU)
    elapsed = time.perf_counter() - start
    del it
    gc.collect()
    return batches * BATCH / elapsed


class RawGather:
    """The limit: the same windows (the tc sampler's order, computed beforehand) copied from an
    ``np.memmap`` into one batch array and widened to int64, in this thread; no DataLoader."""

    def __init__(self, path: str, order: np.ndarray) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.order = order

    def __iter__(self):
        starts = self.order * SEQ
        for b in range(0, len(starts) - BATCH + 1, BATCH):
            out = np.empty((BATCH, SEQ + 1), dtype=np.uint16)
            for row, start in enumerate(starts[b:b + BATCH].tolist()):
                out[row] = self.tokens[start:start + SEQ + 1]
            yield {"input_ids": torch.from_numpy(out[:, :-1].astype(np.int64)),
                   "labels": torch.from_numpy(out[:, 1:].astype(np.int64))}


class NoData:
    """A "loader" of empty batches: times the step alone."""

    def __iter__(self):
        return iter(lambda: None, 0)


def first_batch_s(loader, consumed: int) -> tuple[float, torch.Tensor]:
    state = loader.state_dict()
    state["consumed"] = consumed
    start = time.perf_counter()
    loader.load_state_dict(state)
    it = iter(loader)
    batch = next(it)
    elapsed = time.perf_counter() - start
    del it
    gc.collect()
    return elapsed, batch["input_ids"]


def rss_run(loader, batches: int, every: int, workers: bool) -> list[list[float]]:
    """RSS in MB after every ``every`` batches (the first ``every`` are warm-up): per worker, or ours."""
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    it = iter(loader)
    next(it)  # the workers are started (found as our new child processes: no loader internals)
    procs = [c for c in me.children() if c.pid not in before] if workers else [me]
    assert procs, "no worker processes found"
    samples = []
    for j in range(2, batches + 1):
        next(it)
        if j % every == 0:
            samples.append([p.memory_info().rss / 2 ** 20 for p in procs])
    del it
    gc.collect()
    return samples


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def paired_rounds(label: str, make: dict[str, object], batches: int, rounds: int) -> dict[str, list[float]]:
    """samples/s of two configurations (``make``: name -> () -> loader; the first is the
    baseline) in interleaved rounds, alternating which goes first; -> name -> rates."""
    rates: dict[str, list[float]] = {name: [] for name in make}
    names = list(make)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rates[name].append(make[name]())
        print(f"{label} round {r + 1}/{rounds} (samples/s): "
              + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in names), flush=True)
    return rates


def ratios_of(rates: dict[str, list[float]]) -> list[float]:
    """Per round: the second configuration's rate over the first's (the baseline's)."""
    base, other = rates.values()
    return [o / b for o, b in zip(other, base)]


def map_bytes_argument() -> bool:
    """Whether tc.TokenCache takes the read mode as an argument (map_bytes=)."""
    return "map_bytes" in inspect.signature(tc.TokenCache).parameters


def pread_child(cache_dir: str, batches: int) -> None:
    """(child process, TORCHCACHE_MAP_BYTES set) print the pread row's samples/s as JSON."""
    ds = tc.TokenDataset(tc.TokenCache(cache_dir), SEQ)
    print(json.dumps({"rate": samples_per_s(recommended_loader(ds, 0, PREFETCH), batches)}))


def pread_rate(cache_dir: str, map_bytes: int, batches: int) -> float:
    """samples/s of the recommended loader over the cache with at most ``map_bytes`` mapped."""
    if map_bytes_argument():
        ds = tc.TokenDataset(tc.TokenCache(cache_dir, map_bytes=map_bytes), SEQ)
        return samples_per_s(recommended_loader(ds, 0, PREFETCH), batches)
    env = {**os.environ, "TORCHCACHE_MAP_BYTES": str(map_bytes)}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--cache", cache_dir,
                          "--batches", str(batches), "--pread-child"],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["rate"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="runs/bench-cache")
    p.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds (about 1-2 min)")
    p.add_argument("--batches", type=int, help="timed batches per throughput measurement (<= 808)")
    p.add_argument("--rounds", type=int, help="interleaved rounds of the throughput measurements")
    p.add_argument("--rss-batches", type=int, help="batches of the long RSS run")
    p.add_argument("--only", help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default all)")
    p.add_argument("--pread-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    batches = args.batches or (200 if args.quick else 800)
    rounds = args.rounds or (3 if args.quick else 7)
    rss_batches = args.rss_batches or 2000
    if args.pread_child:
        pread_child(args.cache, batches)
        return
    only = set(SECTIONS if args.only is None else args.only.split(","))
    if only - set(SECTIONS):
        p.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; the sections are {', '.join(SECTIONS)}")
    torch.manual_seed(0)

    t = time.perf_counter()
    shards = sorted(os.path.join(args.corpus, f) for f in os.listdir(args.corpus) if f.endswith(".jsonl"))
    tc.build_cache(shards, args.cache, args.tokenizer, progress=True)
    cache = tc.TokenCache(args.cache)
    ds = tc.TokenDataset(cache, SEQ)
    print(f"cache: {cache.num_tokens:,} tokens in {cache.num_blocks} blocks from {len(shards)} shards, "
          f"{len(ds):,} samples of {SEQ}, {len(ds) // BATCH} batches of {BATCH} per epoch (ready in "
          f"{time.perf_counter() - t:.1f} s); {os.cpu_count()} CPUs, torch {torch.__version__}")
    summary: list[tuple[str, str, str]] = []

    # 1-3: throughput, interleaved rounds -------------------------------------------------------
    if "throughput" in only:
        raw = RawDataset(flat_tokens(cache, args.cache), SEQ)
        assert len(raw) == len(ds)
        order = tc.DistributedSampler(ds, seed=0).indices_for_positions(np.arange(len(ds)))
        configs = {
            "raw memmap, 2 workers (baseline)": lambda: raw_loader(raw, WORKERS),
            "tc, 2 workers": lambda: tc_loader(ds, WORKERS),
            "raw memmap, 0 workers": lambda: raw_loader(raw, 0),
            "raw memmap gather, in-process (limit)": lambda: RawGather(raw.path, order),
            "tc, 0 workers (synchronous)": lambda: tc_loader(ds, 0),
            f"tc recommended (default: prefetch_batches={PREFETCH})":
                lambda: tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=0)),
        }
        # each round: baseline, the others, baseline again; a config's ratio in a round is to the
        # mean of the two baselines around it, and the reported ratio is the median over rounds
        base_name = next(iter(configs))
        rates: dict[str, list[float]] = {name: [] for name in configs}
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(rounds):
            before = samples_per_s(configs[base_name](), batches)
            round_rates = {name: samples_per_s(make(), batches) for name, make in list(configs.items())[1:]}
            after = samples_per_s(configs[base_name](), batches)
            round_rates = {base_name: (before + after) / 2, **round_rates}
            for name, rate in round_rates.items():
                rates[name].append(rate)
                ratios[name].append(rate / round_rates[base_name])
            print(f"round {r + 1}/{rounds} (samples/s): baseline {before:,.0f} .. {after:,.0f}, "
                  + ", ".join(f"{v:,.0f}" for v in list(round_rates.values())[1:]), flush=True)

        # 3b: does the fast mode overlap reads with the step? (step = GIL-free sleep, like a GPU wait)
        step_s = 0.002
        step_batches = max(50, batches // 2)
        overlap: dict[str, list[float]] = {"step only": [], "sync": [], "fast": []}
        for _ in range(rounds):
            overlap["step only"].append(samples_per_s(NoData(), step_batches, step_s))
            overlap["sync"].append(samples_per_s(tc_loader(ds, 0), step_batches, step_s))
            overlap["fast"].append(samples_per_s(
                tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=0)),
                step_batches, step_s))
        ms = {k: BATCH / med(v) * 1e3 for k, v in overlap.items()}
        hidden = 1 - (ms["fast"] - ms["step only"]) / (ms["sync"] - ms["step only"])

        print(f"\n== throughput: {batches} batches x {BATCH} x {SEQ} tokens after the first batch, "
              f"{rounds} interleaved rounds ==")
        print(f"{'configuration':<44}{'samples/s':>11}{'vs baseline':>13}{'range over rounds':>19}")
        for name in configs:
            print(f"{name:<44}{med(rates[name]):>11,.0f}{med(ratios[name]):>12.2f}x"
                  f"{min(ratios[name]):>11.2f}-{max(ratios[name]):.2f}x")
        print(f"overlap, with a {step_s * 1e3:.0f} ms GIL-free step per batch: step alone {ms['step only']:.2f} "
              f"ms/batch, fast mode {ms['fast']:.2f}, synchronous (0 workers) {ms['sync']:.2f} -> the fast "
              f"mode hides {hidden:.0%} of the synchronous loading time\n")
        fast_name = list(configs)[-1]

        def same_round(a: str, b: str) -> float:
            """Median over rounds of a's rate over b's rate in the same round."""
            return med([x / y for x, y in zip(rates[a], rates[b])])
        summary += [
            ("tc 2 workers / raw 2 workers", f"{med(ratios['tc, 2 workers']):.2f}x", ">= 1.0x"),
            ("raw 0 workers / raw 2 workers", f"{med(ratios['raw memmap, 0 workers']):.2f}x", "reference"),
            ("tc recommended / raw 2 workers", f"{med(ratios[fast_name]):.2f}x", ">= 5x"),
            ("tc recommended / raw 0 workers", f"{same_round(fast_name, 'raw memmap, 0 workers'):.2f}x",
             "torch DataLoader, in-process"),
            ("tc recommended / raw gather (limit)",
             f"{same_round(fast_name, 'raw memmap gather, in-process (limit)'):.2f}x", ">= 1.0x"),
            ("fast mode: loading time hidden by a step", f"{hidden:.0%}", "overlap"),
        ]

    # 4: time to first batch after load_state_dict -----------------------------------------------
    if "resume" in only:
        first: dict[tuple[str, int], list[float]] = {}
        same_batch = True
        modes = {"0 workers": (0, 0), "2 workers": (WORKERS, 0), f"prefetch_batches={PREFETCH}": (0, PREFETCH)}
        # far into training, where a step starts (an epoch's start: the last step of an epoch
        # whose size is not a multiple of the batch is a short one)
        big = 10 ** 12 // len(ds) * len(ds)
        for r in range(5):
            at_big = []
            for mode, (workers, prefetch) in modes.items():
                for consumed in ((0, big) if r % 2 else (big, 0)):
                    seconds, ids = first_batch_s(tc_loader(ds, workers, prefetch), consumed)
                    first.setdefault((mode, consumed), []).append(seconds)
                    if consumed:
                        at_big.append(ids)
            same_batch &= all(torch.equal(at_big[0], x) for x in at_big)
        print("== time to first batch after load_state_dict (median of 5, iter() + first next()) ==")
        for mode in modes:
            a, b = med(first[(mode, 0)]), med(first[(mode, big)])
            print(f"{mode:<24} consumed=0: {a * 1e3:8.1f} ms   consumed=10**12: {b * 1e3:8.1f} ms   "
                  f"ratio {b / a:.2f}")
        print(f"first batch at 10**12 identical across modes: {same_batch}\n")
        summary += [(f"first batch 10**12 / 0, {mode}",
                     f"{med(first[(mode, big)]) / med(first[(mode, 0)]):.2f}", "~1") for mode in modes]

    # 5: RSS over a long run ---------------------------------------------------------------------
    if "rss" in only:
        every = max(1, rss_batches // 20)
        rss_tc = rss_run(tc_loader(ds, WORKERS, infinite=True), rss_batches, every, workers=True)
        rss_fast = rss_run(tc_loader(ds, 0, PREFETCH, infinite=True), rss_batches, every, workers=False)
        cache_root = os.path.abspath(args.cache) + os.sep
        mapped_mb = sum(m.rss for m in psutil.Process().memory_maps()
                        if m.path.startswith(cache_root)) / 2 ** 20
        rss_raw = None
        if not args.quick:
            raw = RawDataset(flat_tokens(cache, args.cache), SEQ)
            infinite = tud.RandomSampler(raw, replacement=True, num_samples=10 ** 9)
            rss_raw = rss_run(tud.DataLoader(raw, batch_size=BATCH, sampler=infinite, num_workers=WORKERS),
                              rss_batches, every, workers=True)
        print(f"== RSS over {rss_batches} batches (MB; sampled every {every} batches, first after {every}) ==")

        def rss_line(label: str, samples: list[list[float]]) -> None:
            for w in range(len(samples[0])):
                series = [s[w] for s in samples]
                growth = series[-1] - series[0]
                print(f"{label + (f' worker {w}' if len(samples[0]) > 1 else ''):<36} first {series[0]:7.1f}  "
                      f"last {series[-1]:7.1f}  peak {max(series):7.1f}  growth {growth:+6.1f}  "
                      f"{'flat' if growth < 8 else 'GROWS'}")
        rss_line("tc, 2 workers", rss_tc)
        rss_line("tc fast, main process", rss_fast)
        cache_mb = cache.num_tokens * cache.dtype.itemsize / 2 ** 20
        print(f"{'':<36} of which mapped block files: {mapped_mb:.1f} MB (cache {cache_mb:.0f} MB; "
              f"at most the map budget, default 256 MiB)")
        if rss_raw:
            rss_line("raw memmap, 2 workers", rss_raw)
        print()
        summary.append(("worker RSS growth (max over workers)",
                        f"{max(last - first for first, last in zip(rss_tc[0], rss_tc[-1])):+.1f} MB", "flat"))

    # 6: pickled size ------------------------------------------------------------------------------
    if "pickle" in only:
        pickled = len(pickle.dumps(ds))
        print(f"pickled TokenDataset: {pickled:,} bytes ({'< 64 KB' if pickled < 65536 else 'TOO BIG'})\n")
        summary.append(("pickled TokenDataset", f"{pickled:,} B", "< 64 KB"))

    # 7: packed rows against TokenDataset windows, same loader mode, interleaved rounds ------------
    if "packed" in only:
        t_plan = time.perf_counter()
        packed = tc.PackedDataset(cache, SEQ)  # plans on the first run (then stored), maps afterwards
        plan_s = time.perf_counter() - t_plan
        pack_batches = min(batches, len(ds) // BATCH - 1, len(packed) // BATCH - 1)  # within one epoch
        pack_modes = {f"prefetch_batches={PREFETCH}": (0, PREFETCH), f"{WORKERS} workers": (WORKERS, 0)}
        pack_rates = {}
        for mode, (workers, prefetch) in pack_modes.items():
            pack_rates[mode] = paired_rounds(f"packed, {mode}", {
                "windows": lambda: samples_per_s(recommended_loader(ds, workers, prefetch), pack_batches),
                "packed rows": lambda: samples_per_s(recommended_loader(packed, workers, prefetch), pack_batches),
            }, pack_batches, rounds)
        print(f"== packed rows vs TokenDataset windows: {pack_batches} batches x {BATCH} x {SEQ} tokens after "
              f"the first batch, {rounds} interleaved rounds, shuffle=True ==")
        print(f"{packed!r}: {len(packed):,} rows vs {len(ds):,} windows, {packed.split_documents:,} documents "
              f"split; plan ready in {plan_s:.2f} s")
        print(f"{'loader mode':<36}{'packed rows/s':>15}{'windows/s':>11}{'packed / windows':>18}"
              f"{'range over rounds':>19}")
        for mode, rates2 in pack_rates.items():
            r2 = ratios_of(rates2)
            print(f"{mode:<36}{med(rates2['packed rows']):>15,.0f}{med(rates2['windows']):>11,.0f}"
                  f"{med(r2):>17.2f}x{min(r2):>11.2f}-{max(r2):.2f}x")
        print()
        summary += [(f"packed / TokenDataset, {mode}", f"{med(ratios_of(r2)):.2f}x",
                     ">= 0.5x" if mode.startswith("prefetch") else "rows/s over windows/s")
                    for mode, r2 in pack_rates.items()]

    # 8: a 2-source mixture against one TokenDataset, the same loader -----------------------------
    if "mixture" in only:
        part_dir = args.cache.rstrip("/") + "-part"
        tc.build_cache(shards[-2:], part_dir, args.tokenizer, progress=False)
        part = tc.TokenDataset(tc.TokenCache(part_dir), SEQ)
        mix = tc.MixtureDataset({"gutenberg": ds, "part": part}, seed=0)
        mix_rates = paired_rounds("mixture", {
            "TokenDataset": lambda: samples_per_s(recommended_loader(ds, 0, PREFETCH), batches),
            "mixture": lambda: samples_per_s(recommended_loader(mix, 0, PREFETCH), batches),
        }, batches, rounds)
        r8 = ratios_of(mix_rates)
        print(f"== a 2-source mixture vs one TokenDataset: {batches} batches x {BATCH} x {SEQ}, {rounds} "
              f"interleaved rounds, tc.DataLoader(ds, batch_size={BATCH}, shuffle=True) ==")
        print(f"{mix!r} (sources: the cache, and {len(part):,} windows of {part_dir})")
        print(f"TokenDataset {med(mix_rates['TokenDataset']):,.0f} samples/s, mixture "
              f"{med(mix_rates['mixture']):,.0f}: {med(r8):.2f}x (rounds {min(r8):.2f}-{max(r8):.2f}x)\n")
        summary.append(("2-source mixture / TokenDataset", f"{med(r8):.2f}x", ">= 0.8x"))

    # 9: the pread path: a cache 4x larger than the map budget -----------------------------------
    if "pread" in only:
        map_bytes = cache.num_tokens * cache.dtype.itemsize // 4
        how = ("TokenCache(map_bytes=)" if map_bytes_argument()
               else "TORCHCACHE_MAP_BYTES, in a child process per timing")
        raw_path = flat_tokens(cache, args.cache)
        order = tc.DistributedSampler(ds, seed=0).indices_for_positions(np.arange(len(ds)))
        pread_rates = paired_rounds("pread", {
            "mapped": lambda: samples_per_s(recommended_loader(ds, 0, PREFETCH), batches),
            "pread": lambda: pread_rate(args.cache, map_bytes, batches),
            "raw gather": lambda: samples_per_s(RawGather(raw_path, order), batches),
        }, batches, rounds)
        r9 = [p / m for p, m in zip(pread_rates["pread"], pread_rates["mapped"])]
        r9_raw = [p / g for p, g in zip(pread_rates["pread"], pread_rates["raw gather"])]
        print(f"== the pread path: the cache ({map_bytes * 4 / 2 ** 20:.0f} MB) 4x larger than the map "
              f"budget ({map_bytes:,} B, set by {how}), against the default (all mapped), "
              f"recommended loader ==")
        print(f"mapped {med(pread_rates['mapped']):,.0f} samples/s, pread {med(pread_rates['pread']):,.0f}: "
              f"{med(r9):.2f}x (rounds {min(r9):.2f}-{max(r9):.2f}x)\n")
        print(f"pread / raw in-process memmap gather (limit, all of the cache mapped): "
              f"{med(r9_raw):.2f}x (rounds {min(r9_raw):.2f}-{max(r9_raw):.2f}x)\n")
        summary.append(("cache 4x map budget (pread) / raw gather", f"{med(r9_raw):.2f}x", ">= 0.9x"))
        summary.append(("cache 4x map budget (pread) / mapped", f"{med(r9):.2f}x", "same loader"))

    print("== summary ==")
    for name, value, target in summary:
        print(f"  {name:<40}{value:>14}   ({target})")
    print(f"total {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
