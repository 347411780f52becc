"""Chat and instruction records: the text a document stores and which of its tokens are trained.

A record becomes a list of messages (`normalize_messages`), the messages become one text and the
character spans of it that are trained (`ChatTemplate.render`, or prompt + completion joined as
given), and the spans become one flag per token (`trained_token_mask`) once the whole text is
tokenized; the format stores those flags as runs (`mask_runs`, `mask_from_runs`).

Templates are Jinja, rendered as Hugging Face renders chat templates (the same variables, globals,
filters and whitespace settings, so a model's own template gives the text it was trained and served
with) but in a sandbox that refuses file access (include, import, extends) and any attribute that
starts with "_", with an error naming the template.

What is trained: with {% generation %}...{% endgeneration %} tags, what the tags enclose. Without
them, an assistant turn's span is what the model would write at inference: what rendering the
messages up to and including the turn adds after rendering the messages before it with
add_generation_prompt=True, less the whitespace that ends it. So the assistant header is not
trained; the content and the end-of-turn marker (ChatML's <|im_end|>, Llama 3's <|eot_id|>) are,
since the model must learn to stop; the newline ChatML writes between turns is not. That is what a
template whose tags enclose the content and the end marker gives, so both kinds agree.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from datetime import datetime
from typing import Any, Iterable, Mapping, NoReturn, Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from ..format.model_folder import model_file_path
from ..format.tokenizer_backends import TokenizerBackend
from ..format.tokenizer_declarations import (folder_special_tokens, is_transformers_tokenizer,
                                             transformers_chat_template,
                                             transformers_special_tokens)
from .records import BadRecord
from .template_limits import (BoundedSandbox, RecordLimits, RenderLimitExceeded, bound_filters,
                              budget, instrument)

INPUT_FORMATS = ("messages", "prompt_completion")
TRAIN_ON = ("assistant", "last_assistant", "all")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's "from" values (compared lower-cased), and the names other exports use for them
SHAREGPT_ROLES = {"human": "user", "user": "user",
                  "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "model": "assistant", "chatgpt": "assistant",
                  "system": "system",
                  "tool": "tool", "observation": "tool"}
# the names transformers copies a message's reasoning under (utils/chat_template_utils.py)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template
CONFIG_FILE = "tokenizer_config.json"

Span = tuple[int, int]

# Unicode noncharacters, never assigned to text: the generation tags mark their output with two of
# them (ones the template and the messages do not use), removed again once the text is rendered.
_MARK_CANDIDATES = tuple(chr(c) for c in range(0xFDD0, 0xFDF0))
_MARKS_VARIABLE = "_torchcache_generation_marks"
_PREFIX_STABLE_HINT = ("add {% generation %} tags around what the assistant writes (its content "
                       "and end-of-turn marker), or pass train_on='all'")


# --- records to messages -------------------------------------------------------------------------

def normalize_messages(record: Any, input_format: str) -> list[dict[str, Any]]:
    """The messages of a record as [{"role", "content", ...}, ...], or BadRecord saying what is wrong.

    "messages": {"messages": [{"role", "content"}, ...]} with roles from ROLES, or ShareGPT's
    {"conversations": [{"from", "value"}, ...]} with the names in SHAREGPT_ROLES. Every other field
    of a message (tool_calls, tool_call_id, name, reasoning_content...) is kept, as transformers'
    apply_chat_template passes it to the template (with its reasoning-field aliases); content may
    be null or absent in a message with tool_calls.
    "prompt_completion": {"prompt": str, "completion": str}, returned as a "prompt" and a
    "completion" part (joined as given, no template).
    """
    if input_format == "prompt_completion":
        return _prompt_completion(record)
    if input_format != "messages":
        raise ValueError(f"input_format={input_format!r} is not a chat format; use one of "
                         f"{', '.join(INPUT_FORMATS)}")
    turns, sharegpt = _conversation(record)
    if not turns:
        raise BadRecord("empty_conversation", "the conversation has no messages")
    return [_message(i, turn, sharegpt) for i, turn in enumerate(turns)]


def _conversation(record: Any) -> tuple[list, bool]:
    """The record's list of turns, and whether it is ShareGPT's "conversations"."""
    if not isinstance(record, dict):
        raise BadRecord("no_messages", f"the record is a {type(record).__name__}, not an object "
                                       "with 'messages' (or ShareGPT's 'conversations')")
    key = "messages" if "messages" in record else "conversations" if "conversations" in record else None
    if key is None:
        raise BadRecord("no_messages", f"no 'messages' (or ShareGPT 'conversations') field (found "
                                       f"{sorted(record)[:8]})")
    if not isinstance(record[key], list):
        raise BadRecord("no_messages", f"field {key!r} is a {type(record[key]).__name__}, not a list "
                                       "of messages")
    return record[key], key == "conversations"


def _message(index: int, turn: Any, sharegpt: bool) -> dict[str, Any]:
    """One turn as {"role", "content", other fields as given}; ShareGPT turns use "from"/"value"
    (or "role"/"content")."""
    if not isinstance(turn, dict):
        raise BadRecord("bad_content", f"message {index} is a {type(turn).__name__}, not an object "
                                       "with a role and content")
    role_key, content_key = ("from", "value") if sharegpt and "from" in turn else ("role", "content")
    role = turn.get(role_key)
    if sharegpt:
        role = SHAREGPT_ROLES.get(role.lower()) if isinstance(role, str) else None
        known = ", ".join(sorted(SHAREGPT_ROLES))
    else:
        role = role if role in ROLES else None
        known = ", ".join(ROLES)
    if role is None:
        found = f"{role_key} {_brief(turn[role_key])}" if role_key in turn else f"no {role_key!r}"
        raise BadRecord("unknown_role", f"message {index} has {found}; known roles: {known}")
    message = {"role": role}
    for key, value in turn.items():  # every field, in the record's order (as transformers passes it)
        if key == content_key:
            message["content"] = value
        elif key != role_key:
            _check_strings(value, f"message {index} {key!r}")
            message[key] = value
    content = turn.get(content_key)
    if content is not None or not turn.get("tool_calls"):  # a tool call's content may be null
        message["content"] = _text(content, f"message {index} {content_key!r}")
    return _alias_reasoning(message)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """transformers fills "thinking" and "reasoning_content" from any of the reasoning fields, so
    that templates reading either name see it; the same here."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message,
                                              "reasoning_content": reasoning}


