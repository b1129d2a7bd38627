"""Golden test of token-exact multi-turn continuation: a 3-turn tool-calling conversation through the real
gateway and the real openai SDK, with the model's choices scripted (fakes.ScriptedEngine)."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from fakes import encode
from shop_tools import TOOLS

from artrl import Trajectory
from artrl.local.train.rows import trajectory_rows

SYSTEM = "You are a shop assistant."
TOOLS_TEXT = json.dumps(TOOLS[0])
HEADER = (
    "<|im_start|>system\nYou are a shop assistant.\n\n# Tools\nCall a tool as <tool_call>\n"
    '{"name": <name>, "arguments": <object>}\n</tool_call>\n<tools>\n' + TOOLS_TEXT + "\n</tools><|im_end|>\n"
)
CALL_APPLE = '<tool_call>\n{"name": "lookup", "arguments": {"key": "apple"}}\n</tool_call><|im_end|>'
CALL_PEAR = '<tool_call>\n{"name": "lookup", "arguments": {"key": "pear"}}\n</tool_call><|im_end|>'
ANSWER = "There are 42 apples and 7 pears.<|im_end|>"


def tool_result(choice, content: str) -> dict:
    return {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": content}


async def test_three_turn_tool_conversation_is_token_exact(scripted, tokenizer):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, CALL_APPLE), encode(tokenizer, CALL_PEAR), encode(tokenizer, ANSWER)]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    traj = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How many apples and pears?"},
        ],
        tools=TOOLS,
    )

    async def call():
        response = await client.chat.completions.create(
            model="scripted", messages=traj.messages(), tools=TOOLS, max_tokens=64
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        return choice

    first = await call()
    prompt1 = encode(
        tokenizer, HEADER + "<|im_start|>user\nHow many apples and pears?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert first.prompt_token_ids == prompt1 == engine.prompts[0]
    assert first.prompt_source == "rendered"
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    assert first.message.tool_calls[0].function.name == "lookup"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"key": "apple"}
    assert first.token_ids == encode(tokenizer, CALL_APPLE)
    assert len(first.token_logprobs) == len(first.token_ids)

    traj.messages_and_choices.append(tool_result(first, "42"))
    second = await call()
    suffix = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert second.prompt_source == "continuation"
    assert second.prompt_token_ids == prompt1 + first.token_ids + encode(tokenizer, suffix)

    traj.messages_and_choices.append(tool_result(second, "7"))
    third = await call()
    suffix = "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert third.prompt_source == "continuation"
    assert third.prompt_token_ids == second.prompt_token_ids + second.token_ids + encode(tokenizer, suffix)
    assert third.finish_reason == "stop"
    assert third.message.content == "There are 42 apples and 7 pears."
    assert third.message.tool_calls is None

    # the re-rendered history differs from what the model saw only where tokenization of sampled text differs;
    # each call's prompt begins with the previous call's prompt + sampled ids
    choices = traj.choices()
    for before, after in itertools.pairwise(choices):
        assert after.prompt_token_ids[: len(before.prompt_token_ids) + len(before.token_ids)] == (
            before.prompt_token_ids + before.token_ids
        )
    # training sees one row: exactly the last prompt + its sampled ids, trained exactly on the sampled spans
    (row,) = trajectory_rows(traj, 0, tokenizer, allow_rendered=False)
    assert row.ids == third.prompt_token_ids + third.token_ids
    sampled_spans = [encode(tokenizer, CALL_APPLE), encode(tokenizer, CALL_PEAR), encode(tokenizer, ANSWER)]
    expected_mask = [0] * len(prompt1)
    for i, span in enumerate(sampled_spans):
        expected_mask += [1] * len(span)
        if i < 2:
            expected_mask += [0] * (len(choices[i + 1].prompt_token_ids) - len(expected_mask))
    assert row.mask == expected_mask
    assert [t for t, m in zip(row.ids, row.mask, strict=True) if m] == [t for s in sampled_spans for t in s]
    # the trajectory keeps every id through JSON
    again = Trajectory.model_validate_json(traj.model_dump_json())
    assert [c.token_ids for c in again.choices()] == [c.token_ids for c in choices]
    assert [c.prompt_token_ids for c in again.choices()] == [c.prompt_token_ids for c in choices]


@pytest.mark.parametrize(
    ("content", "arguments", "source"),
    [
        # a real edit of the turn (other arguments): rendered afresh from the messages
        (None, '{"key": "kiwi"}', "rendered"),
        # clients re-serialise arguments (spacing, key order) and send "" for None: still the same turn
        ("", '{"key":"apple"}', "continuation"),
    ],
)
async def test_resent_turn_continues_only_if_unchanged(scripted, tokenizer, content, arguments, source):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, CALL_APPLE), encode(tokenizer, ANSWER)]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Apples?"}]
    response = await client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    call = response.choices[0].message.tool_calls[0]
    resent = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        ],
    }
    history = [*messages, resent, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    second = (await client.chat.completions.create(model="scripted", messages=history, tools=TOOLS)).choices[
        0
    ]
    assert second.prompt_source == source
    if source == "rendered":
        rendered = tokenizer.apply_chat_template(
            history, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert second.prompt_token_ids == encode(tokenizer, rendered)


async def test_truncated_turn_is_closed_before_continuing(scripted, tokenizer):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, "The answer is"), encode(tokenizer, "Yes.<|im_end|>")]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    messages = [{"role": "user", "content": "Q?"}]
    first = (
        await client.chat.completions.create(model="scripted", messages=messages, max_tokens=64)
    ).choices[0]
    assert first.finish_reason == "length"
    history = [
        *messages,
        {"role": "assistant", "content": first.message.content},
        {"role": "user", "content": "Go on"},
    ]
    second = (await client.chat.completions.create(model="scripted", messages=history)).choices[0]
    assert second.prompt_source == "continuation"
    closing = "<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n"
    assert second.prompt_token_ids == first.prompt_token_ids + first.token_ids + encode(tokenizer, closing)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_in_stream_and_not(scripted, tokenizer, stream):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, "Let me check.\n" + CALL_APPLE)]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    kwargs = {"model": "scripted", "messages": [{"role": "user", "content": "Apples?"}], "tools": TOOLS}
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        content, calls, finish, ids = (
            choice.message.content,
            choice.message.tool_calls,
            choice.finish_reason,
            choice.token_ids,
        )
        calls = [(c.id, c.function.name, c.function.arguments) for c in calls]
    else:
        content, calls, finish, ids = "", [], None, None
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                assert "<tool_call>" not in (c.delta.content or "")
                calls += [(t.id, t.function.name, t.function.arguments) for t in c.delta.tool_calls or []]
                if c.finish_reason:
                    finish, ids = c.finish_reason, c.token_ids
    assert content == "Let me check."
    assert [(name, json.loads(args)) for _, name, args in calls] == [("lookup", {"key": "apple"})]
    assert finish == "tool_calls"
    assert ids == encode(tokenizer, "Let me check.\n" + CALL_APPLE)


async def test_invalid_tool_call_stays_content(scripted, tokenizer):
    engine, base_url = scripted
    bad = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call><|im_end|>'
    engine.scripts = [encode(tokenizer, bad)]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    choice = (
        await client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
    ).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == bad.removesuffix("<|im_end|>")
    assert choice.finish_reason == "stop"


async def test_forced_tool_choice_is_prompt_not_sample(scripted, tokenizer):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, 'key": "fig"}}\n</tool_call><|im_end|>')]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", timeout=30)
    choice = (
        await client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "lookup"}},
        )
    ).choices[0]
    forced = '<tool_call>\n{"name": "lookup", "arguments": {"'  # read off the template, to the first argument
    assert tokenizer.decode(choice.prompt_token_ids).endswith("<|im_start|>assistant\n" + forced)
    assert choice.message.tool_calls[0].function.name == "lookup"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"key": "fig"}
    # the forced prefix ends on a token boundary of the rendered call: prompt + sample tokenize like the
    # rendering
    call = {"name": "lookup", "arguments": '{"key": "fig"}'}
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "a", "type": "function", "function": call}],
            },
        ],
        tools=TOOLS,
        tokenize=False,
    )
    assert choice.prompt_token_ids + choice.token_ids == encode(tokenizer, rendered.removesuffix("\n"))
