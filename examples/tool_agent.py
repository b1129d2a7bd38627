"""A multi-turn, tool-using agent rolling out against a model that artrl serves, printing what was recorded.

The agent is ordinary OpenAI chat-completions code. artrl serves the model (here: a tiny, randomly
initialised Qwen3-architecture model built offline; pass --base-model for any Hugging Face chat model) and
records, for every sampled turn, the exact prompt and sampled token ids that training will use.

    python examples/tool_agent.py [--base-model DIR_OR_HUB_ID] [--rollouts 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time

import artrl

INVENTORY = {"apple": 42, "pear": 7, "fig": 13, "plum": 0, "kiwi": 99}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "How many of an item are in stock.",
            "parameters": {
                "type": "object",
                "properties": {"item": {"type": "string"}},
                "required": ["item"],
            },
        },
    }
]
SYSTEM = "You manage a shop's stock. Use the lookup tool, then answer with the number."


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if name != "lookup" or not isinstance(args.get("item"), str):
        return "error: call lookup with an 'item' string"
    count = INVENTORY.get(args["item"])
    return f"{args['item']}: {count}" if count is not None else f"unknown item {args['item']!r}"


def answered(content: str | None, item: str) -> bool:
    return re.search(rf"(?<!\d){INVENTORY[item]}(?!\d)", content or "") is not None


async def rollout(model: artrl.TrainableModel, item: str, seed: int, max_turns: int = 4) -> artrl.Trajectory:
    client = model.openai_client()
    traj = artrl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"How many {item}s are in stock?"},
        ],
        tools=TOOLS,
        metadata={"item": item},
    )
    for turn in range(max_turns):
        response = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=40,
            temperature=1.0,
            seed=seed * 100 + turn,
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            if answered(choice.message.content, item) or turn == max_turns - 1:
                break
            traj.messages_and_choices.append({"role": "user", "content": "Please call lookup, then answer."})
            continue
        for call in choice.message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = traj.messages()[-1].get("content") or ""
    traj.reward = 1.0 if answered(final, item) else 0.0
    traj.metrics["turns"] = len(traj.choices())
    return traj


def show(traj: artrl.Trajectory, tokenizer_decode) -> None:
    print(f"reward={traj.reward} metadata={traj.metadata} metrics={traj.metrics}")
    for item in traj.messages_and_choices:
        if isinstance(item, dict):
            print(f"  [{item['role']}] {str(item.get('content'))[:100]!r}")
            continue
        calls = [f"{c.function.name}({c.function.arguments})" for c in item.message.tool_calls or []]
        print(
            f"  [assistant: sampled] finish={item.finish_reason} prompt={item.prompt_source}"
            f" prompt_ids={len(item.prompt_token_ids)} sampled_ids={len(item.token_ids)}"
            f" sum_logprob={sum(item.token_logprobs):.2f}"
        )
        print(f"      content={item.message.content!r:.120} tool_calls={calls}")
    last = traj.choices()[-1]
    print("  token view of the last call (prompt tail | [sampled tokens, trained]):")
    tail = tokenizer_decode(last.prompt_token_ids[-12:])
    sampled = "".join(f"[{tokenizer_decode([t])}]" for t in last.token_ids[:24])
    print(f"      ...{tail!r} | {sampled}")


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-model", default=None, help="HF folder or hub id (default: build the tiny model)"
    )
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default=".artrl")
    args = parser.parse_args()

    base_model = args.base_model or str(artrl.ensure_tiny_model(f"{args.path}/models/tiny"))
    started = time.perf_counter()
    async with artrl.LocalBackend(path=args.path) as backend:
        model = artrl.TrainableModel(name="shop-agent", project="demo", base_model=base_model)
        await model.register(backend)
        print(f"serving {base_model} at {model.inference_base_url} (step {await model.get_step()})")
        rng = random.Random(args.seed)
        items = [rng.choice(sorted(INVENTORY)) for _ in range(args.rollouts)]
        group = artrl.TrajectoryGroup(
            await asyncio.gather(*(rollout(model, item, args.seed + i) for i, item in enumerate(items)))
        )
        from transformers import AutoTokenizer  # only for printing the token view

        decode = AutoTokenizer.from_pretrained(base_model).decode
        for i, traj in enumerate(group):
            print(f"\n=== rollout {i} ===")
            show(traj, decode)
        calls = sum(len(t.choices()) for t in group)
        continued = sum(c.prompt_source == "continuation" for t in group for c in t.choices())
        print(
            f"\n{len(group)} rollouts, {calls} model calls ({continued} token-exact continuations), "
            f"mean reward {sum(t.reward for t in group) / len(group):.2f}, {time.perf_counter() - started:.1f} s"
        )
        print("(the tiny model is randomly initialised: it has not learned the task; training comes next)")


if __name__ == "__main__":
    asyncio.run(main())
