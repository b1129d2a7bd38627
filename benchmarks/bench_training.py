"""Training step: artrl's `model.train` vs. TRL's `GRPOTrainer`, side by side on CPU, in one run.

For each model preset, each framework runs in its own subprocess (so that each gets its own peak-memory
figure). The two subprocesses run side by side in lockstep: they take turns step by step (ABBA order), one
computing while the other waits on a pipe, so that a noisy shared machine slows both alike (each step also
records the CPU share that other processes used meanwhile). Both run the same workload:

  - `prompts` x `generations` completions per step (default 2 x 4 = 8), GRPO groups of `generations`;
  - exactly `tokens` completion tokens each (default 64): TRL generates with `min_new_tokens = tokens`
    (end-of-sequence suppressed until then) and `max_completion_length = tokens`; artrl samples with
    `max_tokens = tokens` and a seed per completion, and reseeds a completion that ends early (the random
    models rarely sample end-of-sequence), so every trained completion has exactly `tokens` tokens;
  - a reward drawn from a seeded RNG (distinct within a group: every advantage is non-zero);
  - LoRA rank 8, alpha 16, dropout 0 on q,k,v,o,gate,up,down proj; fp32 (--dtype); AdamW lr 1e-5 (constant),
    betas (0.9, 0.999), no weight decay, gradient clipping at 1.0; PPO clip 0.2 / 0.28; no KL term;
    token-level loss normalisation (TRL `loss_type="dapo"`); group-std scaled advantages;
  - one optimizer step per step over all the step's completions (TRL: per_device_train_batch_size =
    completions, gradient_accumulation_steps = 1, num_generations = generations, num_iterations = 1).

Timed per step (the first `--warmup` steps are dropped; figures are medians of the rest):

  - *update*: the training update alone. artrl: `result.metrics["train_seconds"]` (collate, forward,
    loss, backward, gradient clipping, AdamW step, zero_grad; excludes building rows from the trajectories
    and the checkpoint save). TRL: from `on_step_begin` to `on_step_end` of the optimizer step minus the
    time spent in `_prepare_inputs` (generation, reward, advantages, tokenisation), i.e. compute_loss +
    backward + gradient clipping + AdamW step + scheduler + zero_grad.
  - *full step*: artrl = rollouts through the gateway + the whole `model.train` call (incl. the checkpoint
    save); TRL = the whole optimizer step incl. generation (`on_step_begin` to `on_step_end`).
  - trainable tokens/s = completion tokens trained in the step / update seconds;
  - peak memory = `ru_maxrss` of that framework's subprocess (its whole life: imports, model, generation,
    training), and how much it grew from before the first step to the end.

TRL's `gradient_checkpointing` (its default is True) is turned off by default, as artrl does not
checkpoint the decoder; `--trl-gradient-checkpointing` turns it on.

    .venv/bin/python benchmarks/bench_training.py [--presets tiny,small] [--steps N] [--tokens 64]
        [--prompts 2] [--generations 4] [--frameworks artrl,trl] [--rounds 2] [--malloc-arena-max N]
        [--trl-gradient-checkpointing] [--out benchmarks/RESULTS.md]

The section `## Training step vs TRL GRPOTrainer (bench_training.py)` of the results file is replaced (or
added); other sections are kept.
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
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import ensure_model, machine_info, write_section, write_summary_row  # noqa: E402
from training_report import (  # noqa: E402
    FRAMEWORKS,
    FrameworkResult,
    heading,
    headline,
    notes,
    ratio_text,
    section,
    summary_key,
    table,
    target_line,
    versions,
)
from training_workers import worker_main  # noqa: E402

# measured steps per preset when --steps is not given (plus --warmup steps, dropped)
PRESET_STEPS = {"tiny": 10, "small": 8}
FALLBACK_STEPS = 5


class Worker:
    """One framework's subprocess, driven turn by turn over a pipe (see `Gate`)."""

    def __init__(self, framework: str, preset: str, args: argparse.Namespace, tmp: Path) -> None:
        self.framework, self.preset = framework, preset
        self.out = tmp / f"{framework}-{preset}.json"
        self.out.unlink(missing_ok=True)
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            framework,
            "--preset",
            preset,
            "--json-out",
            str(self.out),
            "--done-fd",
            str(write_fd),
            "--steps",
            str(args.steps_for[preset]),
            "--warmup",
            str(args.warmup),
            "--tokens",
            str(args.tokens),
            "--dtype",
            args.dtype,
            "--prompts",
            str(args.prompts),
            "--generations",
            str(args.generations),
            "--model-cache",
            str(args.model_cache),
        ]
        if args.torch_threads is not None:
            cmd += ["--torch-threads", str(args.torch_threads)]
        if args.trl_gradient_checkpointing:
            cmd.append("--trl-gradient-checkpointing")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if args.malloc_arena_max is not None:
            env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self.messages = os.fdopen(read_fd, "r")

    def expect(self, message: str) -> None:
        line = self.messages.readline().strip()
        if line != message:
            self.proc.wait()
            raise RuntimeError(
                f"the {self.framework} worker ({self.preset}) said {line!r} instead of {message!r} "
                f"(exit code {self.proc.returncode})"
            )

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[dict[str, Any], float]:
        code = self.proc.wait()
        wall = time.perf_counter() - self.started
        self.messages.close()
        if code != 0 or not self.out.exists():
            raise RuntimeError(f"the {self.framework} worker ({self.preset}) failed (exit code {code})")
        return json.loads(self.out.read_text()), wall


