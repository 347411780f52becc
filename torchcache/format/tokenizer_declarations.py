"""What a model folder or a transformers tokenizer declares beside its tokenizer.json: its named
special tokens (bos_token, eos_token...) and the added tokens of tokenizer_config.json, read as
transformers (5) reads them, so that a folder gives the ids `AutoTokenizer.from_pretrained(folder)`
gives.

A transformers tokenizer is recognised by its class's module, never by importing transformers: the
package does not need transformers unless one is passed.

Where transformers differs, and this does not follow it: a special token that tokenizer_config.json
and special_tokens_map.json both name is tokenizer_config.json's (transformers takes
special_tokens_map.json's, and only when the config has no added_tokens_decoder); an added token
declared with an id it would not get is refused (transformers renumbers it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Tokenizer

from .model_folder import model_file_path

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
#: the named special tokens, in transformers' order (the order it adds missing ones in)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


@dataclass(frozen=True)
class Declarations:
    """A folder's or transformers tokenizer's own word on its tokens.

    special_tokens: bos_token, eos_token... as a chat template sees them; origin: where they were
    read (a file, or the transformers tokenizer), for error messages; add_bos_token: the folder's
    tokenizer_config.json value (`config`: that file), None when it sets none (and for a
    transformers tokenizer, whose backend tokenizer already does what it says).
    """

    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = ""
    add_bos_token: bool | None = None
    config: str = ""


def is_transformers_tokenizer(obj: Any) -> bool:
    """True for a transformers tokenizer object (fast or slow, or a subclass of one), told by
    the module of its class or of a class it derives from."""
    return (any(c.__module__.split(".")[0] == "transformers" for c in type(obj).__mro__)
            and hasattr(obj, "special_tokens_map") and hasattr(obj, "convert_tokens_to_ids"))


def transformers_backend(obj: Any) -> Tokenizer:
    """A transformers fast tokenizer's `backend_tokenizer`; a clear error for a slow one."""
    backend = getattr(obj, "backend_tokenizer", None) if getattr(obj, "is_fast", False) else None
    if not isinstance(backend, Tokenizer):
        name = getattr(obj, "name_or_path", "") or ""
        raise TypeError(f"tokenizer is a slow transformers tokenizer ({type(obj).__name__}"
                        f"{' ' + repr(name) if name else ''}), which has no tokenizers.Tokenizer to "
                        "build with; load it with AutoTokenizer.from_pretrained(..., use_fast=True), "
                        "or pass its tokenizer.json (or model folder)")
    return backend


def transformers_chat_template(obj: Any) -> str | None:
    """A transformers tokenizer's own chat template (its "default" one when it holds several)."""
    template = getattr(obj, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def transformers_special_tokens(obj: Any) -> dict[str, str]:
    """A transformers tokenizer's bos_token, eos_token... (what its chat template sees)."""
    return {k: v for k, v in obj.special_tokens_map.items()
            if k in SPECIAL_TOKEN_KEYS and isinstance(v, str)}


def tokenizer_declarations(tokenizer: Any) -> Declarations | None:
    """The declarations of a model folder or a transformers tokenizer; None for anything else (a
    tokenizer.json file or a tokenizers.Tokenizer declares nothing beside its own JSON)."""
    if is_transformers_tokenizer(tokenizer):
        return Declarations(transformers_special_tokens(tokenizer),
                            f"the transformers tokenizer {type(tokenizer).__name__}")
    if isinstance(tokenizer, (str, os.PathLike)) and os.path.isdir(tokenizer):
        folder = os.fspath(tokenizer)
        special, origin = folder_special_tokens(folder)
        config = model_json(folder, CONFIG_FILE)
        add_bos = config.get("add_bos_token") if isinstance(config, dict) else None
        return Declarations(special, origin, add_bos if isinstance(add_bos, bool) else None,
                            os.path.join(folder, CONFIG_FILE))
    return None


def folder_special_tokens(folder: str | os.PathLike) -> tuple[dict[str, str], str]:
    """bos_token, eos_token... from tokenizer_config.json, else special_tokens_map.json (a string,
    or an AddedToken's {"content": ...}), and the file the eos_token (else the first) came from."""
    raw = _raw_special_tokens(folder)
    found = {key: _content(value) or "" for key, (value, _) in raw.items()}  # (never empty)
    origin = raw.get("eos_token") or next(iter(raw.values()), (None, os.fspath(folder)))
    return found, origin[1]


def _raw_special_tokens(folder: str | os.PathLike) -> dict[str, tuple[Any, str]]:
    """Each named special token as written (string or AddedToken dict), and its file."""
    found: dict[str, tuple[Any, str]] = {}
    for name in (CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        config = model_json(folder, name)
        for key in SPECIAL_TOKEN_KEYS if isinstance(config, dict) else ():
            if _content(config.get(key)) is not None and key not in found:
                found[key] = (config[key], os.path.join(os.fspath(folder), name))
    return {key: found[key] for key in SPECIAL_TOKEN_KEYS if key in found}


def with_declared_tokens(tok: Tokenizer, folder: str | os.PathLike) -> Tokenizer:
    """`tok` (the folder's tokenizer.json) with the tokens its tokenizer_config.json declares, added
    as transformers adds them: every added_tokens_decoder entry (in id order, its flags as
    written), then each named special token (bos_token, eos_token...) that is not an added token
    yet, as a special token.

    A declared added token that would get another id than the one declared (an id gap after the
    vocabulary) is refused: transformers renumbers it silently, and ids must not move.
    """
    config = model_json(folder, CONFIG_FILE)
    config = config if isinstance(config, dict) else {}
    path = os.path.join(os.fspath(folder), CONFIG_FILE)
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError(f"{path}: added_tokens_decoder must map ids to tokens, not "
                         f"{type(declared).__name__}; fix or remove it")
    ordered: list[tuple[int, AddedToken]] = []
    for key, entry in declared.items():
        try:
            ordered.append((int(key), _added_token(entry)))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: added_tokens_decoder entry {key!r}: {entry!r} is not an id "
                             "and an added token ({'content': ..., 'special': ...}); fix it") from None
    ordered.sort(key=lambda pair: pair[0])
    tokens = [token for _, token in ordered]
    known = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t in tokens}
    for key, (raw, _) in _raw_special_tokens(folder).items():
        value = _content(raw)
        if value is not None and value not in known:
            props = {k: bool(raw[k]) for k in ("single_word", "lstrip", "rstrip", "normalized")
                     if isinstance(raw, dict) and k in raw}
            tokens.append(AddedToken(value, **{"normalized": False, **props, "special": True}))
            known.add(value)
    if tokens:
        tok.add_tokens(tokens)
    for want, token in ordered:
        got = tok.token_to_id(token.content)
        if got != want:
            raise ValueError(f"{path}: added_tokens_decoder declares {token.content!r} as id {want}, "
                             f"but added to {os.path.join(os.fspath(folder), 'tokenizer.json')} it "
                             f"gets id {got} (the ids would not be the model's); fix the id, or add "
                             "the token to tokenizer.json")
    return tok


def model_json(folder: str | os.PathLike, name: str) -> Any:
    """A model folder's JSON file's content (links checked: model_file_path), None when absent."""
    path = model_file_path(folder, name)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None


def _content(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value  # AddedToken form
    return value if isinstance(value, str) else None


def _added_token(entry: Any) -> AddedToken:
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
        raise ValueError("not an added token")
    return AddedToken(entry["content"], **{k: bool(entry[k]) for k in _ADDED_TOKEN_FIELDS
                                            if k in entry})
