"""N models on one base copy (the training server's SharedBase) against N models each with its own copy
(what N LocalBackends load), side by side: resident memory after registering them and after one SFT step
each (adapters and optimizer states), and the step's time. Each setting runs in a fresh subprocess.

    .venv/bin/python benchmarks/bench_server_models.py [--preset small] [--models 1,2,4]

It replaces the section `## Models on one base copy (bench_server_models.py)` of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, command_line, dated_machine_line, ensure_model, publish, write_summary_row

SECTION_HEADING = "## Models on one base copy (bench_server_models.py)"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def child(mode: str, n: int, base: str) -> dict[str, float]:
    import artrl
    from artrl.config import EngineConfig, GatewayConfig, SFTConfig, TrainerConfig
    from artrl.local.backend.models_here import ModelsHere
    from artrl.local.models.shared_base import SharedBase

    load = SharedBase(base).load if mode == "shared" else None
    engine = EngineConfig(merge_lora="never")  # (as the server runs them: no merged copy per model)
    conversations = [
        artrl.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": f"question {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        )
        for i in range(16)
    ]
    with tempfile.TemporaryDirectory() as folder:
        here = ModelsHere(folder, engine, GatewayConfig(), TrainerConfig(), load)
        start = rss_mib()
        models = [artrl.TrainableModel(name=f"m{i}", project="bench", base_model=base) for i in range(n)]
        for model in models:
            await here.register(model)
        registered = rss_mib()
        times = []
        for model in models:
            t = time.perf_counter()
            await here.train_sft(model, conversations, SFTConfig(batch_size=16))
            times.append(time.perf_counter() - t)
        trained = rss_mib()
        await here.close()
    return {
        "registered": registered - start,
        "trained": trained - start,
        "step_s": statistics.median(times),
    }


def weights_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def run_child(mode: str, n: int, base: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(n), str(base)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--models", default="1,2,4")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, n, base = args.child
        print(json.dumps(asyncio.run(child(mode, int(n), base))), flush=True)
        return 0
    base = ensure_model(args.preset, HERE / "out" / "models")  # (as bench_memory.py: ignored by git)
    rows, last_ratio, reading = [], None, ""
    for n in (int(x) for x in args.models.split(",")):
        separate, shared = run_child("separate", n, base), run_child("shared", n, base)
        ratio = separate["trained"] / max(shared["trained"], 1e-9)
        last_ratio = (n, ratio)
        if n > 1:
            saved = (separate["trained"] - shared["trained"]) / (n - 1)
            grown = (shared["trained"] - shared["registered"]) / n
            reading = (
                f"Reading: each model beyond the first costs {saved:.0f} MiB less on one base copy (the base "
                f"weights: {weights_mib(base):.0f} MiB); what still grows per model on one copy, ~{grown:.0f} MiB "
                "after its first step, is each model's own working memory: with MALLOC_ARENA_MAX=2 it was "
                "~130 MiB, so much of it is the allocator's per-thread arenas (each model trains on its own "
                "engine thread); one training thread for every model is the next step."
            )
        rows.append(
            f"| {n} | {separate['registered']:.0f} | {shared['registered']:.0f} | {separate['trained']:.0f} | "
            f"{shared['trained']:.0f} | {ratio:.2f}x | {separate['step_s']:.2f} | {shared['step_s']:.2f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            SECTION_HEADING,
            "",
            f"- Command: `{command_line()}`",
            f"- {dated_machine_line()}",
            f"- Preset `{args.preset}` (fp32, rank-8 LoRA per model, generation through the adapter); one "
            "subprocess per setting: resident memory (VmRSS) grown by registering N models, then by one SFT "
            "step each (16 conversations: optimizer states); the step time is the median over the models",
            "",
            "| models | registered, own copies (MiB) | registered, one base copy (MiB) | after a step, own "
            "copies (MiB) | after a step, one base copy (MiB) | memory ratio | step s, own | step s, shared |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            reading,
            "",
        ]
    )
    if last_ratio is not None:
        n, ratio = last_ratio
        write_summary_row(
            args.out,
            "bench_server_models.py",
            "N models on one base copy (the training server) vs N own copies: resident memory, step time",
            f"{n} models: {ratio:.2f}x less memory than {n} own copies",
        )
    return publish(text, args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
