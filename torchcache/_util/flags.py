"""The library's messages in the command line's spelling.

Errors name the Python arguments a caller passed (``chat_template=``, ``train_on='all'``,
``num_workers``), which is right for Python. The command line prints the same messages, and
there the user passed flags: ``--chat-template``, ``--train-on all``, ``--workers``. This module
respells one message, so every command names what its user can type.
"""

from __future__ import annotations

import re
import shlex

__all__ = ["FLAGS", "command_line_spelling"]

#: Python argument -> the flag that sets it on the command line.
FLAGS = {
    "chat_template": "--chat-template", "train_on": "--train-on", "input_format": "--input-format",
    "on_error": "--on-error", "allow_empty": "--allow-empty", "vocab_size": "--vocab-size",
    "keep_fields": "--keep-field", "text_key": "--text-key", "block_tokens": "--block-tokens",
    "num_workers": "--workers", "storage_options": "--storage-option", "local_dir": "--local-dir",
    "plan_dir": "--plan-dir", "seq_len": "--seq-len", "long_docs": "--long-docs",
    "max_segments": "--max-segments", "batch_size": "--batch-size", "world_size": "--world-size",
    "global_batch": "--global-batch", "eos_id": "--eos", "bos_id": "--bos",
    # plain words: respelled only where written as an argument (see _PLAIN_WORD_USES)
    "tokenizer": "--tokenizer", "eos": "--eos", "bos": "--bos", "seed": "--seed",
    "steps": "--steps", "samples": "--samples",
}

# Whole phrases whose command-line form is not a word-for-word respelling (applied first).
_PHRASES = (
    ("plan_dir= (or `torchcache pack CACHE --plan-dir DIR`)", "--plan-dir DIR"),
    ("chat_template=None takes", "without --chat-template, the build takes"),
    ("see convert_webdataset", "see `torchcache convert-webdataset`"),
    ("build them with build_cache", "build them with `torchcache build`"),
    (" or a tokenizers.Tokenizer", ""),  # a Python object: not something a flag can give
)

_NAMES = "|".join(sorted(map(re.escape, FLAGS), key=len, reverse=True))
# name=VALUE: a quoted string, True, None, another word or number, or nothing (`pass plan_dir=`)
_ASSIGNED = re.compile(rf"(?<![\w./-])({_NAMES})=(?:'([^']*)'|\"([^\"]*)\"|(True|None)\b|([\w.+-]+))?")
# a name with an underscore, written bare (`chat_template is for ...`); not inside a path or word
_BARE = re.compile(rf"(?<![\w./`'\"-])({'|'.join(n for n in FLAGS if '_' in n)})(?![\w/-]|\.\w|\()")
# a plain word as the subject of an argument check: `seed must be >= 0`, `tokenizer is required`
_PLAIN_WORD_USES = re.compile(rf"(?<![\w./-])({'|'.join(n for n in FLAGS if '_' not in n)})"
                              r"(?= must | is required)")


def _assigned(match: re.Match) -> str:
    name, single, double, constant, word = match.groups()
    flag = FLAGS[name]
    text = single if single is not None else double
    if text is not None:
        return f"{flag} {shlex.quote(text)}"
    if constant == "True":
        return flag
    if constant == "None":
        return f"{flag} none" if flag in ("--eos", "--bos") else f"without {flag}"
    return f"{flag} {word}" if word is not None else flag


def command_line_spelling(message: str) -> str:
    """`message` with each Python argument it names spelled as its command-line flag."""
    for python, flag in _PHRASES:
        message = message.replace(python, flag)
    message = _ASSIGNED.sub(_assigned, message)
    message = _BARE.sub(lambda m: FLAGS[m.group(1)], message)
    return _PLAIN_WORD_USES.sub(lambda m: FLAGS[m.group(1)], message)
