"""Records of arrays (issue 32): build overhead, storage overhead and read speed, in one run.

    python tools/bench_arrays.py [--records 400] [--rounds 3] [--tmp DIR] [--keep]
                                 [--speech DIR] [--litdata VENV_PYTHON]

A synthetic speech-like corpus, no audio needed: a small JSON lines file of (text, seed, frames)
records, frames drawn 100..1500 (seeded), and a lazy pipeline whose map, ``featurize``, makes
each record's float32 ``[frames, 80]`` features deterministically from its seed with numpy
(Gaussian "power", then Whisper's log-mel post-processing: log10, clamp to max - 8, scale), so
the features never sit in a JSON file. It measures:

1. build overhead: ``featurize`` alone over all records (in this process, serially) against the
   whole pipeline build, ``tc.source(jsonl).map(featurize).tokenize(gpt2, arrays=
   ("input_features",), num_workers=1).cache(dir)`` (reading, featurize, tokenizing, writing,
   fsync; one input, so the build runs inline, also serially). featurize is timed before and
   after the build and the mean is used. Ratio = build / featurize (acceptance: <= 1.10).
   featurize here is cheap (no STFT), so the ratio is a pessimistic one; a text-only build of the
   same texts is timed too (reading and tokenizing), to show what storing the arrays adds.
2. storage overhead: bytes of the ``*.arrays.safetensors`` sidecars, plus the growth of the
   documents sidecars against a text-only cache of the same texts, over the arrays' raw bytes
   (sum of frames * 80 * 4), in % (acceptance: <= 1%); also the whole cache's growth (every
   file: index, manifest...) over the text-only cache's, beyond the raw bytes.
3. read speed: one epoch of ``tc.DocumentDataset(cache)`` through ``tc.DataLoader(docs,
   batch_size=8, collate_fn=tc.pad_collate, sampler=tc.DistributedSampler(docs, seed=0),
   num_workers=W)`` for W = 0 and 2, against a raw baseline: one flat float32 file plus offsets
   (written by this benchmark), each item a copy out of an ``np.memmap`` as a tensor, batches
   padded with zeros in torch with the true shapes (the same padding work as pad_collate's
   arrays), through ``torch.utils.data.DataLoader`` with the same order (the sampler's, listed
   beforehand), batch size and W. Rates are records/s over the epoch after its first batch
   (worker start-up excluded), in interleaved rounds; a ratio is the median over rounds of
   ours / baseline in the same round (acceptance: >= 0.9 with W = 2).
1b. with real speech (``--speech DIR``, default ``/work/shared/data/speech`` where it exists; pass
   ``--speech ''`` to skip): the same build overhead with a real featurize, examples/speech.py's
   own ``featurize`` (soundfile decodes the FLAC, transformers' ``WhisperFeatureExtractor``
   makes float32 ``[frames, 80]`` log-mel features), over DIR's webdataset tars of
   ``<key>.flac`` + ``<key>.txt``: featurize alone over every sample (read from the tars into
   memory first, then featurized serially in this process, after one untimed call that imports
   soundfile and transformers) against ``tc.source("DIR/*.tar").map(featurize).tokenize(gpt2, arrays=
   ("input_features",), num_workers=1).cache(dir)`` (reading the tars, featurize, tokenizing,
   writing, fsync). num_workers=1 builds inline, in this process, one sample after the other:
   the same parallelism (none) as featurize alone. Also timed: the same pipeline build without
   ``arrays=`` (featurize runs, its features are dropped, the transcript is stored), so that
   storing the arrays costs (build with arrays - build without) / featurize; and, for reference,
   the text-only build of the same tars (a map that keeps the transcript, no featurize). Each of
   the four runs once untimed (warm-up: imports, page cache), then they are timed in --rounds
   interleaved rounds (each round in another order); ratios are medians of each round's own.
   Each step is timed in wall-clock seconds and in CPU seconds of the process (all its threads,
   so the work of the thread that writes blocks in the background counts in full, though it
   overlaps featurize): wall-clock time on a shared 2-CPU machine varies by +-10% from one build
   to the next, which the difference of two builds magnifies; CPU time varies far less.
   Every sample's features are then read back and compared with featurize's, bit for bit.
4. with ``--litdata PYTHON`` (a venv with litdata and torch, e.g. ``python -m venv V &&
   V/bin/pip install litdata torch``): this script re-run under that Python optimizes the same
   records once (``litdata.optimize``, into TMP/litdata) and reads one shuffled epoch of
   ``litdata.StreamingDataset`` through ``litdata.StreamingDataLoader`` (same batch size,
   collate and W), against the raw baseline measured in that same process; ours / litdata is
   then (ours / raw) / (litdata / raw). Its order is litdata's own shuffle, not the sampler's.

No timing is asserted; the machine may be shared, so only same-run ratios count. The exact
command is printed with the figures. Scratch data goes to --tmp (default a fresh temporary
folder, removed at the end unless --keep).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.utils.data as tud

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_GZ = os.path.join(HERE, "..", "tests", "data", "gpt2-tokenizer.json.gz")
MELS, BATCH, FIELD = 80, 8, "input_features"
DEFAULT_SPEECH = "/work/shared/data/speech"
WORDS = ("the quick brown fox jumps over a lazy dog while seven speakers read short "
         "sentences aloud into a microphone at sixteen kilohertz").split()


# ---- corpus ----------------------------------------------------------------------------------

def write_corpus(path: str, records: int, seed: int) -> np.ndarray:
    """JSON lines of {"text", "seed", "frames"}; returns the frames of each record."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(100, 1501, size=records)
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(frames.tolist()):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 30))).tolist())
            f.write(json.dumps({"text": text, "seed": seed * 1_000_003 + i, "frames": n}) + "\n")
    return frames


