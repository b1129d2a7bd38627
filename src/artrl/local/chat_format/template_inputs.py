"""What a chat template takes: the variables a caller may set (`template_variables`, less the ones the
gateway passes itself) and messages in the shape templates expect (`template_messages`)."""

from __future__ import annotations

import json
import re
from typing import Any

# Variables a request may not set through chat_template_kwargs: the gateway passes them itself.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


def _generation_tags_removed(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


_TEMPLATE_GLOBALS = frozenset({"raise_exception", "strftime_now", "namespace", "dict", "range", "loop"})


def template_variables(chat_template: str) -> frozenset[str]:
    """The variables a caller can set for a chat template (what **kwargs / chat_template_kwargs reach): those
    it reads without defining them, less the names it only assigns itself (`set`, loop and macro names) unless
    it asks whether they are defined (`{% if not date_string is defined %}{% set date_string = ... %}`) or
    defaults them (`{% set x = x | default(false) %}`)."""
    import jinja2
    import jinja2.ext
    import jinja2.meta

    text = _generation_tags_removed(chat_template)
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    found = jinja2.meta.find_undeclared_variables(env.parse(text))
    assigned = set(re.findall(r"\{%-?\s*(?:set|macro)\s+(\w+)", text))
    assigned |= {
        n
        for group in re.findall(r"\{%-?\s*for\s+([\w\s,]+?)\s+in\b", text)
        for n in re.split(r"[\s,]+", group)
    }
    tested = set(re.findall(r"(\w+)\s+is\s+(?:not\s+)?defined", text))
    # `{% set enable_thinking = enable_thinking | default(false) %}` (Gemma 4): the caller's value, defaulted
    defaulted = set(re.findall(r"\{%-?\s*set\s+(\w+)\s*=\s*\1\s*\|\s*default\b", text))
    return frozenset(
        n
        for n in found | defaulted
        if (n not in assigned or n in tested | defaulted) and n not in _TEMPLATE_GLOBALS
    )


def _json_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as objects (templates `tojson` or iterate
    them), an empty string for an absent assistant content, and each tool result named after its call."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            if m.get("content") is None:
                m["content"] = ""
            if m.get("tool_calls"):
                calls = []
                for call in m["tool_calls"]:
                    fn = call["function"]
                    names[call.get("id", "")] = fn["name"]
                    calls.append({**call, "function": {**fn, "arguments": _json_object(fn.get("arguments"))}})
                m["tool_calls"] = calls
        elif m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out
