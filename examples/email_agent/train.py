"""The email agent (ART·E's task) trained with GRPO until it visibly gets better, on 2 CPU cores or a GPU.

    python examples/email_agent/train.py [--seed 0] [--summary FILE]   # the tiny model: ~3-4 min on 2 cores
    python examples/email_agent/train.py --base-model Qwen/Qwen2.5-7B-Instruct --engine vllm --val-size 100

The agent answers questions about an inbox with `search_inbox`, `read_email` and `final_answer` (plain
OpenAI-SDK code: `email_env.rollout`). Training questions come from one inbox, validation questions from
another built from disjoint people, facts and ids (`inbox.py`). On the project's tiny model:

1. a stand-in for pretraining (`copying.py`: multi-token copying in unrelated tool tasks; skipped with
   --base-model), cached under --path/models;
2. a weak warm start (cached): SFT on a scripted agent's transcripts over inboxes RL never sees, its
   search, the hit it reads and the value it answers each right with its probability in --warm-skill, so
   the model knows the tools and the format and succeeds only sometimes. The defaults' stand-in and warm
   start come with the example (models/, made by `--ship`; see stages.py): a run with them copies both
   rather than building them (~12 min on one core), as a hub model arrives pretrained; --no-shipped builds;
3. validation of the base model (prompted only) and of the warm start, then GRPO on a LoRA, validated every
   --eval-every steps and at the end, on questions from the inbox it never trains on.

It prints validation success at each point with the time of each phase, and `--summary FILE` writes them as
JSON. `--reward ruler` scores each group with RULER instead of the exact check (the golden answer kept out of
the judge's rubric unless --judge-sees-answer); without --judge-url the judge is the served model itself, a
smoke run of the wiring on this machine, not a judge worth training on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
import email_env as env
import inbox as inboxes
from sft_cache import add_shipping_args
from stages import SHIPPED, ship, stage_folders, stand_in, warm_start

import artrl

METRICS = ("correct", "cited", "found", "read", "answered", "broken", "calls")


async def evaluate(
    model: artrl.Model, inbox: inboxes.Inbox, questions: list[inboxes.Question], temperature: float
) -> dict:
    """One rollout per question, at the rollouts' temperature, with fixed seeds (the same for every point)."""
    trajectories = await artrl.gather_trajectories(
        (
            env.rollout(model, inbox, q, seed=1_000_000 + i, temperature=temperature)
            for i, q in enumerate(questions)
        ),
        pbar=False,
        max_exceptions=0.1,
    )
    n = len(trajectories)
    out = {k: sum(t.metrics[k] for t in trajectories) / n for k in METRICS}
    by_kind = {
        kind: [t.metrics["correct"] for t in trajectories if t.metadata["kind"] == kind]
        for kind in ("easy", "hard")
    }
    return out | {
        "success": out["correct"],
        "reward": sum(t.reward for t in trajectories) / n,
        **{f"success_{k}": sum(v) / len(v) for k, v in by_kind.items() if v},
    }


def _ruler(args: argparse.Namespace, model: artrl.TrainableModel, questions: dict[str, inboxes.Question]):
    """RULER over each group: the judge ranks the group's episodes; the golden answer is kept out of its
    rubric (as in ART) unless --judge-sees-answer. Partial credit for the right search/read/citation stays."""
    from artrl.rewards import DEFAULT_RUBRIC, ruler_score_group

    judge: artrl.Model = model  # the smoke run: the served model judges itself
    if not args.judge_url:
        print(
            "--reward ruler without --judge-url: the served model judges its own groups — a smoke run of the "
            "wiring, not a judge to train with",
            flush=True,
        )
    else:
        judge = artrl.Model(
            name="judge",
            project="email",
            inference_base_url=args.judge_url,
            inference_model_name=args.judge_model,
        )

    async def rescore(group: artrl.TrajectoryGroup) -> artrl.TrajectoryGroup | None:
        question = questions[group.trajectories[0].metadata["question"]]
        rubric = DEFAULT_RUBRIC
        if args.judge_sees_answer:
            rubric += f"\nThe correct answer is {question.answer!r}, from message {question.source_id}."
        judged = await ruler_score_group(group, judge, rubric=rubric, swallow_exceptions=True)
        for t in judged.trajectories if judged is not None else []:
            t.reward += env.PARTIAL_CREDIT * (t.metrics["found"] + t.metrics["read"] + t.metrics["cited"])
        return judged

    return rescore


