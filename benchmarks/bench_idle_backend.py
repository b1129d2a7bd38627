"""A second embedded engine in the same process, idle, slows the first: bench_rollouts' workload (b) (32 agents
x 3 chat calls, `small` preset, bf16, through `model.openai_client()`) measured in one process run in three
phases: alone; next to a second LocalBackend that has served 32 requests and sits idle with its engine thread
kept alive (`engine_thread_idle_s` set very long: the engine before that setting); the same with the default
setting (the idle thread ends, its OpenMP team with it); after the second is closed; after torch work of the
user's own (large products) on a thread that then ended; and after the same on the main thread.

    .venv/bin/python benchmarks/bench_idle_backend.py [--runs 3] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rollouts as br
import harness

SECTION_HEADING = "## A second, idle embedded engine in the process (bench_idle_backend.py)"
KEPT = "second served 32 requests, idle, its engine thread kept (as before `engine_thread_idle_s`)"
OWN_THREAD = "after the user's torch products on a thread that then ended"
MAIN_THREAD = "after the user's torch products on the main thread (its OpenMP team stays)"
ENDED = "second served 32 requests, idle, its engine thread ended after `engine_thread_idle_s` (default 2 s)"


async def phases(runs: int) -> dict[str, list[float]]:
    import artrl

    folder = harness.ensure_model("small", harness.HERE / "out" / "models")
    work = br.Workload("b", "small", 32, 3, 24)
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with artrl.LocalBackend(
            path=Path(tmp) / "a", engine=artrl.EngineConfig(dtype="bfloat16")
        ) as main:
            model = artrl.TrainableModel(name="measured", project="p", base_model=str(folder))
            await model.register(main)
            endpoint = br.Endpoint(model.openai_client(), model.name, {"ignore_eos": True})

            async def measure(phase: str) -> None:
                await br.run_sessions(endpoint, work, f"{phase}-warm")  # (each phase's first run is dropped)
                out[phase] = [
                    (await br.run_sessions(endpoint, work, f"{phase}-{i}")).tok_s for i in range(runs)
                ]

            await measure("alone")

            async def served_then_idle(name: str, idle_s: float) -> artrl.LocalBackend:
                engine = artrl.EngineConfig(dtype="bfloat16", engine_thread_idle_s=idle_s)
                other = artrl.LocalBackend(path=Path(tmp) / name, engine=engine)
                second = artrl.TrainableModel(name=name, project="p", base_model=str(folder))
                await second.register(other)
                side = br.Endpoint(second.openai_client(), second.name, {"ignore_eos": True})
                await br.run_sessions(side, br.Workload("b", "small", 32, 1, 8), "side")
                await asyncio.sleep(idle_s + 0.5 if idle_s < 60 else 1.5)
                return other

            other = await served_then_idle("kept", 1e6)
            await measure(KEPT)
            await other.close()
            other = await served_then_idle("ended", artrl.EngineConfig().engine_thread_idle_s)
            await measure(ENDED)
            await other.close()
            await measure("second closed")
            # torch work of the user's own in the same process: on a thread that ends, then on the main
            # thread (last: the main thread keeps its OpenMP team for the rest of the process)
            harness.on_own_thread(products)
            await measure(OWN_THREAD)
            products()
            await measure(MAIN_THREAD)
    return out


def products() -> None:
    """Some torch work of a user's own: 2048^3 products in fp32, as a reward model's or judge's would be."""
    import torch

    a = torch.randn(2048, 2048)
    for _ in range(3):
        a @ a


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(harness.HERE / "RESULTS.md"))
    args = parser.parse_args()
    results = asyncio.run(phases(args.runs))
    info = harness.machine_info()
    base = statistics.median(results["alone"])
    lines = [
        SECTION_HEADING,
        "",
        f"`{harness.command_line()}` on {info.get('cpu', '?')} ({os.cpu_count()} cores), one process; workload (b)"
        " of bench_rollouts.py; medians of the runs after each phase's warm-up run.",
        "",
        "| phase | generated tok/s (median) | vs alone | runs |",
        "|---|---|---|---|",
    ]
    for phase, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {phase} | {median:.0f} | {median / base:.2f}x | {runs} |")
    lines += [
        "",
        "An idle engine burns no CPU, but a thread that has run torch ops keeps an OpenMP team, and with more libgomp",
        "threads than CPUs every team's spin-waiting is throttled (`OMP_WAIT_POLICY=ACTIVE`: worse). Hence",
        "`EngineConfig.engine_thread_idle_s` (default 2 s): an idle engine thread ends. The same holds for a user's own",
        'torch work in the process: run it on a thread that ends (docs/engines.md, "Your own torch work in the same process").',
        "",
    ]
    harness.write_summary_row(
        args.out,
        "bench_idle_backend.py",
        "32 agents on `small` beside a second, idle engine in the process (and after the user's own torch work)",
        f"{statistics.median(results[ENDED]) / base:.2f}x alone with the idle engine's thread ended (the default), "
        f"{statistics.median(results[KEPT]) / base:.2f}x with it kept",
    )
    return harness.publish("\n".join(lines), args.out, SECTION_HEADING)


if __name__ == "__main__":
    raise SystemExit(main())
