"""What the Responses and Messages dialects make of requests, without a model: malformed bodies are 400s
that name the field (never a 500), settings the gateway cannot honour are refused by name."""

from __future__ import annotations

import json

import pytest

from artrl.config import GatewayConfig
from artrl.local.gateway.dialects.anthropic import MessagesDialect
from artrl.local.gateway.dialects.anthropic_items import stop_fields
from artrl.local.gateway.dialects.responses import ResponsesDialect
from artrl.local.gateway.protocol import RequestError

DEEP = b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
RESPONSES_BAD = [
    ({"model": "m", "input": None, "tools": 5}, "tools must be a list"),
    ({"model": "m", "input": 5}, "input must be a string or a list"),
    ({"model": "m", "input": "hi", "text": {"format": "json"}}, "text.format 'json' is not supported"),
    ({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "json_schema"),
    ({"model": "m", "input": "hi", "text": 5}, "text must be an object"),
    ({"model": "m", "input": "hi", "reasoning": "high"}, "reasoning must be an object"),
    ({"model": "m", "input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary is not supported"),
    ({"model": "m", "input": "hi", "chat_template_kwargs": 5}, "chat_template_kwargs must be an object"),
    ({"model": "m", "input": [{"type": "reasoning", "content": 5}]}, "content is a list of parts"),
    (
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": {"a": 1}}]}]},
        "must be a string",
    ),
    ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "call_id must be a string"),
    ({"model": "m", "input": "hi", "tool_choice": {"type": "function"}}, "tool_choice must be"),
    ({"model": "m", "input": "hi", "background": True}, "unsupported parameter"),
]
MESSAGES_BAD = [
    ({"tools": 5}, "tools must be a list"),
    ({"chat_template_kwargs": 5, "thinking": {"type": "enabled"}}, "chat_template_kwargs must be an object"),
    ({"thinking": {"type": "adaptive"}}, "thinking type 'adaptive' is not supported"),
    ({"thinking": 5}, "thinking must be an object"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "block type 'image' is not supported"),
    ({"max_tokens": None}, "max_tokens is required"),
]


@pytest.mark.parametrize(("body", "message"), RESPONSES_BAD)
def test_bad_responses_requests_are_400s_naming_the_field(body, message):
    with pytest.raises(RequestError, match=message) as caught:
        ResponsesDialect(GatewayConfig()).chat_request(json.dumps(body).encode())
    assert caught.value.status == 400


@pytest.mark.parametrize(("change", "message"), MESSAGES_BAD)
def test_bad_messages_requests_are_400s_naming_the_field(change, message):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(RequestError, match=message) as caught:
        MessagesDialect().chat_request(json.dumps(body).encode())
    assert caught.value.status == 400


@pytest.mark.parametrize("dialect", [ResponsesDialect(GatewayConfig()), MessagesDialect()])
def test_a_body_nested_too_deeply_is_a_400(dialect):
    with pytest.raises(RequestError, match="nested too deeply"):
        dialect.chat_request(DEEP)


def test_requests_translate_to_chat():
    body = {
        "model": "m",
        "instructions": "be brief",
        "max_output_tokens": 9,
        "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": "go"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
    }
    raw, _ = ResponsesDialect(GatewayConfig()).chat_request(json.dumps(body).encode())
    chat = json.loads(raw)
    assert chat["max_tokens"] == 9 and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "hm",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": "be brief",
        "stop_sequences": ["END"],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no", "is_error": True}],
            },
        ],
    }
    chat = json.loads(MessagesDialect().chat_request(json.dumps(body).encode())[0])
    assert (
        chat["stop"] == ["END"] and chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    )
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": "Error: no"}


def test_a_stop_sequence_is_reported_as_anthropic_does():
    assert stop_fields({"finish_reason": "stop", "stop_reason": "END"}) == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
    }
    assert stop_fields({"finish_reason": "tool_calls"}) == {"stop_reason": "tool_use", "stop_sequence": None}
    assert stop_fields({"finish_reason": "length"})["stop_reason"] == "max_tokens"


def test_stored_responses_are_bounded_in_bytes_the_oldest_going_first():
    """`previous_response_id` continues a kept response; the kept ones hold at most `stored_responses_bytes`
    (before: only their count was bounded, 1000 conversations of any size), and one evicted is not found."""
    dialect = ResponsesDialect(GatewayConfig(stored_responses=1000, stored_responses_bytes=10_000))
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}

    def respond(text: str) -> str:
        _, asked = dialect.chat_request(json.dumps({"model": "m", "input": "go"}).encode())
        message = {"role": "assistant", "content": text}
        completion = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}
        return dialect.reply(None, completion, asked)["id"]

    def continued(response_id: str) -> list[dict]:
        body = {"model": "m", "input": "more", "previous_response_id": response_id}
        return json.loads(dialect.chat_request(json.dumps(body).encode())[0])["messages"]

    first, second, third = (respond(letter * 4000) for letter in "abc")  # 3 x ~4 KB over 10 KB
    assert continued(third)[1] == {"role": "assistant", "content": "c" * 4000}
    assert continued(second)[1]["content"] == "b" * 4000
    with pytest.raises(RequestError, match="not found") as caught:
        continued(first)
    assert caught.value.code == "previous_response_not_found"
    assert continued(respond("small"))[1]["content"] == "small"  # room is made for each new one
