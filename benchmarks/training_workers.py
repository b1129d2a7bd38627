"""The two sides of bench_training.py, each run in its own subprocess: artrl's rollouts + GRPO step through
its public API, and TRL's GRPOTrainer on the same model, prompts, rewards and settings."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import cpu_snapshot, ensure_model, foreign_cpu_share, maxrss_mib

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
        backend = artrl.LocalBackend(path=tmp, engine=artrl.EngineConfig(dtype=args.dtype))
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
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
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
            bf16=args.dtype
            == "bfloat16",  # its mixed precision (autocast), as artrl's trainer over bf16 weights
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
