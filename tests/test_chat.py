"""Chat records to text, trained spans and token masks (torchcache.builder.chat).

The main check is an oracle: hundreds of generated conversations (real paragraphs, some unicode,
some system prompts) whose text and trained spans are built in Python piece by piece, without the
template, compared with what the ChatML- and Llama-3-style templates below render (each with and
without {% generation %} tags, which must agree), and token masks compared with a per-token loop
over real tokenizers' offsets.
"""

from __future__ import annotations

import json
import random
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from conftest import paragraphs
from torchcache.builder.chat import (TRAIN_ON, ChatTemplate, load_chat_template, mask_from_runs,
                                   mask_runs, normalize_messages, render_prompt_completion,
                                   render_record, trained_token_mask)
from torchcache.builder.records import SKIP_REASONS, BadRecord

# the GPT-NeoX tokenizer of the shared data beside the project (2.4 MB, not bundled): used when there
NEOX = Path(__file__).resolve().parents[2] / "shared/data/tokenizers/gpt-neox-20b/tokenizer.json"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
NOW = datetime(2024, 7, 26, 12, 0)
DEFAULT_SYSTEM = "You are a careful reader of old books."

# Both templates are written with «gen» «/gen» where the assistant's content and end-of-turn token
# begin and end: `variant` makes the one without tags and the one with {% generation %} tags.
CHATML = r"""
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = 'You are a careful reader of old books.' -%}
    {%- set turns = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- for message in turns -%}
    {%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') -%}
        {{- raise_exception('turns must go user, assistant, user... after the system message; turn '
                            ~ loop.index0 ~ ' is ' ~ message['role']) -}}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        «gen»{{- message['content'] + '<|im_end|>' -}}«/gen»
        {{- '\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nToday Date: ' + strftime_now('%d %b %Y')
        + '\n\n' + messages[0]['content'] | trim + '<|eot_id|>' -}}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') -%}
        {{- raise_exception('roles must alternate user/assistant, starting with user') -}}
    {%- endif -%}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
    {%- if message['role'] == 'assistant' -%}
        «gen»{{- message['content'] | trim + '<|eot_id|>' -}}«/gen»
    {%- else -%}
        {{- message['content'] | trim + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# Qwen3-like: earlier assistant turns lose their <think>...</think> part, the last keeps it, so
# rendering a conversation up to an assistant turn is not a prefix of rendering all of it.
THINKING = r"""
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['role'] == 'assistant' -%}
        {%- set content = message['content'] if loop.last
                          else message['content'].split('</think>')[-1] -%}
        «gen»{{- content + '<|im_end|>' -}}«/gen»
        {{- '\n' -}}
    {%- else -%}
        {{- message['content'] + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def variant(source: str, tags: bool) -> str:
    opening, closing = ("{%- generation -%}", "{%- endgeneration -%}") if tags else ("", "")
    return source.replace("«gen»", opening).replace("«/gen»", closing)


# --- the oracle: texts and spans built piece by piece, masks by a per-token loop ---------------

def chatml_pieces(messages: list[dict]) -> list[tuple[str, bool]]:
    """The ChatML text as (piece, is what the assistant writes)."""
    system, turns = ((messages[0]["content"], messages[1:]) if messages[0]["role"] == "system"
                     else (DEFAULT_SYSTEM, messages))
    pieces = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)]
    for m in turns:
        pieces.append((f"<|im_start|>{m['role']}\n", False))
        pieces.append((m["content"] + "<|im_end|>", m["role"] == "assistant"))
        pieces.append(("\n", False))
    return pieces


def llama3_pieces(messages: list[dict]) -> list[tuple[str, bool]]:
    pieces, turns = [("<|begin_of_text|>", False)], messages
    if messages[0]["role"] == "system":
        pieces.append(("<|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\n\n"
                       + messages[0]["content"].strip() + "<|eot_id|>", False))
        turns = messages[1:]
    for m in turns:
        pieces.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        pieces.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    return pieces


