"""Proof of learning: GRPO visibly improves a multi-call tool-using agent, on a laptop-class CPU.

    python examples/train_agent.py [--base-model DIR_OR_HUB_ID] [--seed 0] [--steps N] [--report-to wandb]

1. warm start (cached under --path/models): on the project's tiny model, first a stand-in for pretraining
   (generic tool-reading conversations, `tool_reading.py`; skipped with --base-model), then supervised
   fine-tuning on transcripts of a weak walker (well-formed `move` calls, toward the breeze only with
   probability --warm-skill, a random direction otherwise) — the model learns the format, not the task. The
   defaults' two stages ship in examples/models and are copied; --no-shipped builds them (maze_stages.py);
2. validation before training (mazes that training never sees), and every --eval-every steps, each next to
   the following step's rollouts (the same weights; the engine decodes both in one batch);
3. GRPO for N steps on a LoRA adapter (groups of rollouts per scenario, one optimizer step each), with a
   live progress bar;
4. validation after; a reward-curve PNG, a before/after table and a JSON summary.
The same script trains any Hugging Face chat model with --base-model (a hub id or a local folder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

# one live bar (GRPO's): no per-checkpoint "Writing model shards" bars from transformers
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import httpx
from tqdm import tqdm

import artrl

sys.path.insert(0, str(Path(__file__).parent))
import maze_env as env
from maze_stages import SHIPPED, pretrained_tiny_model, ship, stage_folders, warm_start
from sft_cache import add_shipping_args

TARGET_GAIN = 0.30  # the gain in validation success the demo must show (issue 4)
# per-step train metrics kept in the summary: the train/inference mismatch monitor and the step's phases
MONITORED = (
    "logprob_mismatch_mean",
    "logprob_mismatch_max",
    "logprob_mismatch_fraction",
    "train_seconds",
    "weight_sync_seconds",
    "staleness_mean",
    "staleness_max",
    "trajectories_dropped_stale",
)


async def evaluate(
    model: artrl.TrainableModel, scenarios: list[env.Scenario], bar: bool = True
) -> dict[str, float]:
    trajectories = await artrl.gather_trajectories(  # a live bar: done/total, mean reward, tokens
        (env.rollout(model, s, seed=1_000_000 + i) for i, s in enumerate(scenarios)),
        pbar=bar,
        pbar_desc="validation",
    )
    await model.log([artrl.TrajectoryGroup(trajectories)], split="val")
    n = len(trajectories)
    return {
        "success": sum(t.metrics["success"] for t in trajectories) / n,
        "reward": sum(t.reward for t in trajectories) / n,
        "moves": sum(t.metrics["moves"] for t in trajectories) / n,
    }


def plot(history: list[dict], val_points: list[tuple[int, float, float]], out: Path, title: str) -> None:
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
    val_steps = [s for s, _, _ in val_points]
    ax.plot(val_steps, [r for _, _, r in val_points], "s--", color="tab:orange", label="validation reward")
    ax.plot(val_steps, [v for _, v, _ in val_points], "o-", color="tab:red", label="validation success rate")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


async def main(args: argparse.Namespace) -> dict:
    if args.ship:
        if Path(args.ship).resolve() == SHIPPED.resolve() and stage_folders(args) != stage_folders(
            parse_args(["--path", args.path])
        ):
            raise SystemExit("--ship without DIR makes the shipped stages, the defaults': give a DIR")
        os.environ["OMP_NUM_THREADS"] = (
            "1"  # (before torch starts: one thread, the build whatever the machine)
        )
    timings: dict[str, float] = {}
    started = time.perf_counter()
    # the service (engine, gateway, trainer) in a child process, the agents here (--in-process: all in this one)
    threads = args.generation_threads or (None if args.base_model else 1)  # (the tiny model: one thread)
    engine = artrl.EngineConfig(generation_threads=threads)
    async with (
        artrl.LocalBackend(path=args.path, engine=engine, in_process=args.in_process) as backend,
        contextlib.AsyncExitStack() as stack,
    ):
        if args.ship:
            shipped_stages = await ship(backend, args, Path(args.ship))
            print("shipped: " + ", ".join(shipped_stages))
            return {"shipped": shipped_stages}
        t = time.perf_counter()
        shipped = SHIPPED if args.shipped else None
        base_model = args.base_model or await pretrained_tiny_model(backend, args, shipped)
        timings["pretraining"] = 0.0 if args.base_model else time.perf_counter() - t
        t = time.perf_counter()
        warm = await warm_start(backend, base_model, args, shipped)
        timings["warm_start"] = time.perf_counter() - t
        if args.warm_start_only:
            print(warm)  # (the folder to start a training server on: `artrl server <it>`)
            return {"warm_start": warm}

        name = f"maze-seed{args.seed}-{int(time.time())}"
        lora = artrl.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
        trackers = [t for t in args.report_to.split(",") if t]  # wandb, tensorboard, trackio
        model = artrl.TrainableModel(
            name=name, project="maze", base_model=warm, lora=lora, report_to=trackers
        )
        # the SFT stages above only train (embedded engine); the RL model's rollouts run on
        # --engine and its training in --trainer-ranks processes
        rl_backend: artrl.LocalBackend | artrl.RemoteBackend = backend
        if args.remote:  # a training server elsewhere (docs/remote.md), started on this warm start
            rl_backend = artrl.RemoteBackend(args.remote)  # (its key: $ARTRL_API_KEY, never argv)
            served = httpx.get(f"{args.remote.rstrip('/')}/health", timeout=30).json()["base_model"]
            if os.path.realpath(served) != os.path.realpath(warm):
                raise SystemExit(
                    f"the server at {args.remote} trains on {served}; the RL model starts from the warm start "
                    f"{warm}: start the server with `artrl server {warm}` (or copy that folder to its machine)"
                )
            model = model.model_copy(update={"base_model": served})
        elif args.engine != "hf" or args.trainer_ranks > 1:  # (vLLM decides its own threads)
            trainer = artrl.TrainerConfig(ranks=args.trainer_ranks)
            rl_backend = await stack.enter_async_context(
                artrl.LocalBackend(
                    path=args.path, engine=args.engine, trainer=trainer, in_process=args.in_process
                )
            )
        t = time.perf_counter()
        await model.register(rl_backend)
        timings["register"] = time.perf_counter() - t
        val = env.scenarios("val", args.val_size, 0)
        # A validation runs next to the following step's rollouts (the same weights: nothing trains until
        # both are done), so the engine decodes both in one batch; "validation" times only the wait for it
        # once that step's rollouts are in.
        validating: list[tuple[int, asyncio.Task[dict[str, float]]]] = []
        val_points: list[tuple[int, float, float]] = []
        validations: dict[int, dict[str, float]] = {}
        timings["validation"] = 0.0

        def validate(step: int) -> None:
            validating.append((step, asyncio.create_task(evaluate(model, val, bar=False))))

        async def validated() -> None:
            t = time.perf_counter()
            for step, task in validating:
                metrics = validations[step] = await task
                val_points.append((step, metrics["success"], metrics["reward"]))
                tqdm.write(f"validation at step {step}: success {metrics['success']:.2f}")
            validating.clear()
            timings["validation"] += time.perf_counter() - t

        if args.steps:
            validate(0)
        else:  # (nothing to run it next to)
            validations[0] = await evaluate(model, val)
            val_points.append((0, validations[0]["success"], validations[0]["reward"]))

        scenarios = env.scenarios("train", args.steps * args.groups_per_step, args.seed)
        # --ahead N: the next N steps' rollouts are gathered while a step trains (N = 0: one after the other);
        # samples up to N updates old are trained, older ones dropped
        config = artrl.TrainConfig(
            learning_rate=args.lr,
            steps_per_call=args.steps_per_call,
            max_staleness=args.ahead if args.ahead else None,
        )
        history: list[dict] = []
        timings["rollouts"] = timings["training"] = 0.0

        async def gather_step(step: int) -> list[artrl.TrajectoryGroup]:
            batch = scenarios[step * args.groups_per_step : (step + 1) * args.groups_per_step]
            return await artrl.gather_trajectory_groups(
                (
                    (
                        env.rollout(model, s, seed=args.seed * 10**7 + step * 1000 + k * 50 + j)
                        for j in range(args.group_size)
                    )
                    for k, s in enumerate(batch)
                ),
                pbar=False,  # the GRPO bar below shows the step's reward
                max_exceptions=0.1,  # a rollout that raises is recorded on its group, up to 10%
            )

        bar = tqdm(total=args.steps, desc="GRPO", unit="step", dynamic_ncols=True)
        t = time.perf_counter()
        steps = await stack.enter_async_context(  # (closed on any exit: steps gathered ahead are cancelled)
            contextlib.aclosing(artrl.rollouts_ahead(gather_step, args.steps, ahead=args.ahead))
        )
        async for step, groups in steps:
            timings["rollouts"] += time.perf_counter() - t  # (waiting for this step's rollouts)
            await validated()  # (before the weights change)
            t = time.perf_counter()
            result = await model.train(groups, config=config)
            timings["training"] += time.perf_counter() - t
            success = sum(tr.metrics["success"] for g in groups for tr in g) / sum(len(g) for g in groups)
            history.append(
                {
                    "step": step + 1,
                    "reward": result.metrics["reward_mean"],
                    "success": success,
                    **{k: result.metrics[k] for k in MONITORED if k in result.metrics},
                }
            )
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                validate(step + 1)
            bar.update(1)
            bar.set_postfix(
                reward=f"{result.metrics['reward_mean']:.2f}",
                success=f"{success:.2f}",
                val=f"{val_points[-1][1]:.2f}",
            )
            t = time.perf_counter()
        bar.close()
        await validated()
        before = validations[0]
        t = time.perf_counter()
        after = await evaluate(model, val)
        timings["validation"] += time.perf_counter() - t
        val_points.append((args.steps, after["success"], after["reward"]))

    total = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (
        f"seed{args.seed}"
        + ("" if args.engine == "hf" else f"_{args.engine}")
        + (f"_ahead{args.ahead}" if args.ahead else "")
        + (f"_ranks{args.trainer_ranks}" if args.trainer_ranks > 1 else "")
    )
    curve = out / f"reward_curve_{tag}.png"
    plot(history, val_points, curve, f"maze agent, seed {args.seed}, engine {args.engine}")
    print(f"\n{f'validation ({len(val)} unseen mazes)':<40}{'before':>10}{'after':>10}")
    for key in ("success", "reward", "moves"):
        print(f"{key:<40}{before[key]:>10.2f}{after[key]:>10.2f}")
    print(f"\ntime: total {total:.0f} s = " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    # the first validation point 30 points of success rate above the warm start (None: not reached)
    at_target = next((s for s, v, _ in val_points if v - before["success"] >= TARGET_GAIN), None)
    print(f"validation success +{TARGET_GAIN:.2f} first seen at step: {at_target}")
    print(f"curve: {curve}")
    print(f"dashboard: artrl dashboard {args.path}")
    summary = {
        "steps_to_target": at_target,
        "seed": args.seed,
        "engine": args.engine,
        "trainer_ranks": args.trainer_ranks,
        "before": before,
        "after": after,
        "timings": timings,
        "total_seconds": total,
        "val_points": val_points,
        "history": history,
    }
    (out / f"summary_{tag}.json").write_text(json.dumps(summary, indent=2))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default=None, help="HF folder or hub id (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=2,
        help="optimizer steps per GRPO step, each on its share of the step's rows (TrainConfig.steps_per_call)",
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    parser.add_argument("--val-size", type=int, default=96)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--ahead",
        type=int,
        default=0,
        help="asynchronous rollouts: steps gathered while one trains (0: none)",
    )
    parser.add_argument(
        "--pretrain-examples", type=int, default=4096, help="tiny model only: pretraining stand-in (0: none)"
    )
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    add_shipping_args(parser, SHIPPED, "pretraining stand-in and warm start")
    parser.add_argument("--sft-examples", type=int, default=1024)
    parser.add_argument("--sft-epochs", type=int, default=1)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument(
        "--warm-skill", type=float, default=0.3, help="how often the warm-start walker follows the breeze"
    )
    parser.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="rollout engine of the RL stage: embedded, or vLLM (needs `bash scripts/setup_vllm.sh`)",
    )
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        help="GRPO in this many trainer processes (FSDP2; gloo on CPU, nccl on GPUs); 1: in this process",
    )
    parser.add_argument(
        "--generation-threads",
        type=int,
        default=None,
        help="torch threads of the embedded engine's token steps (default: 1 on the tiny model, whose products "
        "are too small to split; torch's default with --base-model)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="engine, gateway and trainer in this process (default: in a child process, the agents in this one)",
    )
    parser.add_argument("--report-to", default="", help="experiment trackers: wandb,tensorboard,trackio")
    parser.add_argument("--path", default=".artrl")
    parser.add_argument("--out", default="demo_output")
    parser.add_argument(
        "--remote",
        default=None,
        help="train the RL model on the training server at this URL ($ARTRL_API_KEY: its key; docs/remote.md)",
    )
    parser.add_argument(
        "--warm-start-only",
        action="store_true",
        help="build (or find) the warm start, print its folder, stop",
    )
    args = parser.parse_args(argv)
    if args.ship and (args.base_model or not args.pretrain_examples):
        parser.error(
            "--ship builds the tiny model's two stages (pretraining stand-in, warm start): no --base-model, "
            "no --pretrain-examples 0"
        )
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