def features(seed: int, frames: int) -> np.ndarray:
    """Deterministic log-mel-like float32 [frames, 80] (Whisper's post-processing of a power
    spectrogram, the spectrogram itself Gaussian noise)."""
    power = np.random.default_rng(seed).standard_normal((frames, MELS), dtype=np.float32) ** 2
    log = np.log10(np.maximum(power, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def featurize(r: dict) -> dict:
    """The pipeline's map: the record's features from its seed."""
    return {"text": r["text"], FIELD: features(r["seed"], r["frames"])}


def read_corpus(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def speech_samples(folder: str) -> list[dict]:
    """Every webdataset sample of ``folder``'s tars, in order: {"__key__", ext: bytes, ...}, as
    the pipeline's source gives them to a map."""
    import tarfile

    samples: list[dict] = []
    for path in sorted(glob.glob(os.path.join(folder, "*.tar"))):
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                directory, _, base = member.name.rpartition("/")
                stem, _, ext = base.partition(".")
                key = f"{directory}/{stem}" if directory else stem
                if not samples or samples[-1]["__key__"] != key:
                    samples.append({"__key__": key})
                samples[-1][ext] = tar.extractfile(member).read()
    return samples


def transcript(r: dict) -> dict:
    """The text-only build's map over the speech samples: the transcript alone."""
    return {"text": r["txt"].decode("utf-8").strip()}


def speech_build(folder: str, tmp: str, tokenizer: str, tc, rounds: int) -> dict:
    """Build overhead with examples/speech.py's featurize over ``folder``'s tars (see 1b), in
    ``rounds`` interleaved rounds of (featurize alone, build with arrays, the same build without,
    text-only build), each round in another order; each step timed in wall-clock and in CPU
    seconds of the whole process (every thread: the background block writer's work counts); the
    ratios are medians of the rounds' own ratios."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from speech import featurize as speech_featurize

    samples = speech_samples(folder)
    speech_featurize(samples[0])  # its first call imports soundfile and transformers: not timed
    pattern = os.path.join(folder, "*.tar")
    out, text_out = os.path.join(tmp, "cache-speech"), os.path.join(tmp, "cache-speech-text")
    plain_out = os.path.join(tmp, "cache-speech-plain")

    def featurize_all() -> None:
        for r in samples:
            speech_featurize(r)

    def build() -> None:
        tc.source(pattern).map(speech_featurize).tokenize(
            tokenizer, arrays=(FIELD,), num_workers=1, progress=False).cache(out)

    def plain_build() -> None:  # the same pipeline, featurize included, storing no arrays
        tc.source(pattern).map(speech_featurize).tokenize(
            tokenizer, num_workers=1, progress=False).cache(plain_out)

    def text_build() -> None:
        tc.source(pattern).map(transcript).tokenize(tokenizer, num_workers=1, progress=False).cache(text_out)

    def timed(step, folder: str | None) -> tuple[float, float]:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        return time.perf_counter() - wall, time.process_time() - cpu

    steps = [("feat", featurize_all, None), ("build", build, out), ("plain", plain_build, plain_out),
             ("text", text_build, text_out)]
    for _, step, where in steps:  # warm-up
        timed(step, where)
    times: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    for rnd in range(rounds):
        for name, step, where in steps[rnd % len(steps):] + steps[:rnd % len(steps)]:
            wall_s, cpu_s = timed(step, where)
            times[name].append(wall_s)
            cpu[name].append(cpu_s)
    cache = tc.TokenCache(out)
    assert cache.num_documents == len(samples), (cache.num_documents, len(samples))
    by_key = {r["__key__"]: r for r in samples}
    frames = 0
    for d in range(cache.num_documents):  # read back: what featurize made, bit for bit
        expected = speech_featurize(by_key[cache.document_key(d)])[FIELD]
        got = cache.document_arrays(d)[FIELD]
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), d
        frames += len(got)

    def storing(t: dict[str, list[float]]) -> float:
        return statistics.median((b - p) / f for b, p, f in zip(t["build"], t["plain"], t["feat"]))
    return {"samples": len(samples), "frames": frames, "times": times, "cpu": cpu,
            "median": {name: statistics.median(v) for name, v in times.items()},
            "cpu_median": {name: statistics.median(v) for name, v in cpu.items()},
            "ratio": statistics.median(b / f for b, f in zip(times["build"], times["feat"])),
            "storing": storing(times), "storing_cpu": storing(cpu),
            "storing_vs_text": statistics.median((b - t - f) / f for b, t, f in
                                                 zip(times["build"], times["text"], times["feat"]))}


# ---- raw baseline ----------------------------------------------------------------------------

def write_flat(records: list[dict], path: str) -> np.ndarray:
    """All features in record order in one flat float32 file; returns the frame offsets."""
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        for i, r in enumerate(records):
            f.write(features(r["seed"], r["frames"]).tobytes())
            offsets[i + 1] = offsets[i] + r["frames"]
    np.save(path + ".offsets.npy", offsets)
    return offsets


class RawArrays(tud.Dataset):
    """Item i: a copy of record i's features out of an np.memmap (opened per process)."""

    def __init__(self, path: str) -> None:
        self.path, self.offsets, self.mm = path, np.load(path + ".offsets.npy"), None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.float32, mode="r").reshape(-1, MELS)
        a, b = self.offsets[i], self.offsets[i + 1]
        return {FIELD: torch.from_numpy(np.array(self.mm[a:b]))}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "mm": None}


def raw_pad(batch: list[dict]) -> dict:
    """Zero-pad to the batch's largest shape in every dimension, with the true shapes."""
    arrays = [torch.as_tensor(item[FIELD]) for item in batch]  # litdata's items are numpy
    shapes = torch.tensor([list(a.shape) for a in arrays], dtype=torch.int64)
    padded = torch.zeros((len(arrays), *shapes.max(dim=0).values.tolist()), dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        padded[(i, *(slice(0, n) for n in a.shape))] = a
    return {FIELD: padded, FIELD + "_shape": shapes}


def epoch_rate(loader, records: int) -> float:
    """Records/s over one epoch after its first batch (start-up excluded)."""
    it, seen = iter(loader), 0
    first = next(it)
    seen_first = len(first[FIELD])
    start = time.perf_counter()
    for batch in it:
        seen += len(batch[FIELD])
    seconds = time.perf_counter() - start
    assert seen + seen_first == records, (seen + seen_first, records)
    return seen / seconds


def raw_loader(flat: str, order: list[int] | None, workers: int):
    ds = RawArrays(flat)
    sampler = order if order is not None else \
        tud.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    return tud.DataLoader(ds, batch_size=BATCH, sampler=sampler, collate_fn=raw_pad,
                          num_workers=workers, persistent_workers=False)


# ---- litdata (run under the litdata venv's Python) -------------------------------------------

def litdata_child(tmp: str, rounds: int) -> None:
    """Optimize the corpus once, then time StreamingDataset epochs against the raw baseline;
    print one JSON line."""
    import warnings

    import litdata as ld

    warnings.filterwarnings("ignore", message=".*not writable.*")  # its arrays are read-only views

    records = read_corpus(os.path.join(tmp, "corpus.jsonl"))
    out = os.path.join(tmp, "litdata")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(out, "index.json")):
        ld.optimize(fn=_litdata_item, inputs=records, output_dir=out, chunk_bytes="64MB",
                    num_workers=1)
    optimize_s = time.perf_counter() - t
    nbytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "*.bin")))
    flat = os.path.join(tmp, "flat.f32")
    result = {"optimize_s": optimize_s, "bytes": nbytes, "ratios": {}, "rates": {}}
    for workers in (0, 2):
        ratios, rates = [], []
        for _ in range(rounds):
            ds = ld.StreamingDataset(out, shuffle=True, seed=0)
            lit = epoch_rate(ld.StreamingDataLoader(ds, batch_size=BATCH, collate_fn=raw_pad,
                                                    num_workers=workers), len(records))
            raw = epoch_rate(raw_loader(flat, None, workers), len(records))
            ratios.append(lit / raw)
            rates.append(lit)
        result["ratios"][workers] = statistics.median(ratios)
        result["rates"][workers] = statistics.median(rates)
    print("LITDATA " + json.dumps(result), flush=True)