def expected(pieces: list[tuple[str, bool]], train_on: str) -> tuple[str, list[tuple[int, int]]]:
    text, spans, position = "".join(p for p, _ in pieces), [], 0
    for piece, trained in pieces:
        if trained:
            spans.append((position, position + len(piece)))
        position += len(piece)
    if train_on == "all":
        return text, [(0, len(text))]
    return text, spans[-1:] if train_on == "last_assistant" else spans


def loop_mask(offsets, spans, length: int) -> np.ndarray:
    """The mask rule, token by token over a per-character array (no searchsorted)."""
    chars = [False] * (length + 1)
    for start, end in spans:
        chars[start:end] = [True] * (end - start)
    return np.array([any(chars[a:b]) if b > a else chars[a] for a, b in offsets], dtype=bool)


UNICODE = ["naïve café", "Ελληνικά γράμματα", "東京で会いましょう", "😀👍🏽", "e\u0301", "עברית",
           "\u00a0non-breaking", "Straße", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "tab\there", "<|im_end|>"]
EDGES = ["", "", "", " ", "\n", "\n\n", "  ", "\t"]


def generate_conversations(books: list[dict], count: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of 2-8 turns (user first, alternating) of real paragraphs: some with a system
    prompt, some with unicode, some turns empty or with whitespace at their edges."""
    rng, paras = random.Random(seed), paragraphs(books)

    def content() -> str:
        if rng.random() < 0.05:
            return ""
        text = "\n\n".join(rng.choice(paras)[:rng.randint(1, 300)] for _ in range(rng.randint(1, 2)))
        if rng.random() < 0.3:
            cut = rng.randint(0, len(text))
            text = text[:cut] + " " + rng.choice(UNICODE) + " " + text[cut:]
        return rng.choice(EDGES) + text + rng.choice(EDGES)

    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": content()}] if rng.random() < 0.4 else []
        messages += [{"role": ("user", "assistant")[t % 2], "content": content()}
                     for t in range(rng.randint(2, 8))]
        out.append(messages)
    return out


@pytest.fixture(scope="module")
def tokenizers(gpt2) -> dict[str, Tokenizer]:
    """Real tokenizers: GPT-2 as is (chat markers split into pieces that straddle span edges), GPT-2
    with the chat markers added as special tokens, and GPT-NeoX (NFC, trimmed offsets) when here."""
    with_specials = Tokenizer.from_str(gpt2.to_str())
    with_specials.add_special_tokens(CHAT_TOKENS)
    found = {"gpt2": gpt2, "gpt2+chat": with_specials}
    if NEOX.exists():
        neox = Tokenizer.from_file(str(NEOX))
        neox.add_special_tokens(CHAT_TOKENS)
        found["neox+chat"] = neox
    return found


@pytest.fixture(scope="module")
def conversations(books) -> list[list[dict]]:
    return generate_conversations(books, 200)


@pytest.mark.parametrize("source, pieces", [(CHATML, chatml_pieces), (LLAMA3, llama3_pieces)],
                         ids=["chatml", "llama3"])
def test_render_and_masks_match_the_oracle(source, pieces, conversations, tokenizers):
    plain = ChatTemplate(variant(source, tags=False), SPECIAL, now=NOW)
    tagged = ChatTemplate(variant(source, tags=True), SPECIAL, now=NOW)
    assert (plain.has_generation_tags, tagged.has_generation_tags) == (False, True)
    checked_tokens = 0
    for messages in conversations:
        conversation = pieces(messages)
        text = expected(conversation, "all")[0]
        offsets = {name: tok.encode(text).offsets for name, tok in tokenizers.items()}
        for train_on in TRAIN_ON:
            want_text, want_spans = expected(conversation, train_on)
            for template in (plain, tagged):
                got_text, got_spans = template.render(messages, train_on)
                assert got_text == want_text
                assert got_spans == want_spans, (template.has_generation_tags, train_on)
            for name, token_offsets in offsets.items():
                got = trained_token_mask(token_offsets, got_spans)
                np.testing.assert_array_equal(got, loop_mask(token_offsets, want_spans, len(text)),
                                              err_msg=f"{name} {train_on}")
                checked_tokens += len(got)
    assert checked_tokens > 100_000


def test_the_oracle_sees_the_cases_it_should(conversations):
    """The generated conversations hold what makes the comparison worth it."""
    contents = [m["content"] for c in conversations for m in c]
    assert len(conversations) == 200 and {len(c) for c in conversations} >= set(range(2, 9))
    assert sum(c[0]["role"] == "system" for c in conversations) > 40
    assert "" in contents and any(not t.isascii() for t in contents)
    assert any(t != t.strip() for t in contents) and any(t.startswith("\n") for t in contents)
    assert {c[-1]["role"] for c in conversations} == {"user", "assistant"}


def test_chatml_boundaries_token_by_token(tokenizers):
    """The assistant header and the newline after <|im_end|> are not trained; the content and
    <|im_end|> are; in "all" mode everything is."""
    tok = tokenizers["gpt2+chat"]
    messages = [{"role": "user", "content": "Who wrote it?"},
                {"role": "assistant", "content": "A clerk."}]
    for tags in (False, True):
        text, spans = ChatTemplate(variant(CHATML, tags)).render(messages, "assistant")
        encoding = tok.encode(text)
        mask = trained_token_mask(encoding.offsets, spans)
        assert [t for t, m in zip(encoding.tokens, mask) if m] == ["A", "Ġclerk", ".", "<|im_end|>"]
        assert encoding.tokens[-1] == "Ċ" and not mask[-1]


def test_llama3_trains_the_end_of_turn_token(tokenizers):
    tok = tokenizers["gpt2+chat"]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello.\n"}]
    text, spans = ChatTemplate(variant(LLAMA3, False), SPECIAL).render(messages, "last_assistant")
    encoding = tok.encode(text)
    mask = trained_token_mask(encoding.offsets, spans)
    assert [t for t, m in zip(encoding.tokens, mask) if m] == ["Hello", ".", "<|eot_id|>"]
    assert text.endswith("Hello.<|eot_id|>")


def test_zero_width_tokens_the_tokenizer_adds(gpt2):
    """A post-processor's BOS/EOS have offsets (0, 0): trained when position 0 is (train_on='all')."""
    tok = Tokenizer.from_str(gpt2.to_str())
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A <|endoftext|>",
                                            special_tokens=[("<|endoftext|>", 50256)])
    text, _ = render_prompt_completion("Q: why?", " A: because.", "all")
    encoding = tok.encode(text)
    assert encoding.offsets[0] == encoding.offsets[-1] == (0, 0)
    assert trained_token_mask(encoding.offsets, [(0, len(text))]).all()
    mask = trained_token_mask(encoding.offsets, render_prompt_completion("Q: why?", " A: because.")[1])
    assert not mask[0] and not mask[-1] and mask[1:-1].tolist() == [False] * 4 + [True] * 4


