"""`build_cache`: the one call that tokenizes inputs into a cache (a thin facade).

It checks every argument before anything is read or written, then runs the build engine in
this process, or in the background behind a `BuildHandle`. See `engine` for the build itself,
`worker` for the per-input work, `commit` for the manifest and `executors` for parallelism.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from .._util.args import bool_arg, choice_arg, int_arg, optional_int_arg
from .engine import BuildResult, progress_enabled, run_build
from .formats import INPUT_FORMATS, check_train_on
from .handle import BuildHandle
from ..format.arrays import merged_declarations
from ..format.tokenizer import TokenizerLike


def build_cache(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike | None, *,
                text_key: str = "text", block_tokens: int = 2 ** 24, num_workers: int | None = None,
                on_error: str = "raise", background: bool = False, executor: str = "local",
                eos: int | str | None = "auto", bos: int | str | None = None,
                special_tokens_as_text: bool | None = None, progress: bool | None = None,
                storage_options: dict[str, Any] | None = None,
                vocab_size: int | None = None, allow_empty: bool = False,
                input_format: str = "text", chat_template: str | os.PathLike | None = None,
                train_on: str = "assistant",
                keep_fields: Sequence[str] = (),
                arrays: Sequence[str] | dict[str, str | None] = (),
                token_arrays: Sequence[str] | dict[str, str | None] = (),
                block_array_bytes: int = 2 ** 26) -> "BuildResult | BuildHandle":
    """Tokenize `inputs` into a cache at `output`.

    Re-running a finished build with the same arguments is a cheap no-op; an interrupted build
    (even by kill -9) resumes where it stopped and ends with exactly the cache an uninterrupted
    build would have made.

    Args:
        inputs: paths, globs, directories or fsspec URLs (jsonl, txt, parquet, webdataset tar;
            .gz/.zst compressed), webdataset-style `pipe:COMMAND` URLs, or an iterator of strings.
        output: a new or empty directory, or an fsspec URL (s3://...).
        tokenizer: a `tokenizer.json` path, a model folder (its tokenizer.json with the added
            tokens, eos_token and chat template of its tokenizer_config.json, read as
            transformers reads them), a `tokenizers.Tokenizer`, or a transformers fast tokenizer
            (its backend tokenizer, eos_token and chat_template); None only for pre-tokenized
            inputs: input_format="tokens" records (give vocab_size) or webdataset samples (see
            convert_webdataset).
        text_key: the JSON field or Parquet column holding the text.
        block_tokens: tokens per block (whole documents; the unit of parallelism and reading).
        num_workers: worker processes; default the CPUs this process may use (affinity, cgroup).
        on_error: "raise" stops at a bad record naming file and line; "skip" counts it.
        background: return a BuildHandle at once; training can read the committed prefix.
        executor: "local" (processes on this machine) or "ray" (tasks on a Ray cluster).
        eos, bos: a token id, a token string, "auto" or None. eos="auto": the eos_token a model
            folder or transformers tokenizer declares, else the tokenizer's end-of-text token
            (without a tokenizer, none: pre-tokenized records are stored as given). bos="auto":
            the token the tokenizer itself puts before a text (its post-processor's, as
            transformers' tok(text) does), or none.
        special_tokens_as_text: tokenize "<|endoftext|>" written in a document as plain text
            (default True; for input_format="messages" the rendering's special tokens are tokens,
            as Hugging Face's apply_chat_template makes them, and True is refused).
        progress: a progress bar; default on unless the TQDM_DISABLE environment variable is set.
        storage_options: fsspec options for remote inputs and outputs.
        vocab_size: for pre-tokenized inputs only, without a tokenizer (sets the dtype, refuses
            ids outside it; default: uint32 ids, unchecked).
        allow_empty: accept a build whose inputs hold no document (else BuildError).
        input_format: "text" (one string field, `text_key`); "messages" ({"messages": [{"role",
            "content"}, ...]} or ShareGPT's {"conversations": [{"from", "value"}, ...]}, rendered
            with the chat template); "prompt_completion" ({"prompt", "completion"}, joined as
            given, the completion trained); "tokens" ({"input_ids", "loss_mask"} or
            {"input_ids", "labels"} with -100 where not trained). All but "text" store a loss
            mask (format v3) and read JSON lines or Parquet files (each row a dict; list columns
            are lists) or an iterable of dicts.
        chat_template: for "messages": Jinja text, a .jinja or JSON file, or None for the
            tokenizer's own (tokenizer_config.json or chat_template.jinja beside tokenizer.json).
        train_on: "assistant" (every assistant turn), "last_assistant" or "all" (every token).
        keep_fields: fields of each record kept with its document (cache.document_info).
        arrays: record fields kept as typed arrays (cache.document_arrays): names, or a dict
            name -> "dtype[dims]" ("float16[*, 80]"; "*" any size) or None. Undeclared, a field's
            dtype and rank are its first record's. Values: nested lists, numpy arrays, tensors.
        token_arrays: for input_format="tokens": record fields with one row per input id
            (per-token weights), names or a dict name -> "dtype[*, dims]" (rank 1 unless
            declared). Checked against the ids' count; BOS/EOS added here get 0. TokenDataset,
            PackedDataset (padding 0) and mixtures slice them like input_ids.
        block_array_bytes: with arrays, a block is also closed once its arrays hold this many
            bytes (whole documents; default 64 MiB): what a build holds in memory per input, and
            the size of the files a remote cache copies.

    Example (usually `tokenizer` is a tokenizer.json path and `inputs` a glob like
    "data/*.jsonl"):

        >>> import os, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
        ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> out = os.path.join(tmp.name, "cache")
        >>> result = tc.build_cache(iter(["hello", "world", "hello"]), out, tokenizer, progress=False)
        >>> result.num_tokens, result.num_documents, result.skipped   # EOS ends each document
        (6, 3, {})
        >>> tc.build_cache(iter(["hello", "world", "hello"]), out, tokenizer,
        ...                progress=False).already_complete   # the same build again: a no-op
        True
        >>> handle = tc.build_cache(iter(["world"]), os.path.join(tmp.name, "more"), tokenizer,
        ...                         background=True, progress=False)
        >>> handle.wait().num_tokens
        2
        >>> tmp.cleanup()
    """
    kwargs = checked_build_arguments(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                                on_error=on_error, executor=executor, eos=eos, bos=bos,
                                special_tokens_as_text=special_tokens_as_text,
                                storage_options=storage_options, vocab_size=vocab_size,
                                allow_empty=allow_empty, input_format=input_format,
                                chat_template=chat_template, train_on=train_on,
                                keep_fields=keep_fields, arrays=arrays,
                                token_arrays=token_arrays, block_array_bytes=block_array_bytes)
    progress = None if progress is None else bool_arg(progress, "progress")
    if bool_arg(background, "background"):
        return BuildHandle.start(inputs, output, tokenizer, kwargs)
    return run_build(inputs, output, tokenizer, progress=progress_enabled(progress), **kwargs)


def checked_build_arguments(*, text_key, block_tokens, num_workers, on_error, executor, eos, bos,
                            special_tokens_as_text, storage_options, vocab_size, allow_empty,
                            input_format, chat_template, train_on, keep_fields,
                            arrays=(), token_arrays=(), block_array_bytes=2 ** 26) -> dict[str, Any]:
    """The build's arguments, each checked (type and value) before anything is read or written,
    as plain Python values (a numpy integer or bool becomes an int or a bool: they go into JSON)."""
    if not isinstance(text_key, str) or not text_key:
        raise TypeError(f"text_key must be a non-empty string naming the text field, not {text_key!r}")
    for name, token in (("eos", eos), ("bos", bos)):
        if token is not None and (isinstance(token, bool) or not isinstance(token, (int, np.integer, str))):
            raise TypeError(f"{name} must be a token id (int), a token string, 'auto' or None, "
                            f"not {token!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options, not {storage_options!r}")
    input_format = choice_arg(input_format, "input_format", INPUT_FORMATS)
    if chat_template is not None and input_format != "messages":
        raise ValueError(f"chat_template is for input_format='messages', not {input_format!r}")
    if isinstance(keep_fields, str) or not all(isinstance(k, str) and k for k in keep_fields):
        raise TypeError(f"keep_fields must be a list of field names, not {keep_fields!r}")
    merged_declarations(arrays, token_arrays)  # refuses bad names and declarations, before any work
    if _given(token_arrays) and input_format != "tokens":
        raise ValueError(f"token_arrays needs input_format='tokens' (pre-tokenized records, whose "
                         f"token count the arrays must match), not {input_format!r}; keep "
                         "document-level arrays with arrays=")
    if special_tokens_as_text is None:
        special_tokens_as_text = input_format != "messages"
    elif bool_arg(special_tokens_as_text, "special_tokens_as_text") and input_format == "messages":
        raise ValueError("special_tokens_as_text=True cannot hold for input_format='messages': the "
                         "chat template writes its markers (<|im_start|>...) as special tokens, which "
                         "the rendering must keep; leave special_tokens_as_text unset")
    return dict(text_key=text_key, block_tokens=int_arg(block_tokens, "block_tokens", minimum=1),
                num_workers=optional_int_arg(num_workers, "num_workers", minimum=0),
                on_error=choice_arg(on_error, "on_error", ("raise", "skip")),
                executor=choice_arg(executor, "executor", ("local", "ray")), eos=eos, bos=bos,
                special_tokens_as_text=bool_arg(special_tokens_as_text, "special_tokens_as_text"),
                storage_options=storage_options,
                vocab_size=optional_int_arg(vocab_size, "vocab_size", minimum=1, maximum=2 ** 32),
                allow_empty=bool_arg(allow_empty, "allow_empty"), input_format=input_format,
                chat_template=chat_template, train_on=check_train_on(train_on),
                keep_fields=tuple(keep_fields), arrays=_arrays_arg(arrays),
                token_arrays=_arrays_arg(token_arrays),
                block_array_bytes=int_arg(block_array_bytes, "block_array_bytes", minimum=1))


def _given(arrays: Any) -> bool:
    return not (arrays is None or (not isinstance(arrays, (str, dict)) and not len(arrays)))


def _arrays_arg(arrays: Any) -> dict[str, str | None] | None:
    """`arrays=` (or `token_arrays=`), checked by merged_declarations, as a JSON-able dict
    name -> declaration (None: none declared)."""
    if not _given(arrays):
        return None
    return {name: arrays[name] if isinstance(arrays, dict) else None for name in sorted(arrays)}
