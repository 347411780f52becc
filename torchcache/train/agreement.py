"""What the sources of one mixture must agree on: the tokenizer (one id, one text) and the chat
template (one conversation format).

The one place for these checks: :class:`torchcache.MixtureDataset` runs them on its sources, and
a recipe's plan (``torchcache mix plan``, :func:`torchcache.plan_recipe`) runs them on the caches
it names, so a plan never accepts a recipe that ``MixtureDataset.from_recipe`` refuses. No torch
here: the recipe side plans without it.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["refuse_mixed_templates", "refuse_mixed_tokenizers", "tokenizer_identity"]

#: How a Python caller lets a mixture combine sources that differ (the recipe side says how a
#: recipe file does).
PYTHON_ALLOW = {"tokenizers": "pass allow_mixed_tokenizers=True",
                "templates": "pass allow_mixed_templates=True"}


def tokenizer_identity(cache: Any) -> str:
    """What a cache's token ids mean: its tokenizer's fingerprint, or for pre-tokenized data (no
    tokenizer) the vocabulary size and dtype."""
    tokenizer = cache.spec.get("tokenizer")
    if tokenizer is not None:
        return f"tokenizer fingerprint {tokenizer['fingerprint']}"
    return (f"pre-tokenized ids (no tokenizer), vocab_size={cache.vocab_size}, "
            f"dtype={cache.spec['dtype']}")


def disagreement(values: Mapping[str, str]) -> tuple[str, str] | None:
    """Names of the first source and the first one whose value differs from it, or None."""
    items = list(values.items())
    for name, value in items[1:]:
        if value != items[0][1]:
            return items[0][0], name
    return None


def refuse_mixed_tokenizers(identities: Mapping[str, str],
                            allow: str = PYTHON_ALLOW["tokenizers"]) -> None:
    """ValueError if the sources' token ids come from different tokenizers (``identities``:
    source -> :func:`tokenizer_identity`); ``allow`` says how to accept them anyway."""
    pair = disagreement(identities)
    if pair is None:
        return
    a, b = pair
    raise ValueError(
        f"sources {a!r} and {b!r} were tokenized differently ({a}: {identities[a]}; {b}: "
        f"{identities[b]}): the same token id stands for different text in each, so the "
        f"mixture would feed the model nonsense. Build every source with the same tokenizer, or "
        f"{allow} if the model really takes both")


def refuse_mixed_templates(templates: Mapping[str, str],
                           allow: str = PYTHON_ALLOW["templates"]) -> None:
    """ValueError if the sources' chat caches were rendered with different chat templates
    (``templates``: source -> template text, for the sources that have one)."""
    pair = disagreement(templates)
    if pair is None:
        return
    a, b = pair
    raise ValueError(
        f"sources {a!r} and {b!r} were rendered with different chat templates ({a}: "
        f"{excerpt(templates[a])}; {b}: {excerpt(templates[b])}): the model would learn two "
        f"conversation formats at once. Build both with the same chat_template, or {allow} if "
        "that is what you want")


def excerpt(text: str, width: int = 60) -> str:
    """The start of ``text`` on one line, for error messages."""
    line = " ".join(text.split())
    return repr(line if len(line) <= width else line[:width] + "...")
