"""One GRPO step in one process against the same step in N trainer ranks (FSDP2; gloo on CPU).

    python benchmarks/bench_trainer_ranks.py [--preset small] [--ranks 2] [--rows 32] [--tokens 256]

The same rows, the same starting weights, alternating rounds; the ranks' time includes sending the rows and
loading the trained weights back into the served model. On a CPU the ranks share its cores with each other:
the figure is the cost of the code path, not a speed-up (which needs one device per rank).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    HERE,
    alternating,
    cpu_snapshot,
    ensure_model,
    foreign_cpu_share,
    machine_info,
    publish,
    write_summary_row,
)

SECTION_HEADING = "## Trainer ranks: one GRPO step in 1 process and in N (FSDP2)"


def step_rows(count: int, tokens: int, vocab: int, seed: int) -> list[Any]:
    from artrl.local.train.rows import Row

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = rng.randint(tokens // 2, tokens)
        prompt = n // 3
        rows.append(
            Row(
                ids=[rng.randrange(vocab) for _ in range(n)],
                mask=[0] * prompt + [1] * (n - prompt),
                logprobs=[float("nan")] * prompt + [-8.0] * (n - prompt),
                trajectory=i,
                advantage=rng.choice([1.0, -1.0]),
            )
        )
    return rows


def timed_step(trainer: Any, rows: list[Any], config: Any) -> float:
    from artrl.local.train.batch import TrainingBatch

    started = time.perf_counter()
    trainer.step(TrainingBatch(rows=rows), config)
    if hasattr(trainer, "load_update"):
        trainer.load_update()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="longest row; rows are tokens/2..tokens")
    parser.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and mode")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    args = parser.parse_args(argv)

    import torch

    import artrl
    from artrl.config import EngineConfig, TrainerConfig
    from artrl.local.models.loading import load_model_and_tokenizer
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.ranks.trainer_ranks import TrainerRanks
    from artrl.local.train.trainer import Trainer

    folder = ensure_model(args.preset, args.model_cache)
    lora = artrl.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    config = artrl.TrainConfig(learning_rate=1e-4)

    def model() -> Any:
        torch.manual_seed(0)
        return attach_adapter(load_model_and_tokenizer(str(folder), EngineConfig())[0], lora)

    vocab = model().config.vocab_size
    one = Trainer(model(), pad_id=0)
    started = time.perf_counter()
    log_dir = args.model_cache.parent / "trainer-ranks-bench"
    ranks = TrainerRanks(
        model(), str(folder), EngineConfig(), lora, TrainerConfig(ranks=args.ranks), 0, None, log_dir
    )
    startup = time.perf_counter() - started
    times: dict[str, list[float]] = {"1 process": [], f"{args.ranks} ranks": []}
    before = cpu_snapshot()
    try:
        for k in range(args.rounds):
            for mode in alternating(tuple(times), k):
                trainer = one if mode == "1 process" else ranks
                for s in range(args.steps):
                    times[mode].append(
                        timed_step(trainer, step_rows(args.rows, args.tokens, vocab, k * 100 + s), config)
                    )
                print(f"round {k + 1} {mode}: {times[mode][-args.steps :]}", flush=True)
    finally:
        ranks.close()
    foreign = foreign_cpu_share(before, cpu_snapshot())
    info = machine_info()
    median = {mode: statistics.median(values) for mode, values in times.items()}
    lines = [
        SECTION_HEADING,
        "",
        f"{info['nproc']} cores ({info['cpu']}), torch {info['torch']}; the `{args.preset}` preset, "
        f"{'LoRA rank ' + str(args.lora_rank) if lora else 'full fine-tuning'}, {args.rows} rows of "
        f"{args.tokens // 2}-{args.tokens} tokens per step; {args.ranks} ranks started in {startup:.1f} s; "
        f"other processes used {foreign:.0%} of the CPU meanwhile.",
        "",
        "| trainer | median step (s) | every step (s) |",
        "|---|---:|---|",
        *(f"| {m} | {median[m]:.3f} | {', '.join(f'{t:.3f}' for t in times[m])} |" for m in times),
        "",
    ]
    one, many = median["1 process"], median[f"{args.ranks} ranks"]
    write_summary_row(
        args.out,
        "bench_trainer_ranks.py",
        f"one GRPO step (`{args.preset}`) in 1 process vs {args.ranks} FSDP2 trainer ranks",
        f"{args.ranks} ranks: {many:.2f} s a step against {one:.2f} s in one process ({many / one:.2f}x the time)",
    )
    return publish("\n".join(lines), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
