"""Fuzzing the gateway: requests generated from its own request schema (the JSON schema of `ChatRequest`),
arbitrary JSON and arbitrary bytes. Whatever arrives, the answer is a 2xx or a 4xx with an OpenAI-style error body, never a
5xx, and the server keeps answering."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artrl.local.gateway.protocol import ChatRequest

pytestmark = pytest.mark.slow
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELD = st.sampled_from(sorted(ChatRequest.model_fields))
figures: dict[str, int] = {}


def from_schema(schema: dict, defs: dict | None = None) -> st.SearchStrategy:
    """Values of a JSON schema (the subset pydantic writes): objects, arrays, anyOf, $ref, enums and bounds;
    sometimes a value of another type, so that the gateway's checks are exercised as well as its happy path."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].split("/")[-1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        optional = {k: from_schema(v, defs) for k, v in properties.items() if k not in required}
        fixed = st.fixed_dictionaries(
            {k: from_schema(properties[k], defs) for k in required}, optional=optional
        )
        return fixed if properties else st.dictionaries(st.text(max_size=6), JSON, max_size=3)
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0), max_size=4
        )
    if kind == "string":
        return st.text(max_size=30)
    if kind == "integer":
        return st.integers(
            schema.get("minimum", schema.get("exclusiveMinimum", -(2**40))), schema.get("maximum", 2**40)
        )
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


@pytest.fixture(scope="module")
def gateway(tokenizer):
    from fakes import InstantEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    service = LocalService.serve("fuzz", None, tokenizer, InstantEngine(), EngineConfig(), GatewayConfig())
    with httpx.Client(base_url=service.base_url, timeout=30) as client:
        yield client
    service.server.stop()


def post(client: httpx.Client, content: bytes, kind: str) -> None:
    response = client.post("/chat/completions", content=content, headers={"content-type": "application/json"})
    figures[kind] = figures.get(kind, 0) + 1
    figures[f"{kind} {response.status_code // 100}xx"] = (
        figures.get(f"{kind} {response.status_code // 100}xx", 0) + 1
    )
    assert response.status_code < 500, (response.status_code, response.text[:500], content[:500])
    if response.status_code >= 400:
        assert set(response.json()["error"]) >= {"message", "type", "code"}


CALL = st.fixed_dictionaries(
    {"id": st.sampled_from(["c1", "c2"]), "type": st.just("function")},
    optional={"function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "arguments": JSON})},
)
MESSAGES = st.lists(  # messages that get past the first checks, so that rendering and parsing are fuzzed too
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
        optional={
            "content": st.text(max_size=40) | st.none(),
            "tool_calls": st.lists(CALL, max_size=2),
            "tool_call_id": st.sampled_from(["c1", "c2"]),
            "reasoning_content": st.text(max_size=10),
        },
    ),
    min_size=1,
    max_size=5,
)


def test_requests_from_the_schema(gateway):
    schema = ChatRequest.model_json_schema()

    @SETTINGS
    @given(from_schema(schema), MESSAGES)
    def check(body, messages):
        post(gateway, json.dumps({**body, "model": "fuzz", "messages": messages}).encode(), "schema")

    check()


def test_schema_requests_with_one_field_replaced_by_anything(gateway):
    base = {"model": "fuzz", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    @SETTINGS
    @given(FIELD, JSON)
    def check(field, value):
        post(gateway, json.dumps({**base, field: value}).encode(), "one field")

    check()


def test_arbitrary_json_and_bytes(gateway):
    @SETTINGS
    @given(JSON | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
    def check(value):
        post(
            gateway, json.dumps(value).encode() if not isinstance(value, str) else value.encode(), "malformed"
        )

    check()
    assert gateway.get(str(gateway.base_url).removesuffix("/v1/") + "/health").status_code == 200
    print(f"\nFUZZ FIGURES: {json.dumps(figures, sort_keys=True)}")


def nested(depth: int, leaf: object) -> object:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


def test_sizes_and_depths(gateway):
    """Size and depth strategies (issue 43): many messages, long texts (up to ~1 MB a body), many tools,
    tool arguments nested up to 120 deep (the limit is 64), anywhere in a request: a 2xx or a 4xx, never 5xx."""
    tool = st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                    "parameters": st.just({"type": "object"}),
                }
            ),
        }
    )
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=200)}
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.lists(message, min_size=1, max_size=200),
        st.integers(0, 4000),
        st.lists(tool, max_size=40),
        st.integers(0, 120),
    )
    def check(messages, repeat, tools, depth):
        messages = [*messages, {"role": "user", "content": "x" * (repeat * 250)}]
        if depth:  # (deep JSON where a tool's schema is: the template renders it)
            deep = {"type": "object", "properties": {"x": nested(depth, "leaf")}}
            tools = [*tools, {"type": "function", "function": {"name": "deep", "parameters": deep}}]
        body = {"model": "fuzz", "messages": messages, "max_tokens": 2, **({"tools": tools} if tools else {})}
        post(gateway, json.dumps(body).encode(), "sizes and depths")

    check()
    print(f"\nFUZZ FIGURES (sizes, depths): {json.dumps(figures, sort_keys=True)}")
