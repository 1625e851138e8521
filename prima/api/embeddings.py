"""/v1/embeddings in OpenAI's wire format, and how a prompt's hidden states become one vector.

An embedding is pooled from the final normed hidden states of the input's tokens (the output
head's input, llama.cpp's `result_norm`), then scaled to unit length (L2), as OpenAI's and
llama-server's embeddings are. Mean pooling is the default: a causal model's last token mostly
encodes what comes next, while the mean holds every token of the text, which is what search
and clustering compare. `"pooling": "last"` (a prima extension, llama-server's
`--pooling last`) takes the last token's state instead, which suits models trained for it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from prima.api.openai_schema import RequestError, _opt_str, _require_object, _type_name

Pooling = Literal["mean", "last"]
EncodingFormat = Literal["float", "base64"]

POOLINGS: tuple[Pooling, ...] = ("mean", "last")
ENCODING_FORMATS: tuple[EncodingFormat, ...] = ("float", "base64")
MAX_INPUTS = 64  # inputs in one request: each is a prompt run on the model


@dataclass(frozen=True)
class EmbeddingsRequest:
    """One parsed /v1/embeddings body: each input is text, or token ids."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: EncodingFormat = "float"
    pooling: Pooling = "mean"
    dimensions: int | None = None


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """Validate a /v1/embeddings body; every rejection names the field."""
    obj = _require_object(body)
    encoding = obj.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise RequestError(
            f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format"
        )
    pooling = obj.get("pooling", "mean")
    if pooling not in POOLINGS:
        raise RequestError(f"'pooling' must be 'mean' or 'last', got {pooling!r}", "pooling")
    dimensions = obj.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise RequestError(f"'dimensions' must be an integer, got {_type_name(dimensions)}", "dimensions")
    return EmbeddingsRequest(
        model=_opt_str(obj, "model"),
        inputs=_parse_inputs(obj.get("input")),
        encoding_format=encoding,
        pooling=pooling,
        dimensions=dimensions,
    )


def _parse_inputs(raw: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of token ids, or a list of either (OpenAI's four forms of `input`)."""
    if raw is None:
        raise RequestError("'input' is required: a string, a list of strings, or token ids", "input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_token(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list):
        raise RequestError(f"'input' must be a string or a list, got {_type_name(raw)}", "input")
    if not raw:
        raise RequestError("'input' is empty: send at least one string", "input")
    if len(raw) > MAX_INPUTS:
        raise RequestError(f"'input' has {len(raw)} items; at most {MAX_INPUTS} are allowed", "input")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            inputs.append(tuple(item))
        else:
            raise RequestError(
                f"'input[{i}]' must be a non-empty string or a non-empty list of non-negative token ids",
                "input",
            )
    return tuple(inputs)


def _is_token(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def pool(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """Final normed hidden states (n_tokens, d_model) -> one unit-length vector (d_model,)."""
    v = hidden.mean(axis=0, dtype=np.float64) if pooling == "mean" else hidden[-1].astype(np.float64)
    norm = np.linalg.norm(v)
    return (v / norm if norm > 0 else v).astype(np.float32)


def embeddings_response(
    model: str, vectors: Sequence[np.ndarray], prompt_tokens: int, encoding: EncodingFormat
) -> dict[str, Any]:
    """The `list` of `embedding` objects, floats or base64 of little-endian float32 (as OpenAI's
    clients decode them)."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(v, encoding)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encode(v: np.ndarray, encoding: EncodingFormat) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]