# --- templates that are not prefix-stable --------------------------------------------------------

def test_a_template_that_is_not_prefix_stable_is_refused():
    messages = [{"role": "user", "content": "Add 2 and 2."},
                {"role": "assistant", "content": "<think>two pairs</think>4"},
                {"role": "user", "content": "And 3 and 3?"},
                {"role": "assistant", "content": "<think>double</think>6"}]
    plain = ChatTemplate(variant(THINKING, tags=False))
    with pytest.raises(BadRecord, match=r"\\n\{%- for message in messages -%\}.*not prefix-stable "
                                        r"for this conversation.*assistant turn at message 1.*add "
                                        r"\{% generation %\} tags") as raised:
        plain.render(messages, "assistant")
    assert raised.value.reason == "unstable_template"
    # the last turn alone, the whole text, and the template with tags are all well defined
    text, spans = plain.render(messages, "last_assistant")
    assert [text[a:b] for a, b in spans] == ["<think>double</think>6<|im_end|>"]
    assert plain.render(messages, "all")[1] == [(0, len(text))]
    text, spans = ChatTemplate(variant(THINKING, tags=True)).render(messages, "assistant")
    assert [text[a:b] for a, b in spans] == ["4<|im_end|>", "<think>double</think>6<|im_end|>"]


def test_a_template_file_is_named_by_its_path(tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(variant(THINKING, tags=False))
    template = load_chat_template(None, str(path))
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<think>x</think>y"},
                {"role": "user", "content": "?"}, {"role": "assistant", "content": "z"}]
    with pytest.raises(BadRecord, match=f"chat template {re.escape(str(path))} is not prefix-stable"):
        template.render(messages)


