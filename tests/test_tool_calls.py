from __future__ import annotations

import json

from artrl.local.gateway.tool_calls import parse_tool_calls

NAMES = {"lookup", "move"}


def test_parses_blocks_and_keeps_surrounding_text():
    text = 'Sure.\n<tool_call>\n{"name": "lookup", "arguments": {"k": 1}}\n</tool_call>\n<tool_call>{"name": "move", "arguments": "{\\"d\\": 2}"}</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("lookup", {"k": 1}), ("move", {"d": 2})]
    assert len({c.id for c in calls}) == 2


def test_invalid_blocks_stay_content():
    for text in [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": {}}',  # unterminated
        '{"name": "lookup", "arguments": {}}',
    ]:
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_mixed_valid_and_invalid():
    text = '<tool_call>oops</tool_call><tool_call>{"name": "lookup"}</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "<tool_call>oops</tool_call>"
    assert [(c.name, c.arguments) for c in calls] == [("lookup", "{}")]


def test_empty_content_is_none():
    assert parse_tool_calls('  <tool_call>{"name": "move", "arguments": {}}</tool_call> ', NAMES)[0] is None
