"""Asynchronous rollouts against the synchronous loop: the maze demo (`examples/train_agent.py`) with
`--ahead 0` and `--ahead 1`, side by side in one run, alternating, on one cached warm start.

Each run is a subprocess of the demo with the same seed and settings (--steps GRPO steps, validation at the
start and the end only); reported: the GRPO phase's wall time (rollouts + training: with --ahead 1,
"rollouts" is the time spent waiting for a step's rollouts), the validation success before and after, and the
mean staleness of the steps. The first run also builds the cached warm start (not counted).

    .venv/bin/python benchmarks/bench_async.py [--steps 20] [--rounds 2] [--engine hf]

It replaces the section `## Asynchronous rollouts (bench_async.py)` of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, alternating, command_line, dated_machine_line, publish, write_summary_row

SECTION_HEADING = "## Asynchronous rollouts (bench_async.py)"
DEMO = HERE.parent / "examples" / "train_agent.py"


def demo(path: Path, out: Path, ahead: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(DEMO), "--path", str(path), "--out", str(out), "--steps", str(args.steps)]
    command += ["--ahead", str(ahead), "--eval-every", "0", "--engine", args.engine, "--seed", str(args.seed)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    tag = (
        f"seed{args.seed}"
        + ("" if args.engine == "hf" else f"_{args.engine}")
        + (f"_ahead{ahead}" if ahead else "")
    )
    summary = json.loads((out / f"summary_{tag}.json").read_text())
    timings = summary["timings"]
    return {
        "grpo_s": timings["rollouts"] + timings["training"],
        "rollouts_s": timings["rollouts"],
        "training_s": timings["training"],
        "before": summary["before"]["success"],
        "after": summary["after"]["success"],
        "staleness": statistics.mean(h.get("staleness_mean", 0.0) for h in summary["history"]),
    }


def section(results: dict[int, list[dict[str, Any]]], args: argparse.Namespace, wall: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- The maze demo, seed {args.seed}, engine {args.engine}, {args.steps} GRPO steps (4 mazes x 8 rollouts, "
        f"LoRA r8), validation on 96 mazes before and after only; {args.rounds} round(s), the two modes "
        "alternating, one cached warm start; GRPO s = rollouts + training (medians over rounds)",
        f"- Command: `{command_line()}`; wall time {wall:.0f} s",
        "",
        "| mode | GRPO s | rollouts s | training s | validation success | mean staleness | per round GRPO s |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for ahead, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("grpo_s", "rollouts_s", "training_s")}
        success = "; ".join(f"{r['before']:.2f} → {r['after']:.2f}" for r in runs)
        lines.append(
            f"| {'synchronous (--ahead 0)' if ahead == 0 else f'--ahead {ahead}'} | {med['grpo_s']:.1f} | "
            f"{med['rollouts_s']:.1f} | {med['training_s']:.1f} | {success} | "
            f"{statistics.mean(r['staleness'] for r in runs):.2f} | "
            + ", ".join(f"{r['grpo_s']:.1f}" for r in runs)
            + " |"
        )
    sync, ahead = (statistics.median(r["grpo_s"] for r in results[k]) for k in (0, 1))
    lines += ["", f"--ahead 1 / synchronous GRPO wall time: {ahead / sync:.2f}x.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="artrl-bench-async-") as tmp:
        path = Path(tmp) / "artrl"
        for k in range(args.rounds):
            for ahead in alternating((0, 1), k):
                results[ahead].append(demo(path, Path(tmp) / f"out{k}{ahead}", ahead, args))
                print(f"round {k + 1}, --ahead {ahead}: {results[ahead][-1]}", flush=True)
    sync, ahead = (statistics.median(r["grpo_s"] for r in results[k]) for k in (0, 1))
    write_summary_row(
        args.out,
        "bench_async.py",
        "the maze demo's GRPO phase with `--ahead 1` (asynchronous rollouts) vs the synchronous loop",
        f"`--ahead 1` GRPO wall time {ahead / sync:.2f}x the synchronous loop's",
    )
    return publish(section(results, args, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