def record_tools(record: Any) -> list | None:
    """A record's top-level "tools" (JSON schemas), passed to the template as transformers does."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("bad_content", f"field 'tools' is {_brief(tools)}, not a list of tool "
                                       "schemas (objects)")
    _check_strings(tools, "field 'tools'")
    return tools


def _check_strings(value: Any, where: str) -> None:
    """Every string in a JSON value is valid UTF-8 (a lone surrogate would fail in the tokenizer);
    walked with a stack, so that no nesting depth can exhaust Python's recursion limit."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            _text(item, where)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


def _prompt_completion(record: Any) -> list[dict[str, str]]:
    if not isinstance(record, dict):
        raise BadRecord("missing_text", f"the record is a {type(record).__name__}, not an object "
                                        "with 'prompt' and 'completion'")
    for key in ("prompt", "completion"):
        if key not in record:
            raise BadRecord("missing_text", f"no {key!r} field (found {sorted(record)[:8]})")
    parts = [{"role": key, "content": _text(record[key], f"field {key!r}")}
             for key in ("prompt", "completion")]
    if not parts[0]["content"] and not parts[1]["content"]:
        raise BadRecord("empty_conversation", "'prompt' and 'completion' are both empty")
    return parts


def _text(value: Any, where: str) -> str:
    """A message's text: a string, valid as UTF-8 (a lone surrogate would fail in the tokenizer)."""
    if not isinstance(value, str):
        raise BadRecord("bad_content", f"{where} is {_brief(value)}, not a string")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord("invalid_utf8", f"{where} is not valid UTF-8 (a lone surrogate "
                                            f"{value[e.start]!r} at character {e.start})") from e
    return value


