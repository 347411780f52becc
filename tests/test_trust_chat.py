"""Chat builds that would have trained the wrong thing without an error (issue 31, items 4-8):
builds that train nothing, templates that are prefix-stable for some conversations only (and
Phi-3's closing eos_token), tool calls and tools, templates without limits, links in model folders.

Masks and texts are compared with transformers' own apply_chat_template (a PreTrainedTokenizerFast
made from the same tokenizers.Tokenizer and template, no download), never with our rendering.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import torchcache as tc
from test_chat import THINKING, generate_conversations, variant
from torchcache.builder.chat import (ChatTemplate, load_chat_template, normalize_messages,
                                     render_record, split_role_markers)
from torchcache.builder.records import SKIP_REASONS, BadRecord
from torchcache.format.model_folder import model_file_path
from torchcache.format.tokenizer import load_tokenizer

MARKERS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
           "[INST]", "[/INST]"]
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}

# Written with «gen» «/gen» where what the assistant writes begins and ends; `variant` (test_chat)
# gives the template without tags, or with {% generation %} tags.
CHATML = r"""
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        «gen»{{- message['content'] + '<|im_end|>' -}}«/gen»
        {{- '\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
    {%- if message['role'] == 'assistant' -%}
        «gen»{{- message['content'] | trim + '<|eot_id|>' -}}«/gen»
    {%- else -%}
        {{- message['content'] | trim + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Phi-3 (mini-4k-instruct): the turns, then eos_token after the whole conversation
PHI3 = r"""
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- '<|assistant|>\n' -}}«gen»{{- message['content'] + '<|end|>' -}}«/gen»{{- '\n' -}}
    {%- else -%}
        {{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}
"""

# Qwen2.5 / Hermes style: tools in the system turn, tool calls in the assistant's turn, tool results
HERMES = r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}
    {%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}
    {{- '\n\n# Tools\n\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' -}}{{- tool | tojson -}}{%- endfor -%}
    {{- '\n</tools><|im_end|>\n' -}}
{%- elif messages[0]['role'] == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        «gen»{%- if message.content -%}{{- message.content -}}{%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
            {{- tool_call.arguments | tojson -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>' -}}«/gen»{{- '\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "phi3": PHI3}


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_path, tmp_path_factory) -> tuple[Path, Tokenizer]:
    """A model folder: GPT-2 with the chat markers as special tokens, and a tokenizer_config.json
    holding BOS/EOS (no template of its own: each test passes one)."""
    tok = Tokenizer.from_file(gpt2_tokenizer_path)
    tok.add_special_tokens(MARKERS)
    folder = tmp_path_factory.mktemp("model")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(SPECIAL))
    return folder, tok


def hf_tokenizer(tok: Tokenizer, template: str):
    """transformers' own tokenizer: the same tokenizers.Tokenizer, the same template and tokens."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()),
                                                chat_template=template, **SPECIAL)


def hf_oracle(hf, messages: list[dict], tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ids and assistant mask for a conversation."""
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)


def write_records(path: Path, records: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return str(path)


def build(inputs, out, tokenizer, template, **options) -> tc.TokenCache:
    options = {"eos": None, "progress": False, **options}  # eos=None: the rendering's ids only
    tc.build_cache(inputs, out, str(tokenizer), input_format="messages", chat_template=template,
                   **options)
    return tc.TokenCache(out)


def stored(cache: tc.TokenCache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(cache.document(i), dtype=np.int64), np.asarray(cache.document_loss_mask(i)))
            for i in range(cache.num_documents)]


@pytest.fixture(scope="module")
def conversations(books) -> list[list[dict]]:
    """Real paragraphs in 2-8 turns (some with a system prompt); none holding a control token,
    which transformers and we both encode as the token, but which we never train."""
    found = generate_conversations(books, 200, seed=11)
    return [c for c in found if not any("<|" in m["content"] for m in c)][:80]


# --- 4. a build that trains nothing; role markers that are not tokens ------------------------------

def test_a_chat_build_that_trains_no_token_is_an_error(tmp_path, model_dir):
    folder, _ = model_dir
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)])
    with pytest.raises(tc.BuildError, match=r"no token of this build is trained \(0 of [0-9]+ tokens "
                                            r"in 6 documents\).*\{% generation %\} tags.*train_on='all'"):
        build(chats, tmp_path / "out", folder / "tokenizer.json", "{{ messages[0].content }}")
    # the cache the failed build committed is checked again when the build is run again
    with pytest.raises(tc.BuildError, match="no token of this build is trained"):
        build(chats, tmp_path / "out", folder / "tokenizer.json", "{{ messages[0].content }}")
    # on the command line (the case the issue saw exit 0), a failure naming what to do
    run = subprocess.run([sys.executable, "-m", "torchcache", "build", chats, "-o",
                          str(tmp_path / "cli"), "-t", str(folder / "tokenizer.json"),
                          "--input-format", "messages", "--chat-template",
                          "{{ messages[0].content }}"], env=dict(os.environ, TQDM_DISABLE="1"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "no token of this build is trained" in run.stderr, run.stderr
    # the same records with a template that marks the assistant's turns build
    assert build(chats, tmp_path / "good", folder / "tokenizer.json",
                 variant(CHATML, tags=False)).num_documents == 6


def test_a_resumed_build_that_trains_no_token_is_an_error(tmp_path, model_dir):
    """The check is at the end of every build: one killed after its first commits and resumed
    fails the same way."""
    from conftest import python_with_hooks
    folder, _ = model_dir
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"Question number {i}?"},
                      {"role": "assistant", "content": f"Answer {i}."}]} for i in range(60)])
    script = ("import torchcache as tc\n"
              "tc.build_cache(sys.argv[1], sys.argv[2], sys.argv[3], input_format='messages', "
              "chat_template='{{ messages[0].content }}', block_tokens=20, num_workers=1, "
              "progress=False)\n")
    out = tmp_path / "out"
    killed = subprocess.run(python_with_hooks(script, chats, str(out), str(folder / "tokenizer.json"),
                                              kill_after_commits=3), timeout=300)
    assert killed.returncode == -9
    assert 0 < tc.TokenCache(out).num_documents < 60 and not tc.TokenCache(out).complete
    with pytest.raises(tc.BuildError, match=r"no token of this build is trained \(0 of [0-9]+ "
                                            r"tokens in 60 documents\)"):
        build(chats, out, folder / "tokenizer.json", "{{ messages[0].content }}", eos="auto",
              block_tokens=20, num_workers=1)


