"""The OpenAI wire format as pure functions: JSON bodies in, frozen dataclasses out, and back.

Nothing here touches sockets or the engine, so every validation rule is unit-testable. Parsing is
the trust boundary: a body is checked field by field and every rejection names the field, the way
OpenAI's own 400s do. Unknown fields are ignored (clients send many); known fields of the wrong
type are rejected, because silently ignoring `"max_tokens": "16"` hides a client bug.

Everything the engine would trip on is refused here with a 400 rather than failing deeper as a
500: bodies nested deeper than MAX_JSON_DEPTH, strings holding lone surrogates (which no encoder
takes), non-finite numbers (`1e999` parses as infinity) and integers out of a field's range
(a negative `seed`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prima.errors import InputError

Kind = Literal["chat", "text"]

MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096
MAX_JSON_DEPTH = 32  # a chat body is 5 deep; content parts 6
MAX_INT = (1 << 63) - 1  # what an int field may hold unless it says less
MIN_TEMPERATURE = 1e-3  # below this, sampling divides by ~0: such temperatures mean greedy
CHAT_ROLES = ("system", "user", "assistant")


class RequestError(InputError):
    """A request body that cannot be served; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(RequestError):
    """The request names a model this server does not run (OpenAI answers 404 model_not_found)."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(
            f"the model {_quote(asked)} does not exist here; this server runs {served!r} "
            "(send that, or leave 'model' out)",
            "model",
        )


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def as_template_input(self) -> dict[str, str]:
        """The dict shape the chat template renders (`role`, `content`)."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields the client set; None means "use the server's default" (its CLI flags)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One parsed /v1/chat/completions or /v1/completions body. Exactly one of `messages`
    (chat) and `prompt` (text: a string, or token ids) is set."""

    kind: Kind
    model: str | None
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class Usage:
    """A reply's token counts; `cached_tokens` of the prompt's were kept from an earlier
    request (their KV was not computed again), reported as OpenAI's prompt_tokens_details."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# --- parsing -------------------------------------------------------------------------------------


def parse_chat_request(body: Any) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    obj = _require_object(body)
    _reject_unsupported(obj)
    raw = obj.get("messages")
    if raw is None:
        raise RequestError("'messages' is required: a list of {role, content} objects", "messages")
    if not isinstance(raw, list):
        raise RequestError(f"'messages' must be a list, got {_type_name(raw)}", "messages")
    if not raw:
        raise RequestError("'messages' is empty: send at least one message", "messages")
    if len(raw) > MAX_MESSAGES:
        raise RequestError(
            f"'messages' has {len(raw)} messages; at most {MAX_MESSAGES} are allowed", "messages"
        )
    messages = tuple(_parse_message(n, m) for n, m in enumerate(raw))
    tools = obj.get("tools")
    if tools:
        raise RequestError("tool calling is not supported by this server; omit 'tools'", "tools")
    max_tokens = _opt_int(obj, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _opt_int(obj, "max_tokens", minimum=1)
    return GenerationRequest(
        kind="chat",
        model=_opt_str(obj, "model"),
        messages=messages,
        max_tokens=max_tokens,
        sampling=_parse_sampling(obj),
        stop=_parse_stop(obj),
        stream=_opt_bool(obj, "stream") or False,
        include_usage=_parse_include_usage(obj),
    )


def parse_completion_request(body: Any) -> GenerationRequest:
    """Validate a /v1/completions body. `prompt` is a string or a list of token ids; a batch
    of prompts is refused: each request is one generation (requests run in parallel instead)."""
    obj = _require_object(body)
    _reject_unsupported(obj)
    for name in ("echo",):
        if _opt_bool(obj, name):
            raise RequestError(f"'{name}' is not supported by this server", name)
    if obj.get("suffix") is not None:
        raise RequestError("'suffix' (fill-in-the-middle) is not supported by this server", "suffix")
    return GenerationRequest(
        kind="text",
        model=_opt_str(obj, "model"),
        prompt=_parse_prompt(obj.get("prompt")),
        max_tokens=_opt_int(obj, "max_tokens", minimum=1),
        sampling=_parse_sampling(obj),
        stop=_parse_stop(obj),
        stream=_opt_bool(obj, "stream") or False,
        include_usage=_parse_include_usage(obj),
    )


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type_name(body)}")
    check_json_tree(body)
    return body


def check_json_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a parsed body nested deeper than `max_depth` or holding a string (key or value)
    that is not valid Unicode (a lone surrogate from a `\\ud800` escape). Iterative, so depth
    itself cannot overflow the stack."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise RequestError(f"the request body is nested more than {max_depth} levels deep")
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        else:
            stack.extend((v, depth + 1) for v in value)


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"the request holds a string with a lone surrogate ({text[exc.start]!r} at index "
            f"{exc.start}); send valid Unicode"
        ) from None