# --- generation tags -----------------------------------------------------------------------------

def test_generation_spans_are_positions_in_the_final_text():
    """Output that goes through a macro, a set block and filters still gets its true span."""
    source = ("{% macro turn(m) %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}!{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endmacro %}"
              "{% for m in messages %}{% set out %}  {{ turn(m) }}  {% endset %}"
              "{{ out | trim | upper }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    text, spans = ChatTemplate(source).render(messages)
    assert text == "<USER>HI<ASSISTANT>YO!<USER>MORE<ASSISTANT>SURE!"
    assert [text[a:b] for a, b in spans] == ["YO!", "SURE!"]
    assert ChatTemplate(source).render(messages, "last_assistant")[1] == [spans[-1]]


def test_generation_output_that_is_cut_is_refused():
    source = ("{% for m in messages %}{% set out %}{% generation %}{{ m.content }}"
              "{% endgeneration %}{% endset %}{{ out[:2] }}{% endfor %}")
    with pytest.raises(ValueError, match="cut or reordered the output of a \\{% generation %\\}"):
        ChatTemplate(source).render([{"role": "assistant", "content": "hello"}])


def test_content_holding_the_mark_characters_still_renders():
    messages = [{"role": "user", "content": "\ufdd0\ufdd1"},
                {"role": "assistant", "content": "a\ufdd0b\ufdd1c\ufdd2"}]
    text, spans = ChatTemplate(variant(CHATML, tags=True)).render(messages)
    assert [text[a:b] for a, b in spans] == ["a\ufdd0b\ufdd1c\ufdd2<|im_end|>"]
    assert text == ChatTemplate(variant(CHATML, tags=False)).render_text(messages)


# --- Hugging Face's conventions and the sandbox ---------------------------------------------------

def test_hugging_face_conventions():
    source = """
    {% for m in messages %}
        {% if loop.index0 == 1 %}{% continue %}{% endif %}
        {{ bos_token }}{{ m | tojson }}{{ eos_token }}{{ nothing_defined }}
        {% if loop.index0 == 2 %}{% break %}{% endif %}
    {% endfor %}
    {% if add_generation_prompt %}{{ strftime_now('%Y-%m-%d') }}{% endif %}
    {% if tools is not none or documents is not none %}tools!{% endif %}"""
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "skipped"},
                {"role": "user", "content": "two"}, {"role": "assistant", "content": "never"}]
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}, now=NOW)
    rendered = template.render_text(messages, add_generation_prompt=True)
    # trim_blocks and lstrip_blocks: block lines leave nothing (the first newline is text, kept);
    # tojson keeps HTML and non-ASCII; an undefined variable prints nothing
    assert rendered == ('\n        <s>{"role": "user", "content": "<b>é</b>"}</s>\n'
                        '        <s>{"role": "user", "content": "two"}</s>\n2024-07-26')


@pytest.mark.parametrize("source, message", [
    ("{{ messages.__class__ }}", "reaches attribute '__class__' \\(line 1\\)"),
    ("{{ cycler.__init__.__globals__ }}", "reaches attribute '__globals__'"),
    ("{{ messages['__class__'] }}", "sandbox forbids: access to attribute '__class__'"),
    ("{{ messages[0] | attr('__class__') }}", "sandbox forbids: access to attribute '__class__'"),
    ("{{ messages.append(1) }}", "sandbox forbids: access to attribute 'append' of a 'list'"),
    ("{% set m = messages[0] %}{{ m.update({'role': 'system'}) }}", "sandbox forbids.*'update'"),
    ("{% include 'secrets.txt' %}", "uses include \\(line 1\\).*without file access"),
    ("{% from 'macros.j2' import x %}", "uses fromimport"),
    ("{% extends 'base.j2' %}", "uses extends"),
    ("{% for m in messages %}", "is not valid Jinja \\(line 1:"),
])
def test_sandbox_and_broken_templates_fail_naming_the_template(source, message):
    with pytest.raises(ValueError, match=message) as raised:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], "all")
    unquoted = str(raised.value).replace("'", "").replace('"', "")
    assert f"chat template {source[:12]}".replace("'", "") in unquoted


