"""The GPU check's TRL setting: TRL's `GRPOTrainer` on the same model folder and workload as artrl's settings
(`--agents` completions of exactly `--tokens` tokens per step, groups of `--group-size`, random rewards, LoRA
of `--lora-rank`, bf16, the same learning rate; no KL term, token-level loss, one optimizer step per step).
It generates with vLLM in colocate mode where vLLM is installed next to it and a GPU is there, else with
Hugging Face `generate` (`min_new_tokens` = `--tokens`, so every completion has exactly that many tokens).

Per optimizer step: generation = TRL's `_prepare_inputs` (generation, reward, advantages), the update = the
rest of the step (forward, loss, backward, clipping, AdamW), the step = both."""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
import time
from pathlib import Path
from typing import Any

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def generator(device: str) -> str:
    """How TRL generates here: 'vLLM colocate' (CUDA and vLLM installed) or 'HF generate'."""
    return "vLLM colocate" if device == "cuda" and importlib.util.find_spec("vllm") else "HF generate"


def run_trl(args: argparse.Namespace, device: str, folder: Path, params: int, log: Any) -> dict[str, Any]:
    """TRL's steps on `folder`: one row per step (the keys of gpu_check_setting's artrl rows)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n_steps = args.warmup + args.steps
    n_groups = args.agents // args.group_size
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    prompts = [
        {"prompt": [{"role": "user", "content": f"Task {s}-{g}: find the secret number, then report it."}]}
        for s in range(n_steps)
        for g in range(n_groups)
    ]

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        return [rng.random() for _ in completions]

    timing: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _prepare_inputs(self, generation_batch: Any) -> Any:
            started = time.perf_counter()
            inputs = super()._prepare_inputs(generation_batch)
            timing["generate_s"] += time.perf_counter() - started
            timing["completion"] += int(inputs["completion_mask"].sum())
            timing["prompt"] += int(inputs["prompt_mask"].sum())
            return inputs

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            timing.update(generate_s=0.0, completion=0, prompt=0, began=time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_s = time.perf_counter() - timing["began"]
            train_s = step_s - timing["generate_s"]
            processed = timing["prompt"] + timing["completion"]
            row = {
                "rollout_s": timing["generate_s"],
                "rollout_tokens": timing["completion"],
                "rollout_tok_s": timing["completion"] / timing["generate_s"],
                "train_s": train_s,
                "train_call_s": train_s,
                "trainable_tokens": timing["completion"],
                "processed_tokens": processed,
                "rows": args.agents,
                "trainable_tok_s": timing["completion"] / train_s,
                "processed_tok_s": processed / train_s,
                "mismatch": float("nan"),
                "step_wall_s": step_s,
            }
            steps.append(row)
            log(
                f"TRL step {len(steps)}/{n_steps}{' (warm-up)' if len(steps) <= args.warmup else ''}: "
                f"generation {timing['completion']} tok in {timing['generate_s']:.2f} s = "
                f"{row['rollout_tok_s']:,.0f} tok/s; update {train_s:.3f} s; step {step_s:.2f} s"
            )

    use_vllm = generator(device) == "vLLM colocate"
    with tempfile.TemporaryDirectory(prefix="trl-gpu-check-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=device == "cpu",
            bf16=True,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=args.agents,
            gradient_accumulation_steps=1,
            num_generations=args.group_size,
            num_iterations=1,
            max_completion_length=args.tokens,
            generation_kwargs={} if use_vllm else {"min_new_tokens": args.tokens},
            temperature=1.0,
            top_p=1.0,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            gradient_checkpointing=False,
            use_vllm=use_vllm,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.4,
            max_steps=n_steps,
            shuffle_dataset=False,
            logging_steps=1_000_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        rank = args.lora_rank
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(prompts),
            processing_class=tokenizer,
            peft_config=None
            if args.full_finetune
            else LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                lora_dropout=0.0,
                target_modules=list(LORA_TARGETS),
                task_type="CAUSAL_LM",
            ),
            callbacks=[StepTimer()],
        )
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"params": params, "trainable": trainable, "steps": steps, "reseeds": 0, "peak_mem_gib": peak_mem}
