"""N models on one base copy (the training server: one model holding every model's adapter, one engine
batching their requests and running their steps in turn) against N models each with its own copy, engine
and trainer (what N LocalBackends run), side by side: every model does rollouts (all models at once) then a
GRPO step (all at once); resident memory, aggregate rollout tokens/s and the step's wall time. Each setting
runs in a fresh subprocess.

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


PROMPTS = [[{"role": "user", "content": f"Question {i}: name a colour and a number."}] for i in range(4)]
ROLLOUTS, MAX_TOKENS = 4, 48  # per prompt and model


async def child(mode: str, n: int, base: str) -> dict[str, float]:
    import openai

    import artrl
    from artrl.config import EngineConfig, GatewayConfig, TrainConfig, TrainerConfig
    from artrl.local.backend.models_here import ModelsHere
    from artrl.local.server.shared_model import SharedModel

    # own copies: what a LocalBackend runs (its defaults); one copy: what `artrl server` runs
    engine = EngineConfig() if mode == "separate" else EngineConfig(merge_lora="never")
    shared = SharedModel(base, engine) if mode == "shared" else None
    with tempfile.TemporaryDirectory() as folder:
        here = ModelsHere(folder, engine, GatewayConfig(), TrainerConfig(), shared.start if shared else None)
        start = rss_mib()
        models = [artrl.TrainableModel(name=f"m{i}", project="bench", base_model=base) for i in range(n)]
        for model in models:
            await here.register(model)
        registered = rss_mib()

        async def rollouts(model) -> tuple[list[artrl.TrajectoryGroup], int]:
            client = openai.AsyncOpenAI(base_url=here.service(model).base_url, api_key="-", timeout=600)

            async def one(prompt, k):
                completion = await client.chat.completions.create(
                    model=model.name, messages=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=k
                )
                choice = completion.choices[0]
                reward = float(len(choice.message.content or "") % 3)
                return artrl.Trajectory(messages_and_choices=[*prompt, choice], reward=reward), len(
                    choice.model_extra["token_ids"]
                )

            groups, tokens = [], 0
            done = await asyncio.gather(*(one(p, k) for p in PROMPTS for k in range(ROLLOUTS)))
            for g in range(len(PROMPTS)):
                part = done[g * ROLLOUTS : (g + 1) * ROLLOUTS]
                groups.append(artrl.TrajectoryGroup([t for t, _ in part]))
                tokens += sum(k for _, k in part)
            await client.close()
            return groups, tokens

        await asyncio.gather(*(rollouts(m) for m in models))  # (warm-up: first calls, thread start)
        t = time.perf_counter()
        sampled = await asyncio.gather(*(rollouts(m) for m in models))
        rollout_s = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(
            *(
                here.train(m, groups, TrainConfig(learning_rate=1e-5))
                for m, (groups, _) in zip(models, sampled, strict=True)
            )
        )
        step_s = time.perf_counter() - t
        trained = rss_mib()
        await here.close()
        if shared is not None:
            await shared.close()
    return {
        "registered": registered - start,
        "trained": trained - start,
        "tok_s": sum(k for _, k in sampled) / rollout_s,
        "step_s": step_s,
    }


def median_of(results: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


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
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (medians reported)")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, n, base = args.child
        print(json.dumps(asyncio.run(child(mode, int(n), base))), flush=True)
        return 0
    base = ensure_model(args.preset, HERE / "out" / "models")  # (as bench_memory.py: ignored by git)
    rows, summary, reading, first = [], "", "", None
    for n in (int(x) for x in args.models.split(",")):
        runs = [(run_child("separate", n, base), run_child("shared", n, base)) for _ in range(args.repeats)]
        separate, shared = (median_of([r[i] for r in runs]) for i in (0, 1))
        ratio = separate["trained"] / max(shared["trained"], 1e-9)
        summary = (
            f"{n} models: {ratio:.2f}x less memory, rollouts {shared['tok_s'] / separate['tok_s']:.2f}x, "
            f"steps {separate['step_s'] / shared['step_s']:.2f}x the speed of {n} own copies"
        )
        if first is None:
            first = (n, separate, shared)
        elif n > first[0]:
            more = n - first[0]
            own = (separate["trained"] - first[1]["trained"]) / more
            one = (shared["trained"] - first[2]["trained"]) / more
            reading = (
                f"Reading: from {first[0]} to {n} models, each more model costs ~{own:.0f} MiB with its own copy "
                f"(the base weights, {weights_mib(base):.0f} MiB, its engine with its merged and fused copies, "
                f"its threads' allocator arenas) and ~{one:.0f} MiB on one copy (its adapter and optimizer "
                "state, its trainer, gateway and tokenizer, its share of the activations). Rollouts of several "
                "models go through one engine, each adapter's low-rank products beside the shared base "
                "products, where own copies run merged weights on engine threads of their own."
            )
        rows.append(
            f"| {n} | {separate['trained']:.0f} | {shared['trained']:.0f} | {ratio:.2f}x | "
            f"{separate['tok_s']:.0f} | {shared['tok_s']:.0f} | {separate['step_s']:.2f} | {shared['step_s']:.2f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            SECTION_HEADING,
            "",
            f"- Command: `{command_line()}`",
            dated_machine_line(),
            f"- Preset `{args.preset}` (fp32, rank-8 LoRA per model); one subprocess per run of a setting, "
            f"{args.repeats} runs each (own copies and one copy in turn), medians. Own copies: N "
            "models as N LocalBackends run them (each its weights, engine with merged LoRA and fused decode, "
            "trainer); one copy: as `artrl server` runs them (one model holding every adapter, one engine). "
            f"Each model samples {len(PROMPTS)} prompts x {ROLLOUTS} rollouts of up to {MAX_TOKENS} tokens "
            "(every model at once, after a warm-up round), then trains one GRPO step on them (every model at "
            "once). Memory: resident memory (VmRSS) grown from before registering to after the step",
            "",
            "| models | memory, own copies (MiB) | memory, one copy (MiB) | memory ratio | rollout tok/s, own "
            "| rollout tok/s, one copy | N steps s, own | N steps s, one copy |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            reading,
            "",
        ]
    )
    if summary:
        write_summary_row(
            args.out,
            "bench_server_models.py",
            "N models on one base copy (the training server) vs N own copies: memory, rollouts, steps",
            summary,
        )
    return publish(text, args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