def _brief(value: Any) -> str:
    """A value, shortened for an error message."""
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


# --- the Jinja environment -----------------------------------------------------------------------

class _TemplateRaised(TemplateError):
    """The template called raise_exception: it rejects the conversation."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """JSON as Hugging Face's templates expect it: non-ASCII kept, no HTML escaping (Jinja's own
    tojson escapes <, > and &, which would change what chat models were trained on)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTags(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: wraps what the block renders in two marks (when the
    render passes them), so its span can be found in the final text wherever the output went
    (through macros, set blocks or filters), not where the block happened to be evaluated."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_marked", [nodes.ContextReference()])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _marked(self, context: Any, caller: Any) -> str:
        body = caller()
        marks = context.get(_MARKS_VARIABLE)
        return body if marks is None else f"{marks[0]}{body}{marks[1]}"


class _Sandbox(BoundedSandbox):
    """Jinja's immutable sandbox, counting each rendering's work (template_limits), and an unsafe
    attribute is an error at once (the stock sandbox returns an undefined value that prints as
    nothing, so a probe would pass silently)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                            "object is not allowed")


def _environment() -> _Sandbox:
    """The environment Hugging Face renders chat templates in, sandboxed."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    bound_filters(env)
    return env


# --- templates -----------------------------------------------------------------------------------