def run_lockstep(
    preset: str, args: argparse.Namespace, tmp: Path, flip: bool
) -> dict[str, tuple[dict, float]]:
    """Both frameworks' subprocesses side by side, taking turns step by step (ABBA order): one computes while
    the other waits, so that a noisy machine slows both alike. Set-up (imports, model loading) overlaps."""
    workers = [Worker(name, preset, args, tmp) for name in args.frameworks]
    try:
        for w in workers:
            w.expect("ready")  # set-up done; blocked before its first step
        n_steps = args.warmup + args.steps_for[preset]
        for step in range(n_steps):
            order = workers if (step % 2 == 0) != flip else workers[::-1]
            for w in order:
                w.go()
                w.expect("done")
                w.expect("ready")  # between-step work done: the next step's (or the final) gate
        for w in workers:
            w.go()  # tear down and report
        return {w.framework: w.finish() for w in workers}
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small", help="comma-separated TINY_MODEL_PRESETS names")
    parser.add_argument("--frameworks", default="artrl,trl", help="comma-separated: artrl, trl")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"measured steps per framework (default per preset: {PRESET_STEPS})",
    )
    parser.add_argument("--warmup", type=int, default=1, help="first steps dropped (default 1)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="fresh pairs of subprocesses per preset (default 2)"
    )
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens (default 64)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="base weights of both frameworks (bfloat16: a section of its own in --out)",
    )
    parser.add_argument("--prompts", type=int, default=2, help="prompts (groups) per step (default 2)")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads in workers")
    parser.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL with gradient checkpointing (TRL's default; off by default here, as in artrl)",
    )
    parser.add_argument(
        "--malloc-arena-max",
        type=int,
        default=None,
        help="set MALLOC_ARENA_MAX=N (glibc) for both workers (default: the environment's own)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=HERE / "out" / "models")
    # internal: run one framework's measurement (in a subprocess of the main run)
    parser.add_argument("--worker", choices=FRAMEWORKS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--done-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    from artrl.config import TINY_MODEL_PRESETS

    unknown = [
        p for p in [*args.presets, *([args.preset] if args.preset else [])] if p not in TINY_MODEL_PRESETS
    ]
    if unknown:
        parser.error(f"unknown preset(s) {unknown}; choose from {sorted(TINY_MODEL_PRESETS)}")
    if any(f not in FRAMEWORKS for f in args.frameworks) or not args.frameworks:
        parser.error(f"--frameworks takes a comma-separated subset of {FRAMEWORKS}")
    if args.generations < 2 or args.prompts < 1 or args.tokens < 1 or args.warmup < 0:
        parser.error("--generations >= 2, --prompts >= 1, --tokens >= 1, --warmup >= 0")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.worker and (args.preset is None or args.json_out is None or args.steps is None):
        parser.error("--worker needs --preset, --json-out and --steps")
    args.steps_for = {p: args.steps or PRESET_STEPS.get(p, FALLBACK_STEPS) for p in args.presets}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    started = time.perf_counter()
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    info = machine_info()
    print(
        f"machine: nproc={info['nproc']}, {info['cpu']}, threads={info['torch_threads']}; {versions()}",
        flush=True,
    )
    for preset in args.presets:  # build once, before any subprocess starts
        ensure_model(preset, args.model_cache)
    all_results = {p: {f: FrameworkResult(f, p, args.warmup) for f in args.frameworks} for p in args.presets}
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        runs = 0
        for rnd in range(args.rounds):
            for preset in args.presets:
                print(
                    f"round {rnd + 1}/{args.rounds}, preset {preset}: {' + '.join(args.frameworks)}",
                    flush=True,
                )
                outputs = run_lockstep(preset, args, Path(tmp), flip=runs % 2 == 1)
                runs += 1
                for name, (raw, wall_s) in outputs.items():
                    all_results[preset][name].rounds.append(raw)
                    all_results[preset][name].walls.append(wall_s)
                    updates = [x["update_s"] for x in raw["steps"][args.warmup :]]
                    print(
                        f"[{preset}] {name}: median update {statistics.median(updates):.3f} s, "
                        f"peak RSS {raw['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )
    all_results = {p: {f: r[f] for f in FRAMEWORKS if f in r} for p, r in all_results.items()}
    wall = time.perf_counter() - started
    print()
    for preset, results in all_results.items():
        print(f"preset {preset}:")
        print("\n".join(table(results)))
        print(ratio_text(results))
        for line in notes(results, args):
            print("  " + line)
        print()
    print(target_line(all_results).replace("**", ""))
    print(f"wall time: {wall:.0f} s")
    write_section(args.out, section(all_results, args, info, wall), heading=heading(args.dtype))
    write_summary_row(
        args.out,
        summary_key(args.dtype),
        f"one GRPO optimizer step ({args.dtype}, LoRA) vs TRL's GRPOTrainer, side by side",
        headline(all_results),
    )
    print(f"wrote section {heading(args.dtype)!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
