"""This checkout against an earlier commit of artrl, side by side on this machine, in one run.

An issue's "today's N" is a figure of the code the issue was filed against, measured on whatever machine
its author had; this benchmark measures that code again next to this checkout, alternating, so that the
ratio holds on a noisy machine whose speed drifts within the hour. The earlier code is a source tree (a
`git worktree` of the commit); both run under this checkout's virtualenv, each in child processes of its own
with PYTHONPATH pointing at its `src`.

  b     bench_rollouts' workload (b): 32 agents x 3 chat calls with tools on the `small` preset, through
        `model.openai_client()` on `LocalBackend(engine=EngineConfig(dtype=...))` (each code's defaults
        otherwise), `ignore_eos` where the gateway knows it; per child process one warm-up run, then
        --runs-per-child measured runs (their median is the child's figure);
  demo  the demo from scratch (each tree's own `examples/train_agent.py` with its own defaults, fresh
        --path): wall seconds, and the validation success at steps 0 and 10. (Since 44040da a tree copies its
        shipped pretraining stand-in where older ones build it: a like-for-like run passes --no-shipped to it.)

    git worktree add /tmp/base 94fbe1f
    .venv/bin/python benchmarks/bench_against_commit.py --baseline /tmp/base [--parts b,demo] [--rounds 3]

It replaces the section `## This code against an earlier commit (bench_against_commit.py)` of --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

SECTION_HEADING = "## This code against an earlier commit (bench_against_commit.py)"
CHILD_TIMEOUT_S = 1800.0  # one child process (a demo from scratch takes 2-5 minutes on 2 cores)
DTYPES = ("bfloat16", "float32")


def git_describe(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True, timeout=30
    )
    text = done.stdout.strip() or "not a git tree"
    return text if len(text) <= 60 else text[:60].rsplit(" ", 1)[0] + " …"


def child(tree: Path, argv: list[str], timeout_s: float = CHILD_TIMEOUT_S) -> tuple[float, str]:
    """Run `python argv` with `tree`'s artrl first on the path; (wall seconds, stdout). Fails loudly."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv} under {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stdout


# ------------------------------------------------------------------------ (b), inside a child process
async def rollouts_worker(folder: str, dtype: str, runs: int) -> dict[str, Any]:
    import bench_rollouts as br

    import artrl

    work = br.Workload("b", "small", 32, 3, 24)
    with tempfile.TemporaryDirectory(prefix="artrl-bench-commit-") as tmp:
        async with artrl.LocalBackend(path=tmp, engine=artrl.EngineConfig(dtype=dtype)) as backend:
            model = artrl.TrainableModel(name="measured", project="p", base_model=folder)
            await model.register(backend)
            endpoint = br.Endpoint(model.openai_client(), model.name, {"ignore_eos": True})
            await br.run_sessions(endpoint, work, "warm-up")
            stats = [await br.run_sessions(endpoint, work, f"run-{i}") for i in range(runs)]
    return {
        "tok_s": [s.tok_s for s in stats],
        "tokens": [s.tokens for s in stats],
        "p95_ms": harness.percentile([ms for s in stats for ms in s.latencies_ms], 95),
        "foreign_cpu": [s.foreign_cpu for s in stats],
        "artrl": artrl.__file__,
    }


# ------------------------------------------------------------------------ the parent
def measure_rollouts(trees: dict[str, Path], args: argparse.Namespace) -> dict[tuple[str, str], list[dict]]:
    folder = harness.ensure_model("small", args.model_cache)  # (built by this checkout's code, for both)
    out: dict[tuple[str, str], list[dict]] = {(c, d): [] for c in trees for d in DTYPES}
    for r in range(args.rounds):
        for code in harness.alternating(tuple(trees), r):
            for dtype in DTYPES:
                argv = [
                    __file__,
                    "--worker",
                    str(folder),
                    "--dtype",
                    dtype,
                    "--runs-per-child",
                    str(args.runs_per_child),
                ]
                _, stdout = child(trees[code], argv)
                result = json.loads(stdout.strip().splitlines()[-1])
                if not result["artrl"].startswith(str(trees[code])):
                    raise RuntimeError(f"{code}'s child imported artrl from {result['artrl']}")
                out[(code, dtype)].append(result)
                print(
                    f"[b] round {r + 1} {code:<8} {dtype}: tok/s {[round(x) for x in result['tok_s']]}",
                    flush=True,
                )
    return out


def measure_demo(trees: dict[str, Path], args: argparse.Namespace) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {code: [] for code in trees}
    for r in range(args.rounds):
        for code in harness.alternating(tuple(trees), r):
            with tempfile.TemporaryDirectory(prefix="artrl-bench-demo-") as tmp:
                script = trees[code] / "examples" / "train_agent.py"
                wall, _ = child(trees[code], [str(script), "--path", f"{tmp}/run", "--out", f"{tmp}/out"])
                summary = json.loads(next(Path(tmp, "out").glob("summary*.json")).read_text())
            val = dict((int(step), success) for step, success, *_ in summary["val_points"])
            out[code].append(
                {
                    "wall": wall,
                    "val0": val.get(0),
                    "val10": val.get(10),
                    "val_last": summary["after"]["success"],
                }
            )
            print(f"[demo] round {r + 1} {code:<8}: {wall:.1f} s, validation {val}", flush=True)
    return out


