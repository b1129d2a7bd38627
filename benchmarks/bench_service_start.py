"""A served model's start with trl's templates kept as data (trl_data.py) against reading them from trl: the
maze demo's warm start registered on a LocalBackend (its service child: imports, weights, chat format) and
answering one chat call, in a fresh process each run, alternating, with $ARTRL_CACHE_DIR either holding the
templates (warm: the usual case after the first start on a machine) or empty (cold: what every start paid before
the cache, the import of trl.chat_template_utils).

    .venv/bin/python benchmarks/bench_service_start.py [--rounds 5]

It replaces the section `## A served model's start (bench_service_start.py)` of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, alternating, command_line, dated_machine_line, publish, write_summary_row

SECTION_HEADING = "## A served model's start (bench_service_start.py)"
MODELS = HERE.parent / "examples" / "models"

START = """
import asyncio, json, sys, time
import artrl

async def main(base, path):
    t = time.perf_counter()
    async with artrl.LocalBackend(path=path) as backend:
        model = artrl.TrainableModel(name="start", project="bench", base_model=base)
        await model.register(backend)
        registered = time.perf_counter() - t
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, timeout=120
        )
        print(json.dumps({"register_s": registered, "first_call_s": time.perf_counter() - t}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def start(base: Path, cache: Path, work: Path) -> dict[str, float]:
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", START, str(base), str(work)],
        env={**os.environ, "ARTRL_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    (base,) = MODELS.glob("maze-warm-*")
    started = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        start(base, warm, Path(tmp) / "first")  # (fills the warm cache; not counted)
        for r in range(args.rounds):
            for mode in alternating(("warm", "cold"), r):
                cache = warm if mode == "warm" else Path(tmp) / f"cold-{r}"
                runs[mode].append(start(base, cache, Path(tmp) / f"{mode}-{r}"))
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    ratio = med["warm"]["first_call_s"] / med["cold"]["first_call_s"]
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- The shipped maze warm start ({base.name}) registered on a LocalBackend in a fresh process, then one "
        f"chat call; {args.rounds} rounds, warm and cold alternating; medians",
        f"- Command: `{command_line()}`; wall time {time.perf_counter() - started:.0f} s",
        "",
        "| trl's templates | register s | register + first call s | process s | per run (first call) |",
        "|---|---:|---:|---:|---|",
    ]
    for mode, label in (("warm", "kept as JSON (warm cache)"), ("cold", "read from trl (empty cache)")):
        per_run = ", ".join(f"{x['first_call_s']:.2f}" for x in runs[mode])
        m = med[mode]
        lines.append(
            f"| {label} | {m['register_s']:.2f} | {m['first_call_s']:.2f} | {m['process_s']:.2f} | {per_run} |"
        )
    lines += ["", f"Warm / cold, register + first call: {ratio:.2f}x."]
    write_summary_row(
        args.out,
        "bench_service_start.py",
        "a served model's start (LocalBackend register + one call) with trl's templates cached vs read from trl",
        f"{ratio:.2f}x the cold start's time ({med['warm']['first_call_s']:.1f} s vs "
        f"{med['cold']['first_call_s']:.1f} s, medians of {args.rounds})",
    )
    return publish("\n".join(lines), args.out, SECTION_HEADING)


if __name__ == "__main__":
    raise SystemExit(main())