def test_a_template_that_raises_on_a_conversation_is_a_template_error_bad_record():
    source = "{% for x in messages[0].content.no_such_method() %}{% endfor %}"
    with pytest.raises(BadRecord, match="chat template .* failed rendering this conversation: "
                                        "UndefinedError") as raised:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], "all")
    assert raised.value.reason == "template_error" and "no_such_method" in raised.value.detail


def test_raise_exception_is_a_role_order_bad_record():
    template = ChatTemplate(variant(CHATML, tags=False))
    for messages in ([{"role": "assistant", "content": "first"}],
                     [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                     [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]):
        with pytest.raises(BadRecord) as raised:
            template.render(messages)
        assert raised.value.reason == "role_order"
        assert "turns must go user, assistant, user" in raised.value.detail
    with pytest.raises(BadRecord, match="roles must alternate") as raised:
        render_record({"messages": [{"role": "assistant", "content": "x"}]}, "messages",
                      ChatTemplate(variant(LLAMA3, tags=True), SPECIAL))
    assert raised.value.reason == "role_order"


def test_train_on_is_checked():
    with pytest.raises(ValueError, match="train_on='assistants': use one of assistant, last_assistant"):
        ChatTemplate(CHATML).render([{"role": "user", "content": "x"}], "assistants")


# --- records -------------------------------------------------------------------------------------

def test_messages_and_sharegpt_normalize_alike():
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"}]
    record = {"messages": [dict(m, name="kept") for m in want], "id": 7}
    assert normalize_messages(record, "messages") == [dict(m, name="kept") for m in want]
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "Hi"}, {"from": "GPT", "value": "Hello"},
                                  {"from": "observation", "value": "42"}]}
    assert normalize_messages(sharegpt, "messages") == want
    aliases = {"conversations": [{"from": f, "value": "x"} for f in
                                 ("user", "bot", "model", "chatgpt", "assistant", "tool")]}
    assert [m["role"] for m in normalize_messages(aliases, "messages")] == \
        ["user"] + ["assistant"] * 4 + ["tool"]
    mixed = {"conversations": [{"role": "user", "content": "Hi"}]}  # ShareGPT key, HF message keys
    assert normalize_messages(mixed, "messages") == [{"role": "user", "content": "Hi"}]


def test_prompt_completion_is_joined_as_given_and_the_completion_trained(tokenizers):
    record = {"prompt": "Translate: chat ->", "completion": " cat", "source": "x"}
    assert normalize_messages(record, "prompt_completion") == [
        {"role": "prompt", "content": "Translate: chat ->"}, {"role": "completion", "content": " cat"}]
    text, spans = render_record(record, "prompt_completion", None, "assistant")
    assert text == "Translate: chat -> cat" and spans == [(18, 22)]
    assert render_record(record, "prompt_completion", None, "last_assistant")[1] == [(18, 22)]
    assert render_record(record, "prompt_completion", None, "all")[1] == [(0, 22)]
    encoding = tokenizers["gpt2"].encode(text)
    mask = trained_token_mask(encoding.offsets, spans)
    assert [t for t, m in zip(encoding.tokens, mask) if m] == ["Ġcat"]
    assert render_record({"prompt": "all prompt", "completion": ""}, "prompt_completion", None) == \
        ("all prompt", [])


