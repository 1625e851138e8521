"""Chat templates: the model's own template reproduces llama.cpp's chat prompt; fallbacks are sane."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prima.errors import InputError, ModelFileError
from prima.model.chat_template import (
    GEMMA_TURN_TEMPLATE,
    PLAIN_TEMPLATE,
    RenderLimits,
    TemplateLimitError,
    chat_template_for,
    render_chat,
)
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Why?"},
]


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_path: Path) -> dict[str, Any]:
    with GGUFFile(smollm2_path) as gguf:
        return gguf.metadata


@pytest.fixture(scope="module")
def gemma3_meta(gemma3_path: Path) -> dict[str, Any]:
    with GGUFFile(gemma3_path) as gguf:
        return gguf.metadata


def test_smollm2_template_reproduces_oracle_chat_prompt(
    smollm2_meta: dict[str, Any], oracle: Callable[[str], dict[str, Any]]
) -> None:
    chats = [p for p in oracle("smollm2-135m")["prompts"] if p["chat"]]
    assert chats
    template = chat_template_for(smollm2_meta)
    tok = Tokenizer.from_gguf(smollm2_meta)
    for prompt in chats:
        rendered = render_chat(template, [{"role": "user", "content": prompt["text"]}])
        assert rendered == prompt["rendered"]
        assert (
            tok.encode(rendered, add_bos=tok.add_bos_default, parse_special=True)
            == prompt["prompt_token_ids"]
        )


def test_gemma3_without_template_falls_back_to_gemma_turns(gemma3_meta: dict[str, Any]) -> None:
    assert "tokenizer.chat_template" not in gemma3_meta
    assert chat_template_for(gemma3_meta) == GEMMA_TURN_TEMPLATE
    tok = Tokenizer.from_gguf(gemma3_meta)
    rendered = render_chat(GEMMA_TURN_TEMPLATE, [{"role": "user", "content": "Hi"}])
    ids = tok.encode(rendered, add_bos=tok.add_bos_default, parse_special=True)
    texts = [tok.token_text(i) for i in ids]
    assert texts == [
        "<bos>",
        "<start_of_turn>",
        "user",
        "\n",
        "Hi",
        "<end_of_turn>",
        "\n",
        "<start_of_turn>",
        "model",
        "\n",
    ]


def test_gemma_turns_fold_system_into_first_user_turn() -> None:
    assert render_chat(GEMMA_TURN_TEMPLATE, CONVERSATION) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_turns_reject_unknown_role() -> None:
    with pytest.raises(InputError, match="tool"):
        render_chat(GEMMA_TURN_TEMPLATE, [{"role": "tool", "content": "x"}])


def test_plain_fallback_for_vocab_without_turn_tokens() -> None:
    template = chat_template_for({"tokenizer.ggml.tokens": ["a", "b"]})
    assert template == PLAIN_TEMPLATE
    assert (
        render_chat(template, CONVERSATION)
        == "System: Be brief.\nUser: Hi\nAssistant: Hello!\nUser: Why?\nAssistant:"
    )
    assert (
        render_chat(template, CONVERSATION[:2], add_generation_prompt=False)
        == "System: Be brief.\nUser: Hi\n"
    )


def test_hf_whitespace_rules_apply() -> None:
    template = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    assert render_chat(template, CONVERSATION[1:2]) == "  Hi\n"


def test_bos_eos_and_extra_variables_reach_template() -> None:
    template = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{{ tools | tojson }}"
    out = render_chat(template, CONVERSATION[1:2], bos_token="<s>", eos_token="</s>", tools=[{"n": "<a>"}])
    assert out == '<s>Hi</s>[{"n": "<a>"}]'


def test_raise_exception_becomes_input_error() -> None:
    with pytest.raises(InputError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", CONVERSATION)


def test_broken_template_is_a_model_file_error() -> None:
    with pytest.raises(ModelFileError, match="does not parse"):
        render_chat("{% for m in messages %}", CONVERSATION)


def test_sandbox_blocks_mutation() -> None:
    with pytest.raises(ModelFileError):
        render_chat("{{ messages.append(1) }}", CONVERSATION)


def test_message_without_role_is_rejected() -> None:
    with pytest.raises(InputError, match="role"):
        render_chat(PLAIN_TEMPLATE, [{"content": "hi"}])


SMALL_LIMITS = RenderLimits(max_steps=20_000, max_chars=100_000, max_int=100_000)


@pytest.mark.parametrize(
    "template",
    [
        pytest.param("{{ 'x' * 1000000000 }}", id="repeat-literal"),
        pytest.param("{% set n = 1000000000 %}{{ [0] * n }}", id="repeat-list"),
        pytest.param(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", id="loop"
        ),
        pytest.param(
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            id="doubling",
        ),
        pytest.param("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", id="doubling-macro"),
        pytest.param("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", id="recursion"),
        pytest.param("{{ 'x'|center(1000000000) }}", id="filter-width"),
        pytest.param("{{ '{:>999999999}'.format(1) }}", id="format-width"),
        pytest.param("{{ '%0999999999d' % 1 }}", id="percent-width"),
        pytest.param("{% set x = 10 %}{{ x ** 100000000 }}", id="power"),
        pytest.param("{{ range(1000000)|list|length }}", id="big-range"),
        pytest.param(
            "{% for m in messages %}{% for i in range(99999) %}xx{% endfor %}{% endfor %}", id="output"
        ),
    ],
)
def test_render_chat_bounds_a_hostile_template(template: str) -> None:
    with pytest.raises(TemplateLimitError):
        render_chat(template, CONVERSATION, limits=SMALL_LIMITS)


def test_render_limit_is_an_input_error_and_the_default_renders_long_chats() -> None:
    assert issubclass(TemplateLimitError, InputError)  # the API answers 400, not 500
    long_chat = [{"role": "user", "content": "word " * 100_000}] * 4
    assert len(render_chat(PLAIN_TEMPLATE, long_chat)) > 2_000_000


def test_render_chat_puts_back_the_tracer_it_found() -> None:
    before = sys.gettrace()
    render_chat(PLAIN_TEMPLATE, CONVERSATION)
    assert sys.gettrace() is before


def test_a_template_failing_on_python_errors_is_a_model_file_error() -> None:
    with pytest.raises(ModelFileError, match="TypeError"):
        render_chat("{{ 1 + messages[0]['content'] }}", CONVERSATION)