def _reject_unsupported(obj: Mapping[str, Any]) -> None:
    """Fields whose non-default values would change the answer's shape; refusing beats ignoring."""
    n = _opt_int(obj, "n", minimum=1)
    if n not in (None, 1):
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    best_of = _opt_int(obj, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise RequestError(f"'best_of' must be 1, got {best_of}", "best_of")
    if obj.get("logprobs") not in (None, False, 0):
        raise RequestError("'logprobs' is not supported by this server", "logprobs")
    # Penalties we accept for compatibility but cannot apply: check the type, then ignore.
    for name in ("frequency_penalty", "presence_penalty"):
        _opt_number(obj, name, low=-2.0, high=2.0)


def _parse_message(n: int, raw: Any) -> ChatMessage:
    where = f"messages[{n}]"
    if not isinstance(raw, dict):
        raise RequestError(
            f"{where} must be an object with 'role' and 'content', got {_type_name(raw)}", where
        )
    role = raw.get("role")
    if not isinstance(role, str):
        raise RequestError(f"{where}.role must be a string (system, user or assistant)", f"{where}.role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in CHAT_ROLES:
        raise RequestError(
            f"{where}.role '{role}' is not supported; use system, user or assistant", f"{where}.role"
        )
    return ChatMessage(role, _parse_content(where, raw.get("content")))


def _parse_content(where: str, content: Any) -> str:
    """A string, or a list of content parts of which only `text` parts are understood."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{i}] must be {{'type': 'text', 'text': str}}; this model reads text only",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise RequestError(f"{where}.content is required", f"{where}.content")
    raise RequestError(
        f"{where}.content must be a string or a list of text parts, got {_type_name(content)}",
        f"{where}.content",
    )


def _parse_prompt(raw: Any) -> str | tuple[int, ...]:
    if raw is None:
        raise RequestError("'prompt' is required: a string or a list of token ids", "prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one is the single prompt
    if isinstance(raw, str):
        if not raw:
            raise RequestError("'prompt' is empty", "prompt")
        return raw
    if isinstance(raw, list):
        if not raw:
            raise RequestError("'prompt' is empty", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
            return tuple(raw)
        if all(isinstance(t, (str, list)) for t in raw):
            raise RequestError(f"'prompt' holds {len(raw)} prompts; send one prompt per request", "prompt")
        raise RequestError("'prompt' must be a string or a list of non-negative token ids", "prompt")
    raise RequestError(f"'prompt' must be a string or a list of token ids, got {_type_name(raw)}", "prompt")


def _parse_sampling(obj: Mapping[str, Any]) -> SamplingOverrides:
    return SamplingOverrides(
        temperature=_parse_temperature(obj),
        top_p=_opt_number(obj, "top_p", low=0.0, high=1.0, low_open=True),
        top_k=_opt_int(obj, "top_k", minimum=0),
        min_p=_opt_number(obj, "min_p", low=0.0, high=1.0, high_open=True),
        repeat_penalty=_opt_number(obj, "repeat_penalty", low=0.01, high=100.0),
        seed=_opt_int(obj, "seed", minimum=0, maximum=(1 << 64) - 1),
    )


def _parse_temperature(obj: Mapping[str, Any]) -> float | None:
    t = _opt_number(obj, "temperature", low=0.0, high=2.0)
    return 0.0 if t is not None and t < MIN_TEMPERATURE else t


def _parse_stop(obj: Mapping[str, Any]) -> tuple[str, ...]:
    raw = obj.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(raw) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' has {len(raw)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    return tuple(s for s in raw if s)


def _parse_include_usage(obj: Mapping[str, Any]) -> bool:
    opts = obj.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise RequestError(f"'stream_options' must be an object, got {_type_name(opts)}", "stream_options")
    return _opt_bool(opts, "include_usage", prefix="stream_options.") or False


def _opt_str(obj: Mapping[str, Any], name: str) -> str | None:
    v = obj.get(name)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"'{name}' must be a string, got {_type_name(v)}", name)
    return v


def _opt_bool(obj: Mapping[str, Any], name: str, prefix: str = "") -> bool | None:
    v = obj.get(name)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"'{prefix}{name}' must be true or false, got {_type_name(v)}", prefix + name)
    return v


def _opt_int(obj: Mapping[str, Any], name: str, *, minimum: int | None, maximum: int = MAX_INT) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    # JSON has one number type: accept 16.0 as 16, refuse 16.5 and true.
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer, got {_type_name(v)}", name)
    if minimum is not None and v < minimum:
        raise RequestError(f"'{name}' must be >= {minimum}, got {_quote_int(v)}", name)
    if v > maximum:
        raise RequestError(f"'{name}' must be <= {maximum}, got {_quote_int(v)}", name)
    return v


def _opt_number(
    obj: Mapping[str, Any],
    name: str,
    *,
    low: float | None,
    high: float | None,
    low_open: bool = False,
    high_open: bool = False,
) -> float | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {_type_name(v)}", name)
    try:
        v = float(v)
    except OverflowError:  # an int beyond float range
        v = math.copysign(math.inf, v)
    if not math.isfinite(v):
        raise RequestError(f"'{name}' must be a finite number, got {v}", name)
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and (v >= high if high_open else v > high)
    if too_low or too_high:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        bounds = f"{lo}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}{hi}"
        raise RequestError(f"'{name}' must be in {bounds}, got {v}", name)
    return v


def _quote_int(v: int) -> str:
    """An int for a message: huge ones by size (str() refuses over 4300 digits)."""
    return str(v) if abs(v) < 10**30 else f"an integer of {v.bit_length()} bits"


def _quote(text: str, limit: int = 64) -> str:
    """A caller's string for a message, cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__
    )