def test_role_markers_that_are_not_single_tokens_are_named(tmp_path, model_dir, gpt2_tokenizer_path):
    folder, with_markers = model_dir
    plain = Tokenizer.from_file(gpt2_tokenizer_path)  # <|im_end|> is 7 GPT-2 tokens here
    template = ChatTemplate(variant(CHATML, tags=False))
    assert split_role_markers(template, plain) == ["<|im_end|>"]
    assert split_role_markers(template, with_markers) == []
    text_roles = ChatTemplate("{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n"
                              "{% endfor %}")
    assert split_role_markers(text_roles, with_markers) == ["User:", "Assistant:"]
    # a build warns, naming them; with the markers as special tokens it does not
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    with pytest.warns(UserWarning, match=r"role markers '<\|im_end\|>' .*not single tokens"):
        build(chats, tmp_path / "split", gpt2_tokenizer_path, variant(CHATML, tags=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(chats, tmp_path / "whole", folder / "tokenizer.json", variant(CHATML, tags=False))


# --- 5. template problems are per record; Phi-3; masks equal transformers' -------------------------

# Mistral v0.3 (Instruct): the system prompt goes into the last user turn
MISTRAL = r"""
{%- if messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set turns = messages -%}{%- endif -%}
{{- bos_token -}}
{%- for message in turns -%}
    {%- if message['role'] == 'user' -%}
        {%- if loop.last and system is defined -%}
            {{- '[INST] ' + system + '\n\n' + message['content'] + '[/INST]' -}}
        {%- else -%}{{- '[INST] ' + message['content'] + '[/INST]' -}}{%- endif -%}
    {%- else -%}{{- ' ' + message['content'] + eos_token -}}{%- endif -%}
{%- endfor -%}
"""

UNSTABLE = {  # (template, a conversation it is prefix-stable for, one it is not)
    "qwen3-like": (variant(THINKING, tags=False),
                   [{"role": "user", "content": "Add 2 and 2."},
                    {"role": "assistant", "content": "<think>pairs</think>4"}],
                   [{"role": "user", "content": "Add 2 and 2."},
                    {"role": "assistant", "content": "<think>two pairs</think>4"},
                    {"role": "user", "content": "And 3 and 3?"},
                    {"role": "assistant", "content": "<think>double</think>6"}]),
    "mistral-v0.3": (MISTRAL,
                     [{"role": "user", "content": "Add 2 and 2."},
                      {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "And 3 and 3?"},
                      {"role": "assistant", "content": "6"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Add 2 and 2."},
                      {"role": "assistant", "content": "4"}]),
}


@pytest.mark.parametrize("name", list(UNSTABLE))
def test_a_conversation_the_template_is_not_stable_for_is_a_record_problem(tmp_path, model_dir,
                                                                           name):
    folder, _ = model_dir
    template, stable_messages, unstable_messages = UNSTABLE[name]
    stable, unstable = {"messages": stable_messages}, {"messages": unstable_messages}
    chats = write_records(tmp_path / "chats.jsonl", [stable, unstable, stable])
    with pytest.raises(tc.InputError, match=f"{chats}:2: chat template .* is not prefix-stable for "
                                            r"this conversation.*\{% generation %\} tags"):
        build(chats, tmp_path / "raise", folder / "tokenizer.json", template)
    result = tc.build_cache(chats, tmp_path / "skip", str(folder / "tokenizer.json"),
                            input_format="messages", chat_template=template, on_error="skip",
                            progress=False)
    assert result.skipped == {"unstable_template": 1} and result.num_documents == 2
    assert "unstable_template" in SKIP_REASONS and "template_limit" in SKIP_REASONS
    assert [tc.TokenCache(tmp_path / "skip").document_info(i)["record"] for i in range(2)] == [0, 2]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_masks_equal_transformers_for_chatml_llama3_and_phi3(tmp_path, model_dir, conversations, name):
    """train_on="assistant" with the tagged template is transformers' assistant mask, token for
    token; the template without tags gives the same (Phi-3's closing eos_token included, which
    every multi-turn Phi-3 conversation was refused for)."""
    folder, tok = model_dir
    hf = hf_tokenizer(tok, variant(TEMPLATES[name], tags=True))
    chats = write_records(tmp_path / "chats.jsonl", [{"messages": m} for m in conversations])
    multi_turn = sum(sum(m["role"] == "assistant" for m in c) > 1 for c in conversations)
    assert multi_turn > 20
    for tags in (True, False):
        cache = build(chats, tmp_path / f"tags-{tags}", folder / "tokenizer.json",
                      variant(TEMPLATES[name], tags), block_tokens=1 << 30)
        assert cache.num_documents == len(conversations)
        for (ids, mask), messages in zip(stored(cache), conversations):
            want_ids, want_mask = hf_oracle(hf, messages)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)
        assert 0.1 < np.mean(np.concatenate([m for _, m in stored(cache)])) < 0.9


def test_phi3_closing_eos_is_not_trained(model_dir):
    _, tok = model_dir
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    text, spans = ChatTemplate(variant(PHI3, tags=False), SPECIAL).render(messages)
    assert text.endswith("<|end|>\n<|endoftext|>")
    assert [text[a:b] for a, b in spans] == ["b<|end|>", "d<|end|>"]


# --- 6. tool calls and tools -------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def tool_conversations() -> list[dict]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "{\"temperature\": 21}", "tool_call_id": "call_1",
             "name": "get_weather"},
            {"role": "assistant", "content": "It is 21 degrees in Paris."}]},
        {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Two cities?"},
            {"role": "assistant", "content": None, "tool_calls": [call, dict(call, function={
                "name": "get_weather", "arguments": {"city": "Lyon"}})]},
            {"role": "tool", "content": "21"}, {"role": "tool", "content": "19"},
            {"role": "assistant", "content": "21 and 19."}]},
        {"tools": TOOLS, "messages": [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello."}]},
    ]


def test_tool_calls_and_tools_are_rendered_and_trained_as_transformers_does(tmp_path, model_dir):
    folder, tok = model_dir
    records = tool_conversations()
    hf = hf_tokenizer(tok, variant(HERMES, tags=True))
    chats = write_records(tmp_path / "chats.jsonl", records)
    for tags in (True, False):
        cache = build(chats, tmp_path / f"tags-{tags}", folder / "tokenizer.json",
                      variant(HERMES, tags))
        assert cache.num_documents == len(records)
        for (ids, mask), record in zip(stored(cache), records):
            want_ids, want_mask = hf_oracle(hf, record["messages"], record.get("tools"))
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)
        trained = tok.decode(stored(cache)[0][0][stored(cache)[0][1]].tolist(),
                             skip_special_tokens=False)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in trained
        whole = tok.decode(stored(cache)[0][0].tolist(), skip_special_tokens=False)
        assert '"description": "The weather in a city."' in whole  # the record's tools