@pytest.mark.parametrize("record, input_format, reason, detail", [
    ({"text": "hi"}, "messages", "no_messages", "no 'messages' \\(or ShareGPT 'conversations'\\) "
                                                 "field \\(found \\['text'\\]\\)"),
    ({"messages": "hi"}, "messages", "no_messages", "field 'messages' is a str, not a list"),
    ({"conversations": {"from": "human"}}, "messages", "no_messages", "'conversations' is a dict"),
    (["hi"], "messages", "no_messages", "the record is a list"),
    ({"messages": []}, "messages", "empty_conversation", "no messages"),
    ({"conversations": []}, "messages", "empty_conversation", "no messages"),
    ({"prompt": "", "completion": ""}, "prompt_completion", "empty_conversation", "both empty"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}]}, "messages",
     "unknown_role", "message 1 has role str 'narrator'; known roles: system, user"),
    ({"messages": [{"content": "a"}]}, "messages", "unknown_role", "message 0 has no 'role'"),
    ({"messages": [{"role": "human", "content": "a"}]}, "messages", "unknown_role", "role str 'human'"),
    ({"conversations": [{"from": "alien", "value": "a"}]}, "messages", "unknown_role",
     "message 0 has from str 'alien'; known roles: assistant, bot"),
    ({"conversations": [{"from": 3, "value": "a"}]}, "messages", "unknown_role", "from int 3"),
    ({"messages": [{"role": "user", "content": ["a", "b"]}]}, "messages", "bad_content",
     "message 0 'content' is list \\['a', 'b'\\], not a string"),
    ({"messages": [{"role": "user"}]}, "messages", "bad_content", "message 0 'content' is null"),
    ({"conversations": [{"from": "human", "value": 5}]}, "messages", "bad_content",
     "message 0 'value' is int 5"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, "messages", "bad_content",
     "message 1 is a str, not an object"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages", "invalid_utf8",
     "message 0 'content' is not valid UTF-8 \\(a lone surrogate '\\\\ud800' at character 1\\)"),
    ({"prompt": "a"}, "prompt_completion", "missing_text", "no 'completion' field"),
    ({"prompt": 1, "completion": "b"}, "prompt_completion", "bad_content", "field 'prompt' is int 1"),
    ("text", "prompt_completion", "missing_text", "the record is a str"),
])
def test_bad_records_name_their_reason_and_what_is_wrong(record, input_format, reason, detail):
    with pytest.raises(BadRecord, match=detail) as raised:
        normalize_messages(record, input_format)
    assert raised.value.reason == reason and reason in SKIP_REASONS


def test_a_long_value_is_shortened_in_the_detail():
    with pytest.raises(BadRecord) as raised:
        normalize_messages({"messages": [{"role": "x" * 500, "content": "a"}]}, "messages")
    assert len(raised.value.detail) < 150 and raised.value.detail.count("x") < 60


def test_formats_and_templates_are_checked():
    with pytest.raises(ValueError, match="input_format='text' is not a chat format; use one of "
                                         "messages, prompt_completion"):
        normalize_messages({"text": "a"}, "text")
    with pytest.raises(ValueError, match="input_format='messages' needs a chat template"):
        render_record({"messages": [{"role": "user", "content": "a"}]}, "messages", None)


# --- finding the template ------------------------------------------------------------------------

@pytest.fixture()
def tokenizer_dir(tmp_path, gpt2_tokenizer_path) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(gpt2_tokenizer_path).read_bytes())
    return folder


def write_config(folder: Path, **fields) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))


MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_the_tokenizers_own_template_from_tokenizer_config(tokenizer_dir):
    write_config(tokenizer_dir, chat_template=variant(LLAMA3, tags=False),
                 bos_token={"content": "<|begin_of_text|>", "special": True}, eos_token="<|eot_id|>")
    for path in (tokenizer_dir, tokenizer_dir / "tokenizer.json", str(tokenizer_dir)):
        template = load_chat_template(path, None)
        assert template.name == str(tokenizer_dir / "tokenizer_config.json")
        assert template.special_tokens == SPECIAL
        assert template.render_text(MESSAGES).startswith("<|begin_of_text|><|start_header_id|>user")
    assert ChatTemplate.from_tokenizer_dir(tokenizer_dir).source == variant(LLAMA3, tags=False)


