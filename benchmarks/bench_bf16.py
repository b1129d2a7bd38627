"""bf16 against fp32 on the `small` preset, side by side in one process: decode throughput of the embedded
engine and one GRPO training step, with the trainer/sampler logprob mismatch each dtype gives.

`EngineConfig(dtype="bfloat16")` loads the base weights in bf16; the LoRA adapter stays fp32 (PEFT keeps
adapters in fp32 over a bf16 base) and the loss's log-softmax runs in fp32. Per round (--rounds), a fresh model
with a rank-8 LoRA per dtype, both loaded at once, taking turns: --agents sequences of --tokens sampled tokens
at once (3 runs each); then training steps on 8 of those sequences (advantages +-1, lr 1e-6), the first step's
mismatch (before any update: engine and trainer on the same weights) and the median time of the others,
with artrl's fused LoRA linears and RMS norms (its defaults; shared prompts on in both) and with PEFT's layer forward and the model's own
norms, the dtypes' steps one after the other (a slow minute of a noisy machine falls on both), and the
ratio of each such pair. And the step's largest matrix product alone in each dtype: the gain this CPU's bf16
units allow (a CPU whose 512-bit units are split in two, as AMD's family 25, does bf16 products ~2.3x as
fast as fp32; family 26 several times). After the rounds, GRPO steps on agent-length rows (16 x 1,000 tokens by
default): fp32 and bf16 as artrl trains them, and bf16 with torch's flash kernel instead of artrl's attention.

    .venv/bin/python benchmarks/bench_bf16.py [--rounds 2] [--agents 32] [--tokens 64] [--long-rows 16]

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

from harness import (
    HERE,
    alternating,
    command_line,
    dated_machine_line,
    ensure_model,
    on_own_thread,
    publish,
    write_summary_row,
)

SECTION_HEADING = "## bf16 vs fp32 (bench_bf16.py)"
DTYPES = ("float32", "bfloat16")
# the engines' threads end this soon after a call: the two models take turns, and an idle engine thread's
# OpenMP team spinning next to the working one's would slow it (bench_idle_backend.py)
IDLE_S = 0.05


def measure_round(
    folder: Path, args: argparse.Namespace, order: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """One round: a fresh model per dtype, both loaded at once; their decode runs and training steps take
    turns (dtype after dtype, fused and PEFT's forward in turn), so that a slow minute of a noisy machine
    falls on both dtypes alike."""
    from artrl.config import EngineConfig, LoraConfig, TrainConfig
    from artrl.local.engine.contract import SamplingParams
    from artrl.local.engine.hf.engine import HFEngine
    from artrl.local.models.loading import load_model_and_tokenizer
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.batch import TrainingBatch
    from artrl.local.train.rows import Row
    from artrl.local.train.trainer import Trainer

    prompt = [(7 * i) % 1000 + 10 for i in range(40)]
    engines = {}
    for dtype in order:
        config = EngineConfig(dtype=dtype, engine_thread_idle_s=IDLE_S)
        model, _ = load_model_and_tokenizer(str(folder), config)
        model = attach_adapter(model, LoraConfig())
        model.eval()
        engines[dtype] = (model, HFEngine(model, max_context=2048, config=config))

    async def decode(engine: Any) -> tuple[float, list[tuple[list[int], list[float]]]]:
        async def one(seed: int) -> tuple[list[int], list[float]]:
            choices = [c async for c in engine.generate(prompt, SamplingParams(args.tokens, seed=seed), 1)[0]]
            return [c.token_id for c in choices], [c.logprob for c in choices]

        started = time.perf_counter()
        out = await asyncio.gather(*(one(seed) for seed in range(args.agents)))
        return sum(len(ids) for ids, _ in out) / (time.perf_counter() - started), out

    runs: dict[str, list[Any]] = {d: [] for d in order}
    for _ in range(3):
        for dtype in order:
            runs[dtype].append(asyncio.run(decode(engines[dtype][1])))
    # each model trained by artrl's fused LoRA linears and RMS norms (TrainerConfig's defaults) and by PEFT's
    # layer forward with the model's own norms
    trainers, rows = {}, {}
    for dtype, (model, _) in engines.items():
        fused = Trainer(model, pad_id=0, fused_lora=True, fused_norms=True, share_prompts=True)
        # (shared prompts in both: the fused/PEFT ratio is the fused layers' alone)
        trainers[dtype] = {"fused": fused, "peft": Trainer(model, pad_id=0, share_prompts=True)}
        rows[dtype] = []
        for i, (ids, logprobs) in enumerate(runs[dtype][-1][1][:8]):
            row = Row(trajectory=i, advantage=1.0 if i % 2 else -1.0, weight=1.0)
            row.extend(prompt, sampled=False)
            row.extend(ids, sampled=True, logprobs=logprobs)
            rows[dtype].append(row)
    steps = {d: {"fused": [], "peft": []} for d in order}
    first: dict[str, Any] = {}
    for k in range(2 * args.train_steps):
        name = ("fused", "peft")[k % 2]
        for dtype in order if k % 4 < 2 else order[::-1]:
            time.sleep(IDLE_S + 0.1)  # (the other engine's thread has ended: one OpenMP team at a time)
            trainer, engine, batch = trainers[dtype][name], engines[dtype][1], TrainingBatch(rows=rows[dtype])
            started = time.perf_counter()
            result = engine.call(
                lambda t=trainer, b=batch: t.step(b, TrainConfig(learning_rate=1e-6))
            ).result()
            steps[dtype][name].append(time.perf_counter() - started)
            first.setdefault(dtype, result)
    split = {
        dtype: engines[dtype][1]
        .call(lambda t=trainers[dtype]["fused"], d=dtype: profiled_step(t, rows[d]))
        .result()
        for dtype in order
    }
    for _, engine in engines.values():
        asyncio.run(engine.close())
    # per pair of steps (the same kind, one right after the other): fp32 seconds / bf16 seconds
    pairs = [
        f / b for f, b in zip(steps["float32"]["fused"][1:], steps["bfloat16"]["fused"][1:], strict=True)
    ]
    return {
        dtype: {
            "tok_s": statistics.median(r[0] for r in runs[dtype]),
            "tok_s_runs": [r[0] for r in runs[dtype]],
            "train_s": statistics.median(steps[dtype]["fused"][1:]),
            "train_s_peft": statistics.median(steps[dtype]["peft"][1:]),
            "pair_ratios": pairs,
            "products_ms": split[dtype][0],
            "rest_ms": split[dtype][1],
            "mismatch_mean": first[dtype]["logprob_mismatch_mean"],
            "mismatch_max": first[dtype]["logprob_mismatch_max"],
            "mismatch_fraction": first[dtype]["logprob_mismatch_fraction"],
        }
        for dtype in order
    }


LONG_VARIANTS = (("float32", "artrl_cpu"), ("bfloat16", "artrl_cpu"), ("bfloat16", "sdpa"))


def agent_length_steps(folder: Path, args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Seconds of GRPO steps on agent-length rows (--long-rows rows of --long-prompt shared prompt tokens and
    --long-tokens trained ones; the token ids are drawn, their values cost nothing), after the rounds, with a
    fresh model per dtype: fp32 and bf16 as artrl trains them (its attention `artrl_cpu`: the flash kernel in
    fp32, `chunked_attention` in bf16), and bf16 with torch's flash kernel ("sdpa"), the three taking turns."""
    import random

    from artrl.config import EngineConfig, LoraConfig, TrainConfig
    from artrl.local.kernels.cpu_attention import NAME
    from artrl.local.models.loading import load_model_and_tokenizer
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.batch import TrainingBatch
    from artrl.local.train.rows import Row
    from artrl.local.train.trainer import Trainer

    draw = random.Random(0)
    prompt = [draw.randrange(10, 1000) for _ in range(args.long_prompt)]
    rows = []
    for i in range(args.long_rows):
        row = Row(trajectory=i, advantage=1.0 if i % 2 else -1.0, weight=1.0)
        row.extend(prompt, sampled=False)
        tokens = [draw.randrange(10, 1000) for _ in range(args.long_tokens)]
        row.extend(tokens, sampled=True, logprobs=[-1.0] * args.long_tokens)
        rows.append(row)
    models = {}
    for dtype in DTYPES:
        model, _ = load_model_and_tokenizer(str(folder), EngineConfig(dtype=dtype))
        models[dtype] = attach_adapter(model, LoraConfig())
    steps: dict[tuple[str, str], list[float]] = {v: [] for v in LONG_VARIANTS}
    for k in range(args.long_steps):
        for dtype, attention in LONG_VARIANTS if k % 2 == 0 else LONG_VARIANTS[::-1]:
            model = models[dtype]
            trainer = Trainer(model, pad_id=0, fused_lora=True, fused_norms=True, share_prompts=True)
            model.get_base_model().set_attn_implementation(NAME if attention == "artrl_cpu" else attention)
            started = time.perf_counter()
            trainer.step(TrainingBatch(rows=rows), TrainConfig(learning_rate=1e-6))
            steps[(dtype, attention)].append(time.perf_counter() - started)
            model.get_base_model().set_attn_implementation(NAME)
            print(
                f"agent-length step {k + 1} {dtype} {attention}: {steps[(dtype, attention)][-1]:.2f} s",
                flush=True,
            )
    return steps


PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm")


def profiled_step(trainer: Any, rows: list[Any]) -> tuple[float, float]:
    """One training step under torch's profiler (on the engine's thread): milliseconds of CPU time in matrix
    products (`PRODUCTS`, their own time) and in everything else. What bf16 can gain is mostly the first
    (products run at the bf16 units' rate); the rest (norms, activations, softmax, casts, Python, autograd) gains
    little, so it bounds the step's gain (Amdahl)."""
    from torch.profiler import ProfilerActivity, profile

    from artrl.config import TrainConfig
    from artrl.local.train.batch import TrainingBatch

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(TrainingBatch(rows=rows), TrainConfig(learning_rate=1e-6))
    events = prof.key_averages()
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCTS) / 1000
    total = sum(e.self_cpu_time_total for e in events) / 1000
    return products, total - products


