"""Prompt text and chat messages become the token ids llama.cpp feeds the model (tests/data/llama_cpp):
BOS as the model's metadata says (never twice), special tokens parsed, chat through the template."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prima.engine.prompt import chat_prompt_ids, prompt_ids, render_messages
from prima.errors import InputError
from prima.model.gguf_file import GGUFFile
from prima.model.tokenizer import Tokenizer
from tests.conftest import ORACLE_TAGS, load_oracle

Model = tuple[dict[str, Any], Tokenizer]


def _model(path: Path) -> Model:
    with GGUFFile(path) as gguf:
        return gguf.metadata, Tokenizer.from_gguf(gguf.metadata)


@pytest.fixture(scope="module")
def models(smollm2_path: Path, gemma3_path: Path) -> dict[str, Model]:
    """Metadata and tokenizer of each oracle model, by oracle tag."""
    return {"smollm2-135m": _model(smollm2_path), "gemma3-270m": _model(gemma3_path)}


def _cases(chat: bool) -> list[Any]:
    return [
        pytest.param(tag, p, id=f"{tag}-{p['name']}")
        for tag in ORACLE_TAGS
        for p in load_oracle(tag)["prompts"]
        if p["chat"] == chat
    ]


@pytest.mark.parametrize(("tag", "prompt"), _cases(chat=False))
def test_prompt_ids_are_llama_cpps(models: dict[str, Model], tag: str, prompt: dict[str, Any]) -> None:
    """Gemma adds BOS and SmolLM2 does not, as each model's metadata says."""
    _, tok = models[tag]
    ids = prompt_ids(tok, prompt["text"])
    assert ids == prompt["prompt_token_ids"]
    assert (ids[0] == tok.bos_id) == tok.add_bos_default


@pytest.mark.parametrize(("tag", "prompt"), _cases(chat=True))
def test_chat_prompt_ids_are_llama_cpps(models: dict[str, Model], tag: str, prompt: dict[str, Any]) -> None:
    meta, tok = models[tag]
    messages = [{"role": "user", "content": prompt["text"]}]
    assert render_messages(meta, tok, messages) == prompt["rendered"]
    assert chat_prompt_ids(meta, tok, messages) == prompt["prompt_token_ids"]


def test_text_that_starts_with_bos_gets_no_second_one(
    models: dict[str, Model], oracle: Callable[[str], dict[str, Any]]
) -> None:
    """A template (or user) that writes the BOS text itself gets exactly llama.cpp's ids."""
    _, tok = models["gemma3-270m"]
    prompt = oracle("gemma3-270m")["prompts"][0]
    assert prompt["prompt_token_ids"][0] == tok.bos_id
    assert prompt_ids(tok, "<bos>" + prompt["text"]) == prompt["prompt_token_ids"]


def test_a_given_template_replaces_the_models_and_sees_its_special_tokens(models: dict[str, Model]) -> None:
    meta, tok = models["gemma3-270m"]
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = render_messages(meta, tok, messages, template)
    assert rendered == "<bos>[system] Be brief.\n[user] Hi\n<eos>"
    ids = chat_prompt_ids(meta, tok, messages, template)
    assert ids.count(tok.bos_id) == 1  # written by the template, so not added again
    assert ids[0] == tok.bos_id
    assert ids[-1] == tok.eos_id  # special tokens are parsed, not spelled out


def test_empty_prompt_is_refused(models: dict[str, Model]) -> None:
    _, tok = models["smollm2-135m"]
    with pytest.raises(InputError, match="the prompt is empty"):
        prompt_ids(tok, "")
