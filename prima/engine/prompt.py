"""Turn user text (or chat messages) into prompt token ids the way llama.cpp does:
BOS as the model's metadata says, special tokens parsed, chat wrapped in the model's template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prima.errors import InputError
from prima.model.chat_template import chat_template_for, render_chat
from prima.model.tokenizer import Tokenizer


def render_messages(
    meta: Mapping[str, Any],
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    template: str | None = None,
) -> str:
    """Chat messages -> prompt text through `template`, else the GGUF's own (or its fallback)."""
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return render_chat(
        template if template is not None else chat_template_for(meta),
        messages,
        add_generation_prompt=True,
        bos_token=bos,
        eos_token=eos,
    )


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt text -> ids. A template that already starts with the BOS text gets no second BOS."""
    if not text:
        raise InputError("the prompt is empty: give some text with -p")
    add_bos = tokenizer.add_bos_default
    if add_bos and tokenizer.bos_id is not None and text.startswith(tokenizer.token_text(tokenizer.bos_id)):
        add_bos = False
    ids = tokenizer.encode(text, add_bos=add_bos, parse_special=True)
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    return ids


def chat_prompt_ids(
    meta: Mapping[str, Any],
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    template: str | None = None,
) -> list[int]:
    return prompt_ids(tokenizer, render_messages(meta, tokenizer, messages, template))