def _litdata_item(r: dict) -> dict:
    return {FIELD: features(r["seed"], r["frames"])}


# ---- main ------------------------------------------------------------------------------------

def dir_bytes(pattern: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(pattern, recursive=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=400, help="records in the corpus (default 400, "
                   "about 100 MB of features)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved read rounds (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--litdata", default=None, metavar="PYTHON",
                   help="a Python with litdata installed: add the litdata comparison")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the main process "
                   "(default 1, as in DataLoader workers: on a busy machine more threads make the "
                   "padding of in-process loaders tens of times slower)")
    p.add_argument("--speech", default=DEFAULT_SPEECH if os.path.isdir(DEFAULT_SPEECH) else "",
                   metavar="DIR", help="webdataset tars of FLAC + transcripts: also measure the "
                   "build overhead with examples/speech.py's real featurize (default "
                   f"{DEFAULT_SPEECH} where it exists; '' skips it)")
    p.add_argument("--litdata-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.litdata_child:
        litdata_child(args.litdata_child, args.rounds)
        return

    sys.path.insert(0, os.path.join(HERE, ".."))
    import torchcache as tc

    command = " ".join([os.path.basename(sys.executable), *sys.argv])
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_arrays-")
    os.makedirs(tmp, exist_ok=True)
    try:
        corpus = os.path.join(tmp, "corpus.jsonl")
        frames = write_corpus(corpus, args.records, args.seed)
        records = read_corpus(corpus)
        raw_bytes = int(frames.sum()) * MELS * 4
        tokenizer = os.path.join(tmp, "gpt2-tokenizer.json")
        with gzip.open(TOKENIZER_GZ, "rb") as f, open(tokenizer, "wb") as g:
            g.write(f.read())
        print(f"{args.records} records, frames 100..1500 (mean {frames.mean():.0f}), "
              f"{raw_bytes / 1e6:.1f} MB of float32 features; scratch {tmp}", flush=True)

        # 1. build overhead
        def featurize_all() -> float:
            t = time.perf_counter()
            for r in records:
                featurize(r)
            return time.perf_counter() - t

        before = featurize_all()
        out = os.path.join(tmp, "cache")
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        cache = (tc.source(corpus).map(featurize)
                 .tokenize(tokenizer, arrays=(FIELD,), num_workers=1, progress=False).cache(out))
        build_s = time.perf_counter() - t
        after = featurize_all()
        feat_s = (before + after) / 2
        text_out = os.path.join(tmp, "cache-text")
        shutil.rmtree(text_out, ignore_errors=True)
        t = time.perf_counter()
        tc.source(corpus).tokenize(tokenizer, num_workers=1, progress=False).cache(text_out)
        text_s = time.perf_counter() - t
        speech = speech_build(args.speech, tmp, tokenizer, tc, args.rounds) if args.speech else None

        # 2. storage overhead
        arrays_b = dir_bytes(os.path.join(out, "**", "*.arrays.safetensors"))
        docs_b = dir_bytes(os.path.join(out, "**", "*.docs*"))
        docs_text_b = dir_bytes(os.path.join(text_out, "**", "*.docs*"))
        total_b, total_text_b = dir_bytes(os.path.join(out, "**", "*")), \
            dir_bytes(os.path.join(text_out, "**", "*"))
        storage = arrays_b + (docs_b - docs_text_b)

        # check: what we read back is what featurize made
        for i in (0, len(records) // 2, len(records) - 1):
            expected = features(records[i]["seed"], records[i]["frames"])
            assert np.array_equal(cache.document_arrays(i)[FIELD], expected), i

        # 3. read speed
        flat = os.path.join(tmp, "flat.f32")
        write_flat(records, flat)
        docs = tc.DocumentDataset(cache)
        order = list(iter(tc.DistributedSampler(docs, seed=0)))
        assert sorted(order) == list(range(len(records)))
        for path in glob.glob(os.path.join(out, "**", "*"), recursive=True) + [flat]:
            if os.path.isfile(path):  # page cache warm for both
                with open(path, "rb") as f:
                    while f.read(1 << 24):
                        pass
        ratios: dict[int, list[float]] = {0: [], 2: []}
        rates: dict[str, dict[int, list[float]]] = {"ours": {0: [], 2: []}, "raw": {0: [], 2: []}}
        for rnd in range(args.rounds):
            for workers in (0, 2):
                def ours() -> float:
                    loader = tc.DataLoader(docs, batch_size=BATCH, collate_fn=tc.pad_collate,
                                           sampler=tc.DistributedSampler(docs, seed=0),
                                           num_workers=workers)
                    return epoch_rate(loader, len(records))

                def raw() -> float:
                    return epoch_rate(raw_loader(flat, order, workers), len(records))

                if rnd % 2 == 0:
                    a, b = ours(), raw()
                else:
                    b, a = raw(), ours()
                rates["ours"][workers].append(a)
                rates["raw"][workers].append(b)
                ratios[workers].append(a / b)

        lit = None
        if args.litdata:
            proc = subprocess.run([args.litdata, os.path.abspath(__file__), "--litdata-child", tmp,
                                   "--rounds", str(args.rounds), "--threads", str(args.threads)],
                                  capture_output=True, text=True)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("LITDATA ")]
            if proc.returncode or not lines:
                print(f"litdata run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            else:
                lit = json.loads(lines[-1][len("LITDATA "):])

        # summary
        print()
        print(f"command: {command}")
        print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; loadavg "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine: same-run ratios only)")
        print(f"build   featurize alone {feat_s:.2f} s (before {before:.2f}, after {after:.2f}); "
              f"pipeline build with arrays {build_s:.2f} s; ratio build/featurize "
              f"{build_s / feat_s:.3f} (overhead {100 * (build_s / feat_s - 1):+.1f}%); "
              f"for reference the text-only "
              f"build of the same texts {text_s:.2f} s, so storing the arrays adds "
              f"{build_s - feat_s - text_s:.2f} s "
              f"({100 * (build_s - feat_s - text_s) / feat_s:+.1f}% of featurize)")
        if speech is not None:
            sp, med, cpu = speech, speech["median"], speech["cpu_median"]
            print(f"speech  {sp['samples']} samples of {args.speech} ({sp['frames']:,} frames), "
                  f"{args.rounds} interleaved rounds, medians (wall s / CPU s): featurize alone "
                  f"(examples/speech.py) {med['feat']:.2f} / {cpu['feat']:.2f}; pipeline build with "
                  f"arrays {med['build']:.2f} / {cpu['build']:.2f}; the same build without arrays "
                  f"{med['plain']:.2f} / {cpu['plain']:.2f}; text-only build {med['text']:.2f} / "
                  f"{cpu['text']:.2f}; ratio build/featurize {sp['ratio']:.3f}")
            print(f"speech  storing the arrays, (build with arrays - without) / featurize "
                  f"(acceptance <= 10%): {100 * sp['storing']:+.1f}% in wall-clock time, "
                  f"{100 * sp['storing_cpu']:+.1f}% in CPU time (all threads); (build with arrays - "
                  f"text-only build - featurize) / featurize {100 * sp['storing_vs_text']:+.1f}% "
                  "(wall)")
            print("speech  rounds, wall s with/without/text/featurize: " + ", ".join(
                f"{b:.2f}/{p:.2f}/{t:.2f}/{f:.2f}" for b, p, t, f in zip(
                    sp['times']['build'], sp['times']['plain'], sp['times']['text'], sp['times']['feat'])))
            print("speech  rounds, CPU s with/without/text/featurize: " + ", ".join(
                f"{b:.2f}/{p:.2f}/{t:.2f}/{f:.2f}" for b, p, t, f in zip(
                    sp['cpu']['build'], sp['cpu']['plain'], sp['cpu']['text'], sp['cpu']['feat'])))
        else:
            print("speech  not measured (no --speech DIR)")
        print(f"storage arrays sidecars {arrays_b:,} B + docs sidecars growth "
              f"{docs_b - docs_text_b:+,} B vs raw arrays {raw_bytes:,} B: overhead "
              f"{100 * (storage - raw_bytes) / raw_bytes:+.3f}%  (whole cache {total_b:,} B, "
              f"text-only cache {total_text_b:,} B: all of the growth "
              f"{total_b - total_text_b - raw_bytes:+,} B "
              f"beyond the arrays, {100 * (total_b - total_text_b - raw_bytes) / raw_bytes:+.3f}%)")
        for workers in (0, 2):
            print(f"read    W={workers}: DocumentDataset+pad_collate "
                  f"{statistics.median(rates['ours'][workers]):,.0f} rec/s, raw memmap gather "
                  f"{statistics.median(rates['raw'][workers]):,.0f} rec/s; ours/raw median "
                  f"{statistics.median(ratios[workers]):.3f} (rounds: "
                  f"{', '.join(f'{r:.3f}' for r in ratios[workers])})")
        if lit is not None:
            print(f"litdata optimize {lit['optimize_s']:.2f} s, {lit['bytes']:,} B of chunks "
                  f"({100 * (lit['bytes'] - raw_bytes) / raw_bytes:+.3f}% over raw)")
            for workers in (0, 2):
                lr = lit["ratios"][str(workers)]
                ours_r = statistics.median(ratios[workers])
                print(f"litdata W={workers}: StreamingDataset {lit['rates'][str(workers)]:,.0f} rec/s, "
                      f"litdata/raw {lr:.3f}; ours/litdata {ours_r / lr:.3f}")
        elif not args.litdata:
            print("litdata: not measured (pass --litdata PYTHON)")
    finally:
        if not args.keep and not args.tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
