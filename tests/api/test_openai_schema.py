"""Request parsing, as pure functions over hand-written bodies."""

from __future__ import annotations

import re
from typing import Any

import pytest

from prima.api.openai_schema import (
    ChatMessage,
    RequestError,
    check_json_tree,
    parse_chat_request,
    parse_completion_request,
)

USER = [{"role": "user", "content": "hi"}]


def test_chat_request_reads_every_known_field() -> None:
    req = parse_chat_request(
        {
            "model": "anything",
            "messages": [{"role": "developer", "content": "be brief"}, *USER],
            "max_tokens": 16.0,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.1,
            "repeat_penalty": 1.1,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "frequency_penalty": 0.5,
            "user": "someone",  # unknown to us: ignored
        }
    )
    assert req.kind == "chat"
    assert req.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hi"))
    assert req.max_tokens == 16
    assert req.sampling.temperature == 0.0
    assert req.sampling.top_k == 20
    assert req.sampling.seed == 3
    assert req.stop == ("\n",)
    assert req.stream
    assert req.include_usage


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_chat_request({"messages": USER, "max_tokens": 50, "max_completion_tokens": 8})
    assert req.max_tokens == 8


def test_chat_content_parts_are_joined_text() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = parse_chat_request({"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].content == "ab"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ([1, 2], None, "JSON object"),
        ({}, "messages", "required"),
        ({"messages": "hi"}, "messages", "must be a list"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "not supported"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text"),
        ({"messages": USER, "max_tokens": "16"}, "max_tokens", "integer"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens", "integer"),
        ({"messages": USER, "max_tokens": True}, "max_tokens", "integer"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"messages": USER, "temperature": "hot"}, "temperature", "number"),
        ({"messages": USER, "temperature": 3}, "temperature", "[0.0, 2.0]"),
        ({"messages": USER, "top_p": 0}, "top_p", "(0.0, 1.0]"),
        ({"messages": USER, "stop": 5}, "stop", "strings"),
        ({"messages": USER, "stop": ["a", 1]}, "stop", "strings"),
        ({"messages": USER, "stop": ["x"] * 17}, "stop", "at most"),
        ({"messages": USER, "stream": "yes"}, "stream", "true or false"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "true"),
        ({"messages": USER, "model": 7}, "model", "string"),
        ({"messages": USER, "n": 2}, "n", "must be 1"),
        ({"messages": USER, "logprobs": True}, "logprobs", "not supported"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"messages": USER, "frequency_penalty": "x"}, "frequency_penalty", "number"),
    ],
)
def test_chat_request_rejections_name_the_field(body: Any, param: str | None, words: str) -> None:
    with pytest.raises(RequestError, match=re.escape(words)) as info:
        parse_chat_request(body)
    assert info.value.param == param


def test_completion_prompt_forms() -> None:
    assert parse_completion_request({"prompt": "Hi"}).prompt == "Hi"
    assert parse_completion_request({"prompt": ["Hi"]}).prompt == "Hi"
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion_request({"prompt": [[1, 2]]}).prompt == (1, 2)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "required"),
        ({"prompt": ""}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": [1, -2]}, "non-negative"),
        ({"prompt": 3}, "string or a list"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_completion_request_rejections(body: dict[str, Any], words: str) -> None:
    with pytest.raises(RequestError, match=words):
        parse_completion_request(body)


def test_temperatures_too_small_to_divide_by_mean_greedy() -> None:
    req = parse_completion_request({"prompt": "x", "temperature": 1e-30})
    assert req.sampling.temperature == 0.0
    assert parse_completion_request({"prompt": "x", "temperature": 0.5}).sampling.temperature == 0.5


def test_json_tree_check_is_iterative_and_names_the_depth() -> None:
    deep: list[object] = []
    inner = deep
    for _ in range(5000):  # deeper than Python's recursion limit
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    with pytest.raises(RequestError, match="nested more than 32"):
        check_json_tree({"x": deep})
    check_json_tree({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