class ChatTemplate:
    """A chat template, compiled once: renders conversations to text and trained spans.

    `special_tokens` are the template's bos_token, eos_token... (from tokenizer_config.json);
    `now` pins what strftime_now returns (None: the time of each render, as Hugging Face does;
    pin it when the template prints a date and the cache must be reproducible).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *,
                 name: str | None = None, now: datetime | None = None):
        if not isinstance(source, str):
            raise TypeError(f"a chat template is Jinja text, not {type(source).__name__}")
        self.source = source
        self.name = name or _short_name(source)
        self.special_tokens = dict(special_tokens or {})
        self.now = now
        env = _environment()
        tree = self._parse(env)
        self.has_generation_tags = _uses_generation_tags(tree)
        self._template = env.from_string(instrument(tree))
        self._closing_of: tuple[Any, str] = (None, "")  # (key, text) of the last closing rendered
        fixed = [source, *self.special_tokens.values()]
        self._marks = tuple(c for c in _MARK_CANDIDATES if not any(c in s for s in fixed))

    @classmethod
    def from_tokenizer_dir(cls, path: str | os.PathLike, *,
                           now: datetime | None = None) -> "ChatTemplate":
        """The tokenizer's own template (see load_chat_template)."""
        return load_chat_template(path, None, now=now)

    def _parse(self, env: _Sandbox) -> nodes.Template:
        """The template's syntax tree, refused when it reaches outside the sandbox."""
        try:
            tree = env.parse(self.source)
        except TemplateSyntaxError as e:
            raise ValueError(f"chat template {self.name} is not valid Jinja (line {e.lineno}: "
                             f"{e.message})") from None
        for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            raise ValueError(f"chat template {self.name} uses {type(node).__name__.lower()} (line "
                             f"{node.lineno}): templates are rendered without file access; put the "
                             "text it loads into the template")
        for node in tree.find_all(nodes.Getattr):
            if node.attr.startswith("_"):
                raise ValueError(f"chat template {self.name} reaches attribute {node.attr!r} (line "
                                 f"{node.lineno}): templates are rendered in a sandbox without "
                                 "access to private attributes; remove it")
        return tree

    def render_text(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = False, tools: list | None = None) -> str:
        """The template's text for these messages (Hugging Face's apply_chat_template, untokenized)."""
        return self._run(_Conversation(messages, tools, self._moment()), add_generation_prompt)

    def render(self, messages: Sequence[Mapping[str, Any]], train_on: str = "assistant",
               tools: list | None = None) -> tuple[str, list[Span]]:
        """The conversation's text and its trained character spans (sorted, non-overlapping).

        train_on: "assistant" (every assistant turn), "last_assistant" (the last one), "all" (the
        whole text); tools: the record's tool schemas (the template's `tools`). A conversation the
        template rejects (raise_exception) is a BadRecord ("role_order"); one whose turns the
        template does not render as prefixes of the whole (and it has no generation tags) is a
        BadRecord ("unstable_template") naming the template; one whose rendering goes over the
        limits of template_limits is a BadRecord ("template_limit"); any other error the template
        raises rendering it is a BadRecord ("template_error") naming the template and the error.
        """
        _check_train_on(train_on)
        chat = _Conversation(messages, tools, self._moment())
        if train_on == "all":
            text = self._run(chat, False)
            return text, [(0, len(text))] if text else []
        if self.has_generation_tags:
            return self._tagged(chat, train_on)
        text = self._run(chat, False)
        return text, _merged(self._turn_spans(chat, text, train_on))

    def _moment(self) -> datetime:
        return self.now or datetime.now()

    def _tagged(self, chat: "_Conversation", train_on: str) -> tuple[str, list[Span]]:
        """Text and spans from the generation tags: all of them, or the last one."""
        marks = self._free_marks(chat)
        raw = self._run(chat, False, marks)
        text, spans = _strip_marks(raw, marks, self.name)
        if train_on == "last_assistant":
            spans = spans[-1:]
        return text, _merged(spans)

    def _turn_spans(self, chat: "_Conversation", text: str, train_on: str) -> list[Span]:
        """Each assistant turn's span, found by rendering the conversation up to it: from the end
        of the generation prompt before it to the end of the turn, less trailing whitespace.

        A template may end every rendering with the same closing text (Phi-3 writes its
        eos_token after the conversation): that text, what it renders for no messages, is taken
        off the renderings that end with it before they are compared, and is never trained."""
        messages = chat.messages
        turns = [k for k, message in enumerate(messages) if message.get("role") == "assistant"]
        if train_on == "last_assistant":
            turns = turns[-1:]
        closing = self._closing(chat, text) if turns else ""
        whole = text[:len(text) - len(closing)]
        spans = []
        for k in turns:
            prompt = self._run(chat, True, upto=k)
            upto = whole if k == len(messages) - 1 else self._run(chat, False, upto=k + 1)
            if closing and upto.endswith(closing) and not whole.startswith(upto):
                upto = upto[:len(upto) - len(closing)]
            if not upto.startswith(prompt):
                raise self._unstable(f"rendering the first {k} messages with add_generation_prompt="
                                     f"True is not a prefix of rendering the first {k + 1}", k)
            if not whole.startswith(upto):
                raise self._unstable(f"rendering the first {k + 1} messages is not a prefix of "
                                     f"rendering all {len(messages)}", k)
            written = upto[len(prompt):]
            spans.append((len(prompt), len(prompt) + len(written.rstrip())))
        return spans

    def _closing(self, chat: "_Conversation", text: str) -> str:
        """The text the template writes after every conversation, when the whole rendering ends
        with what it renders for no messages (else "")."""
        key = (chat.now, chat.tools_json)  # what the rendering of no messages depends on
        if self._closing_of[0] != key:
            try:
                closing = self._run(_Conversation([], chat.tools, chat.now, chat.limits), False,
                                    upto=0)
            except (BadRecord, ValueError):
                closing = ""  # (a template that refuses an empty conversation writes no closing)
            self._closing_of = (key, closing)
        closing = self._closing_of[1]
        return closing if closing and len(closing) < len(text) and text.endswith(closing) else ""

    def _unstable(self, what: str, turn: int) -> BadRecord:
        return BadRecord("unstable_template",
                         f"chat template {self.name} is not prefix-stable for this conversation: "
                         f"{what} (assistant turn at message {turn}), so its trained span cannot be "
                         f"found; {_PREFIX_STABLE_HINT} (on_error='skip' skips and counts such "
                         "conversations)")

    def _free_marks(self, chat: "_Conversation") -> tuple[str, str]:
        """Two mark characters no message (nor tool) uses (nearly always the first two candidates)."""
        free = list(itertools.islice((c for c in self._marks if c not in chat.json), 2))
        if len(free) < 2:
            raise BadRecord("bad_content", "the messages use every Unicode noncharacter U+FDD0.."
                                           "U+FDEF, one of which marks the generation tags' output")
        return free[0], free[1]

    def _run(self, chat: "_Conversation", add_generation_prompt: bool,
             marks: tuple[str, str] | None = None, upto: int | None = None) -> str:
        """Render once (the first `upto` messages), within the record's limits; the template's
        errors as BadRecord naming the template (it rejects the conversation, goes over a limit,
        or raises on it: a field this record lacks...) or a ValueError naming the template (it
        broke out of the sandbox). A template that does not compile fails in __init__ instead."""
        where = "" if upto is None else f" (rendering its first {upto} messages)"
        messages = chat.messages if upto is None else chat.messages[:upto]
        try:
            with budget(chat.limits):
                # tools: the record's, or None; documents: None (as Hugging Face passes them)
                return self._template.render(messages=list(messages), tools=chat.tools,
                                             documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             strftime_now=chat.now.strftime, **self.special_tokens,
                                             **{_MARKS_VARIABLE: marks})
        except _TemplateRaised as e:
            raise BadRecord("role_order", f"the chat template rejects this conversation{where}: "
                                          f"{e.message}") from None
        except RenderLimitExceeded as e:
            raise BadRecord("template_limit", f"chat template {self.name} went over its limits "
                                              f"rendering this conversation{where}: {e}. A template "
                                              "must render a conversation within the limits the "
                                              "README gives (Chat and instruction data: Limits); "
                                              "fix the template, or split the conversation") from None
        except SecurityError as e:
            raise ValueError(f"chat template {self.name} tried something the sandbox forbids: {e}; "
                             "templates may not reach files, private attributes or change their "
                             "arguments") from None
        except BadRecord:
            raise
        except Exception as e:  # the template fails on this conversation (a field it lacks...)
            raise BadRecord("template_error", f"chat template {self.name} failed rendering this "
                                              f"conversation{where}: {type(e).__name__}: {e}; fix "
                                              "the template or the record") from e


