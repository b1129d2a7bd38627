"""The trainer's log-prob of each target through the lm_head, forward and backward, side by side in one
process: artrl's `target_logprobs` (local/train/logprobs.py: the backward written out, one (c, V) buffer per
direction) against `log_softmax` + `gather` + the entropy from the log-probs (artrl's code before it, and what
most trainers write).

Per shape (positions c x vocabulary V: `small`'s 4,096, Llama 3's 128,256, Qwen's 151,936), fp32 logits from a
(c, 256) hidden state and a (V, 256) head, the two taking turns, --repeats each: the median milliseconds of
head product + log-probs + entropy + backward into the hidden state, and the ratio.

    .venv/bin/python benchmarks/bench_loss.py [--repeats 10]

The section `## The trainer's target log-probs (bench_loss.py)` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import HERE, command_line, dated_machine_line, on_own_thread, publish, write_summary_row

SECTION_HEADING = "## The trainer's target log-probs (bench_loss.py)"
SHAPES = ((512, 4096, "`small`"), (256, 128256, "Llama 3"), (256, 151936, "Qwen"))


def log_softmax_and_gather(logits: Any, targets: Any) -> tuple[Any, Any]:
    """The baseline: log-probs, the targets' picked out, the entropy from the log-probs."""
    import torch

    logp = torch.log_softmax(logits, dim=-1)  # (c, V)
    picked = logp.gather(-1, targets[:, None])[:, 0]  # (c,)
    return picked, -(logp.exp() * logp).sum(-1).detach()  # (c,), (c,)


def measure(c: int, vocab: int, repeats: int) -> dict[str, list[float]]:
    import torch

    from artrl.local.train.logprobs import target_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(c, 256, requires_grad=True)  # (c, H)
    head = 0.05 * torch.randn(vocab, 256)  # (V, H)
    targets = torch.randint(0, vocab, (c,))  # (c,)
    variants = {"baseline": log_softmax_and_gather, "artrl": target_logprobs}
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(2 * (repeats + 1)):
        name = ("baseline", "artrl")[k % 2] if (k // 2) % 2 == 0 else ("artrl", "baseline")[k % 2]
        hidden.grad = None
        started = time.perf_counter()
        picked, _ = variants[name](hidden @ head.t(), targets)
        picked.sum().backward()
        if k >= 2:  # (the first pair warms up)
            ms[name].append(1000 * (time.perf_counter() - started))
    return ms


def section(results: list[tuple[int, int, str, dict[str, list[float]]]], seconds: float) -> str:
    lines = [
        SECTION_HEADING,
        "",
        dated_machine_line(),
        "- Forward and backward of an fp32 head product, the targets' log-probs and the entropy, into a (c, 256) "
        "hidden state; the two variants taking turns, medians",
        f"- Command: `{command_line()}`; wall time {seconds:.0f} s",
        "",
        "| positions x vocabulary | log_softmax + gather ms | artrl ms | ratio | runs (baseline; artrl) |",
        "|---|---:|---:|---:|---|",
    ]
    for c, vocab, label, ms in results:
        base, ours = statistics.median(ms["baseline"]), statistics.median(ms["artrl"])
        runs = "; ".join(", ".join(f"{x:.0f}" for x in ms[n]) for n in ("baseline", "artrl"))
        lines.append(f"| {c} x {vocab:,} ({label}) | {base:.1f} | {ours:.1f} | {base / ours:.2f}x | {runs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # (on a thread that ends: torch's work on the main thread would leave it an OpenMP team for good)
    results = [
        (c, vocab, label, on_own_thread(lambda c=c, v=vocab: measure(c, v, args.repeats)))
        for c, vocab, label in SHAPES
    ]
    ratios = [statistics.median(ms["baseline"]) / statistics.median(ms["artrl"]) for *_, ms in results]
    write_summary_row(
        args.out,
        "bench_loss.py",
        "the trainer's target log-probs + entropy, forward and backward, vs log_softmax + gather",
        f"{min(ratios):.2f}-{max(ratios):.2f}x log_softmax + gather ({len(ratios)} vocabularies)",
    )
    return publish(section(results, time.perf_counter() - started), args.out, SECTION_HEADING)


if __name__ == "__main__":
    sys.exit(main())
