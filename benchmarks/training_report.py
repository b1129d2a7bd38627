"""bench_training.py's results: per-framework medians over rounds, the paired ratios, the table and the
RESULTS.md section."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from harness import command_line
from training_workers import (
    CLIP_HIGH,
    CLIP_LOW,
    LEARNING_RATE,
    LORA_ALPHA,
    LORA_RANK,
    LORA_TARGETS,
    MAX_GRAD_NORM,
)

SECTION_HEADING = "## Training step vs TRL GRPOTrainer (bench_training.py)"


AUTOCAST = "; bf16 autocast: artrl's trainer over bf16 weights, TRL's bf16=True"


def heading(dtype: str) -> str:
    """fp32 keeps the historical heading; another dtype gets a section of its own."""
    return SECTION_HEADING if dtype == "float32" else f"{SECTION_HEADING[:-1]} --dtype {dtype})"


FRAMEWORKS = ("artrl", "trl")
TARGET = "artrl's training update at least as fast as TRL's per optimizer step (ratio TRL/artrl seconds >= 1)"


# ------------------------------------------------------------------------------------- orchestration
@dataclass
class FrameworkResult:
    """One framework on one preset: the workers' outputs of every round."""

    framework: str
    preset: str
    warmup: int
    rounds: list[dict[str, Any]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)

    @property
    def raw(self) -> dict[str, Any]:
        return self.rounds[0]

    @property
    def measured(self) -> list[dict[str, Any]]:
        return [s for r in self.rounds for s in r["steps"][self.warmup :]]

    def median(self, key: str) -> float:
        return statistics.median(s[key] for s in self.measured)

    @property
    def update_s(self) -> float:
        return self.median("update_s")

    @property
    def update_range(self) -> tuple[float, float]:
        values = [s["update_s"] for s in self.measured]
        return min(values), max(values)

    @property
    def round_medians(self) -> list[float]:
        return [statistics.median(s["update_s"] for s in r["steps"][self.warmup :]) for r in self.rounds]

    @property
    def tokens(self) -> float:
        return self.median("trainable_tokens")

    @property
    def tok_s(self) -> float:
        return statistics.median(s["trainable_tokens"] / s["update_s"] for s in self.measured)

    @property
    def peak_rss(self) -> float:
        return max(r["peak_rss_mib"] for r in self.rounds)

    @property
    def rss_growth(self) -> float:
        return max(r["peak_rss_mib"] - r["rss_before_mib"] for r in self.rounds)


def ratio(results: dict[str, FrameworkResult]) -> float | None:
    if "artrl" in results and "trl" in results:
        return results["trl"].update_s / results["artrl"].update_s
    return None