def peak_gflops(dtype: str, n: int = 2048) -> float:
    """This CPU's matrix-product rate in `dtype` on a large square product (n x n x n), best of 5: what its
    units give when nothing else counts."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=a.dtype)
    a @ b
    times = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * n**3 / min(times) / 1e9


def product_ms(dtype: str, repeats: int = 40) -> float:
    """Median milliseconds of the step's largest matrix product (the MLP's: 8 x 104 tokens, 512 -> 1536) in
    `dtype`: what this CPU's bf16 units give over fp32 before anything else in the step counts."""
    import torch

    x = torch.randn(832, 512, dtype=getattr(torch, dtype))  # (N, in)
    w = torch.randn(1536, 512, dtype=x.dtype)  # (out, in)
    times = []
    for k in range(repeats + 5):
        started = time.perf_counter()
        x @ w.t()
        if k >= 5:
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def ratio(med: dict[str, dict[str, float]], key: str) -> float:
    return med["float32"][key] / med["bfloat16"][key]


def amdahl(med: dict[str, dict[str, float]]) -> str:
    """What the profiled split allows: the step's ratio with the rest at no cost in either dtype, and how much
    of bf16's rest would have to go (everything else as it is) for a 2x step."""
    f, b = med["float32"], med["bfloat16"]
    bound = f["products_ms"] / b["products_ms"]
    # (Pf + Rf) / (Pb + x) = 2  =>  x = (Pf + Rf) / 2 - Pb
    allowed = (f["products_ms"] + f["rest_ms"]) / 2 - b["products_ms"]
    need = (
        ""
        if allowed >= b["rest_ms"]
        else (
            f" A 2x step would need bf16's rest at {max(allowed, 0):.0f} ms instead of {b['rest_ms']:.0f} (fp32's as it is)."
        )
    )
    return f"With the rest at no cost in both, the step would be {bound:.2f}x.{need}"


