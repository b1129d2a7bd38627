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
  - LoRA rank 8, alpha 16, dropout 0 on q,k,v,o,gate,up,down proj; fp32; AdamW lr 1e-5 (constant),
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
import asyncio
import datetime as dt
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_concurrency import command_line, ensure_model, machine_info, write_section  # noqa: E402

SECTION_HEADING = "## Training step vs TRL GRPOTrainer (bench_training.py)"
FRAMEWORKS = ("artrl", "trl")
TARGET = "artrl's training update at least as fast as TRL's per optimizer step (ratio TRL/artrl seconds >= 1)"
# measured steps per preset when --steps is not given (plus --warmup steps, dropped)
PRESET_STEPS = {"tiny": 10, "small": 8}
FALLBACK_STEPS = 5
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16.0
LEARNING_RATE = 1e-5
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
MAX_GRAD_NORM = 1.0
REWARD_SEED = 1234
MAX_RESEEDS = 50


def prompt_text(i: int) -> str:
    """The i-th prompt; every prompt has the same shape (and, with these tokenizers, a similar length)."""
    return f"Round {i % 100:02d}: the secret number is between one and ten. What is your next guess?"


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall clock, CPU seconds of the whole machine busy, CPU seconds of this process and its children)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.time(), busy, t.user + t.system + t.children_user + t.children_system


def foreign_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Fraction of the machine's CPU capacity used by other processes between two snapshots."""
    wall = after[0] - before[0]
    foreign = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, foreign / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


def count_params(model: Any) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


class Gate:
    """The worker's side of the lockstep protocol (see `Pair`): only the worker holding the turn computes.

    `ready()` says "ready" and blocks until the orchestrator answers "go"; `done()` says "done". Without a
    `--done-fd` (a worker started by hand) both are no-ops. Each step's window (go to done) also measures
    the CPU that other processes used meanwhile.
    """

    def __init__(self, fd: int | None) -> None:
        self.out = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        self.snapshot: tuple[float, float, float] | None = None

    def ready(self) -> None:
        if self.out is not None:
            self.out.write("ready\n")
            line = sys.stdin.readline()
            if line.strip() != "go":
                raise SystemExit(f"lockstep: expected 'go', got {line!r}")
        self.snapshot = cpu_snapshot()

    def done(self) -> float:
        """Say "done"; return the share of the machine's CPU used by other processes during the step."""
        share = foreign_cpu_share(self.snapshot, cpu_snapshot()) if self.snapshot else 0.0
        if self.out is not None:
            self.out.write("done\n")
        return share


