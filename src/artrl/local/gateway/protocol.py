"""Request schema and checks for `POST /v1/chat/completions`.

Everything a client can get wrong is caught here and turned into a `RequestError` (HTTP 4xx with an
OpenAI-style error body). Parameters the gateway cannot honour are rejected, not silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

# fullmatch, never match with `$`: `$` also matches before a final newline ("get_weather\n")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
Number = StrictInt | StrictFloat


class RequestError(Exception):
    """A client error: becomes an HTTP response with an OpenAI-style error body."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        kind = "server_error" if self.status >= 500 else kind
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(BaseModel):
    """A function tool. Keys beyond OpenAI's (e.g. `return`, from transformers' `get_json_schema`) are kept
    and passed to the chat template, which may render them."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class _NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request that the gateway reads."""

    model_config = ConfigDict(extra="allow")  # `user`, `metadata`, `store`… are accepted and not used

    model: StrictStr
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    n: StrictInt = Field(default=1, ge=1)
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the chat template (vLLM's name)
    ignore_eos: StrictBool | None = None  # vLLM's extension: sample max_tokens, past end-of-turn tokens too


_FIELD_NAMES = {
    name
    for schema in (ChatRequest, ToolSpec, FunctionSpec, NamedToolChoice, StreamOptions)
    for name in schema.model_fields
}


# a JSON string (with its escapes), and every byte but the four brackets
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [{ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}.get(b, 0) for b in range(256)]


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (0: a scalar), counted without parsing it (the brackets
    outside strings, in C loops: milliseconds for 8 MiB). Text that is not JSON gets some count, and the
    parser's refusal after."""
    brackets = _STRING.sub("", text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_depth(raw: bytes | str, limit: int, where: str = "the request body") -> None:
    """A RequestError (400) when the JSON in `raw` nests deeper than `limit`: before anything that recurses
    over it (parsing, validation, marking control tokens, the chat template) can exhaust the stack."""
    if isinstance(raw, bytes):
        try:  # (as json.loads decodes bytes)
            raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
        except UnicodeDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if json_depth(raw) > limit:
        raise RequestError(
            f"{where} is nested deeper than {limit} levels of arrays and objects (GatewayConfig.max_json_depth)",
            code="too_deep",
        )


def _argument_strings(body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, text) of each tool call's arguments sent as a JSON string: the gateway parses those too."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                yield f"messages[{i}].tool_calls[{j}].function.arguments", arguments


def parse_request(raw: bytes, max_depth: int | None = None) -> ChatRequest:
    """The chat request in `raw`, checked; with `max_depth`, the JSON of tool calls' arguments (strings in
    the body) may nest no deeper than that (the body itself: `check_depth` before)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", code="invalid_json")
    if max_depth is not None:
        for where, arguments in _argument_strings(body):
            check_depth(arguments, max_depth, where)
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            "request body has a string that is not valid Unicode (a lone surrogate escape)",
            code="invalid_json",
        ) from None
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in _FIELD_NAMES)
        raise RequestError(
            f"invalid value for '{where}': {first['msg']} (got {first.get('input')!r:.80})",
            param=where,
            code="invalid_value",
        ) from None
    _check_unsupported(request)
    _check_tools(request)
    return request


def _check_unsupported(r: ChatRequest) -> None:
    if r.presence_penalty or r.frequency_penalty:
        raise RequestError(
            "presence_penalty and frequency_penalty are not supported; send 0 or omit them",
            param="presence_penalty",
            code="unsupported_parameter",
        )
    if r.logit_bias:
        raise RequestError(
            "logit_bias is not supported; omit it", param="logit_bias", code="unsupported_parameter"
        )
    if r.response_format and r.response_format.get("type") not in (None, "text"):
        raise RequestError(
            "only response_format {'type': 'text'} is supported",
            param="response_format",
            code="unsupported_parameter",
        )
    if r.top_logprobs and not r.logprobs:
        raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")


def _check_tools(r: ChatRequest) -> None:
    names = [t.function.name for t in r.tools or []]
    for i, name in enumerate(names):
        if not _FUNCTION_NAME.fullmatch(name):
            raise RequestError(
                f"tools[{i}].function.name {name!r} must match {_FUNCTION_NAME.pattern}",
                param=f"tools.{i}.function.name",
                code="invalid_value",
            )
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique", param="tools", code="invalid_value")
    choice = r.tool_choice
    if (choice in ("required",) or isinstance(choice, NamedToolChoice)) and not names:
        raise RequestError(
            "tool_choice requires a non-empty 'tools' list", param="tool_choice", code="invalid_value"
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            f"tool_choice names {choice.function.name!r}, which is not in 'tools'",
            param="tool_choice",
            code="invalid_value",
        )