def section(
    results: dict[str, list[dict[str, Any]]],
    long_steps: dict[tuple[str, str], list[float]],
    args: argparse.Namespace,
    wall: float,
) -> str:
    keys = (
        "tok_s",
        "train_s",
        "train_s_peft",
        "product_ms",
        "products_ms",
        "rest_ms",
    )
    keys += ("peak_gflops",)
    med = {d: {k: statistics.median(r[k] for r in results[d]) for k in keys} for d in DTYPES}
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        f"- `small` preset (~27M parameters) with a rank-8 LoRA; decode: {args.agents} sequences x {args.tokens} "
        f"tokens at once (40-token prompt), median of 3 runs; train: one GRPO step on 8 of those sequences, median "
        f"of {args.train_steps - 1} steps with artrl's fused LoRA linears and RMS norms (`TrainerConfig.fused_lora`, "
        f"`fused_norms`, `share_prompts`: the defaults) and as many with PEFT's layer forward and the model's own norms (lr 1e-6); "
        f"{args.rounds} round(s), each with a fresh model per dtype, both loaded, their runs and steps taking turns",
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
    pairs = [x for r in results["float32"] for x in r["pair_ratios"]]
    long = {v: statistics.median(t) for v, t in long_steps.items()}
    fp32_long, bf16_long = long_steps[LONG_VARIANTS[0]], long_steps[LONG_VARIANTS[1]]
    long_pairs = [f / b for f, b in zip(fp32_long, bf16_long, strict=True)]  # (taken one after the other)
    speed = med["bfloat16"]["tok_s"] / med["float32"]["tok_s"]
    train = med["float32"]["train_s"] / med["bfloat16"]["train_s"]
    peft = {d: med[d]["train_s_peft"] / med[d]["train_s"] for d in DTYPES}
    lines += [
        "",
        f"bf16 / fp32: decode {speed:.2f}x, training step {train:.2f}x faster "
        f"(with PEFT's forward: {med['float32']['train_s_peft'] / med['bfloat16']['train_s_peft']:.2f}x); per "
        f"pair of steps one right after the other, fp32 s / bf16 s: median {statistics.median(pairs):.2f}x "
        f"({min(pairs):.2f}-{max(pairs):.2f}x, {len(pairs)} pairs). "
        f"Fused LoRA linears and norms / PEFT's forward and the model's norms: fp32 {peft['float32']:.2f}x, bf16 {peft['bfloat16']:.2f}x faster.",
        f"The step's largest matrix product alone (832 x 512 -> 1536): fp32 {med['float32']['product_ms']:.2f} ms, "
        f"bf16 {med['bfloat16']['product_ms']:.2f} ms = {med['float32']['product_ms'] / med['bfloat16']['product_ms']:.2f}x "
        "(the bound this CPU's bf16 units set on the step's gain: the rest of the step gains less); "
        f"a 2048^3 product: fp32 {med['float32']['peak_gflops']:.0f}, bf16 {med['bfloat16']['peak_gflops']:.0f} "
        f"GFLOP/s = {med['bfloat16']['peak_gflops'] / med['float32']['peak_gflops']:.2f}x.",
        f"One profiled step (CPU time): matrix products fp32 {med['float32']['products_ms']:.0f} ms, bf16 "
        f"{med['bfloat16']['products_ms']:.0f} ms ({ratio(med, 'products_ms'):.2f}x); everything else fp32 "
        f"{med['float32']['rest_ms']:.0f} ms, bf16 {med['bfloat16']['rest_ms']:.0f} ms "
        f"({ratio(med, 'rest_ms'):.2f}x). {amdahl(med)}",
        "",
        f"Agent-length rows, after the rounds: GRPO steps on {args.long_rows} rows of {args.long_prompt} shared "
        f"prompt tokens + {args.long_tokens} trained tokens (artrl's defaults), {args.long_steps} per variant, the "
        "variants taking turns, a fresh model per dtype:",
        "",
        "| dtype, attention | step s (median) | steps s |",
        "|---|---:|---|",
        *(
            f"| {d}, {'artrl_cpu (as artrl trains)' if a == 'artrl_cpu' else 'sdpa (the flash kernel)'} | "
            f"{long[(d, a)]:.2f} | " + ", ".join(f"{t:.2f}" for t in long_steps[(d, a)]) + " |"
            for d, a in LONG_VARIANTS
        ),
        "",
        f"bf16 / fp32 on agent-length rows, as artrl trains: {long[LONG_VARIANTS[0]] / long[LONG_VARIANTS[1]]:.2f}x "
        f"(per pair of steps: median {statistics.median(long_pairs):.2f}x, "
        f"{min(long_pairs):.2f}-{max(long_pairs):.2f}x); bf16 with the flash kernel instead: "
        f"{long[LONG_VARIANTS[0]] / long[LONG_VARIANTS[2]]:.2f}x (artrl's bf16 attention / the flash kernel: "
        f"{long[LONG_VARIANTS[2]] / long[LONG_VARIANTS[1]]:.2f}x faster). In fp32 artrl trains with the flash kernel.",
        "",
    ]
    return "\n".join(lines)