def test_named_templates_take_the_default(tokenizer_dir):
    write_config(tokenizer_dir, chat_template=[{"name": "tool_use", "template": "{{ 'tools' }}"},
                                               {"name": "default", "template": "{{ 'plain' }}"}])
    assert load_chat_template(tokenizer_dir).render_text(MESSAGES) == "plain"
    write_config(tokenizer_dir, chat_template=[{"name": "tool_use", "template": "{{ 'tools' }}"}])
    with pytest.raises(ValueError, match="tokenizer_config.json: its chat templates are named "
                                         "\\['tool_use'\\], none 'default'"):
        load_chat_template(tokenizer_dir)


def test_special_tokens_map_fills_what_the_config_lacks(tokenizer_dir):
    write_config(tokenizer_dir, chat_template="{{ bos_token }}|{{ eos_token }}", eos_token="</s>")
    (tokenizer_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "<ignored>"}))
    assert load_chat_template(tokenizer_dir).render_text(MESSAGES) == "<s>|</s>"


def test_chat_template_jinja_beside_the_tokenizer_is_used_first(tokenizer_dir):
    write_config(tokenizer_dir, chat_template="{{ 'from config' }}")
    (tokenizer_dir / "chat_template.jinja").write_text("{{ 'from jinja file' }}")
    template = load_chat_template(tokenizer_dir / "tokenizer.json")
    assert template.render_text(MESSAGES) == "from jinja file"
    assert template.name == str(tokenizer_dir / "chat_template.jinja")


def test_no_template_found_names_the_path(tokenizer_dir):
    with pytest.raises(ValueError, match=f"tokenizer '{re.escape(str(tokenizer_dir))}' has no "
                                         "tokenizer_config.json"):
        load_chat_template(str(tokenizer_dir))
    write_config(tokenizer_dir, eos_token="</s>")
    with pytest.raises(ValueError, match=f"{re.escape(str(tokenizer_dir))}/tokenizer_config.json has no "
                                         "'chat_template'.*pass chat_template="):
        load_chat_template(str(tokenizer_dir))
    write_config(tokenizer_dir, chat_template=3)
    with pytest.raises(ValueError, match="a 'chat_template' that is a int"):
        load_chat_template(str(tokenizer_dir))
    (tokenizer_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_chat_template(str(tokenizer_dir))


def test_explicit_templates_text_files_and_objects(tokenizer_dir, gpt2):
    write_config(tokenizer_dir, chat_template="{{ 'own' }}", eos_token="</s>")
    given = load_chat_template(tokenizer_dir, "{{ 'given' }}{{ eos_token }}")
    assert given.render_text([]) == "given</s>"
    file = tokenizer_dir / "mine.jinja"
    file.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for given in (file, str(file)):
        template = load_chat_template(tokenizer_dir, given)
        assert template.render_text(MESSAGES) == "HiHello" and template.name == str(file)
    other = tokenizer_dir / "other_config.json"
    other.write_text(json.dumps({"chat_template": "{{ 'from json' }}"}))
    assert load_chat_template(None, str(other)).render_text([]) == "from json"
    missing = str(tokenizer_dir / "nope.jinja")
    with pytest.raises(FileNotFoundError, match=f"'{re.escape(missing)}' is neither Jinja text"):
        load_chat_template(tokenizer_dir, missing)
    with pytest.raises(ValueError, match="the tokenizer was not given as a path; pass chat_template="):
        load_chat_template(gpt2, None)
    assert load_chat_template(gpt2, "{{ 'object' }}").render_text([]) == "object"
    with pytest.raises(TypeError, match="chat_template must be Jinja text, a file path or None"):
        load_chat_template(tokenizer_dir, 3)


def test_strftime_now_is_pinned_or_the_time_of_the_render():
    template = ChatTemplate(variant(LLAMA3, tags=False), SPECIAL, now=NOW)
    messages = [{"role": "system", "content": "Terse."}] + MESSAGES
    assert "Today Date: 26 Jul 2024" in template.render(messages)[0]
    unpinned = ChatTemplate("{{ strftime_now('%Y') }}")
    assert unpinned.render_text([]) == str(datetime.now().year)


# --- masks and runs ------------------------------------------------------------------------------

@st.composite
def offsets_and_spans(draw):
    """Token offsets as a tokenizer gives them (mostly contiguous, some zero-width, some at (0, 0),
    some overlapping a neighbour), and sorted, non-overlapping spans over the same characters."""
    length = draw(st.integers(0, 60))
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=30)))
    offsets = [(a, b) for a, b in zip([0] + cuts, cuts + [length])]
    offsets += draw(st.lists(st.tuples(st.integers(0, length), st.integers(0, 2)).map(
        lambda t: (t[0], min(t[0] + t[1], length))), max_size=5))
    edges = sorted(draw(st.lists(st.integers(0, length), max_size=10)))
    spans = [(a, b) for a, b in zip(edges[0::2], edges[1::2])]
    return offsets, spans, length


