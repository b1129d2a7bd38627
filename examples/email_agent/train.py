"""An email-search agent trained with RL, in the manner of ART's ART·E: it answers questions about an inbox
with two tools (`search_inbox`, `read_email`) and ends with `final_answer(answer, source_id)`.

Reward: correctness (exact: the expected value appears in the answer; or `--judge ruler`: RULER ranks the
group's answers, with the expected answer shown to the judge) + 0.1 for citing the message that holds the
answer − 0.02 per model call. The agent is plain OpenAI-SDK code against the served model.

    python examples/email_agent/train.py                      # smoke: artrl's tiny model, a few steps
    python examples/email_agent/train.py --base-model Qwen/Qwen2.5-7B-Instruct --steps 100 --split hard
    python examples/email_agent/train.py --baseline-only --baseline-url http://host/v1 --baseline-model gpt-x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from inbox import Inbox, Question, build

import artrl

SYSTEM = (
    "You answer questions about the user's email inbox. Use search_inbox to find messages and read_email to "
    "read one; when you know the answer, call final_answer with it and the id of the message it is from."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_inbox",
            "description": "Search the inbox by keywords.",
            "parameters": {
                "type": "object",
                "required": ["keywords"],
                "properties": {
                    "keywords": {"type": "string"},
                    "sender": {"type": "string"},
                    "to": {"type": "string"},
                    "after": {"type": "string", "description": "YYYY-MM-DD"},
                    "before": {"type": "string"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_email",
            "description": "Read one message by its id.",
            "parameters": {
                "type": "object",
                "required": ["message_id"],
                "properties": {"message_id": {"type": "string"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "final_answer",
            "description": "Give the answer and its source.",
            "parameters": {
                "type": "object",
                "required": ["answer", "source_id"],
                "properties": {"answer": {"type": "string"}, "source_id": {"type": "string"}},
            },
        },
    },
]


def run_tool(inbox: Inbox, name: str, arguments: str) -> tuple[str, dict | None]:
    """The tool's result text, and the final answer's arguments when it is `final_answer`."""
    try:
        args = json.loads(arguments)
        if not isinstance(args, dict):
            raise ValueError("arguments must be an object")
        if name == "search_inbox":
            fields = {k: args.get(k) for k in ("sender", "to", "after", "before")}
            return json.dumps(inbox.search_inbox(str(args["keywords"]), **fields)), None
        if name == "read_email":
            return json.dumps(inbox.read_email(str(args["message_id"])) or "no such message"), None
        if name == "final_answer":
            return "ok", {"answer": str(args.get("answer", "")), "source_id": str(args.get("source_id", ""))}
        return f"error: unknown tool {name!r}", None
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}", None


def score(question: Question, final: dict | None, calls: int) -> tuple[float, dict[str, float]]:
    """Exact reward: correct + 0.1 for the right source − 0.02 per model call."""
    correct = float(final is not None and question.answer.lower() in final["answer"].lower())
    cited = float(final is not None and final["source_id"] == question.source_id)
    reward = correct + 0.1 * cited - 0.02 * calls
    return reward, {
        "correct": correct,
        "cited": cited,
        "calls": float(calls),
        "answered": float(final is not None),
    }


async def rollout(model, inbox: Inbox, question: Question, seed: int, max_calls: int = 6) -> artrl.Trajectory:
    client = model.openai_client()
    traj = artrl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question.question},
        ],
        tools=TOOLS,
        metadata={"question": question.id},
    )
    final, calls = None, 0
    while final is None and calls < max_calls:
        reply = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=traj.messages(),
            tools=TOOLS,
            max_tokens=96,
            temperature=1.0,
            seed=seed * 100 + calls,
        )
        choice, calls = reply.choices[0], calls + 1
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            result, answer = run_tool(inbox, call.function.name, call.function.arguments)
            final = final or answer
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    traj.reward, traj.metrics = score(question, final, calls)
    return traj


def expert(inbox: Inbox, question: Question) -> tuple[float, dict[str, float]]:
    """A scripted policy (search the question's words, read the newest hit, answer with the value in it): how
    well the environment can be solved with these tools, for the baseline table."""
    words = [
        w for w in question.question.rstrip("?").split() if w[0].isupper() or any(c.isdigit() for c in w)
    ]
    hits = inbox.search_inbox(" ".join(words[1:] or words))
    if not hits:
        return score(question, None, 2)
    newest = max(hits, key=lambda h: h["date"])
    body = inbox.read_email(newest["id"])["body"]
    return score(question, {"answer": body, "source_id": newest["id"]}, 3)


async def evaluate(model, inbox: Inbox, questions: list[Question], name: str) -> dict[str, float]:
    groups = await artrl.gather_trajectory_groups(
        [
            artrl.TrajectoryGroup(rollout(model, inbox, q, seed=1_000 + i) for _ in range(1))
            for i, q in enumerate(questions)
        ],
        pbar_desc=f"val {name}",
        max_exceptions=0.1,
    )
    trajectories = [t for g in groups for t in g]
    return {
        k: sum(t.metrics[k] for t in trajectories) / len(trajectories) for k in ("correct", "cited", "calls")
    } | {"reward": sum(t.reward for t in trajectories) / len(trajectories)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base-model", default=None, help="a hub id or folder; default: artrl's tiny model (built here)"
    )
    p.add_argument("--out", default="email_agent_output")
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--split", choices=("easy", "hard", "all"), default="easy")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--groups", type=int, default=2, help="questions per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--val-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--judge", choices=("exact", "ruler"), default="exact")
    p.add_argument(
        "--judge-url", default=None, help="--judge ruler: an OpenAI-compatible endpoint (default: OpenAI)"
    )
    p.add_argument("--judge-model", default="o3")
    p.add_argument(
        "--baseline-only", action="store_true", help="evaluate (and a prompted model), no training"
    )
    p.add_argument("--baseline-url", default=None, help="a prompted model to compare: its endpoint")
    p.add_argument("--baseline-model", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


async def main() -> None:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = [
        q for q in build(out / "inbox.sqlite", args.messages, args.seed) if args.split in ("all", q.split)
    ]
    inbox = Inbox(out / "inbox.sqlite")
    rng = random.Random(args.seed)
    rng.shuffle(questions)
    val, train = questions[: args.val_size], questions[args.val_size :]
    base = args.base_model or str(artrl.ensure_tiny_model(out / "tiny-model"))
    table = {"scripted expert": _mean([expert(inbox, q) for q in val])}
    async with artrl.LocalBackend(path=out / "runs") as backend:
        model = artrl.TrainableModel(name="email-agent", project="email", base_model=base)
        await model.register(backend)
        if args.baseline_url:
            prompted = artrl.Model(
                name="baseline",
                project="email",
                inference_base_url=args.baseline_url,
                inference_model_name=args.baseline_model,
                inference_api_key="none",
            )
            table[f"prompted {args.baseline_model}"] = await evaluate(prompted, inbox, val, "baseline")
        table[f"{Path(base).name} (step {await model.get_step()})"] = await evaluate(
            model, inbox, val, "model"
        )
        if not args.baseline_only:
            for step in range(args.steps):
                batch = [train[(step * args.groups + i) % len(train)] for i in range(args.groups)]
                groups = await artrl.gather_trajectory_groups(
                    (
                        artrl.TrajectoryGroup(
                            rollout(model, inbox, q, seed=step * 1000 + j) for j in range(args.group_size)
                        )
                        for q in batch
                    ),
                    pbar_desc=f"step {step + 1}",
                    max_exceptions=0.1,
                    after_each=_judge(args, questions) if args.judge == "ruler" else None,
                )
                result = await model.train(groups, artrl.TrainConfig(learning_rate=args.learning_rate))
                print(f"step {result.step}: reward {result.metrics['reward_mean']:.3f}")
            table[f"{Path(base).name} (step {await model.get_step()})"] = await evaluate(
                model, inbox, val, "model"
            )
    print("\n| policy | correct | cited | calls | reward |\n|---|---|---|---|---|")
    for name, m in table.items():
        print(f"| {name} | {m['correct']:.2f} | {m['cited']:.2f} | {m['calls']:.1f} | {m['reward']:.3f} |")


def _mean(scored: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    out = {k: sum(m[k] for _, m in scored) / len(scored) for k in ("correct", "cited", "calls")}
    return out | {"reward": sum(r for r, _ in scored) / len(scored)}


def _judge(args: argparse.Namespace, questions: list[Question]):
    """RULER over each group, the expected answer given to the judge in the rubric; then the same citation
    bonus and per-call cost as the exact reward."""
    from artrl.rewards import DEFAULT_RUBRIC, ruler_score_group

    by_id = {q.id: q for q in questions}
    judge = artrl.Model(
        name="judge",
        project="email",
        inference_base_url=args.judge_url,
        inference_model_name=args.judge_model,
    )

    async def rescore(group: artrl.TrajectoryGroup) -> artrl.TrajectoryGroup | None:
        question = by_id[group.trajectories[0].metadata["question"]]
        rubric = f"{DEFAULT_RUBRIC}\nThe correct answer is {question.answer!r}, found in message {question.source_id}."
        judged = await ruler_score_group(group, judge, rubric=rubric, swallow_exceptions=True)
        for t in judged.trajectories if judged is not None else []:
            t.reward += 0.1 * t.metrics["cited"] - 0.02 * t.metrics["calls"]
        return judged

    return rescore


if __name__ == "__main__":
    asyncio.run(main())
