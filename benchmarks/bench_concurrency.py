"""Gateway concurrency benchmark: N concurrent multi-turn agents vs. the same calls served one at a time.

For each model preset and each N in --agents, in one process:

  (a) concurrent: N agents run at once, each making --turns chat-completion calls through
      `model.openai_client()` (the real `openai.AsyncOpenAI`), appending the assistant reply and a new
      user message every turn;
  (b) one at a time: exactly the same calls (same messages, same seeds), agent after agent.

Generated tokens are counted as `len(choice.token_ids)`; the reported figure is generated tokens per second
of wall time, the median of --repeats runs (the order of (a) and (b) alternates between runs).

Where --turns / --max-tokens / --repeats are not given, each preset uses its own defaults
(PRESET_DEFAULTS: `tiny` 3 turns x 32 tokens, 3 runs; `small` a lighter 2 turns x 16 tokens, 1 run, so
that the default run stays within ~6 minutes on a 2-core machine); the output states what was used.

The models are random-weight, so a call can sample the end-of-sequence token before max_tokens. A
calibration pass (which also warms up the batch shapes) picks, per agent and turn, a seed whose call
generates the full max_tokens (`finish_reason == "length"`); the measured runs then reuse those seeds,
so both modes generate the same number of tokens. Any call that still ends otherwise is reported.

    .venv/bin/python benchmarks/bench_concurrency.py [--presets tiny,small] [--agents 1,8,32]
        [--turns 3] [--max-tokens 32] [--out benchmarks/RESULTS.md]

The section `## Gateway concurrency (bench_concurrency.py)` of the results file is replaced (or added);
other sections are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_workload import RunStats, Workload, run_concurrent, run_sequential
from harness import HERE, command_line, ensure_model, machine_info, write_section, write_summary_row

SECTION_HEADING = "## Gateway concurrency (bench_concurrency.py)"
TARGET_RATIO = 4.0
TARGET_AGENTS = 32

# Defaults per preset, used where --turns / --max-tokens / --repeats are not given. The `small` model
# costs far more per token than `tiny` on CPU, and the one-at-a-time runs of 32 agents dominate the run
# time, so `small` runs a lighter workload, measured once, to keep the default run within ~6 minutes.
PRESET_DEFAULTS: dict[str, dict[str, int]] = {
    "tiny": {"turns": 3, "max_tokens": 32, "repeats": 3},
    "small": {"turns": 2, "max_tokens": 16, "repeats": 1},
}
FALLBACK_DEFAULTS = {"turns": 3, "max_tokens": 32, "repeats": 3}


# ------------------------------------------------------------------------------------------ per preset
@dataclass
class Row:
    agents: int
    concurrent: list[RunStats]
    sequential: list[RunStats]

    @property
    def conc_tok_s(self) -> float:
        return statistics.median(s.tok_s for s in self.concurrent)

    @property
    def seq_tok_s(self) -> float:
        return statistics.median(s.tok_s for s in self.sequential)

    @property
    def ratio(self) -> float:
        return self.conc_tok_s / self.seq_tok_s if self.seq_tok_s > 0 else float("nan")

    @property
    def ratios(self) -> list[float]:
        return [c.tok_s / s.tok_s for c, s in zip(self.concurrent, self.sequential, strict=True)]


@dataclass
class PresetResult:
    preset: str
    params: int
    turns: int
    max_tokens: int
    repeats: int
    rows: list[Row]
    calibration_retries: int
    odd_finishes: Counter
    token_mismatches: list[str]
    seconds: float


async def bench_preset(backend: Any, preset: str, folder: Path, args: argparse.Namespace) -> PresetResult:
    import artrl

    started = time.perf_counter()
    defaults = PRESET_DEFAULTS.get(preset, FALLBACK_DEFAULTS)
    turns = args.turns or defaults["turns"]
    max_tokens = args.max_tokens or defaults["max_tokens"]
    repeats = args.repeats or defaults["repeats"]
    model = artrl.TrainableModel(name=f"bench-{preset}", project="bench", base_model=str(folder))
    await model.register(backend)
    params = sum(p.numel() for p in backend.service(model).model.parameters())
    client = model.openai_client()
    try:
        work = Workload(client, model.name, turns, max_tokens, {})
        # warm-up: one small call, then a calibration pass that fixes the seeds (and warms the batch shapes)
        await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hello"}], max_tokens=4, seed=0
        )
        n_max = max(args.agents)
        calib = await run_concurrent(work, n_max, calibrate=True)
        retries = calib.reseeded
        # one more small call: in trial runs the first measured request after calibration was slow
        await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hello"}], max_tokens=4, seed=0
        )
        print(
            f"[{preset}] {params:,} params; calibration: {calib.calls} calls, {retries} reseeded call(s), "
            f"finish {dict(calib.finish)}, {calib.seconds:.1f} s; turns={turns}, max_tokens={max_tokens}, "
            f"repeats={repeats}",
            flush=True,
        )
        rows: list[Row] = []
        odd: Counter = Counter()
        mismatches: list[str] = []
        for n in args.agents:
            expected = n * turns * max_tokens
            concurrent: list[RunStats] = []
            sequential: list[RunStats] = []
            for rep in range(repeats):
                order = ("concurrent", "sequential") if rep % 2 == 0 else ("sequential", "concurrent")
                for mode in order:
                    if mode == "concurrent":
                        stats = await run_concurrent(work, n)
                        concurrent.append(stats)
                    else:
                        stats = await run_sequential(work, n)
                        sequential.append(stats)
                    for reason, count in stats.finish.items():
                        if reason != "length":
                            odd[f"N={n} {mode} {reason}"] += count
                    if stats.tokens != expected:
                        mismatches.append(
                            f"N={n} rep {rep + 1} {mode}: {stats.tokens} tokens, expected {expected}"
                        )
                    print(
                        f"[{preset}] N={n:>3} rep {rep + 1}/{repeats} {mode:<10}: {stats.tokens:>6} tok "
                        f"in {stats.seconds:6.2f} s = {stats.tok_s:8.1f} tok/s",
                        flush=True,
                    )
            rows.append(Row(n, concurrent, sequential))
    finally:
        await client.close()
    return PresetResult(
        preset,
        params,
        turns,
        max_tokens,
        repeats,
        rows,
        retries,
        odd,
        mismatches,
        time.perf_counter() - started,
    )


# ------------------------------------------------------------------------------------------- reporting
def _runs(repeats: int) -> str:
    return "1 run" if repeats == 1 else f"median of {repeats} runs"


def table(result: PresetResult) -> list[str]:
    lines = [
        "| N agents | concurrent tok/s | one-at-a-time tok/s | ratio | ratio per run |",
        "|---:|---:|---:|---:|---|",
    ]
    for row in result.rows:
        per_run = ", ".join(f"{r:.2f}" for r in row.ratios)
        lines.append(
            f"| {row.agents} | {row.conc_tok_s:.1f} | {row.seq_tok_s:.1f} | {row.ratio:.2f}x | {per_run} |"
        )
    return lines


def target_line(results: list[PresetResult]) -> str:
    parts = []
    for res in results:
        row = next((r for r in res.rows if r.agents == TARGET_AGENTS), None)
        if row is None:
            parts.append(f"`{res.preset}`: not measured (no N={TARGET_AGENTS})")
        else:
            verdict = "MET" if row.ratio >= TARGET_RATIO else "NOT met"
            parts.append(f"`{res.preset}`: {verdict} ({row.ratio:.2f}x)")
    return f"**Target (ratio >= {TARGET_RATIO:g}x at {TARGET_AGENTS} agents):** " + "; ".join(parts) + "."


def section(results: list[PresetResult], args: argparse.Namespace, info: dict[str, Any], wall: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        f"- Date: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: nproc={info['nproc']}, CPU: {info['cpu']}, torch {info['torch']}, "
        f"torch.get_num_threads()={info['torch_threads']}, Python {info['python']}",
        "- Workload: each agent makes `turns` chat-completion calls (the assistant reply and a new user "
        "message appended each turn), temperature=1.0, a fixed seed per agent/turn, through "
        "`model.openai_client()` (openai.AsyncOpenAI) and the embedded engine on CPU; turns, max_tokens "
        "and repetitions per preset are in each heading (`small` runs a lighter default workload, measured "
        "once, to keep the default run within ~6 minutes)",
        "- Measured: generated tokens (`len(choice.token_ids)`) per second of wall time; *concurrent* = the N "
        "agents at once, *one-at-a-time* = the same calls sequentially, agent after agent; each figure is "
        "the median of the repetitions below, the order of the two modes alternating between repetitions",
        "- Seeds: a calibration pass picks, per agent/turn, a seed whose call generates the full max_tokens "
        "(random-weight models can sample end-of-sequence early), so both modes generate the same tokens",
        f"- Command: `{command_line()}`",
        f"- Wall time of the whole run: {wall:.0f} s",
        "",
    ]
    for res in results:
        lines.append(
            f"### Preset `{res.preset}` ({res.params:,} parameters): {res.turns} turns, "
            f"max_tokens={res.max_tokens}, {_runs(res.repeats)}"
        )
        lines.append("")
        lines.extend(table(res))
        lines.append("")
        notes = [f"calibration reseeded {res.calibration_retries} call(s)"]
        if res.odd_finishes:
            notes.append(
                "finish reasons other than `length`: "
                + ", ".join(f"{k}: {v}" for k, v in res.odd_finishes.items())
            )
        else:
            notes.append("every measured call finished with `length`")
        if res.token_mismatches:
            notes.append("token-count mismatches: " + "; ".join(res.token_mismatches))
        lines.append("Notes: " + "; ".join(notes) + f"; preset time {res.seconds:.0f} s.")
        lines.append("")
    lines.append(target_line(results))
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        values = [int(v) for v in text.split(",") if v.strip()]
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError("give positive integers separated by commas")
        return values

    per_preset = "; ".join(f"{p}: {d}" for p, d in PRESET_DEFAULTS.items())
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Per-preset defaults when --turns/--max-tokens/--repeats are not given: " + per_preset,
    )
    parser.add_argument("--presets", default="tiny,small", help="comma-separated TINY_MODEL_PRESETS names")
    parser.add_argument("--agents", type=ints, default=[1, 8, 32], help="comma-separated agent counts")
    parser.add_argument("--turns", type=int, default=None, help="calls per agent (default: per preset)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="max_tokens per call (default: per preset)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per measurement (default: per preset)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) first (default: torch's own)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    args = parser.parse_args(argv)
    args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    from artrl.config import TINY_MODEL_PRESETS

    unknown = [p for p in args.presets if p not in TINY_MODEL_PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {unknown}; choose from {sorted(TINY_MODEL_PRESETS)}")
    if any(v is not None and v < 1 for v in (args.turns, args.max_tokens, args.repeats, args.torch_threads)):
        parser.error("--turns, --max-tokens, --repeats and --torch-threads must be >= 1")
    return args


async def main_async(args: argparse.Namespace) -> list[PresetResult]:
    import artrl

    folders = {p: ensure_model(p, args.model_cache) for p in args.presets}
    results = []
    with tempfile.TemporaryDirectory(prefix="artrl-bench-") as tmp:
        backend = artrl.LocalBackend(path=tmp)
        try:
            for preset in args.presets:
                results.append(await bench_preset(backend, preset, folders[preset], args))
        finally:
            await backend.close()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    info = machine_info()
    print(
        f"machine: nproc={info['nproc']}, {info['cpu']}, torch {info['torch']}, "
        f"threads={info['torch_threads']}",
        flush=True,
    )
    results = asyncio.run(main_async(args))
    wall = time.perf_counter() - started
    print()
    for res in results:
        print(
            f"preset {res.preset} ({res.params:,} params): {res.turns} turns, "
            f"max_tokens={res.max_tokens}, {_runs(res.repeats)}"
        )
        print("\n".join(table(res)))
        if res.odd_finishes:
            print("  finish reasons other than length:", dict(res.odd_finishes))
        for m in res.token_mismatches:
            print("  token-count mismatch:", m)
        print()
    print(target_line(results).replace("**", ""))
    print(f"wall time: {wall:.0f} s")
    write_section(args.out, section(results, args, info, wall), SECTION_HEADING)
    ratios = [
        f"{row.ratio:.2f}x (`{res.preset}`)"
        for res in results
        for row in res.rows
        if row.agents == TARGET_AGENTS
    ]
    write_summary_row(
        args.out,
        "bench_concurrency.py",
        "gateway + embedded engine: N agents at once vs the same calls one at a time",
        f"at {TARGET_AGENTS} agents {', '.join(ratios) or 'not measured'} the one-at-a-time tok/s",
    )
    print(f"wrote section {SECTION_HEADING!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