@settings(max_examples=300, deadline=None)
@given(offsets_and_spans())
def test_trained_token_mask_matches_the_loop(case):
    offsets, spans, length = case
    np.testing.assert_array_equal(trained_token_mask(offsets, spans), loop_mask(offsets, spans, length))
    np.testing.assert_array_equal(trained_token_mask(np.asarray(offsets, dtype=np.int32), spans),
                                  loop_mask(offsets, spans, length))


def test_trained_token_mask_edges():
    assert trained_token_mask([], [(0, 3)]).shape == (0,)
    assert trained_token_mask([(0, 2), (2, 4)], []).tolist() == [False, False]
    # a zero-width token at a span's end is outside it, at its start inside
    assert trained_token_mask([(2, 2), (5, 5), (4, 4)], [(2, 5)]).tolist() == [True, False, True]
    # empty spans train nothing, touching spans are fine
    assert trained_token_mask([(0, 1), (1, 2), (2, 3)], [(1, 1), (2, 3), (3, 3)]).tolist() == \
        [False, False, True]
    with pytest.raises(ValueError, match="sorted and must not overlap"):
        trained_token_mask([(0, 1)], [(2, 5), (0, 3)])
    with pytest.raises(ValueError, match="ends before it starts"):
        trained_token_mask([(0, 1)], [(3, 2)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=300))
def test_mask_runs_round_trip(flags):
    mask = np.array(flags, dtype=bool)
    runs = mask_runs(mask)
    assert runs.dtype == np.int64 and runs.shape == (len(runs), 2)
    assert (runs[:, 1] >= 1).all() and (runs[1:, 0] > runs[:-1].sum(axis=1)).all()  # maximal runs
    assert int(runs[:, 1].sum()) == int(mask.sum())
    np.testing.assert_array_equal(mask_from_runs(runs, len(mask)), mask)


def test_mask_runs_examples_and_refusals():
    assert mask_runs([0, 1, 1, 0, 1]).tolist() == [[1, 2], [4, 1]]
    assert mask_runs([]).shape == (0, 2)
    assert mask_from_runs([[0, 2], [2, 1]], 4).tolist() == [True, True, True, False]  # touching
    assert mask_from_runs(np.zeros((0, 2)), 3).tolist() == [False] * 3
    for runs, message in (([[0, 0]], "lengths of 1 or more"), ([[3, 2]], "within the 4 tokens"),
                          ([[-1, 1]], "within"), ([[2, 2], [0, 3]], "sorted and must not overlap")):
        with pytest.raises(ValueError, match=message):
            mask_from_runs(runs, 4)


def test_a_real_mask_stores_as_few_runs(conversations, tokenizers):
    """A chat mask is a handful of runs, not a flag per token (what the format stores)."""
    template = ChatTemplate(variant(CHATML, tags=True))
    text, spans = template.render(conversations[0])
    mask = trained_token_mask(tokenizers["gpt2+chat"].encode(text).offsets, spans)
    runs = mask_runs(mask)
    assert len(runs) == len(spans) == sum(m["role"] == "assistant" for m in conversations[0])
    np.testing.assert_array_equal(mask_from_runs(runs, len(mask)), mask)
