"""Training with a group's prompt computed once (`TrainerConfig.share_prompts`, the default) against whole rows,
side by side on the same model: GRPO steps on groups of rows that share a prompt, as a group's rollouts do.

Rows like the maze demo's: --groups groups of --group-size rows, each a --prompt-token prompt (system message,
tools, question) and then turns of its own (sampled spans and tool results, ~--own tokens in all). Per preset
and dtype (tiny: fp32; small: fp32 and bf16) one model with a rank-8 LoRA is trained by two trainers in turn,
step by step (lr 1e-9, so the weights stay put): one computing each shared prompt once, one the whole rows.
Reported: the median step time of each and the ratio, and the largest difference of the two steps' loss.

    .venv/bin/python benchmarks/bench_shared_prompts.py [--steps 10] [--groups 4] [--group-size 8]

The section `## Shared prompts in training (bench_shared_prompts.py)` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, command_line, dated_machine_line, ensure_model, publish, write_summary_row

SECTION_HEADING = "## Shared prompts in training (bench_shared_prompts.py)"
SETTINGS = (("tiny", "float32"), ("small", "float32"), ("small", "bfloat16"))


def group_rows(args: argparse.Namespace, vocab: int, seed: int) -> list[Any]:
    from artrl.local.train.rows import Row

    rng = random.Random(seed)
    rows = []
    for g in range(args.groups):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        for k in range(args.group_size):
            row = Row(trajectory=g * args.group_size + k, advantage=rng.uniform(-1, 1))
            row.extend(prompt, sampled=False)
            while len(row.ids) < args.prompt_tokens + rng.randrange(args.own // 2, args.own * 3 // 2):
                n = rng.randrange(8, 16)  # a call (sampled), then its result (prompt)
                row.extend(
                    [rng.randrange(10, vocab) for _ in range(n)], True, [-rng.random() for _ in range(n)]
                )
                row.extend([rng.randrange(10, vocab) for _ in range(30)], sampled=False)
            rows.append(row)
    return rows


def measure(folder: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from artrl.config import EngineConfig, LoraConfig, TrainConfig
    from artrl.local.kernels.cpu_attention import use_cpu_attention
    from artrl.local.models.loading import load_model_and_tokenizer
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.batch import TrainingBatch
    from artrl.local.train.trainer import Trainer

    model, tokenizer = load_model_and_tokenizer(str(folder), EngineConfig(dtype=dtype))
    model = attach_adapter(model, LoraConfig())
    use_cpu_attention(model)
    trainers = {
        "shared": Trainer(model, pad_id=0, fused_lora=True, share_prompts=True),
        "whole": Trainer(model, pad_id=0, fused_lora=True, share_prompts=False),
    }
    steps = [group_rows(args, len(tokenizer), seed) for seed in range(3)]
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    config = TrainConfig(learning_rate=1e-9)
    for k in range(2 * (args.steps + 1)):
        name = ("shared", "whole")[k % 2] if (k // 2) % 2 == 0 else ("whole", "shared")[k % 2]
        rows = steps[(k // 2) % len(steps)]
        started = time.perf_counter()
        metrics = trainers[name].step(TrainingBatch(rows=rows), config)
        if k >= 2:  # (the first pair warms up)
            seconds[name].append(time.perf_counter() - started)
            losses[name].append(metrics["loss"])
    tokens = [sum(len(r.ids) for r in rows) for rows in steps]
    return {
        "shared_s": statistics.median(seconds["shared"]),
        "whole_s": statistics.median(seconds["whole"]),
        "loss_gap": max(abs(a - b) for a, b in zip(losses["shared"], losses["whole"], strict=True)),
        "tokens": statistics.median(tokens),
        "saved": args.groups * (args.group_size - 1) * args.prompt_tokens / statistics.median(tokens),
    }


def section(results: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- One GRPO step = {args.groups} groups x {args.group_size} rows; each row a {args.prompt_tokens}-token "
        f"prompt shared by its group, then ~{args.own} tokens of its own (sampled calls of 8-15 tokens, 30-token "
        "results); rank-8 LoRA (fused linears), one optimizer step per call, max_tokens_per_microbatch 4096; the two "
        f"trainers take turns step by step on one model (ABBA), median of {args.steps} steps each",
        f"- Command: `{command_line()}`; wall time {wall:.0f} s",
        "",
        "| preset, dtype | tokens per step | repeated prompt share | shared prompt s/step | whole rows s/step | "
        "speed-up | largest loss difference |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (preset, dtype), r in results.items():
        lines.append(
            f"| {preset}, {dtype} | {r['tokens']:.0f} | {r['saved']:.0%} | {r['shared_s']:.3f} | "
            f"{r['whole_s']:.3f} | {r['whole_s'] / r['shared_s']:.2f}x | {r['loss_gap']:.1e} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--own", type=int, default=200)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = {}
    for preset, dtype in SETTINGS:
        results[(preset, dtype)] = measure(ensure_model(preset, args.model_cache), dtype, args)
        print(f"{preset} {dtype}: {results[(preset, dtype)]}", flush=True)
    speedups = [f"{r['whole_s'] / r['shared_s']:.2f}x (`{p}`, {d})" for (p, d), r in results.items()]
    write_summary_row(
        args.out,
        "bench_shared_prompts.py",
        "a GRPO step with each group's prompt computed once vs whole rows (groups of 8)",
        f"{', '.join(speedups)} the whole-rows step",
    )
    return publish(section(results, args, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