class _Conversation:
    """One record's rendering inputs: messages, tools, the moment strftime_now gives, and the
    limits every rendering of it runs under (sized by its JSON text, which the marks avoid)."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], tools: list | None, now: datetime,
                 limits: RecordLimits | None = None):
        self.messages, self.tools, self.now = list(messages), tools, now
        try:
            self.tools_json = None if tools is None else json.dumps(tools, sort_keys=True,
                                                                    default=str)
            self.json = json.dumps([self.messages, tools], ensure_ascii=False, default=str)
        except RecursionError:
            raise BadRecord("bad_content", "the messages or tools are nested too deeply to "
                                           "render") from None
        self.limits = limits or RecordLimits.for_input(len(self.json))


def _short_name(source: str) -> str:
    """A template without a file is named by its start."""
    return repr(source[:60]) + ("..." if len(source) > 60 else "")


def _uses_generation_tags(tree: nodes.Template) -> bool:
    for block in tree.find_all(nodes.CallBlock):
        call = block.call.node if isinstance(block.call, nodes.Call) else None
        if isinstance(call, nodes.ExtensionAttribute) and call.identifier == _GenerationTags.identifier:
            return True
    return False


def _strip_marks(raw: str, marks: tuple[str, str], name: str) -> tuple[str, list[Span]]:
    """The rendered text without the marks, and the spans of the outermost marked pieces."""
    start_mark, end_mark = marks
    spans, depth, opened = [], 0, 0
    for removed, match in enumerate(re.finditer(f"[{start_mark}{end_mark}]", raw)):
        position = match.start() - removed
        if match.group() == start_mark:
            opened = position if depth == 0 else opened
            depth += 1
            continue
        depth -= 1
        if depth < 0:
            break
        if depth == 0:
            spans.append((opened, position))
    if depth != 0:
        raise ValueError(f"chat template {name} cut or reordered the output of a {{% generation %}} "
                         "block, so its span is lost; output generation blocks whole")
    return raw.replace(start_mark, "").replace(end_mark, ""), spans


def _merged(spans: Iterable[Span]) -> list[Span]:
    """Sorted, non-empty, non-overlapping spans; touching ones joined."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


