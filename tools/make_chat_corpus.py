"""A realistic multi-turn chat corpus from the Gutenberg books, for chat-build benchmarks.

    python tools/make_chat_corpus.py OUT_DIR [--corpus DIR] [--conversations N] [--shards 4]
                                     [--seed 0] [--sharegpt-share 0.1]

No chat corpus ships with shared/data, so this makes one: conversations of 2 to 8 turns (user and
assistant turns alternating, the assistant's last), each turn one to four consecutive paragraphs of a
book (so turns are real English prose of realistic lengths), a system prompt on about a third of
them, written as JSON lines of ``{"messages": [{"role", "content"}, ...]}``; a share of the
records use ShareGPT's ``{"conversations": [{"from", "value"}]}`` instead. Deterministic for a
seed. Prints the corpus's size, turns and characters per role.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
SYSTEM_PROMPTS = (
    "You are a helpful assistant who answers in the style of a nineteenth-century novelist.",
    "You are a careful reader. Answer with passages of prose, never with lists.",
    "Reply in full paragraphs. Keep the tone of the book under discussion.",
    "You are an assistant for literary questions.",
)
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def paragraphs_of(corpus: str) -> list[list[str]]:
    """Each book's paragraphs (blank-line separated, whitespace-normalised, 40+ characters)."""
    books = []
    for name in sorted(os.listdir(corpus)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(corpus, name), encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                parts = [" ".join(p.split()) for p in text.split("\n\n")]
                parts = [p for p in parts if len(p) >= 40]
                if len(parts) >= 16:
                    books.append(parts)
    if not books:
        sys.exit(f"no book with paragraphs found in {corpus}")
    return books


def conversation(rng: random.Random, books: list[list[str]]) -> list[dict[str, str]]:
    """2, 4, 6 or 8 alternating user/assistant turns (ending with the assistant's) from
    consecutive paragraphs of one book."""
    book = rng.choice(books)
    turns = 2 * rng.randint(1, 4)
    at = rng.randrange(0, max(1, len(book) - 4 * turns))
    messages = []
    if rng.random() < 1 / 3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for k in range(turns):
        take = rng.randint(1, 4 if k % 2 else 2)  # answers run longer than questions
        content = "\n\n".join(book[at:at + take])
        at += take
        messages.append({"role": "assistant" if k % 2 else "user", "content": content})
    return messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    p.add_argument("--conversations", type=int, default=20_000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharegpt-share", type=float, default=0.1,
                   help="share of records written in ShareGPT's form (default 0.1)")
    args = p.parse_args()
    if args.conversations < 1 or args.shards < 1 or not 0 <= args.sharegpt_share <= 1:
        p.error("--conversations and --shards must be >= 1, --sharegpt-share in [0, 1]")
    books = paragraphs_of(args.corpus)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    files = [open(os.path.join(args.out, f"chat-{i:05d}.jsonl"), "w", encoding="utf-8")
             for i in range(args.shards)]
    chars = {"system": 0, "user": 0, "assistant": 0}
    turns = 0
    try:
        for i in range(args.conversations):
            messages = conversation(rng, books)
            for m in messages:
                chars[m["role"]] += len(m["content"])
            turns += len(messages)
            if rng.random() < args.sharegpt_share:
                record = {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
                                            for m in messages]}
            else:
                record = {"messages": messages}
            files[i % args.shards].write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        for f in files:
            f.close()
    size = sum(os.path.getsize(f.name) for f in files)
    print(f"{args.conversations:,} conversations, {turns:,} messages, {size / 2 ** 20:.1f} MB in "
          f"{args.shards} shards under {args.out}; characters: "
          + ", ".join(f"{role} {n:,}" for role, n in chars.items()))


if __name__ == "__main__":
    main()
