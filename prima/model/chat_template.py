"""Render chat messages into a prompt with the model's own Jinja template, as HF transformers does.

Templates come from untrusted model files, so they run in jinja2's immutable sandbox. The
environment mirrors transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`) so a template renders the same text here as there.
Models that ship no template (Gemma 3 270M) get a built-in fallback from `chat_template_for`,
which they may not follow; `read_chat_template` loads the real one from a file instead.

The rendered text is meant to be tokenized with `parse_special=True` and BOS added as the
vocabulary's `add_bos_default` says; the fallbacks therefore do not emit `bos_token` themselves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prima.errors import InputError, ModelFileError

# Gemma's turn format: roles are `user` and `model`; a system message has no turn of its own and
# is prepended to the first user turn, as Gemma's published template does.
GEMMA_TURN_TEMPLATE = (
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for m in (messages[1:] if system else messages) -%}"
    "{%- if m['role'] not in ('user', 'assistant') -%}"
    "{{ raise_exception('Gemma turns must be user or assistant, got ' + m['role']) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ (system if loop.first and m['role'] == 'user' else '') + m['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# For vocabularies with no template and no known turn tokens: plain labelled lines.
PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ {'system': 'System', 'user': 'User', 'assistant': 'Assistant'}.get(m['role'], m['role'] | capitalize) }}"
    "{{ ': ' + m['content'] + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)


def model_chat_template(meta: Mapping[str, Any]) -> str | None:
    """The GGUF's own `tokenizer.chat_template`, or None when it ships none."""
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        return template
    return None


def chat_template_for(meta: Mapping[str, Any]) -> str:
    """The GGUF's `tokenizer.chat_template`, else a fallback suited to its vocabulary: Gemma's turn
    format when the vocabulary has `<start_of_turn>`, otherwise `User:`/`Assistant:` lines."""
    template = model_chat_template(meta)
    if template is not None:
        return template
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        return GEMMA_TURN_TEMPLATE
    return PLAIN_TEMPLATE


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """A Jinja chat template from a file (the `chat_template` string of a model's Hugging Face
    tokenizer_config.json, saved as text). InputError if it is unreadable, empty or not Jinja."""
    try:
        template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the chat template {path}: {exc}") from exc
    if not template.strip():
        raise InputError(f"the chat template {path} is empty")
    try:
        _compile(template)
    except ModelFileError as exc:
        raise InputError(f"the chat template {path} is not a valid Jinja template: {exc}") from None
    return template


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` (dicts with `role` and `content`) into prompt text.

    Raises InputError for malformed messages or a template's own `raise_exception`, and
    ModelFileError when the template itself is broken.
    """
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputError(f"message {n} needs a string 'role' (user, assistant or system)")
        if "content" not in message:
            raise InputError(f"message {n} ({message['role']}) has no 'content'")
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except _TemplateRaised as exc:
        raise InputError(f"the chat template rejected the messages: {exc}") from None
    except TemplateError as exc:
        raise ModelFileError(f"the model's chat template failed to render: {exc}") from exc


class _TemplateRaised(Exception):
    """A template called raise_exception(); its message is meant for the user."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping (jinja's built-in would turn '<' into \u003c).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as exc:
        raise ModelFileError(
            f"the model's chat template does not parse (line {exc.lineno}: {exc.message}); "
            "use a raw prompt instead of chat messages"
        ) from exc