def _check_train_on(train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r}: use one of {', '.join(TRAIN_ON)}")


# --- role markers and the tokenizer --------------------------------------------------------------

_PROBES = (("system", "user", "assistant", "user", "assistant"),
           ("user", "assistant", "user", "assistant"))


def role_markers(template: ChatTemplate) -> list[str]:
    """The text the template writes right after a turn's content (its first run of non-space
    characters: the end-of-turn marker, or the next header), found by rendering probe
    conversations; in order of first appearance."""
    found: list[str] = []
    for roles in _PROBES:
        contents = [f"Probe{i} {role} words." for i, role in enumerate(roles)]
        try:
            text = template.render_text([{"role": r, "content": c} for r, c in zip(roles, contents)])
        except (BadRecord, ValueError):
            continue  # the template refuses this shape of conversation: try the next
        position = 0
        for i, content in enumerate(contents):
            at = text.find(content, position)
            if at < 0:
                continue  # (the template left it out or changed it)
            position = at + len(content)
            following = [text.find(c, position) for c in contents[i + 1:]]
            end = min([f for f in following if f >= 0] or [len(text)])
            marker = re.match(r"\s*(\S+)", text[position:end])  # never the next turn's content
            if marker and marker.group(1) not in found:
                found.append(marker.group(1))
    return found


def split_role_markers(template: ChatTemplate, tokenizer: Any) -> list[str]:
    """The role markers (role_markers) that are not one token of `tokenizers.Tokenizer`: with
    them, a token can span the end of a turn and what follows, so the turn's edge is not a token
    edge. A marker that starts with one of the tokenizer's added tokens is that token; else it is
    cut where an added token starts."""
    if isinstance(tokenizer, TokenizerBackend):  # tiktoken, SentencePiece
        added = sorted(tokenizer.special_tokens(), key=len, reverse=True)
        count = lambda piece: len(tokenizer.encode(piece))  # noqa: E731
    else:
        added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len,
                       reverse=True)
        count = lambda piece: len(tokenizer.encode(piece, add_special_tokens=False).ids)  # noqa: E731
    split = []
    for marker in role_markers(template):
        first = next((t for t in added if t and marker.startswith(t)), None)
        if first is not None:
            continue  # an added token: always one token
        cut = min([marker.find(t) for t in added if t and t in marker] or [len(marker)])
        piece = marker[:cut]
        if piece and count(piece) != 1:
            split.append(piece)
    return split


# --- finding a template --------------------------------------------------------------------------

def load_chat_template(tokenizer_path: str | os.PathLike | None,
                       chat_template: str | os.PathLike | None = None, *,
                       now: datetime | None = None) -> ChatTemplate:
    """The chat template to render with, and the special tokens it sees.

    tokenizer_path: tokenizer.json or its folder, or a transformers tokenizer (its chat_template
    and special tokens); None, or a tokenizers.Tokenizer, when there is none.
    chat_template: None takes the tokenizer's own, from chat_template.jinja or
    tokenizer_config.json ("chat_template": text, or a list of named templates: "default") beside
    tokenizer.json; a string holding "{%" or "{{" is the template's text; anything else is a file
    holding it (a .jinja file, or a JSON file with a "chat_template" field).
    """
    folder = _tokenizer_folder(tokenizer_path)
    special = _special_tokens(folder) if folder else {}
    if is_transformers_tokenizer(tokenizer_path):
        special = transformers_special_tokens(tokenizer_path)
    if chat_template is None:
        source, name = _own_template(folder, tokenizer_path)
    elif isinstance(chat_template, str) and ("{%" in chat_template or "{{" in chat_template):
        source, name = chat_template, None
    elif isinstance(chat_template, (str, os.PathLike)):
        source, name = _template_file(os.fspath(chat_template)), os.fspath(chat_template)
    else:
        raise TypeError(f"chat_template must be Jinja text, a file path or None, not "
                        f"{type(chat_template).__name__}")
    return ChatTemplate(source, special, name=name, now=now)