# ------------------------------------------------------------------------------------- artrl worker
async def artrl_worker(args: argparse.Namespace, folder: Path, gate: Gate) -> dict[str, Any]:
    import artrl

    n_steps = args.warmup + args.steps
    rng = random.Random(REWARD_SEED)
    steps: list[dict[str, Any]] = []
    reseeds = 0
    with tempfile.TemporaryDirectory(prefix="artrl-bench-train-") as tmp:
        backend = artrl.LocalBackend(path=tmp)
        try:
            model = artrl.TrainableModel(
                name=f"train-{args.preset}",
                project="bench",
                base_model=str(folder),
                lora=artrl.LoraConfig(
                    rank=LORA_RANK, alpha=LORA_ALPHA, dropout=0.0, target_modules=LORA_TARGETS
                ),
            )
            await model.register(backend)
            total, trainable = count_params(backend.service(model).model)
            dtype = str(next(backend.service(model).model.parameters()).dtype)
            config = artrl.TrainConfig(
                learning_rate=LEARNING_RATE,
                max_grad_norm=MAX_GRAD_NORM,
                clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH,
                loss="ppo",
                kl_coef=0.0,
                scale_rewards=True,
            )
            client = model.openai_client()
            rss_before = maxrss_mib()

            async def complete(messages: list[dict[str, str]], seed: int) -> tuple[Any, int]:
                nonlocal reseeds
                for attempt in range(MAX_RESEEDS + 1):
                    response = await client.chat.completions.create(
                        model=model.name,
                        messages=messages,
                        max_tokens=args.tokens,
                        temperature=1.0,
                        seed=seed + 7919 * attempt,
                    )
                    choice = response.choices[0]
                    if choice.finish_reason == "length":
                        break
                    reseeds += 1
                return choice, len(choice.model_extra["prompt_token_ids"])

            try:
                for step in range(n_steps):
                    gate.ready()
                    started = time.perf_counter()
                    convs = [
                        [{"role": "user", "content": prompt_text(step * args.prompts + p)}]
                        for p in range(args.prompts)
                    ]
                    results = await asyncio.gather(
                        *(
                            complete(convs[p], 1_000_003 * step + 1009 * p + g + 1)
                            for p in range(args.prompts)
                            for g in range(args.generations)
                        )
                    )
                    rollout_s = time.perf_counter() - started
                    rss_rollouts = maxrss_mib()
                    groups = []
                    for p in range(args.prompts):
                        chunk = results[p * args.generations : (p + 1) * args.generations]
                        groups.append(
                            artrl.TrajectoryGroup(
                                artrl.Trajectory(
                                    messages_and_choices=[*convs[p], choice], reward=rng.random()
                                )
                                for choice, _ in chunk
                            )
                        )
                    completion_tokens = [len(c.model_extra["token_ids"]) for c, _ in results]
                    called = time.perf_counter()
                    result = await model.train(groups, config=config)
                    done = time.perf_counter()
                    foreign = gate.done()
                    m = result.metrics
                    steps.append(
                        {
                            "update_s": float(m["train_seconds"]),
                            "train_call_s": done - called,
                            "step_s": done - started,
                            "rollout_s": rollout_s,
                            "trainable_tokens": int(m["trainable_tokens"]),
                            "completion_tokens": sum(completion_tokens),
                            "short_completions": sum(1 for n in completion_tokens if n != args.tokens),
                            "prompt_tokens_mean": statistics.fmean(n for _, n in results),
                            "rows": int(m["rows"]),
                            "optimizer_steps": int(m.get("optimizer_steps", 0)),
                            "loss": float(m.get("loss", float("nan"))),
                            "maxrss_after_rollouts_mib": rss_rollouts,
                            "maxrss_after_step_mib": maxrss_mib(),
                            "foreign_cpu_share": foreign,
                        }
                    )
                    print(
                        f"  [artrl {args.preset}] step {step + 1}/{n_steps}: update "
                        f"{m['train_seconds']:.3f} s, train call {done - called:.3f} s, rollouts "
                        f"{rollout_s:.2f} s, {m['trainable_tokens']} trainable tokens, {m['rows']} rows; "
                        f"other processes {100 * foreign:.0f}% CPU",
                        flush=True,
                    )
                gate.ready()  # the last turn: tear down while the other worker waits
            finally:
                await client.close()
        finally:
            await backend.close()
    return {
        "params_total": total,
        "params_trainable": trainable,
        "dtype": dtype,
        "steps": steps,
        "reseeds": reseeds,
        "rss_before_mib": rss_before,
    }