def test_every_field_of_a_message_reaches_the_template(model_dir):
    """The messages as transformers passes them: every field, reasoning aliases included."""
    _, tok = model_dir
    source = ("{% for m in messages %}{{ m | tojson }}|{{ m.reasoning_content }}|{{ m.thinking }}\n"
              "{% endfor %}{{ tools | tojson }}")
    record = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "q", "name": "alice"},
        {"role": "assistant", "content": "a", "reasoning": "because"},
        {"role": "tool", "content": "r", "tool_call_id": "call_9"}]}
    hf = hf_tokenizer(tok, source)
    want = hf.apply_chat_template(record["messages"], tools=record["tools"], tokenize=False)
    messages = normalize_messages(record, "messages")
    assert ChatTemplate(source).render_text(messages, tools=record["tools"]) == want
    with pytest.raises(BadRecord, match="'tools' is str"):
        render_record(dict(record, tools="get_weather"), "messages", ChatTemplate(source))
    with pytest.raises(BadRecord, match="message 0 'content' is null"):
        normalize_messages({"messages": [{"role": "user", "content": None}]}, "messages")


# --- 7. render limits ----------------------------------------------------------------------------

HOSTILE = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for i in range(100000) %}{{ 'x' * 50000 }}{% endfor %}", "characters of output"),
    ("{% set s %}{% for i in range(100000) %}{{ range(1000) | join }}{% endfor %}{% endset %}",
     "characters of output|steps"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s | length }}", "steps"),
    ("{{ 'x' | center(10**10) }}", "a size argument of center of 10,000,000,000"),
    ("{{ 'x'.ljust(10**10) }}", "a size argument of ljust"),
    ("{{ '{:>9999999999}'.format(1) }}", "a width in a format string"),
    ("{{ '%9999999999d' % 1 }}", "a width in a format string"),
    ("{{ lipsum(10**8) }}", "a size argument of generate_lorem_ipsum"),
    ("{{ 'x' * 10**10 }}", "a repetition of 10,000,000,000"),
    ("{{ 7 ** (10**9) }}", "a power"),
    ("{% for i in range(100000) %}{{ range(100000) | sum }}{% endfor %}", "steps"),
]