def _tokenizer_folder(tokenizer_path: Any) -> str | None:
    if not isinstance(tokenizer_path, (str, os.PathLike)):
        return None  # a tokenizer object, or none: no files beside it
    path = os.fspath(tokenizer_path)
    return path if os.path.isdir(path) else os.path.dirname(path) or "."


def _own_template(folder: str | None, tokenizer_path: Any) -> tuple[str, str]:
    """The template saved with the tokenizer, and the file it came from."""
    if is_transformers_tokenizer(tokenizer_path):
        source = transformers_chat_template(tokenizer_path)
        name = f"{type(tokenizer_path).__name__}.chat_template"
        if source is None:
            raise ValueError(f"chat_template=None takes the tokenizer's own template, but this "
                             f"transformers tokenizer ({type(tokenizer_path).__name__} "
                             f"{getattr(tokenizer_path, 'name_or_path', '')!r}) has none; pass "
                             "chat_template= (Jinja text or a file)")
        return source, name
    if folder is None:
        raise ValueError("chat_template=None takes the tokenizer's own template from the "
                         "tokenizer_config.json beside its tokenizer.json, but the tokenizer was not "
                         "given as a path; pass chat_template= (Jinja text or a file)")
    jinja_file = model_file_path(folder, TEMPLATE_FILE)  # links must stay in the model folder
    if jinja_file is not None:
        return _read(jinja_file), jinja_file
    config_file = os.path.join(folder, CONFIG_FILE)
    config = _model_json(folder, CONFIG_FILE)
    if config is None:
        raise ValueError(f"tokenizer {os.fspath(tokenizer_path)!r} has no {CONFIG_FILE} or "
                         f"{TEMPLATE_FILE} beside it to take its chat template from; pass "
                         "chat_template= (Jinja text or a file)")
    return _template_of_config(config, config_file), config_file


def _template_of_config(config: Any, path: str) -> str:
    """A config's "chat_template": a string, or Hugging Face's [{"name", "template"}] (the default)."""
    value = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ValueError(f"{path}: its chat templates are named {sorted(map(str, named))}, none "
                             "'default'; pass the one to use as chat_template=")
        return named["default"]
    if not isinstance(value, str):
        found = ("no 'chat_template'" if value is None
                 else f"a 'chat_template' that is a {type(value).__name__}")
        raise ValueError(f"{path} has {found}: the tokenizer has no chat template of its own; pass "
                         "chat_template= (Jinja text or a file)")
    return value


def _template_file(path: str) -> str:
    """The template in a file: its text, or a JSON file's "chat_template"."""
    try:
        text = _read(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"chat_template {path!r} is neither Jinja text (it holds no '{{%' "
                                "or '{{') nor an existing file; pass the template's text or its "
                                "file's path") from None
    if path.endswith(".json"):
        return _template_of_config(_parse_json(text, path), path)
    return text


def _special_tokens(folder: str) -> dict[str, str]:
    """bos_token, eos_token... from tokenizer_config.json, else special_tokens_map.json."""
    return folder_special_tokens(folder)[0]


def _model_json(folder: str, name: str) -> Any:
    """A model folder's JSON file's content (links checked: model_file_path), None when absent."""
    path = model_file_path(folder, name)
    return None if path is None else _parse_json(_read(path), path)


