"""What the memory settings save: a GRPO step's peak memory and time with and without gradient checkpointing,
in fp32 and in bf16, on the `small` preset with a rank-8 LoRA, each setting in a fresh subprocess.

The step trains --rows sequences of --tokens tokens (half prompt, half sampled). Peak memory is the growth of
the subprocess's peak RSS (`ru_maxrss`) during the training steps over its RSS just before them: the
activations kept for the backward pass, the gradients and the optimizer state (the weights are loaded
before). The time is the median of --steps steps after one warm-up. On a GPU the same settings are measured
by `gpu_check.py`.

    .venv/bin/python benchmarks/bench_memory.py [--rows 4] [--tokens 1024] [--steps 3]

It replaces the section `## Memory settings (bench_memory.py)` of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    HERE,
    command_line,
    dated_machine_line,
    ensure_model,
    maxrss_mib,
    publish,
    write_summary_row,
)

SECTION_HEADING = "## Memory settings (bench_memory.py)"
SETTINGS = [(dtype, gc) for dtype in ("float32", "bfloat16") for gc in (False, True)]


def rss_mib() -> float:
    """The current resident set size of this process."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize() / 2**20


def worker(folder: str, dtype: str, checkpointing: bool, args: argparse.Namespace) -> dict[str, Any]:
    from artrl.config import EngineConfig, LoraConfig, TrainConfig
    from artrl.local.models.loading import load_model_and_tokenizer
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.batch import TrainingBatch
    from artrl.local.train.rows import Row
    from artrl.local.train.trainer import Trainer

    model, _ = load_model_and_tokenizer(folder, EngineConfig(dtype=dtype))
    model = attach_adapter(model, LoraConfig())
    trainer = Trainer(model, pad_id=0)
    rng = random.Random(0)
    half = args.tokens // 2
    rows = []
    for i in range(args.rows):
        row = Row(trajectory=i, advantage=1.0 if i % 2 else -1.0)
        row.extend([rng.randrange(10, 4000) for _ in range(half)], sampled=False)
        row.extend([rng.randrange(10, 4000) for _ in range(half)], sampled=True, logprobs=[-8.0] * half)
        rows.append(row)
    config = TrainConfig(
        learning_rate=1e-6,
        gradient_checkpointing=checkpointing,
        max_tokens_per_microbatch=args.rows * args.tokens,
    )
    before = rss_mib()
    times = []
    for _ in range(args.steps + 1):
        started = time.perf_counter()
        trainer.step(TrainingBatch(rows=rows), config)
        times.append(time.perf_counter() - started)
    return {"growth_mib": maxrss_mib() - before, "step_s": statistics.median(times[1:])}


def section(results: dict[tuple[str, bool], dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- `small` preset (~27M parameters), rank-8 LoRA; one GRPO step = {args.rows} sequences x {args.tokens} "
        f"tokens (half of them trained) in one micro-batch; peak RSS growth during the steps over the RSS before "
        f"them; step time: median of {args.steps} after a warm-up; each setting in a fresh subprocess",
        f"- Command: `{command_line()}`; wall time {wall:.0f} s",
        "",
        "| base weights | gradient checkpointing | peak memory growth MiB | step s |",
        "|---|---|---:|---:|",
    ]
    for (dtype, gc), r in results.items():
        lines.append(f"| {dtype} | {'on' if gc else 'off'} | {r['growth_mib']:.0f} | {r['step_s']:.3f} |")
    lines.append("")
    for dtype in ("float32", "bfloat16"):
        off, on = results[(dtype, False)], results[(dtype, True)]
        lines.append(
            f"{dtype}: checkpointing holds {on['growth_mib']:.0f} instead of {off['growth_mib']:.0f} MiB "
            f"({off['growth_mib'] / max(on['growth_mib'], 1):.1f}x less) for a {on['step_s'] / off['step_s']:.2f}x "
            "longer step."
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "dtype,0|1" in a subprocess
    args = parser.parse_args(argv)
    folder = ensure_model("small", args.model_cache)
    if args.worker:
        dtype, gc = args.worker.split(",")
        print(json.dumps(worker(str(folder), dtype, gc == "1", args)))
        return 0
    started = time.perf_counter()
    results = {}
    for dtype, gc in SETTINGS:
        command = [sys.executable, __file__, "--worker", f"{dtype},{int(gc)}", "--rows", str(args.rows)]
        command += [
            "--tokens",
            str(args.tokens),
            "--steps",
            str(args.steps),
            "--model-cache",
            str(args.model_cache),
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
        results[(dtype, gc)] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{dtype} checkpointing={gc}: {results[(dtype, gc)]}", flush=True)
    less, longer = [], []
    for dtype in ("float32", "bfloat16"):
        off, on = results[(dtype, False)], results[(dtype, True)]
        less.append(f"{off['growth_mib'] / max(on['growth_mib'], 1):.1f}x ({dtype})")
        longer.append(f"{on['step_s'] / off['step_s']:.2f}x")
    write_summary_row(
        args.out,
        "bench_memory.py",
        "gradient checkpointing on/off, fp32 and bf16 base weights (`small`, 4 x 1024 tokens)",
        f"checkpointing: {', '.join(less)} less peak memory for a {' / '.join(longer)} longer step",
    )
    return publish(section(results, args, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