def section(args: argparse.Namespace, rollouts: dict | None, demo: dict | None) -> str:
    lines = [
        SECTION_HEADING,
        "",
        harness.dated_machine_line(),
        f"- Baseline: `{args.baseline}` = {git_describe(args.baseline)}; this code: {git_describe(harness.REPO)}",
        f"- Command: `{harness.command_line()}`; wall time {args.wall:.0f} s; {args.rounds} rounds, the order "
        "alternating; every figure comes from a child process of its own (PYTHONPATH = the tree's src)",
        "",
    ]
    if rollouts:
        lines += [
            f"### (b) 32 agents x 3 chat calls, max_tokens=24, `small` preset ({args.runs_per_child} measured runs "
            "per child after a warm-up)",
            "",
            "| code | dtype | tok/s (median) | per child (median of its runs) | p95 ms/call (median) | this / baseline |",
            "|---|---|---:|---|---:|---:|",
        ]
        for dtype in DTYPES:
            base = statistics.median(statistics.median(c["tok_s"]) for c in rollouts[("baseline", dtype)])
            for code in ("baseline", "this"):
                per_child = [statistics.median(c["tok_s"]) for c in rollouts[(code, dtype)]]
                med = statistics.median(per_child)
                p95 = statistics.median(c["p95_ms"] for c in rollouts[(code, dtype)])
                lines.append(
                    f"| {code} | {dtype} | {med:.0f} | {', '.join(f'{x:.0f}' for x in per_child)} | {p95:.0f} "
                    f"| {med / base:.2f}x |"
                )
        best_base = max(
            statistics.median(statistics.median(c["tok_s"]) for c in rollouts[("baseline", d)])
            for d in DTYPES
        )
        this_bf16 = statistics.median(statistics.median(c["tok_s"]) for c in rollouts[("this", "bfloat16")])
        lines += [
            "",
            f"This code in bf16 against the baseline's faster dtype: {this_bf16 / best_base:.2f}x.",
            "",
        ]
    if demo:
        lines += [
            "### The demo from scratch (each tree's `examples/train_agent.py`, its defaults, a fresh --path)",
            "",
            "| round | baseline s | this code s | baseline / this | validation success 0 → 10 → end: baseline; this |",
            "|---|---:|---:|---:|---|",
        ]
        pairs = list(zip(demo["baseline"], demo["this"], strict=True))
        for i, (b, t) in enumerate(pairs):
            lines.append(
                f"| {i + 1} | {b['wall']:.1f} | {t['wall']:.1f} | {b['wall'] / t['wall']:.2f}x | "
                f"{b['val0']:.2f} → {b['val10']:.2f} → {b['val_last']:.2f}; "
                f"{t['val0']:.2f} → {t['val10']:.2f} → {t['val_last']:.2f} |"
            )
        ratio = statistics.median(b["wall"] / t["wall"] for b, t in pairs)
        walls = statistics.median(b["wall"] for b, _ in pairs), statistics.median(t["wall"] for _, t in pairs)
        lines += [
            "",
            f"Median pair ratio {ratio:.2f}x; median walls {walls[0]:.0f} s and {walls[1]:.0f} s.",
            "",
        ]
    return "\n".join(lines)


def headline(args: argparse.Namespace, rollouts: dict | None, demo: dict | None) -> str:
    """The summary row's figures: this code over the baseline's, (b) in bf16 against its faster dtype, the demo."""
    figures = []
    if rollouts:
        tok_s = {
            key: statistics.median(statistics.median(c["tok_s"]) for c in children)
            for key, children in rollouts.items()
        }
        best_base = max(tok_s[("baseline", d)] for d in DTYPES)
        figures.append(f"(b) {tok_s[('this', 'bfloat16')] / best_base:.2f}x the baseline's tok/s")
    if demo:
        ratio = statistics.median(
            b["wall"] / t["wall"] for b, t in zip(demo["baseline"], demo["this"], strict=True)
        )
        figures.append(f"the demo {ratio:.2f}x faster (median pair)")
    return "; ".join(figures) + f", baseline {git_describe(args.baseline).split(' ', 1)[0]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="the earlier commit's source tree (a git worktree)")
    parser.add_argument("--parts", default="b,demo", help="b (rollouts on `small`), demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs-per-child", type=int, default=2)
    parser.add_argument("--out", type=Path, default=harness.HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=harness.HERE / "out" / "models")
    parser.add_argument("--worker", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.baseline is None or not (args.baseline / "src" / "artrl" / "__init__.py").exists():
        parser.error(
            "--baseline must be a source tree of artrl (with src/artrl), e.g. a `git worktree add` of a commit"
        )
    args.baseline = args.baseline.resolve()
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not args.parts or args.parts - {"b", "demo"}:
        parser.error("--parts takes a comma-separated subset of b,demo")
    if args.rounds < 1 or args.runs_per_child < 1:
        parser.error("--rounds and --runs-per-child must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(asyncio.run(rollouts_worker(args.worker, args.dtype, args.runs_per_child))))
        return 0
    started = time.perf_counter()
    trees = {"baseline": args.baseline, "this": harness.REPO}
    rollouts = measure_rollouts(trees, args) if "b" in args.parts else None
    demo = measure_demo(trees, args) if "demo" in args.parts else None
    args.wall = time.perf_counter() - started
    harness.write_summary_row(
        args.out,
        "bench_against_commit.py",
        "this code vs an earlier commit, side by side: 32 agents on `small`, the demo from scratch",
        headline(args, rollouts, demo),
    )
    return harness.publish(section(args, rollouts, demo), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