@pytest.mark.parametrize("source, limit", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_template_goes_over_a_limit_naming_the_template(source, limit):
    with pytest.raises(BadRecord, match=f"chat template .*went over its limits rendering this "
                                        f"conversation.*({limit})") as raised:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], "all")
    assert raised.value.reason == "template_limit"
    assert source[:20].replace("'", "") in str(raised.value).replace("'", "").replace('"', "")


def test_large_numbers_that_are_not_sizes_render():
    source = ("{{ 1730000000 }} {{ '%d' | format(1730000000) }} {{ '{}'.format(1730000000) }} "
              "{{ (1730000000 * 3) ~ '' }} {{ 'ab' * 3 }}")
    assert ChatTemplate(source).render_text([]) == ("1730000000 1730000000 1730000000 5190000000 "
                                                    "ababab")


def test_a_hostile_template_in_a_build_names_file_and_line(tmp_path, model_dir):
    folder, _ = model_dir
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "x" * n}, {"role": "assistant", "content": "y"}]}
        for n in (1, 1, 100_000)])
    # quadratic in the length of the first message: fine for short ones, not for the last
    source = ("{% for c in messages[0].content %}{% for d in messages[0].content %}{% endfor %}"
              "{% endfor %}" + variant(CHATML, tags=True))
    with pytest.raises(tc.InputError, match=f"{chats}:3: chat template .*went over its limits"):
        build(chats, tmp_path / "raise", folder / "tokenizer.json", source)
    result = tc.build_cache(chats, tmp_path / "skip", str(folder / "tokenizer.json"),
                            input_format="messages", chat_template=source, on_error="skip",
                            progress=False)
    assert result.skipped == {"template_limit": 1} and result.num_documents == 2