async def main(args: argparse.Namespace) -> dict:
    if args.ship:  # (before torch starts: one thread, the same build whatever the machine)
        os.environ["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    data = Path(args.path) / "email-data"
    train_path, val_path = (
        data / f"train-{args.train_messages}.sqlite",
        data / f"val-{args.val_messages}.sqlite",
    )
    train_questions = inboxes.build(train_path, "train", args.train_messages)
    val_questions = inboxes.build(val_path, "val", args.val_messages)[: args.val_size]
    if len(val_questions) < args.val_size:
        raise SystemExit(
            f"--val-size {args.val_size}: the validation inbox of {args.val_messages} messages holds "
            f"{len(val_questions)} questions (one per {inboxes.MESSAGES_PER_QUESTION} messages); raise "
            f"--val-messages to {args.val_size * inboxes.MESSAGES_PER_QUESTION}"
        )
    train_inbox, val_inbox = inboxes.Inbox(train_path), inboxes.Inbox(val_path)
    threads = args.generation_threads or (None if args.base_model else 1)
    async with artrl.LocalBackend(
        path=args.path, engine=artrl.EngineConfig(generation_threads=threads), in_process=args.in_process
    ) as backend:
        if args.ship:
            shipped = await ship(backend, args, Path(args.ship))
            print("shipped: " + ", ".join(shipped))
            return {"shipped": shipped}
        t = time.perf_counter()
        ready = SHIPPED if args.shipped else None
        base = args.base_model or await stand_in(backend, args, ready)
        seconds["stand_in"] = time.perf_counter() - t
        t = time.perf_counter()
        warm = await warm_start(backend, base, args, ready) if args.warm_examples else base
        seconds["warm_start"] = time.perf_counter() - t
        async with contextlib.AsyncExitStack() as stack:  # (--engine vllm: GRPO's rollouts on vLLM)
            rl_backend = backend
            if args.engine != "hf":
                rl_backend = await stack.enter_async_context(
                    artrl.LocalBackend(path=args.path, engine=args.engine, in_process=args.in_process)
                )
            return await _train(
                args,
                rl_backend,
                base,
                warm,
                train_questions,
                val_questions,
                train_inbox,
                val_inbox,
                seconds,
                started,
            )


async def _train(
    args, backend, base, warm, train_questions, val_questions, train_inbox, val_inbox, seconds, started
):
    table: dict[str, dict] = {}
    t = time.perf_counter()
    if args.baseline_url:
        prompted = artrl.Model(
            name=args.baseline_model,
            project="email",
            inference_base_url=args.baseline_url,
            inference_model_name=args.baseline_model,
            inference_api_key=os.environ.get("BASELINE_API_KEY", "none"),
        )
        table[f"prompted {args.baseline_model}"] = await evaluate(
            prompted, val_inbox, val_questions, args.temperature
        )
    if warm != base and args.score_base:
        base_model = artrl.TrainableModel(
            name=f"email-base-{int(time.time())}", project="email", base_model=base
        )
        await base_model.register(backend)
        table["base model, prompted"] = await evaluate(base_model, val_inbox, val_questions, args.temperature)
    seconds["baselines"] = time.perf_counter() - t

    lora = artrl.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    model = artrl.TrainableModel(
        name=f"email-seed{args.seed}-{int(time.time())}", project="email", base_model=warm, lora=lora
    )
    await model.register(backend)
    t = time.perf_counter()
    points = [(0, await evaluate(model, val_inbox, val_questions, args.temperature))]
    seconds["validation"] = time.perf_counter() - t
    start = "warm start" if warm != base else "the base model, prompted"
    print(f"validation at step 0 ({start}): success {points[0][1]['success']:.2f}", flush=True)
    table[f"{start} (step 0)"] = points[0][1]

    rng = random.Random(args.seed)
    order = [
        q
        for _ in range(1 + args.steps * args.groups_per_step // len(train_questions))
        for q in rng.sample(train_questions, len(train_questions))
    ]
    rescore = _ruler(args, model, {q.id: q for q in train_questions}) if args.reward == "ruler" else None
    config = artrl.TrainConfig(learning_rate=args.lr, steps_per_call=args.steps_per_call)
    history: list[dict] = []
    seconds["rollouts"] = seconds["training"] = 0.0
    for step in range(args.steps):
        t = time.perf_counter()
        batch = order[step * args.groups_per_step : (step + 1) * args.groups_per_step]
        groups = await artrl.gather_trajectory_groups(
            (
                artrl.TrajectoryGroup(
                    env.rollout(
                        model,
                        train_inbox,
                        q,
                        seed=args.seed * 10**7 + step * 1000 + k * 50 + j,
                        temperature=args.temperature,
                    )
                    for j in range(args.group_size)
                )
                for k, q in enumerate(batch)
            ),
            pbar=False,
            max_exceptions=0.1,
            after_each=rescore,
        )
        seconds["rollouts"] += time.perf_counter() - t
        rewards = [[tr.reward for tr in g] for g in groups]
        zero_variance = sum(max(r) == min(r) for r in rewards) / max(1, len(rewards))
        correct = [tr.metrics["correct"] for g in groups for tr in g]
        t = time.perf_counter()
        result = await model.train(groups, config=config) if groups else None
        if result is None:
            print(f"step {step + 1}: no group was scored, nothing trained", flush=True)
        seconds["training"] += time.perf_counter() - t
        history.append(
            {
                "step": step + 1,
                "reward": sum(map(sum, rewards)) / max(1, sum(map(len, rewards))),
                "success": sum(correct) / max(1, len(correct)),
                "zero_variance": zero_variance,
                "groups": len(groups),
                "trained": result is not None,
            }
        )
        h = history[-1]
        print(
            f"step {step + 1}: reward {h['reward']:.2f} success {h['success']:.2f} zero-variance groups {zero_variance:.2f}",
            flush=True,
        )
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
            t = time.perf_counter()
            points.append((step + 1, await evaluate(model, val_inbox, val_questions, args.temperature)))
            seconds["validation"] += time.perf_counter() - t
            print(f"validation at step {step + 1}: success {points[-1][1]['success']:.2f}", flush=True)
    after = points[-1][1]
    table[f"trained (step {points[-1][0]})"] = after
    total = time.perf_counter() - started
    first = history[:5]
    summary = {
        "seed": args.seed,
        "base_model": args.base_model or "tiny",
        "reward": args.reward,
        "n_val": len(val_questions),
        "val_before": points[0][1]["success"],
        "val_after": after["success"],
        "cited_before": points[0][1]["cited"],
        "cited_after": after["cited"],
        "zero_variance_first5": sum(h["zero_variance"] for h in first) / max(1, len(first)),
        "seconds": seconds | {"total": total},
        "val_points": [(s, p["success"]) for s, p in points],
        "table": table,
        "history": history,
    }
    print(
        f"\n| policy ({len(val_questions)} validation questions) | success | easy | hard | cited | calls | reward |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, m in table.items():
        print(
            f"| {name} | {m['success']:.2f} | {m.get('success_easy', 0):.2f} | {m.get('success_hard', 0):.2f} "
            f"| {m['cited']:.2f} | {m['calls']:.1f} | {m['reward']:.2f} |"
        )
    print(f"\nzero-variance groups over the first 5 steps: {summary['zero_variance_first5']:.2f}")
    print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in summary["seconds"].items()))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=1))
    if args.curve:
        from train_agent import plot  # (the maze demo's curve: train reward, validation success and reward)

        val_points = [(s, p["success"], p["reward"]) for s, p in points]
        plot(history, val_points, Path(args.curve), f"email agent, seed {args.seed}")
        print(f"curve: {args.curve}")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--base-model", default=None, help="a hub id or folder (default: the project's tiny model)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="GRPO learning rate (default: 1e-3 on the tiny model's LoRA, 1.2e-5 with --base-model, as ART·E)",
    )
    p.add_argument("--steps-per-call", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of every rollout")
    p.add_argument("--val-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--train-messages",
        type=int,
        default=None,
        help="the RL inbox (25 messages per question; default: a question per group, none asked twice)",
    )
    p.add_argument("--val-messages", type=int, default=2000, help="25 messages per question")
    p.add_argument(
        "--copy-examples", type=int, default=32768, help="tiny model: the stand-in's size (0: none)"
    )
    p.add_argument("--copy-lr", type=float, default=3e-3)
    add_shipping_args(p, SHIPPED, "stand-in and warm start")
    p.add_argument(
        "--warm-examples",
        type=int,
        default=None,
        help="default: 8192 on the tiny model, 0 (none) with --base-model",
    )
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument(
        "--warm-skill",
        type=float,
        nargs=3,
        default=(0.2, 0.3, 1.0),
        metavar=("SEARCH", "READ", "ANSWER"),
        help="the scripted agent's chance of the right search, the right hit read, the right value answered",
    )
    p.add_argument(
        "--score-base", action=argparse.BooleanOptionalAction, default=True, help="validate the base model"
    )
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the GRPO stage's rollout engine")
    p.add_argument("--reward", choices=("exact", "ruler"), default="exact")
    p.add_argument("--judge-url", default=None, help="--reward ruler: an OpenAI-compatible judge endpoint")
    p.add_argument("--judge-model", default="o3")
    p.add_argument("--judge-sees-answer", action="store_true", help="put the golden answer in the rubric")
    p.add_argument("--baseline-url", default=None, help="a prompted model to score on the same questions")
    p.add_argument("--baseline-model", default=None)
    p.add_argument("--generation-threads", type=int, default=None)
    p.add_argument("--in-process", action="store_true")
    p.add_argument("--path", default=".artrl")
    p.add_argument("--summary", default=None, help="write the summary as JSON here")
    p.add_argument("--curve", default=None, help="draw the learning curve here (a PNG)")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 1.2e-5 if args.base_model else 1e-3
    if args.train_messages is None:
        args.train_messages = max(2000, inboxes.MESSAGES_PER_QUESTION * args.steps * args.groups_per_step)
    if args.warm_examples is None:
        args.warm_examples = 0 if args.base_model else 8192
    if args.ship and (args.base_model or not args.copy_examples or not args.warm_examples):
        p.error(
            "--ship builds the tiny model's two stages: it takes no --base-model, --copy-examples 0 or --warm-examples 0"
        )
    defaults = args.ship and Path(args.ship).resolve() == SHIPPED.resolve()  # (--ship without DIR)
    if defaults and stage_folders(args) != stage_folders(parse_args(["--path", args.path])):
        p.error(
            "--ship without DIR makes the shipped stages, the defaults': these settings are not (give a DIR)"
        )
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
