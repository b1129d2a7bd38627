"""Model families: how each one's chat template writes tool calls and reasoning, and how to recognise it.

A family is data, not code. Its output is parsed with a *response template* from the `trl` package
(`trl.chat_template_utils.*_template`, read by transformers' streaming `ResponseParser`), and it is recognised
by its chat template: exactly (one of the real templates `trl` ships) or, for edited and re-uploaded
templates, by the markers the template writes. artrl adds only what those sources lack: the family's
stop tokens, the message key its template reads reasoning from, and (gpt-oss) the header order real models
emit. See `docs/model-families.md`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from artrl.local.chat_format.trl_data import trl_values


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    response_template: str  # name of a response template in trl.chat_template_utils
    trl_chat_templates: tuple[str, ...] = ()  # trl.chat_template_utils names of real templates of this family
    markers: tuple[str, ...] = ()  # all of these in a chat template = this family (checked in FAMILIES order)
    stop_tokens: tuple[str, ...] = ()  # tokens that end an assistant turn (with the tokenizer's eos)
    template_patch: dict[str, Any] = field(default_factory=dict)  # artrl's additions to the response template


_GPT_OSS_CALL = (
    # the header order the template renders (to=functions.NAME<|channel|>commentary json) and the one gpt-oss
    # models also write (<|channel|>commentary to=functions.NAME <|constrain|>json)
    r"(?|to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary\s+(?:<\|constrain\|>)?json"
    r"|<\|channel\|>commentary\s+to=functions\.(?P<name>[^\s<]+)\s*(?:<\|constrain\|>)?json)<\|message\|>"
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "gpt_oss",
        "gpt-oss (harmony: analysis channel = reasoning, `to=functions.NAME` calls ending in <|call|>)",
        "gptoss_template",
        ("gptoss_chat_template",),
        markers=("<|channel|>", "<|message|>", "to=functions."),
        stop_tokens=("<|return|>", "<|call|>"),
        template_patch={
            "fields": {
                "tool_calls": {"open_pattern": _GPT_OSS_CALL},
                # a final message ends generation with <|return|>; <|end|> also ends a message (harmony)
                "content": {"close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*"},
            }
        },
    ),
    Family(
        "gemma4",
        "Gemma 4 (<|tool_call>call:NAME{key:value}<tool_call|>, <|channel>thought reasoning, tool results inside "
        "the model turn)",
        "gemma4_template",
        (
            "gemma4_chat_template",
            "gemma4_v2_chat_template",
            "gemma4_v3_chat_template",
            "gemma4_v4_chat_template",
            "gemma4_v5_chat_template",
        ),
        markers=("<|turn>", "<|tool_call>", "<tool_call|>"),
        stop_tokens=("<turn|>", "<|tool_response>", "<eos>"),
    ),
    Family(
        "glm4_moe",
        "GLM-4.5/4.6 (<tool_call>NAME <arg_key>/<arg_value> pairs, <think> reasoning, turns end at the next role)",
        "glm4moe_template",
        ("glm4moe_chat_template",),
        markers=("<arg_key>", "<arg_value>", "<|assistant|>"),
        stop_tokens=("<|user|>", "<|observation|>", "<|endoftext|>"),
    ),
    Family(
        "qwen3_5",
        "Qwen3.5/3.6 (<tool_call><function=NAME><parameter=KEY> XML arguments, <think> reasoning)",
        "qwen3_5_template",
        (
            "qwen3_5_think_chat_template",
            "qwen3_5_nothink_chat_template",
            "qwen3_6_chat_template",
            "qwen3_8_chat_template",
        ),
        markers=("<tool_call>", "<function=", "<parameter="),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    Family(
        "llama3_json",
        'Llama 3.1/3.2 (one bare JSON call {"name": ..., "parameters": {...}} per turn, <|eot_id|>)',
        "llama3_template",
        ("llama3_1_chat_template", "llama3_2_chat_template"),
        markers=("<|start_header_id|>", '"parameters"'),
        stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    ),
    Family(
        "qwen3",
        "Qwen3 (Hermes <tool_call> JSON, <think> reasoning, enable_thinking)",
        "qwen3_template",
        ("qwen3_chat_template", "qwen3_instruct_2507_chat_template"),
        markers=("<tool_call>", "<think>", "<|im_start|>"),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    Family(
        "hermes",
        "Hermes-style <tool_call> JSON on ChatML (Qwen2.5, artrl's own tiny models)",
        "qwen3_template",
        ("qwen2_5_chat_template",),
        markers=("<tool_call>",),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
)

PLAIN = Family(
    "plain",
    "no known tool-call format: the whole output is content (tools are rendered, calls are not parsed)",
    "",
)

BY_NAME: dict[str, Family] = {f.name: f for f in (*FAMILIES, PLAIN)}


def family_named(name: str) -> Family:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown chat format {name!r}; choose one of {sorted(BY_NAME)}") from None


# every trl.chat_template_utils value the families name, asked for together (one cache file holds them: trl_data.py)
TRL_NAMES = tuple(sorted({n for f in FAMILIES for n in (*f.trl_chat_templates, f.response_template) if n}))


def _trl_values() -> dict[str, Any]:
    return trl_values(TRL_NAMES)


@cache
def _trl_chat_templates() -> dict[str, str]:
    """{text of a real chat template: family name}, from the templates the trl package ships."""
    values = _trl_values()
    return {values[t]: f.name for f in FAMILIES for t in f.trl_chat_templates}


def detect_family(chat_template: str | dict | None) -> tuple[Family, str]:
    """The family of a chat template, and how it was recognised ('exact' trl template, 'markers', 'none')."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default") or next(iter(chat_template.values()), None)
    if not chat_template:
        return PLAIN, "none"
    exact = _trl_chat_templates().get(chat_template)
    if exact is not None:
        return BY_NAME[exact], "exact"
    for family in FAMILIES:
        if all(marker in chat_template for marker in family.markers):
            return family, "markers"
    return PLAIN, "none"


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@cache
def response_template(family_name: str) -> dict[str, Any] | None:
    """The family's response template (trl's, with artrl's patch), or None for the plain format."""
    family = BY_NAME[family_name]
    if not family.response_template:
        return None
    return _merge(_trl_values()[family.response_template], family.template_patch)
