"""Property: for any conversation the gateway itself produced, every call's prompt is exactly the previous
call's prompt + its sampled ids + the rendered new messages. Randomised over message kinds, lengths,
sampling settings and forced tool calls, with the real embedded model."""

from __future__ import annotations

import random

import pytest

from artrl import Trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]
WORDS = [
    "apple",
    "pear",
    "stock",
    "look",
    "move",
    "north",
    "higher",
    "lower",
    "guess",
    "number",
    "secret",
    "café",
    "東京",
    "✓",
]


def render_new(messages: list[dict]) -> str:
    """The chat template's text for messages after an assistant turn, plus the generation prompt."""
    out = ""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            out += f"<|im_start|>user\n{m['content']}<|im_end|>\n"
        else:  # tool results are grouped into one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                out += "<|im_start|>user"
            out += f"\n<tool_response>\n{m['content']}\n</tool_response>"
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out += "<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@pytest.mark.parametrize("seed", range(6))
async def test_randomised_conversations_continue_token_exactly(served, tokenizer, seed):
    rng = random.Random(seed)
    client = served.openai_client()
    use_tools = rng.random() < 0.5
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))}],
        tools=TOOLS if use_tools else None,
    )
    previous = None
    for _turn in range(rng.randint(2, 5)):
        kwargs = {
            "model": "tiny",
            "messages": traj.messages(),
            "max_tokens": rng.randint(1, 24),
            "temperature": rng.choice([0.0, 0.7, 1.0, 1.5]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": rng.randint(0, 10_000),
        }
        if use_tools:
            kwargs["tools"] = TOOLS
            kwargs["tool_choice"] = rng.choice(
                ["auto", "required", {"type": "function", "function": {"name": "lookup"}}]
            )
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        if previous is not None:
            prev_choice, new_messages = previous
            ended = prev_choice.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
            closing = ("" if ended else "<|im_end|>") + "\n"
            forced = tokenizer.decode(choice.prompt_token_ids).rsplit("<|im_start|>assistant\n", 1)[1]
            expected = (
                prev_choice.prompt_token_ids
                + prev_choice.token_ids
                + tokenizer(closing + render_new(new_messages) + forced, add_special_tokens=False)[
                    "input_ids"
                ]
            )
            assert choice.prompt_source == "continuation"
            assert choice.prompt_token_ids == expected
        traj.messages_and_choices.append(choice)
        if choice.message.tool_calls:
            new = [
                {"role": "tool", "tool_call_id": c.id, "content": rng.choice(WORDS)}
                for c in choice.message.tool_calls
            ]
        else:
            new = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))}]
        traj.messages_and_choices.extend(new)
        previous = (choice, new)
