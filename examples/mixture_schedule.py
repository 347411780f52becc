"""Check a two-stage mixture schedule: realised proportions per window of samples.

    python examples/mixture_schedule.py                 # print the table
    python examples/mixture_schedule.py --plot mix.png  # and plot it (needs matplotlib)

Stage 0 (samples [0, 20000)) mixes "web" and "code" 90/10, stage 1 (from sample 20000) 50/50, in
blocks of 100 samples: every block holds the exact shares, so each window of 1,000 samples shows
exactly 900/100 and then 500/500. ``source_counts`` is exact and O(1) per window, so the same check
works for a schedule over billions of samples. Real training would use TokenDatasets as sources.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset

import torchcache as tc


class Numbers(Dataset):
    """Stand-in source: item i is a tensor holding ``offset + i``."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([self.offset + i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="PNG", help="save a plot of the proportions here")
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--window", type=int, default=1_000)
    args = parser.parse_args()

    mix = tc.MixtureDataset(
        {"web": Numbers(50_000, 0), "code": Numbers(3_000, 1_000_000)},
        schedule=[(0, {"web": 0.9, "code": 0.1}), (20_000, {"web": 0.5, "code": 0.5})],
        block_size=100,
        seed=0,
    )
    print(mix)
    print(f"mix[0] = {mix[0].item()} from {mix.source_of(0)!r}")

    starts = list(range(0, args.samples, args.window))
    shares = {name: [] for name in mix.names}
    print(f"{'samples':>15}  " + "  ".join(f"{name:>6}" for name in mix.names))
    for start in starts:
        counts = mix.source_counts(start, start + args.window)
        for name in mix.names:
            shares[name].append(counts[name] / args.window)
        print(f"{start:>7}-{start + args.window:<7}  " +
              "  ".join(f"{counts[n] / args.window:6.1%}" for n in mix.names))
    total = mix.source_counts(0, args.samples)
    print("whole run: " + ", ".join(f"{n} {c} samples" for n, c in total.items()))

    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: printed the table only (pip install matplotlib)")
            return
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for (name, values), style in zip(shares.items(), ("-", "--", ":", "-.")):
            ax.step(starts + [args.samples], values + values[-1:], style, where="post", label=name)
        for start, _ in mix.stages[1:]:
            ax.axvline(start, color="grey", linestyle=":")
        ax.set(xlabel="mixture sample", ylabel=f"share per {args.window} samples", ylim=(0, 1))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"saved {args.plot}")


if __name__ == "__main__":
    main()
