"""The shop assistant's one tool, `lookup` (an item's stock), as the gateway tests and the capture tests
offer it: the golden transcripts (tests/local/gateway/test_continuation_golden.py) render exactly this."""

from __future__ import annotations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "stock of an item",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]
