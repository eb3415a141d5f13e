"""Role prefixes/suffixes derived from real chat-template shapes: a program's text built role
by role must equal the template's own rendering of its messages."""

from __future__ import annotations

import pytest

from plait.lang.chat_template import ChatTemplate
from plait.lang.executor import TextState

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (  # strict alternation, no system role
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN25 = (  # inserts a default system prompt
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def build(template: ChatTemplate, messages: list[dict[str, str]]) -> str:
    state = TextState(template)
    for m in messages:
        state.role_begin(m["role"])
        state.fill(m["content"])
        state.role_end(m["role"])
    assert state.messages_ == messages
    return state.text_


CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.mark.parametrize(
    "name,source,system",
    [
        ("llama3", LLAMA3, True),
        ("mistral", MISTRAL, False),
        ("gemma", GEMMA, False),
        ("qwen2.5", QWEN25, True),
    ],
)
def test_role_by_role_text_equals_the_templates_rendering(name, source, system):
    template = ChatTemplate.from_string(source, SPECIALS, name=name)
    messages = ([{"role": "system", "content": "Be brief."}] if system else []) + CONVERSATION
    assert build(template, messages) == template.render(messages, False)


def test_assistant_prefix_is_the_generation_prompt():
    template = ChatTemplate.from_string(LLAMA3, SPECIALS)
    history = [{"role": "user", "content": "Hi"}]
    prefix, suffix = template.get_prefix_and_suffix("assistant", history)
    assert prefix == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert suffix == "<|eot_id|>"
    first, _ = template.get_prefix_and_suffix("user", [])
    assert first.startswith("<s>")  # BOS comes with the first message only
    later, _ = template.get_prefix_and_suffix("user", CONVERSATION[:2])
    assert not later.startswith("<s>")


def test_unsupported_roles_fail_with_the_templates_reason():
    template = ChatTemplate.from_string(GEMMA, SPECIALS, name="gemma")
    with pytest.raises(ValueError, match="System role not supported"):
        template.get_prefix_and_suffix("system", [])


def test_tokenizer_templates_and_end_of_turn_tokens(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    template = ChatTemplate.from_tokenizer(tok)
    assert template.stop_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert build(template, CONVERSATION) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    tok.chat_template = None
    assert ChatTemplate.from_tokenizer(tok) is None