# --------------------------------------------------------------------------------------- TRL worker
def trl_worker(args: argparse.Namespace, folder: Path, gate: Gate) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n_steps = args.warmup + args.steps
    completions = args.prompts * args.generations
    rng = random.Random(REWARD_SEED)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": prompt_text(i)}]} for i in range(n_steps * args.prompts)]
    )

    def reward(prompts: list, completions: list, completion_ids: list | None = None, **_: Any) -> list[float]:
        return [rng.random() for _ in completions]

    timing: dict[str, Any] = {"prepare_s": 0.0, "tokens": 0, "short": 0, "prompt_tokens": []}
    steps: list[dict[str, Any]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _prepare_inputs(self, generation_batch: Any) -> Any:
            started = time.perf_counter()
            inputs = super()._prepare_inputs(generation_batch)
            timing["prepare_s"] += time.perf_counter() - started
            timing["rss_prepared"] = maxrss_mib()
            per_completion = inputs["completion_mask"].sum(dim=1)  # (B,)
            timing["tokens"] += int(per_completion.sum())
            timing["short"] += int((per_completion != args.tokens).sum())
            timing["prompt_tokens"].append(float(inputs["prompt_mask"].sum(dim=1).float().mean()))
            return inputs

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            gate.ready()
            timing.update(prepare_s=0.0, tokens=0, short=0, prompt_tokens=[], began=time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_s = time.perf_counter() - timing["began"]
            foreign = gate.done()
            steps.append(
                {
                    "update_s": step_s - timing["prepare_s"],
                    "step_s": step_s,
                    "rollout_s": timing["prepare_s"],
                    "trainable_tokens": timing["tokens"],
                    "completion_tokens": timing["tokens"],
                    "short_completions": timing["short"],
                    "prompt_tokens_mean": statistics.fmean(timing["prompt_tokens"]),
                    "rows": completions,
                    "optimizer_steps": 1,
                    "maxrss_after_rollouts_mib": timing["rss_prepared"],
                    "maxrss_after_step_mib": maxrss_mib(),
                    "foreign_cpu_share": foreign,
                }
            )
            print(
                f"  [trl {args.preset}] step {len(steps)}/{n_steps}: update {step_s - timing['prepare_s']:.3f} s, "
                f"full step {step_s:.3f} s, generation+scoring {timing['prepare_s']:.2f} s, "
                f"{timing['tokens']} trainable tokens; other processes {100 * foreign:.0f}% CPU",
                flush=True,
            )

    with tempfile.TemporaryDirectory(prefix="trl-bench-train-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            fp16=False,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=MAX_GRAD_NORM,
            per_device_train_batch_size=completions,
            gradient_accumulation_steps=1,
            num_generations=args.generations,
            num_iterations=1,
            max_completion_length=args.tokens,
            generation_kwargs={"min_new_tokens": args.tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            epsilon=CLIP_LOW,
            epsilon_high=CLIP_HIGH,
            loss_type="dapo",
            scale_rewards="group",
            gradient_checkpointing=args.trl_gradient_checkpointing,
            max_steps=n_steps,
            shuffle_dataset=False,
            logging_steps=1_000_000,  # no log lines
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=LORA_RANK,
                lora_alpha=LORA_ALPHA,
                lora_dropout=0.0,
                target_modules=list(LORA_TARGETS),
                task_type="CAUSAL_LM",
            ),
            callbacks=[StepTimer()],
        )
        total, trainable = count_params(trainer.model)
        dtype = str(next(trainer.model.parameters()).dtype)
        rss_before = maxrss_mib()
        trainer.train()
        gate.ready()  # the last turn: tear down while the other worker waits
    return {
        "params_total": total,
        "params_trainable": trainable,
        "dtype": dtype,
        "steps": steps,
        "reseeds": 0,
        "rss_before_mib": rss_before,
    }


def worker_main(args: argparse.Namespace) -> int:
    import torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    folder = ensure_model(args.preset, args.model_cache)
    started = time.perf_counter()
    gate = Gate(args.done_fd)
    if args.worker == "artrl":
        result = asyncio.run(artrl_worker(args, folder, gate))
    else:
        result = trl_worker(args, folder, gate)
    result.update(
        framework=args.worker,
        preset=args.preset,
        seconds=time.perf_counter() - started,
        peak_rss_mib=maxrss_mib(),
        torch_threads=torch.get_num_threads(),
    )
    args.json_out.write_text(json.dumps(result, indent=1))
    return 0


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


def target_line(all_results: dict[str, dict[str, FrameworkResult]]) -> str:
    parts = []
    for preset, results in all_results.items():
        value = ratio(results)
        if value is None:
            parts.append(f"`{preset}`: not measured")
        else:
            parts.append(f"`{preset}`: {'MET' if value >= 1 else 'NOT met'} ({value:.2f}x)")
    return f"**Target ({TARGET}):** " + "; ".join(parts) + "."


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
        SECTION_HEADING,
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
        f"{', '.join(LORA_TARGETS)}; fp32; AdamW lr {LEARNING_RATE:g} (constant), betas (0.9, 0.999), "
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
        "- artrl runs its training step on the engine's own thread (`HFEngine.call`) and sends only "
        "trainable positions through the lm_head. Before that change (same benchmark, 2026-11-30 01:37 UTC) "
        "artrl was 0.79x (tiny) and 0.95x (small) of TRL: training on an `asyncio.to_thread` worker gave a "
        "second OpenMP team next to the engine thread's (libgomp throttles spin-waiting when threads exceed "
        "CPUs) and a fresh glibc arena per new worker (~2x outlier steps, +0.5 GiB RSS)",
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
    write_section(args.out, section(all_results, args, info, wall), heading=SECTION_HEADING)
    print(f"wrote section {SECTION_HEADING!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
