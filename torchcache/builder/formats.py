"""Input formats: what one input record becomes, and what a v3 cache keeps of it.

"text" (the default) reads one string field. The other formats read the whole JSON object:
"messages" (and ShareGPT's "conversations") renders it with a chat template, "prompt_completion"
joins prompt and completion, "tokens" takes ids and a mask as given. Each gives a `Shaped`
document: a text to tokenize with its trained character spans, or ids with their trained flags.
`keep_fields` copies named fields of the record into the document's provenance.

A cache whose documents carry a loss mask or kept fields is format v3; its spec records the
format, the template text and train_on, so they are part of the cache's identity.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from ..format.arrays import ArrayDeclaration, declarations_from_spec
from .arrays import ArrayConverter, check_token_rows
from .chat import ChatTemplate, TRAIN_ON, render_record
from .records import BadRecord

INPUT_FORMATS = ("text", "messages", "prompt_completion", "tokens")
# What strftime_now() gives a template in a build: fixed, so that a cache is a pure function of
# its inputs (a template that prints today's date would otherwise change the cache every day).
BUILD_MOMENT = datetime(2025, 1, 1)
_MAX_FIELDS_CHARS = 1 << 20


@dataclass(frozen=True)
class Shaped:
    """One document before tokenizing: `text` with trained character `spans` (None: no mask), or
    pre-tokenized `ids` with one trained flag per id; `fields`: the kept fields, compact JSON."""

    text: str | None = None
    spans: list[tuple[int, int]] | None = None
    ids: np.ndarray | None = None
    trained: np.ndarray | None = None
    fields: bytes | None = None
    arrays: dict[str, np.ndarray] | None = None


def documents_spec(input_format: str, keep_fields: Sequence[str], template: ChatTemplate | None,
                   train_on: str, arrays: dict[str, ArrayDeclaration] | None = None
                   ) -> dict[str, Any] | None:
    """The spec's "documents" entry (None for a plain text cache, which stays format v2); with
    `arrays`, their declarations (absent without, so that other caches keep their bytes)."""
    if input_format == "text" and not keep_fields and not arrays:
        return None
    masked = input_format != "text"
    extra = {"arrays": {name: d.to_spec() for name, d in arrays.items()}} if arrays else {}
    return extra | {
        "input_format": input_format,
        "loss_mask": masked,
        "chat_template": template.source if template is not None else None,
        "chat_special_tokens": dict(sorted(template.special_tokens.items())) if template else None,
        "train_on": train_on if input_format in ("messages", "prompt_completion") else None,
        "keep_fields": list(keep_fields),
    }


class RecordShaper:
    """Turns records (parsed JSON objects) into `Shaped` documents for one build's spec
    (`documents` None: a text cache's, whose records a pipeline reads whole)."""

    def __init__(self, documents: dict[str, Any] | None, text_key: str,
                 template_name: str | None = None):
        documents = documents or {}
        self.format = documents.get("input_format", "text")
        self.text_key = text_key
        self.train_on = documents.get("train_on") or "assistant"
        self.keep = tuple(documents.get("keep_fields", ()))
        declared = declarations_from_spec(documents)
        self.arrays = ArrayConverter(declared) if declared else None
        self.per_token = tuple(name for name, d in declared.items() if d.per_token)
        source = documents.get("chat_template")
        self.template = None if source is None else ChatTemplate(
            source, documents.get("chat_special_tokens") or {}, name=template_name, now=BUILD_MOMENT)

    def __call__(self, obj: Any) -> Shaped:
        """The document `obj` makes (BadRecord when it cannot make one)."""
        fields = self._fields(obj) if self.keep else None
        if self.format == "text":
            shaped = Shaped(text=_text_field(obj, self.text_key), fields=fields)
        elif self.format == "tokens":
            ids, trained = _tokens_record(obj)
            shaped = Shaped(ids=ids, trained=trained, fields=fields)
        else:
            text, spans = render_record(obj, self.format, self.template, self.train_on)
            shaped = Shaped(text=text, spans=spans, fields=fields)
        if self.arrays is None:
            return shaped
        arrays = self.arrays(obj)
        if shaped.ids is not None:
            check_token_rows(arrays, self.per_token, len(shaped.ids))
        return dataclasses.replace(shaped, arrays=arrays)

    def _fields(self, obj: Any) -> bytes:
        if not isinstance(obj, dict):
            raise BadRecord("missing_text", f"the record is a {type(obj).__name__}, not an object")
        kept = {name: obj[name] for name in self.keep if name in obj}
        try:
            data = json.dumps(kept, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        except (TypeError, ValueError) as e:  # bytes (a tar member), a set, a cycle
            raise BadRecord("bad_content", f"the kept fields {sorted(kept)} are not plain JSON "
                                           f"data ({e}); make them JSON values in a map step "
                                           "(decode a tar member's bytes)") from e
        if len(data) > _MAX_FIELDS_CHARS:
            raise BadRecord("missing_text", f"the kept fields take {len(data):,} characters, more "
                                            f"than {_MAX_FIELDS_CHARS:,}; keep smaller fields")
        return data.encode()


def _text_field(obj: Any, key: str) -> str:
    if not isinstance(obj, dict) or key not in obj:
        found = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        hint = ""
        if isinstance(obj, dict) and "__key__" in obj:  # a tar's sample: members are bytes
            hint = (f"; a tar sample holds its members as bytes by extension: decode the text in "
                    f"a map step, e.g. .map(lambda r: {{{key!r}: r['txt'].decode('utf-8')}})")
        raise BadRecord("missing_text", f"no {key!r} field (found {found}); set text_key to the "
                                        f"field that holds the text{hint}")
    value = obj[key]
    if isinstance(value, (bytes, bytearray, memoryview)):
        member = f" (the bytes of member {obj['__key__'] + '.' + key!r})" if "__key__" in obj else ""
        raise BadRecord("missing_text", f"field {key!r} is bytes{member}, not a string: decode it "
                                        f"in a map step, e.g. .map(lambda r: {{{key!r}: "
                                        f"r[{key!r}].decode('utf-8')}})")
    if not isinstance(value, str):
        raise BadRecord("missing_text", f"field {key!r} is a {type(value).__name__}, not a string")
    return value


def _tokens_record(obj: Any) -> tuple[np.ndarray, np.ndarray]:
    """{"input_ids", "loss_mask"} (1 trained, 0 not) or {"input_ids", "labels"} (-100: not trained;
    labels align with input_ids, as Hugging Face models take them before their own shift)."""
    if not isinstance(obj, dict) or "input_ids" not in obj:
        found = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise BadRecord("missing_text", f"no 'input_ids' field (found {found})")
    ids = _int_list(obj["input_ids"], "input_ids")
    if "loss_mask" in obj:
        flags = _int_list(obj["loss_mask"], "loss_mask")
        if np.any((flags != 0) & (flags != 1)):
            raise BadRecord("bad_tokens", "'loss_mask' holds values other than 0 and 1")
        trained = flags == 1
        name = "loss_mask"
    elif "labels" in obj:
        labels = _int_list(obj["labels"], "labels")
        trained = labels != -100
        name = "labels"
        if len(labels) == len(ids):
            _check_labels(ids, labels, trained)
    else:
        raise BadRecord("missing_text", "no 'loss_mask' or 'labels' field beside 'input_ids'")
    if len(trained) != len(ids):
        raise BadRecord("bad_tokens", f"{name!r} has {len(trained)} values, 'input_ids' {len(ids)}")
    return ids, trained


def _check_labels(ids: np.ndarray, labels: np.ndarray, trained: np.ndarray) -> None:
    """Labels in Hugging Face's convention (unshifted: -100, or the input id at the same place),
    the only one whose values say nothing beyond the mask; any other value would be dropped
    silently, and shifted labels would train every target one token off."""
    wrong = np.flatnonzero(trained & (labels != ids))
    if not len(wrong):
        return
    at, before_last = int(wrong[0]), trained[:-1]
    shifted = before_last.any() and bool(np.all(labels[:-1][before_last] == ids[1:][before_last]))
    hint = ("; these look shifted by one (labels[i] == input_ids[i + 1]): give them unshifted, "
            "the model shifts them itself" if shifted else "")
    raise BadRecord("bad_labels",
                    f"'labels' at position {at} is {int(labels[at])}, but 'input_ids' there is "
                    f"{int(ids[at])} ({len(wrong)} such labels){hint}. Labels follow Hugging "
                    "Face's convention, unshifted: -100 where not trained, else equal to "
                    "input_ids at the same position (or give 'loss_mask', 0/1, instead of "
                    "'labels')")


def _int_list(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise BadRecord("bad_tokens", f"{name!r} is not a list of integers")
    return np.asarray(value, dtype=np.int64)


def check_train_on(train_on: str) -> str:
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r}: use one of {', '.join(TRAIN_ON)}")
    return train_on