MEASURES = "bf16 against fp32 on `small` + LoRA: a GRPO step, agent-length rows, decode"


def headline(results: dict[str, list[dict[str, Any]]], long_steps: dict[tuple[str, str], list[float]]) -> str:
    """The summary row's figures: bf16 over fp32 for the training step, agent-length rows and decode."""
    med = {d: {k: statistics.median(r[k] for r in results[d]) for k in ("tok_s", "train_s")} for d in DTYPES}
    long = {v: statistics.median(t) for v, t in long_steps.items()}
    return (
        f"bf16 training step {med['float32']['train_s'] / med['bfloat16']['train_s']:.2f}x fp32 "
        f"(agent-length rows {long[LONG_VARIANTS[0]] / long[LONG_VARIANTS[1]]:.2f}x); decode "
        f"{med['bfloat16']['tok_s'] / med['float32']['tok_s']:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--long-rows", type=int, default=16)
    parser.add_argument("--long-prompt", type=int, default=100)
    parser.add_argument("--long-tokens", type=int, default=900)
    parser.add_argument("--long-steps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    folder = ensure_model("small", args.model_cache)
    results: dict[str, list[dict[str, Any]]] = {d: [] for d in DTYPES}
    for k in range(args.rounds):
        measured = measure_round(folder, args, alternating(DTYPES, k))
        for dtype in alternating(DTYPES, k):
            results[dtype].append(
                {
                    **measured[dtype],
                    "product_ms": on_own_thread(lambda d=dtype: product_ms(d)),
                    "peak_gflops": on_own_thread(lambda d=dtype: peak_gflops(d)),
                }
            )
            print(f"round {k + 1} {dtype}: {results[dtype][-1]}", flush=True)
    long_steps = agent_length_steps(folder, args)
    write_summary_row(args.out, "bench_bf16.py", MEASURES, headline(results, long_steps))
    return publish(
        section(results, long_steps, args, time.perf_counter() - started), args.out, SECTION_HEADING
    )


if __name__ == "__main__":
    sys.exit(main())
