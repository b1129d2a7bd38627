"""The output parser of every chat format: tool calls, reasoning and content, streamed in any chunking.

Driven by the families' response templates (trl's), on text as each family's template writes it."""

from __future__ import annotations

import json

import pytest

from artrl.local.chat_format.families import response_template
from artrl.local.chat_format.output import OutputParser, raw_call_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"k": {"type": "integer"}, "s": {"type": "string"}},
            },
        },
    },
    {"type": "function", "function": {"name": "move", "parameters": {"type": "object", "properties": {}}}},
]
NAMES = {"lookup", "move"}
CHATML = "<|im_start|>assistant\n"


def parse(family: str, text: str, prompt: str = "", step: int = 0, names: set[str] = NAMES):
    template = response_template(family)
    parser = OutputParser(template, raw_call_template(template), prompt, TOOLS, names)
    chunks = [text[i : i + step] for i in range(0, len(text), step)] if step else [text]
    pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    streamed = "".join(p.text for p in pieces if p.kind == "content")
    assert streamed == parser.content  # streaming = the fold
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == parser.reasoning
    return parser.reasoning, parser.content, [(c.name, json.loads(c.arguments)) for c in parser.calls]


# (family, prompt, generated text, reasoning, content, calls)
CASES = [
    (
        "hermes",
        CHATML,
        'Sure.\n<tool_call>\n{"name": "lookup", "arguments": {"k": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "move", "arguments": {}}\n</tool_call><|im_end|>',
        "",
        "Sure.",
        [("lookup", {"k": 1}), ("move", {})],
    ),
    (
        "qwen3",
        CHATML,
        '<think>\nI should look.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"k": 2}}\n</tool_call>',
        "I should look.",
        "",
        [("lookup", {"k": 2})],
    ),
    ("qwen3", CHATML + "<think>\n\n</think>\n\n", "Hello there.<|im_end|>", "", "Hello there.", []),
    (
        "qwen3_5",
        CHATML + "<think>\n",
        "Look it up.\n</think>\n\n<tool_call>\n<function=lookup>\n<parameter=k>\n7\n</parameter>\n"
        "<parameter=s>\n12\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "Look it up.",
        "",
        [("lookup", {"k": 7, "s": "12"})],  # typed by the tool's schema: s stays a string
    ),
    (
        "llama3_json",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        '{"name": "lookup", "parameters": {"k": 3}}<|eot_id|>',
        "",
        "",
        [("lookup", {"k": 3})],
    ),
    (
        "llama3_json",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "The answer is {not a call}.<|eot_id|>",
        "",
        "The answer is {not a call}.",
        [],
    ),
    (
        "gpt_oss",
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Need k.<|end|><|start|>assistant to=functions.lookup<|channel|>"
        'commentary json<|message|>{"k": 4}<|call|>',
        "Need k.",
        "",
        [("lookup", {"k": 4})],
    ),
    (  # the header order gpt-oss models themselves write
        "gpt_oss",
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Need k.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.lookup <|constrain|>json<|message|>{"k": 5}<|call|>',
        "Need k.",
        "",
        [("lookup", {"k": 5})],
    ),
    (
        "gpt_oss",
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Six.<|return|>",
        "Easy.",
        "Six.",
        [],
    ),
    (
        "glm4_moe",
        "<|assistant|>",
        "\n<think>Look.</think>\n<tool_call>lookup\n<arg_key>k</arg_key>\n<arg_value>8</arg_value>\n</tool_call>",
        "Look.",
        "",
        [("lookup", {"k": 8})],
    ),
]


@pytest.mark.parametrize("step", [0, 1, 3, 7])
@pytest.mark.parametrize(("family", "prompt", "text", "reasoning", "content", "calls"), CASES)
def test_families_parse_in_any_chunking(family, prompt, text, reasoning, content, calls, step):
    assert parse(family, text, prompt, step) == (reasoning, content, calls)


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": {}}',  # unterminated: the output ended inside the call
    ],
)
def test_a_call_that_does_not_parse_stays_content_verbatim(block):
    for step in (0, 2):
        assert parse("hermes", block, CHATML, step) == ("", block, [])


def test_one_bad_call_does_not_spoil_the_others():
    text = '<tool_call>oops</tool_call><tool_call>{"name": "move", "arguments": {}}</tool_call>'
    _, content, calls = parse("hermes", text, CHATML)
    assert content == "<tool_call>oops</tool_call>"
    assert calls == [("move", {})]


def test_without_offered_tools_a_call_is_text():
    text = '<tool_call>\n{"name": "move", "arguments": {}}\n</tool_call>'
    assert parse("hermes", text, CHATML, names=set()) == ("", text, [])


def test_plain_format_passes_text_through():
    parser = OutputParser(None, None, "", None, set())
    assert [p.text for p in parser.feed("a <tool_call> b")] == ["a <tool_call> b"]
    assert parser.finish() == [] and parser.content == "a <tool_call> b"


def test_streamed_decoding_is_linear_and_exact(tokenizer):
    """Each token's text comes from a short window (before: the whole sequence was decoded at every token,
    quadratic in its length); the text is exactly the whole decode, multi-byte characters included."""
    from artrl.local.chat_format.decoding import IncrementalDecoder

    class Counting:  # the real tokenizer, counting the ids it decodes
        decoded = 0

        def decode(self, ids, **kwargs):
            Counting.decoded += len(ids)
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer("café 東京 ✓ apples and pears " * 100, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(Counting())
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert Counting.decoded < 10 * len(ids)  # a full re-decode per token would be ~len(ids)**2 / 2