def table(results: dict[str, FrameworkResult]) -> list[str]:
    lines = [
        "| framework | params (trainable) | completions x tokens / step | prompt tokens | update s/step "
        "(median; min-max) | trainable tok/s | full step s (incl. generation) | peak RSS MiB "
        "(growth after setup) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in FRAMEWORKS:
        r = results.get(name)
        if r is None:
            continue
        lo, hi = r.update_range
        per_completion = r.tokens / r.measured[0]["rows"]
        lines.append(
            f"| {name} | {r.raw['params_total']:,} ({r.raw['params_trainable']:,}) | "
            f"{r.measured[0]['rows']} x {per_completion:g} | {r.median('prompt_tokens_mean'):.1f} | "
            f"{r.update_s:.3f} ({lo:.3f}-{hi:.3f}) | {r.tok_s:,.0f} | {r.median('step_s'):.3f} | "
            f"{r.peak_rss:,.0f} (+{r.rss_growth:,.0f}) |"
        )
    return lines


def paired_ratios(results: dict[str, FrameworkResult]) -> list[float]:
    """TRL update seconds / artrl update seconds, step by step (the steps ran back to back in lockstep)."""
    if "artrl" not in results or "trl" not in results:
        return []
    pairs = zip(results["artrl"].measured, results["trl"].measured, strict=False)
    return [t["update_s"] / a["update_s"] for a, t in pairs]


def ratio_text(results: dict[str, FrameworkResult]) -> str:
    value = ratio(results)
    if value is None:
        return "ratio: not measured (one framework only)"
    paired = paired_ratios(results)
    return (
        f"speed ratio artrl/TRL (= TRL median update seconds / artrl median update seconds): {value:.2f}x "
        f"({'artrl faster' if value >= 1 else 'artrl slower'}); per step pair: median "
        f"{statistics.median(paired):.2f}x, range {min(paired):.2f}-{max(paired):.2f}x"
    )


def notes(results: dict[str, FrameworkResult], args: argparse.Namespace) -> list[str]:
    out = []
    for name, r in results.items():
        short = sum(s["short_completions"] for s in r.measured)
        parts = [
            f"{len(r.rounds)} round(s) x {len(r.measured) // len(r.rounds)} measured steps after "
            f"{args.warmup} warm-up; per-round median update s: "
            + ", ".join(f"{v:.3f}" for v in r.round_medians)
        ]
        parts.append(f"dtype {r.raw['dtype']}")
        if name == "artrl":
            reseeds = sum(x["reseeds"] for x in r.rounds)
            parts.append(f"{reseeds} completion(s) resampled for ending early")
            parts.append(
                f"median `model.train` call {r.median('train_call_s'):.3f} s (update + rows + checkpoint save)"
            )
            parts.append(f"median rollouts {r.median('rollout_s'):.2f} s")
        else:
            parts.append(f"median generation+scoring {r.median('rollout_s'):.2f} s")
        if short:
            parts.append(f"{short} trained completion(s) not exactly {args.tokens} tokens")
        foreign = [s["foreign_cpu_share"] for s in r.measured]
        parts.append(
            f"CPU used by other processes during its measured steps: median {100 * statistics.median(foreign):.0f}%, "
            f"max {100 * max(foreign):.0f}% of the machine"
        )
        out.append(f"`{name}`: " + "; ".join(parts))
    return out


def full_step_ratio(results: dict[str, FrameworkResult]) -> float | None:
    """TRL median full-step seconds / artrl's (rollouts + update; issue 16 asks >= 1.5 on `small`)."""
    if "artrl" in results and "trl" in results:
        return results["trl"].median("step_s") / results["artrl"].median("step_s")
    return None


def target_line(all_results: dict[str, dict[str, FrameworkResult]]) -> str:
    parts, full = [], []
    for preset, results in all_results.items():
        value, whole = ratio(results), full_step_ratio(results)
        if value is None or whole is None:
            parts.append(f"`{preset}`: not measured")
            continue
        parts.append(f"`{preset}`: {'MET' if value >= 1 else 'NOT met'} ({value:.2f}x)")
        full.append(
            f"`{preset}`: {whole:.2f}x"
            + (
                " (target >= 1.5x: " + ("MET" if whole >= 1.5 else "NOT met") + ")"
                if preset == "small"
                else ""
            )
        )
    line = f"**Target ({TARGET}):** " + "; ".join(parts) + "."
    return line + (
        "\n\n**Full step (rollouts + update), TRL seconds / artrl seconds:** " + "; ".join(full) + "."
        if full
        else ""
    )


def summary_key(dtype: str) -> str:
    """The first cell of this run's row in the summary table (the script, and its --dtype if not fp32)."""
    return "bench_training.py" + ("" if dtype == "float32" else f" --dtype {dtype}")


def headline(all_results: dict[str, dict[str, FrameworkResult]]) -> str:
    """The summary row's figures: TRL's seconds / artrl's, the update and the full step, per preset."""
    update, full = [], []
    for preset, results in all_results.items():
        value, whole = ratio(results), full_step_ratio(results)
        if value is not None and whole is not None:
            update.append(f"{value:.2f}x (`{preset}`)")
            full.append(f"{whole:.2f}x")
    if not update:
        return "not measured (one framework only)"
    return f"update {', '.join(update)} TRL GRPOTrainer's speed; full step {', '.join(full)}"


def arena_setting(args: argparse.Namespace) -> str:
    if args.malloc_arena_max is not None:
        return f"{args.malloc_arena_max} (--malloc-arena-max) for both"
    inherited = os.environ.get("MALLOC_ARENA_MAX")
    return f"{inherited} (inherited) for both" if inherited else "not set (glibc default)"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "transformers", "peft", "trl", "accelerate", "datasets"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def section(
    all_results: dict[str, dict[str, FrameworkResult]],
    args: argparse.Namespace,
    info: dict[str, Any],
    wall: float,
) -> str:
    lines = [
        heading(args.dtype),
        "",
        f"- Date: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: nproc={info['nproc']}, CPU: {info['cpu']}, torch.get_num_threads()="
        f"{info['torch_threads']}, Python {info['python']}",
        f"- Versions: {versions()}",
        f"- Workload per optimizer step: {args.prompts} prompts x {args.generations} generations = "
        f"{args.prompts * args.generations} completions of exactly {args.tokens} tokens (TRL: "
        f"`min_new_tokens={args.tokens}`, `max_completion_length={args.tokens}`; artrl: `max_tokens="
        f"{args.tokens}` and a completion that ends early is resampled with another seed), one chat-template "
        "user prompt each (same prompts for both), reward from a seeded RNG (every advantage non-zero)",
        f"- Settings (both): LoRA r={LORA_RANK}, alpha={LORA_ALPHA:g}, dropout 0 on "
        f"{', '.join(LORA_TARGETS)}; base weights {args.dtype} (LoRA adapter fp32, PEFT's default{AUTOCAST if args.dtype == 'bfloat16' else ''}); AdamW lr {LEARNING_RATE:g} (constant), betas (0.9, 0.999), "
        f"weight decay 0, grad-norm clip {MAX_GRAD_NORM:g}; PPO clip {CLIP_LOW} / {CLIP_HIGH}; no KL; token-level "
        "normalisation (TRL `loss_type='dapo'`); group-std advantages; one optimizer step per step (TRL: "
        f"per_device_train_batch_size={args.prompts * args.generations}, gradient_accumulation_steps=1, "
        f"num_generations={args.generations}, num_iterations=1; TRL gradient_checkpointing="
        f"{args.trl_gradient_checkpointing}); MALLOC_ARENA_MAX: {arena_setting(args)}",
        "- Runs: each framework in its own subprocess; the two subprocesses run side by side in lockstep, "
        "taking turns step by step (order ABBA...): one computes while the other waits, so a noisy shared "
        f"machine slows both alike. {args.rounds} round(s) (fresh subprocesses) per preset; the figures pool "
        "the measured steps of all rounds. Each step also records the CPU share other processes used "
        "meanwhile (from /proc/stat)",
        "- *update s/step* (the compared figure): artrl = `result.metrics['train_seconds']` (collate, forward, "
        "loss, backward, grad clipping, AdamW step, zero_grad; not the rows built from the trajectories nor "
        "the checkpoint save); TRL = `on_step_begin` to `on_step_end` of the optimizer step minus the time in "
        "`_prepare_inputs` (generation, reward, advantages), i.e. compute_loss + backward + grad clipping + "
        "AdamW step + LR scheduler + zero_grad",
        f"- *full step s*: artrl = rollouts through the gateway ({args.prompts * args.generations} concurrent "
        "chat completions, incl. any resampled ones) + the whole `model.train` call (incl. the checkpoint save); TRL = the whole optimizer "
        "step incl. HF `generate` and scoring. The two generators differ (artrl's engine vs HF `generate` "
        "with min_new_tokens); this column is context, not the target",
        "- *trainable tok/s* = trained completion tokens / update seconds (median over steps); *peak RSS* = "
        "`ru_maxrss` of the framework's subprocess over its whole life (imports, model, generation, "
        "training; the largest over the rounds); *growth* = that peak minus the peak before the first step "
        "(generation and training; torch's first forward pass with gradients alone adds a few hundred MiB "
        "on the `small` model in either framework)",
        f"- Medians over the measured steps; the first {args.warmup} step(s) of each subprocess are warm-up "
        "and dropped",
        f"- Command: `{command_line()}`",
        f"- Wall time of the whole run: {wall:.0f} s",
        "",
    ]
    for preset, results in all_results.items():
        params = next(iter(results.values())).raw["params_total"]
        lines.append(f"### Preset `{preset}` (~{params:,} parameters with the adapter)")
        lines.append("")
        lines.extend(table(results))
        lines.append("")
        text = ratio_text(results)
        lines.append(text[0].upper() + text[1:] + ".")
        lines.append("")
        lines.append("Notes: " + " — ".join(notes(results, args)) + ".")
        lines.append("")
    lines.append(target_line(all_results))
    lines.append("")
    return "\n".join(lines)