def _parse_json(text: str, path: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# --- records to text and spans -------------------------------------------------------------------

def render_prompt_completion(prompt: str, completion: str,
                             train_on: str = "assistant") -> tuple[str, list[Span]]:
    """prompt + completion, joined as given; the completion is trained (everything for "all")."""
    _check_train_on(train_on)
    text = prompt + completion
    start = 0 if train_on == "all" else len(prompt)
    return text, _merged([(start, len(text))])


def render_record(record: Any, input_format: str, template: ChatTemplate | None,
                  train_on: str = "assistant") -> tuple[str, list[Span]]:
    """A record's text and trained spans (BadRecord when the record cannot be one)."""
    _check_train_on(train_on)
    messages = normalize_messages(record, input_format)
    if input_format == "prompt_completion":
        return render_prompt_completion(messages[0]["content"], messages[1]["content"], train_on)
    if template is None:
        raise ValueError("input_format='messages' needs a chat template: pass chat_template=, or a "
                         "tokenizer path with a tokenizer_config.json that holds one")
    return template.render(messages, train_on, tools=record_tools(record))


# --- spans to tokens, tokens to runs -------------------------------------------------------------

def trained_token_mask(offsets: Any, spans: Sequence[Span]) -> np.ndarray:
    """One flag per token: True when the token's characters [start, end) overlap a trained span.

    A zero-width token (start == end: one the tokenizer adds) is trained when its position lies
    inside a span (start <= position < end). Give offsets that cover every character of a token:
    offsets trimmed of whitespace (GPT-NeoX's) would make a whitespace token of untrained
    characters zero-width at the start of the next span (tokenizing.untrimmed_offsets).
    offsets: the tokenizer's (start, end) character offsets, one pair per token.
    """
    tokens = _offset_array(offsets)
    trained = _span_array(spans)
    if len(trained) == 0 or len(tokens) == 0:
        return np.zeros(len(tokens), dtype=bool)
    starts, ends = tokens[:, 0], tokens[:, 1]
    # the first span that ends after the token starts: the only one that can overlap it first
    first = np.searchsorted(trained[:, 1], starts, side="right")
    limit = np.where(ends > starts, ends, starts + 1)  # zero-width: the span must start at or before it
    return (first < len(trained)) & (trained[np.minimum(first, len(trained) - 1), 0] < limit)


def _offset_array(offsets: Any) -> np.ndarray:
    """Token offsets as an (n, 2) int64 array; a tokenizer's list of pairs is flattened through an
    iterator (twice as fast as numpy converting the tuples one by one)."""
    if isinstance(offsets, np.ndarray) or not isinstance(offsets, Sequence):
        return np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    flat = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    return flat.reshape(-1, 2)


def _span_array(spans: Sequence[Span]) -> np.ndarray:
    """Spans as an (n, 2) array, empty ones dropped; refused unless sorted and non-overlapping."""
    array = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if np.any(array[:, 1] < array[:, 0]):
        raise ValueError("a trained span ends before it starts; spans are (start, end) pairs")
    array = array[array[:, 1] > array[:, 0]]
    if np.any(array[1:, 0] < array[:-1, 1]):
        raise ValueError("trained spans must be sorted and must not overlap")
    return array


def mask_runs(mask: Any) -> np.ndarray:
    """The runs of True in a mask, as an (n, 2) int64 array of (start, length)."""
    flags = np.asarray(mask, dtype=bool).ravel()
    padded = np.concatenate(([False], flags, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    starts, stops = edges[0::2], edges[1::2]
    return np.stack([starts, stops - starts], axis=1).astype(np.int64)


def mask_from_runs(runs: Any, length: int) -> np.ndarray:
    """The mask of `length` flags that mask_runs turned into `runs` (its inverse)."""
    array = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    starts, stops = array[:, 0], array[:, 0] + array[:, 1]
    if np.any(array[:, 1] < 1) or np.any(starts < 0) or np.any(stops > length):
        raise ValueError(f"mask runs must have lengths of 1 or more and lie within the {length} "
                         "tokens they describe")
    if np.any(starts[1:] < stops[:-1]):
        raise ValueError("mask runs must be sorted and must not overlap")
    edges = np.zeros(length + 1, dtype=np.int64)
    edges[starts] += 1
    edges[stops] -= 1
    return np.cumsum(edges[:-1]) > 0
