"""Proof of learning: GRPO visibly improves a multi-call tool-using agent, on a laptop-class CPU.

    python examples/train_agent.py [--base-model DIR_OR_HUB_ID] [--seed 0] [--steps N]

1. warm start (cached): supervised fine-tuning on transcripts of a weak walker (well-formed `move` calls,
   toward the breeze or away from it at random; --warm-skill) — the model learns the format, not the task;
2. validation before training (mazes that training never sees);
3. GRPO for N steps (groups of rollouts per scenario, one optimizer step each), with a live progress bar;
4. validation after; a reward-curve PNG and a before/after table.
The same script serves any Hugging Face chat model with --base-model.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

# one live bar (GRPO's): no per-checkpoint "Writing model shards" bars from transformers
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from tqdm import tqdm

import artrl

sys.path.insert(0, str(Path(__file__).parent))
import maze_env as env


async def evaluate(model: artrl.TrainableModel, scenarios: list[env.Scenario]) -> dict[str, float]:
    trajectories = await asyncio.gather(
        *(env.rollout(model, s, seed=1_000_000 + i) for i, s in enumerate(scenarios))
    )
    await model.log([artrl.TrajectoryGroup(trajectories)], split="val")
    n = len(trajectories)
    return {
        "success": sum(t.metrics["success"] for t in trajectories) / n,
        "reward": sum(t.reward for t in trajectories) / n,
        "moves": sum(t.metrics["moves"] for t in trajectories) / n,
    }


async def warm_start(backend: artrl.LocalBackend, base_model: str, args: argparse.Namespace) -> str:
    """SFT on weak transcripts; the result is cached as a model folder keyed by its inputs."""
    config = artrl.SFTConfig(learning_rate=args.sft_lr, epochs=args.sft_epochs, batch_size=16, seed=0)
    key = hashlib.sha256(
        json.dumps([base_model, args.sft_examples, args.warm_skill, config.model_dump()]).encode()
    ).hexdigest()[:12]
    folder = Path(args.path) / "models" / f"maze-warm-{key}"
    if (folder / "config.json").exists():
        return str(folder)
    model = artrl.TrainableModel(name=f"warm-{key}", project="maze", base_model=base_model, lora=None)
    await model.register(backend)
    rng = random.Random(0)
    transcripts = [
        env.weak_transcript(s, rng, i, args.warm_skill)
        for i, s in enumerate(env.scenarios("train", args.sft_examples, 0))
    ]
    result = await model.train_sft(transcripts, config)
    tmp = folder.with_name(folder.name + ".tmp")
    await model.export(str(tmp))
    tmp.rename(folder)
    print(f"warm start: {result.metrics['optimizer_steps']} SFT steps, loss {result.metrics['loss']:.3f}")
    return str(folder)


def plot(history: list[dict], val_points: list[tuple[int, float]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    window = 5
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    ax.plot(steps, rewards, color="tab:blue", alpha=0.3, label="train reward (per step)")
    ax.plot(steps, smooth, color="tab:blue", label=f"train reward ({window}-step mean)")
    ax.plot(
        [s for s, _ in val_points],
        [v for _, v in val_points],
        "o-",
        color="tab:red",
        label="validation success rate",
    )
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


async def main(args: argparse.Namespace) -> dict:
    timings: dict[str, float] = {}
    started = time.perf_counter()
    base_model = args.base_model or str(artrl.ensure_tiny_model(Path(args.path) / "models" / "tiny"))
    async with artrl.LocalBackend(path=args.path) as backend:
        t = time.perf_counter()
        warm = await warm_start(backend, base_model, args)
        timings["warm_start"] = time.perf_counter() - t

        name = f"maze-seed{args.seed}-{int(time.time())}"
        model = artrl.TrainableModel(name=name, project="maze", base_model=warm, lora=None)
        await model.register(backend)
        val = env.scenarios("val", args.val_size, 0)
        t = time.perf_counter()
        before = await evaluate(model, val)
        timings["validation"] = time.perf_counter() - t
        val_points = [(0, before["success"])]

        scenarios = env.scenarios("train", args.steps * args.groups_per_step, args.seed)
        config = artrl.TrainConfig(learning_rate=args.lr)
        history: list[dict] = []
        timings["rollouts"] = timings["training"] = 0.0
        bar = tqdm(range(args.steps), desc="GRPO", unit="step", dynamic_ncols=True)
        for step in bar:
            t = time.perf_counter()
            batch = scenarios[step * args.groups_per_step : (step + 1) * args.groups_per_step]
            groups = await asyncio.gather(
                *(
                    asyncio.gather(
                        *(
                            env.rollout(model, s, seed=args.seed * 10**7 + step * 1000 + k * 50 + j)
                            for j in range(args.group_size)
                        )
                    )
                    for k, s in enumerate(batch)
                )
            )
            timings["rollouts"] += time.perf_counter() - t
            t = time.perf_counter()
            result = await model.train([artrl.TrajectoryGroup(g) for g in groups], config=config)
            timings["training"] += time.perf_counter() - t
            success = sum(tr.metrics["success"] for g in groups for tr in g) / sum(len(g) for g in groups)
            history.append({"step": step + 1, "reward": result.metrics["reward_mean"], "success": success})
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                t = time.perf_counter()
                val_points.append((step + 1, (await evaluate(model, val))["success"]))
                timings["validation"] += time.perf_counter() - t
            bar.set_postfix(
                reward=f"{result.metrics['reward_mean']:.2f}",
                success=f"{success:.2f}",
                val=f"{val_points[-1][1]:.2f}",
            )
        t = time.perf_counter()
        after = await evaluate(model, val)
        timings["validation"] += time.perf_counter() - t
        val_points.append((args.steps, after["success"]))

    total = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(history, val_points, out / f"reward_curve_seed{args.seed}.png", f"maze agent, seed {args.seed}")
    print(f"\n{f'validation ({len(val)} unseen mazes)':<40}{'before':>10}{'after':>10}")
    for key in ("success", "reward", "moves"):
        print(f"{key:<40}{before[key]:>10.2f}{after[key]:>10.2f}")
    print(f"\ntime: total {total:.0f} s = " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    print(f"curve: {out / f'reward_curve_seed{args.seed}.png'}")
    summary = {
        "seed": args.seed,
        "before": before,
        "after": after,
        "timings": timings,
        "total_seconds": total,
        "val_points": val_points,
        "history": history,
    }
    (out / f"summary_seed{args.seed}.json").write_text(json.dumps(summary, indent=2))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default=None, help="HF folder or hub id (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--val-size", type=int, default=96)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--sft-examples", type=int, default=2048)
    parser.add_argument("--sft-epochs", type=int, default=4)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument(
        "--warm-skill",
        type=float,
        default=0.5,
        help="how often the warm-start walker goes toward the breeze (otherwise it goes away from it)",
    )
    parser.add_argument("--path", default=".artrl")
    parser.add_argument("--out", default="demo_output")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
