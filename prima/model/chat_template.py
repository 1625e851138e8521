"""Render chat messages into a prompt with the model's own Jinja template, as HF transformers does.

Templates come from untrusted model files, so they run in jinja2's immutable sandbox, and a
render is bounded (`RenderLimits`): steps of template code, wall time, the size of every value
the template reads, builds or passes to a function, and the size of its output. The sandbox alone
stops a template touching Python internals, not `'x' * 10**10` or a loop of 10^10 steps.
The environment mirrors transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`) so a template renders the same text here as there.
Models that ship no template (Gemma 3 270M) get a built-in fallback from `chat_template_for`,
which they may not follow; `read_chat_template` loads the real one from a file instead.

The rendered text is meant to be tokenized with `parse_special=True` and BOS added as the
vocabulary's `add_bos_default` says; the fallbacks therefore do not emit `bos_token` themselves.
"""

from __future__ import annotations

import json
import operator
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import FrameType
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


TEMPLATE_FILENAME = "<chat-template>"  # the compiled template's code, told apart by the tracer


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render. `max_steps` counts lines of template code run (each loop iteration
    is at least one), so a runaway template is stopped the same way on every machine;
    `max_seconds` is the backstop for steps that are slow in themselves. `max_chars` bounds the
    output and every string, list or dict the template reads or builds; `max_int` bounds the
    integers it passes to functions and operators (widths, repeat counts, exponents)."""

    max_steps: int = 2_000_000
    max_seconds: float = 5.0
    max_chars: int = 4 << 20  # 4 Mi characters: four times the largest HTTP body
    max_int: int = 1 << 20


DEFAULT_LIMITS = RenderLimits()


class TemplateLimitError(InputError):
    """A render went over its RenderLimits: the messages are too big for the template, or the
    template runs away on any input."""


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
    limits: RenderLimits = DEFAULT_LIMITS,
    **extra: Any,
) -> str:
    """Render `messages` (dicts with `role` and `content`) into prompt text.

    Raises InputError for malformed messages or a template's own `raise_exception`,
    TemplateLimitError (an InputError) when the render goes over `limits`, and ModelFileError
    when the template itself is broken.
    """
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputError(f"message {n} needs a string 'role' (user, assistant or system)")
        if "content" not in message:
            raise InputError(f"message {n} ({message['role']}) has no 'content'")
    compiled = _compile(template, limits)
    variables = dict(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **extra,
    )
    out: list[str] = []
    size = 0
    try:
        with _Budget(limits):
            for piece in compiled.generate(variables):
                size += len(piece)
                if size > limits.max_chars:
                    raise TemplateLimitError(
                        f"the chat template's output passed {limits.max_chars} characters; "
                        "send shorter messages"
                    )
                out.append(piece)
    except _TemplateRaised as exc:
        raise InputError(f"the chat template rejected the messages: {exc}") from None
    except OverflowError as exc:  # the sandbox's range() cap, or a float grown out of range
        raise TemplateLimitError(f"the chat template went over a limit: {exc}") from None
    except RecursionError:
        raise TemplateLimitError("the chat template nests its calls too deeply") from None
    except (TemplateError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as exc:
        # Jinja passes Python's own errors through: a template that fails on these messages.
        raise ModelFileError(
            f"the model's chat template failed to render: {exc.__class__.__name__}: {exc}"
        ) from exc
    return "".join(out)


class _Budget:
    """Counts the lines of template code this thread runs (a line tracer on the template's frames
    only) and stops the render past `max_steps` or `max_seconds`. Any tracer already installed
    (a debugger, coverage) is put back afterwards."""

    CLOCK_EVERY = 4096  # steps between reads of the clock

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.deadline = 0.0
        self._previous: Callable[..., Any] | None = None

    def __enter__(self) -> _Budget:
        self.deadline = time.monotonic() + self.limits.max_seconds
        self._previous = sys.gettrace()
        sys.settrace(self._on_call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)

    def _on_call(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        return self._on_line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    def _on_line(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            self.steps += 1
            if self.steps > self.limits.max_steps:
                raise TemplateLimitError(
                    f"the chat template ran more than {self.limits.max_steps} steps; "
                    "send fewer or shorter messages, or use another template"
                )
            if self.steps % self.CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
                raise TemplateLimitError(
                    f"the chat template took more than {self.limits.max_seconds:g} s; "
                    "send fewer or shorter messages, or use another template"
                )
        return self._on_line


_SIZED = (str, bytes, list, tuple, dict)
MAX_EXPONENT = 64
_LONG_NUMBER = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string
_BINOPS: dict[str, Callable[[Any, Any], Any]] = {
    "*": operator.mul,
    "**": operator.pow,
    "%": operator.mod,
    "+": operator.add,
}


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the size checks of RenderLimits on every value the template
    reads (attributes, items), passes (calls, filters) or computes with `*`, `**`, `%`, `+`."""

    intercepted_binops = frozenset(_BINOPS)

    def __init__(self, limits: RenderLimits, **options: Any) -> None:
        super().__init__(**options)
        self.limits = limits
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}

    def check(self, value: Any) -> Any:
        if isinstance(value, _SIZED) and len(value) > self.limits.max_chars:
            raise TemplateLimitError(
                f"the chat template built a value of {len(value)} items or characters; "
                f"the limit is {self.limits.max_chars}"
            )
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.limits.max_int:
            raise TemplateLimitError(
                f"the chat template used the number {_quote_int(value)}; the limit is {self.limits.max_int}"
            )
        return value

    def check_format(self, fmt: Any) -> None:
        if isinstance(fmt, str) and _LONG_NUMBER.search(fmt):
            raise TemplateLimitError("the chat template formats with a width or precision over a million")

    def _bounded(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                self.check(a)
            if f.__name__ == "do_format" and args:
                self.check_format(args[0])
            return self.check(f(*args, **kwargs))

        mark = getattr(f, "jinja_pass_arg", None)  # jinja's pass_context / pass_environment
        if mark is not None:
            bounded.jinja_pass_arg = mark  # type: ignore[attr-defined]
        return bounded

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            self.check_format(obj)
        return self.check(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self.check(super().getitem(obj, argument))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            __self.check(a)
        return __self.check(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%":
            self.check_format(left)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise TemplateLimitError(f"the chat template raises to a power over {MAX_EXPONENT}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (
                    isinstance(seq, _SIZED)
                    and isinstance(n, int)
                    and len(seq) * max(n, 0) > self.limits.max_chars
                ):
                    raise TemplateLimitError(
                        f"the chat template repeats a value {_quote_int(n)} times; "
                        f"the limit is {self.limits.max_chars} characters"
                    )
        self.check(left)
        self.check(right)
        return self.check(_BINOPS[operator](left, right))


def _quote_int(n: int) -> str:
    """An int for a message: big ones by their digit count, as str() refuses 4300+ digits."""
    return str(n) if abs(n) < 10**30 else f"of {n.bit_length()} bits"


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
    if len(fmt) > 256 or _LONG_NUMBER.search(fmt):
        raise TemplateLimitError("the chat template's strftime_now format is too long")
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str, limits: RenderLimits = DEFAULT_LIMITS) -> Any:
    env = _BoundedEnvironment(limits, trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = env._bounded(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        code = env.compile(template, filename=TEMPLATE_FILENAME)
        return env.template_class.from_code(env, code, env.make_globals(None))
    except TemplateSyntaxError as exc:
        raise ModelFileError(
            f"the model's chat template does not parse (line {exc.lineno}: {exc.message}); "
            "use a raw prompt instead of chat messages"
        ) from exc
