"""bf16 against fp32 on the `small` preset, side by side in one process: decode throughput of the embedded
engine and one GRPO training step, with the trainer/sampler logprob mismatch each dtype gives.

`EngineConfig(dtype="bfloat16")` loads the base weights in bf16; the LoRA adapter stays fp32 (PEFT keeps
adapters in fp32 over a bf16 base) and the loss's log-softmax runs in fp32. For each dtype, alternating over
--rounds: a fresh model with a rank-8 LoRA; --agents sequences of --tokens sampled tokens at once (median of 3
runs); then training steps on 8 of those sequences (advantages +-1, lr 1e-6), the first step's mismatch
(before any update: engine and trainer on the same weights) and the median time of the others, with
artrl's fused LoRA linears and with PEFT's layer forward in turn.

    .venv/bin/python benchmarks/bench_bf16.py [--rounds 2] [--agents 32] [--tokens 64]

The section `## bf16 vs fp32 (bench_bf16.py)` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, alternating, command_line, dated_machine_line, ensure_model, publish

SECTION_HEADING = "## bf16 vs fp32 (bench_bf16.py)"
DTYPES = ("float32", "bfloat16")


def measure(folder: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from artrl.config import EngineConfig, LoraConfig, TrainConfig
    from artrl.local.batch import TrainingBatch
    from artrl.local.engine import SamplingParams
    from artrl.local.engine_hf import HFEngine
    from artrl.local.loading import load_model_and_tokenizer
    from artrl.local.rows import Row
    from artrl.local.trainer import Trainer, attach_adapter

    config = EngineConfig(dtype=dtype)
    model, _ = load_model_and_tokenizer(str(folder), config)
    model = attach_adapter(model, LoraConfig())
    model.eval()
    engine = HFEngine(model, max_context=2048, config=config)
    prompt = [(7 * i) % 1000 + 10 for i in range(40)]

    async def decode() -> tuple[float, list[tuple[list[int], list[float]]]]:
        async def one(seed: int) -> tuple[list[int], list[float]]:
            choices = [c async for c in engine.generate(prompt, SamplingParams(args.tokens, seed=seed), 1)[0]]
            return [c.token_id for c in choices], [c.logprob for c in choices]

        started = time.perf_counter()
        out = await asyncio.gather(*(one(seed) for seed in range(args.agents)))
        return sum(len(ids) for ids, _ in out) / (time.perf_counter() - started), out

    runs = [asyncio.run(decode()) for _ in range(3)]
    # the same model trained by artrl's fused LoRA linears and by PEFT's layer forward, step by step in turn
    trainers = {"fused": Trainer(model, pad_id=0, fused_lora=True), "peft": Trainer(model, pad_id=0)}
    rows = []
    for i, (ids, logprobs) in enumerate(runs[-1][1][:8]):
        row = Row(trajectory=i, advantage=1.0 if i % 2 else -1.0, weight=1.0)
        row.extend(prompt, sampled=False)
        row.extend(ids, sampled=True, logprobs=logprobs)
        rows.append(row)
    steps: dict[str, list[float]] = {"fused": [], "peft": []}
    first: dict[str, Any] = {}
    for k in range(2 * args.train_steps):
        name = ("fused", "peft")[k % 2]
        trainer = trainers[name]
        started = time.perf_counter()
        metrics = engine.call(
            lambda t=trainer: t.step(TrainingBatch(rows=rows), TrainConfig(learning_rate=1e-6))
        )
        result = metrics.result()
        steps[name].append(time.perf_counter() - started)
        if k == 0:
            first = result
    asyncio.run(engine.close())
    return {
        "tok_s": statistics.median(r[0] for r in runs),
        "tok_s_runs": [r[0] for r in runs],
        "train_s": statistics.median(steps["fused"][1:]),
        "train_s_peft": statistics.median(steps["peft"][1:]),
        "mismatch_mean": first["logprob_mismatch_mean"],
        "mismatch_max": first["logprob_mismatch_max"],
        "mismatch_fraction": first["logprob_mismatch_fraction"],
    }


def section(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, wall: float) -> str:
    keys = ("tok_s", "train_s", "train_s_peft")
    med = {d: {k: statistics.median(r[k] for r in results[d]) for k in keys} for d in DTYPES}
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- `small` preset (~27M parameters) with a rank-8 LoRA; decode: {args.agents} sequences x {args.tokens} "
        f"tokens at once (40-token prompt), median of 3 runs; train: one GRPO step on 8 of those sequences, median "
        f"of {args.train_steps - 1} steps with artrl's fused LoRA linears (`TrainerConfig.fused_lora`, the default) "
        f"and as many with PEFT's layer forward, the two taking turns step by step on the same model (lr 1e-6); "
        f"{args.rounds} round(s), dtypes alternating, a fresh model each",
        f"- Command: `{command_line()}`; wall time {wall:.0f} s",
        "",
        "| dtype | decode tok/s | train step s | train step s, PEFT's forward | mismatch mean | mismatch max | "
        "fraction > 0.5 | per round (tok/s; s; PEFT s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in DTYPES:
        rs = results[d]
        lines.append(
            f"| {d} | {med[d]['tok_s']:.0f} | {med[d]['train_s']:.3f} | {med[d]['train_s_peft']:.3f} | "
            f"{rs[0]['mismatch_mean']:.2e} | {rs[0]['mismatch_max']:.2e} | {rs[0]['mismatch_fraction']:.3f} | "
            + "; ".join(f"{r['tok_s']:.0f}, {r['train_s']:.3f}, {r['train_s_peft']:.3f}" for r in rs)
            + " |"
        )
    speed = med["bfloat16"]["tok_s"] / med["float32"]["tok_s"]
    train = med["float32"]["train_s"] / med["bfloat16"]["train_s"]
    peft = {d: med[d]["train_s_peft"] / med[d]["train_s"] for d in DTYPES}
    lines += [
        "",
        f"bf16 / fp32: decode {speed:.2f}x, training step {train:.2f}x faster "
        f"(with PEFT's forward: {med['float32']['train_s_peft'] / med['bfloat16']['train_s_peft']:.2f}x). "
        f"Fused LoRA linears / PEFT's forward: fp32 {peft['float32']:.2f}x, bf16 {peft['bfloat16']:.2f}x faster.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    folder = ensure_model("small", args.model_cache)
    results: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
    for k in range(args.rounds):
        for dtype in alternating(DTYPES, k):
            results[dtype].append(measure(folder, dtype, args))
            print(f"round {k + 1} {dtype}: {results[dtype][-1]}", flush=True)
    return publish(section(results, args, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