def test_long_real_conversations_stay_within_the_limits(model_dir, books):
    """A long conversation without tags renders once per assistant turn: 300 turns of real text."""
    paragraphs = [p for b in books for p in b["text"].split("\n\n") if p.strip()][:300]
    messages = [{"role": ("user", "assistant")[i % 2], "content": p} for i, p in enumerate(paragraphs)]
    for name, source in TEMPLATES.items():
        text, spans = ChatTemplate(variant(source, tags=False), SPECIAL).render(messages)
        assert len(spans) == 150 and sum(len(p) for p in paragraphs) < len(text)


# --- 8. links in model folders -------------------------------------------------------------------

def test_a_link_out_of_the_model_folder_is_refused(tmp_path, model_dir):
    folder, _ = model_dir
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0:root:/root:/bin/bash {{ 'leaked' }}")
    (model / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ValueError, match=f"{model / 'chat_template.jinja'} is a link to {secret}, "
                                         f"outside the model folder {model}"):
        load_chat_template(str(model))
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(ValueError, match="chat_template.jinja is a link to"):
        tc.build_cache(chats, tmp_path / "out", str(model), input_format="messages", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    # the same rule for tokenizer_config.json and tokenizer.json
    (model / "chat_template.jinja").unlink()
    os.replace(model / "tokenizer_config.json", tmp_path / "outside" / "config.json")
    (model / "tokenizer_config.json").symlink_to(tmp_path / "outside" / "config.json")
    with pytest.raises(ValueError, match="tokenizer_config.json is a link to"):
        load_chat_template(str(model / "tokenizer.json"), "{{ messages }}")
    os.replace(model / "tokenizer.json", tmp_path / "outside" / "tokenizer.json")
    (model / "tokenizer.json").symlink_to(tmp_path / "outside" / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json is a link to"):
        load_tokenizer(str(model))


def test_links_inside_the_folder_and_in_a_hugging_face_cache_are_followed(tmp_path, model_dir):
    folder, tok = model_dir
    template = variant(CHATML, tags=True)
    # a link inside the model folder
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    (model / "templates").mkdir()
    (model / "templates" / "chat.jinja").write_text(template)
    (model / "chat_template.jinja").symlink_to("templates/chat.jinja")
    assert load_chat_template(str(model)).source == template
    # a Hugging Face hub cache: snapshots/<rev>/* are relative links to ../../blobs/<hash>
    hub = tmp_path / "hub" / "models--org--chat"
    (hub / "blobs").mkdir(parents=True)
    snapshot = hub / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, data in (("tokenizer.json", (folder / "tokenizer.json").read_bytes()),
                       ("tokenizer_config.json", json.dumps(SPECIAL).encode()),
                       ("chat_template.jinja", template.encode())):
        blob = hub / "blobs" / f"blob-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}])
    result = tc.build_cache(chats, tmp_path / "out", str(snapshot), input_format="messages",
                            progress=False)
    assert result.num_documents == 1 and tc.TokenCache(tmp_path / "out").chat_template == template
    assert load_tokenizer(str(snapshot)).to_str() == tok.to_str()
    # but not into another model's blobs, even inside the same hub cache
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "x").write_text("{{ 'other' }}")
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to(os.path.relpath(other / "x", snapshot))
    with pytest.raises(ValueError, match=f"outside the model folder {hub}"):
        model_file_path(str(snapshot), "chat_template.jinja")


# a template that fails inside Jinja for one record only (the second of three): a field that
# record lacks, arithmetic on its text, a division by its length
FAILING_FOR_ONE = {
    "missing_field": ("{{- messages[0].meta.lang -}}", {"meta": {"lang": "en"}}, {},
                      "UndefinedError"),
    "type_error": ("{{- messages[0].content + (1 if messages[0].content == 'bad' else '') -}}",
                   {}, {}, "TypeError"),
    "zero_division": ("{{- (1 // (messages[0].content | length - 3)) and '' -}}", {}, {},
                      "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", list(FAILING_FOR_ONE))
def test_a_template_that_raises_for_one_record_is_a_record_problem(tmp_path, model_dir, name):
    """An error raised while rendering one conversation stops the build naming file:line, the
    template and the error (on_error="raise"), or is skipped and counted (on_error="skip")."""
    folder, _ = model_dir
    prefix, good_fields, bad_fields, error = FAILING_FOR_ONE[name]
    template = prefix + variant(CHATML, tags=True)

    def record(user: str, fields: dict) -> dict:
        return {"messages": [{"role": "user", "content": user, **fields},
                             {"role": "assistant", "content": "An answer."}]}
    chats = write_records(tmp_path / "chats.jsonl", [record("Hello there", good_fields),
                                                     record("bad", bad_fields),
                                                     record("Hello again", good_fields)])
    with pytest.raises(tc.InputError, match=f"{chats}:2: chat template .* failed rendering this "
                                            f"conversation: {error}") as raised:
        build(chats, tmp_path / "raise", folder / "tokenizer.json", template)
    assert prefix[:20] in str(raised.value)
    result = tc.build_cache(chats, tmp_path / "skip", str(folder / "tokenizer.json"),
                            input_format="messages", chat_template=template, on_error="skip",
                            progress=False)
    assert result.skipped == {"template_error": 1} and result.num_documents == 2
    assert "template_error" in SKIP_REASONS
    assert [tc.TokenCache(tmp_path / "skip").document_info(i)["record"] for i in range(2)] == [0, 2]


def test_a_template_that_does_not_compile_is_one_error_naming_it(tmp_path, model_dir):
    folder, _ = model_dir
    chats = write_records(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(ValueError, match=r"chat template '\{% for m in messages %\}' is not valid "
                                         r"Jinja \(line 1") as raised:
        tc.build_cache(chats, tmp_path / "skip", str(folder / "tokenizer.json"),
                       input_format="messages", chat_template="{% for m in messages %}",
                       on_error="skip", progress=False)
    assert not isinstance(raised.value, tc.InputError)
