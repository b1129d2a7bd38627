"""A forced tool call's opening (`ChatFormat.tool_call_prefix`) from one render of the conversation instead of two,
once a first request has shown for its template, tools and call that the second render adds nothing: the same
opening as two renders for every family's real template (trl's), and two renders where they would differ."""

from __future__ import annotations

import copy

import pytest
import trl.chat_template_utils as trl_templates

from artrl.local.chat_format import ChatFormat
from artrl.local.chat_format.families import FAMILIES

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one step.",
            "parameters": {"type": "object", "properties": {"direction": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "look", "description": "Look around.", "parameters": {}}},
]
CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "move", "arguments": '{"direction": "north"}'},
}
HISTORIES = [
    [{"role": "system", "content": "You walk mazes."}, {"role": "user", "content": "Find the exit."}],
    [
        {"role": "user", "content": "Find the exit."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"breeze": "east"}'},
    ],
    [
        {"role": "user", "content": "Find the exit."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"breeze": "east"}'},
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "call_1"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"breeze": "north"}'},
    ],
]
TEMPLATES = sorted({t for f in FAMILIES if f.response_template for t in f.trl_chat_templates})


def with_template(tokenizer, template: str) -> ChatFormat:
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return ChatFormat.for_tokenizer(changed)


def counting(fmt: ChatFormat) -> list[int]:
    """Count fmt's renders (an instance attribute over the method)."""
    renders = [0]
    render = fmt.render

    def counted(*args, **kwargs):
        renders[0] += 1
        return render(*args, **kwargs)

    fmt.render = counted  # type: ignore[method-assign]
    return renders


@pytest.mark.parametrize("template", TEMPLATES)
def test_one_render_gives_the_opening_two_renders_give(tokenizer, template):
    fmt = with_template(tokenizer, getattr(trl_templates, template))
    reference = with_template(tokenizer, getattr(trl_templates, template))
    renders = counting(fmt)
    for name in (None, "move", "look"):  # any tool, a function with arguments, one without
        for messages in HISTORIES:
            prompt = fmt.render(messages, TOOLS, True)
            reference._one_probe.clear()  # (a format that has seen nothing: two probe renders, as before)
            expected = reference.tool_call_prefix(messages, TOOLS, None, name, prompt)
            before = renders[0]
            assert fmt.tool_call_prefix(messages, TOOLS, None, name, prompt) == expected
            first = messages is HISTORIES[0] and name != "look"
            assert renders[0] - before == (2 if first else 1), (name, messages)
            assert expected is None or name is None or name in expected


def test_a_template_that_writes_the_key_in_another_form_first_keeps_two_renders(tokenizer):
    """The key's first letter before the arguments: the two probes part there, before the word itself; the
    format must not cut at the word."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{% for k in c.function.arguments %}{{ k[0] }}{% endfor %}"
        ':{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
        "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = with_template(tokenizer, template)
    renders = counting(fmt)
    messages = HISTORIES[0]
    for _ in range(3):
        prompt = fmt.render(messages, TOOLS, True)
        before = renders[0]
        opening = fmt.tool_call_prefix(messages, TOOLS, None, "move", prompt)
        assert renders[0] - before == 2
        assert opening is None  # (the common part ends before the function's arguments, without the name)
