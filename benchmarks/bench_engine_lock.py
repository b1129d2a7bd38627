"""The embedded engine's layer loops and sampling as TorchScript calls against the same code run eagerly, with
the gateway and the agents in the same process (the interpreter lock shared), side by side in one run.

bench_rollouts' workload (a) (`tiny` preset, --sessions concurrent tool sessions x --turns chat calls through
`model.openai_client()`, `ignore_eos`, fp32) and workload (b) (`small`, 32 agents) on one LocalBackend per
preset; between runs the engine's fused forward is rebuilt with its layer loops compiled by TorchScript
(`scripted_layers`, the default) or run eagerly, and sampling's `choose` likewise. Every eager torch operation
gives the interpreter lock away and waits to get it back while the gateway's threads run Python; the
TorchScript calls take it back a few times per step. Medians of --runs runs per mode, the modes alternating.

    .venv/bin/python benchmarks/bench_engine_lock.py [--runs 4] [--out benchmarks/RESULTS.md]

It replaces the section `## The engine's layers as TorchScript calls (bench_engine_lock.py)` of --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rollouts as br
import harness

SECTION_HEADING = "## The engine's layers as TorchScript calls (bench_engine_lock.py)"
MODES = ("TorchScript (default)", "eager")


def use(engine, scripted: bool) -> None:
    """The engine's layer loops and sampling compiled or eager, from its next step on (call it while idle)."""
    from artrl.local.engine.hf import sampling

    fused = engine._fused
    assert fused is not None, "the fused forward does not apply to this model"
    fused._script = scripted
    fused.stale()
    sampling._SCRIPTED[:] = []
    if not scripted:
        sampling._SCRIPTED.append(sampling.choose)


async def measure(preset: str, work: br.Workload, runs: int) -> dict[str, list[float]]:
    import artrl

    folder = harness.ensure_model(preset, harness.HERE / "out" / "models")
    out: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        async with artrl.LocalBackend(path=tmp, engine=artrl.EngineConfig(dtype="float32")) as backend:
            model = artrl.TrainableModel(name="measured", project="p", base_model=str(folder))
            await model.register(backend)
            engine = backend.service(model).engine
            endpoint = br.Endpoint(model.openai_client(), model.name, {"ignore_eos": True})
            for mode in MODES:  # (a warm-up run each: compiles, first-use setup)
                use(engine, mode == MODES[0])
                await br.run_sessions(endpoint, work, f"warm-{mode}")
            for i in range(runs):
                for mode in harness.alternating(MODES, i):
                    use(engine, mode == MODES[0])
                    await asyncio.sleep(0.5)
                    out[mode].append((await br.run_sessions(endpoint, work, f"{mode}-{i}")).tok_s)
            use(engine, True)
    return out


def section(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, wall: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        harness.dated_machine_line(),
        f"- Workloads of bench_rollouts.py through `model.openai_client()` (gateway, engine and agents in one "
        f"process, fp32): (a) `tiny`, {args.sessions} sessions x {args.turns} calls; (b) `small`, 32 agents x "
        f"3 calls; {args.max_tokens} tokens a call (`ignore_eos`); {args.runs} runs per mode, alternating",
        f"- Command: `{harness.command_line()}`; wall time {wall:.0f} s",
        "",
        "| workload | " + " | ".join(f"{m} tok/s (median)" for m in MODES) + " | ratio | runs |",
        "|---|---:|---:|---:|---|",
    ]
    for name, out in results.items():
        medians = [statistics.median(out[m]) for m in MODES]
        runs = "; ".join(f"{m}: " + ", ".join(f"{v:.0f}" for v in out[m]) for m in MODES)
        lines.append(
            f"| {name} | {medians[0]:.0f} | {medians[1]:.0f} | {medians[0] / medians[1]:.2f}x | {runs} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--parts", default="a,b", help="which workloads: a (tiny), b (small)")
    parser.add_argument("--out", default=str(harness.HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = {}
    if "a" in args.parts:
        work = br.Workload("a", "tiny", args.sessions, args.turns, args.max_tokens)
        results["(a) tiny"] = asyncio.run(measure("tiny", work, args.runs))
        print("(a)", results["(a) tiny"], flush=True)
    if "b" in args.parts:
        work = br.Workload("b", "small", 32, 3, args.max_tokens)
        results["(b) small"] = asyncio.run(measure("small", work, args.runs))
        print("(b)", results["(b) small"], flush=True)
    ratios = [
        f"{name} {statistics.median(out[MODES[0]]) / statistics.median(out[MODES[1]]):.2f}x"
        for name, out in results.items()
    ]
    harness.write_summary_row(
        args.out,
        "bench_engine_lock.py",
        "the engine's layers as TorchScript calls vs the same code eager (one process, agents beside it)",
        f"TorchScript: {', '.join(ratios)} the eager tok/s",
    )
    return harness.publish(section(results, args, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
