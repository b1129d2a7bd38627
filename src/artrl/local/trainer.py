"""GRPO updates of the weights the engine serves: one model object, one copy of the base weights.

The LoRA adapter (or, for small models, every weight) is trained in place on the model that the embedded
engine generates with. The backend runs each training call on the engine's own thread (`HFEngine.call`):
generation pauses between two token steps, and the next token is sampled from the updated weights.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from artrl.config import LoraConfig, SFTConfig, TrainConfig
from artrl.local.batch import TrainingBatch
from artrl.local.loss import LossSettings, policy_loss, sft_loss
from artrl.local.pack import MicroBatch, collate, pack
from artrl.local.rows import Row


def attach_adapter(model: Any, lora: LoraConfig | None) -> Any:
    """Wrap `model` with a fresh LoRA adapter (None = full fine-tuning: every weight trainable)."""
    if lora is None:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _inner(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def token_logprobs(
    model: Any, batch: MicroBatch, chunk: int, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token t+1 | tokens ≤ t) and that distribution's entropy, (B, T-1) each, at the positions whose
    target is trainable (`batch.mask`; 0 elsewhere).

    Only those positions go through the lm_head, `chunk` at a time; with more than one chunk each runs
    under activation checkpointing, so the (positions x vocab) logits never exist at once, forward or
    backward.
    """
    inner = _inner(model)
    hidden = inner.get_decoder()(
        input_ids=batch.ids, attention_mask=batch.attention
    ).last_hidden_state  # (B,T,H)
    head = inner.get_output_embeddings()
    where = batch.mask.nonzero(as_tuple=True)  # ((N,), (N,)) trainable target positions
    picked_hidden = hidden[:, :-1][where]  # (N, H)
    targets = batch.ids[:, 1:][where]  # (N,)

    def piece(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(head(h).float(), dim=-1)  # (c, V)
        picked = logp.gather(-1, y[:, None])[:, 0]  # (c,)
        entropy = -(logp.exp() * logp).sum(-1).detach() if with_entropy else torch.zeros_like(picked)  # (c,)
        return picked, entropy

    recompute = torch.is_grad_enabled() and len(targets) > chunk
    parts = [
        checkpoint(piece, picked_hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
        if recompute
        else piece(picked_hidden[s : s + chunk], targets[s : s + chunk])
        for s in range(0, len(targets), chunk)
    ]
    lp = torch.cat([p[0] for p in parts]) if parts else hidden.new_zeros(0)  # (N,)
    entropy = torch.cat([p[1] for p in parts]) if parts else hidden.new_zeros(0)  # (N,)
    shape = batch.mask.shape  # (B, T-1)
    full_lp = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put(where, lp)  # (B, T-1)
    full_entropy = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put(where, entropy)  # (B, T-1)
    return full_lp, full_entropy


class Trainer:
    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        from peft import PeftModel

        self.has_adapter = isinstance(model, PeftModel)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-4)
        self.device = next(model.parameters()).device

    def step(self, batch: TrainingBatch, config: TrainConfig) -> dict[str, float]:
        """GRPO: one optimizer step per `steps_per_call` slice of the rows; returns metrics."""
        started = time.perf_counter()
        if config.kl_coef > 0 and not self.has_adapter:
            raise ValueError("kl_coef > 0 needs a LoRA adapter (the base policy is the adapter disabled)")
        settings = LossSettings(
            config.loss,
            config.clip_low,
            config.clip_high,
            config.tis_cap,
            config.kl_coef,
            config.mismatch_threshold,
        )
        advantage = dict(zip(map(id, batch.rows), batch.advantages, strict=True))

        def loss_fn(lp, mb, normaliser, totals):
            lp_ref = None
            if settings.kl_coef > 0:
                with torch.no_grad(), self.model.disable_adapter():
                    lp_ref, _ = token_logprobs(self.model, mb, config.logprob_chunk_size, with_entropy=False)
            terms = policy_loss(
                lp, mb.behaviour, mb.advantages, mb.mask, mb.weights, normaliser, settings, lp_ref
            )
            totals["clipped"] += terms.clipped_tokens
            totals["kl"] += terms.kl
            totals["ratio"] += terms.ratio
            if totals["optimizer_steps"] == 0:  # the monitor: before this call changed the weights
                totals["mismatch"] += terms.mismatch
                totals["mismatch_max"] = max(totals["mismatch_max"], terms.mismatch_max)
                totals["mismatch_over"] += terms.mismatch_over
                totals["known"] += terms.known
            return terms.loss

        order = list(range(len(batch.rows)))
        slices = [
            [batch.rows[i] for i in order[k :: config.steps_per_call]] for k in range(config.steps_per_call)
        ]
        totals = self._run(slices, lambda row: advantage[id(row)], config, loss_fn)
        weight = totals["weight"] or 1.0
        return {
            "loss": totals["loss"],
            "clip_fraction": totals["clipped"] / weight,
            "kl": totals["kl"] / weight,
            "ratio_mean": totals["ratio"] / weight,
            # the monitor of train/inference mismatch: trainer vs engine logprobs of the sampled tokens
            "logprob_mismatch_mean": totals["mismatch"] / (totals["known"] or 1.0),
            "logprob_mismatch_max": totals["mismatch_max"],
            "logprob_mismatch_fraction": totals["mismatch_over"] / (totals["known"] or 1.0),
            "entropy": totals["entropy"] / weight,
            "grad_norm": totals["grad_norm"],
            "optimizer_steps": totals["optimizer_steps"],
            "train_seconds": time.perf_counter() - started,
        }

    def sft(self, steps: list[list[Row]], config: SFTConfig) -> dict[str, float]:
        """Supervised fine-tuning: one optimizer step per list of rows; returns metrics."""
        started = time.perf_counter()

        def loss_fn(lp, mb, normaliser, totals):
            return sft_loss(lp, mb.mask, mb.weights, normaliser)

        totals = self._run(steps, lambda row: 0.0, config, loss_fn)
        steps_done = totals["optimizer_steps"] or 1
        return {
            "loss": totals["loss"] / steps_done,  # mean over optimizer steps of the token-mean NLL
            "entropy": totals["entropy"] / (totals["weight"] or 1.0),
            "grad_norm": totals["grad_norm"],
            "optimizer_steps": totals["optimizer_steps"],
            "trainable_tokens": sum(r.trainable_tokens for rows in steps for r in rows),
            "train_seconds": time.perf_counter() - started,
        }

    def _run(
        self, steps: list[list[Row]], advantage_of, config: TrainConfig | SFTConfig, loss_fn
    ) -> dict[str, float]:
        """Optimizer steps over `steps` (each a list of rows); call it on the engine thread."""
        for group in self.optimizer.param_groups:
            group.update(lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay)
        totals = dict.fromkeys(
            [
                "loss",
                "clipped",
                "kl",
                "ratio",
                "mismatch",
                "mismatch_max",
                "mismatch_over",
                "known",
                "entropy",
                "weight",
                "grad_norm",
            ],
            0.0,
        )
        totals["optimizer_steps"] = 0
        self.model.train()
        try:
            for rows in steps:
                if rows:
                    self._optimizer_step(rows, advantage_of, config, loss_fn, totals)
        finally:
            self.model.eval()
            self.optimizer.zero_grad(set_to_none=True)
        return totals

    def _optimizer_step(
        self, rows: list[Row], advantage_of, config, loss_fn, totals: dict[str, float]
    ) -> None:
        normaliser = sum(r.weight * (r.trainable_tokens - r.mask[0]) for r in rows)  # targets = positions 1..
        for micro in pack(rows, config.max_tokens_per_microbatch):
            chosen = [rows[i] for i in micro]
            mb = collate(chosen, [advantage_of(r) for r in chosen], self.device, self.pad_id)
            lp, entropy = token_logprobs(self.model, mb, config.logprob_chunk_size)  # (B, T-1) each
            loss = loss_fn(lp, mb, normaliser, totals)
            loss.backward()
            token_weight = mb.mask * mb.weights[:, None]  # (B, T-1)
            totals["loss"] += float(loss.detach())
            totals["entropy"] += float((entropy * token_weight).sum())
            totals["weight"] += float(token_weight.sum())
        max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
        totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["optimizer_steps"] += 1

    # ---------------------------------------------------------------- persistence
    def save(self, directory: str) -> None:
        """Adapter (PEFT format) or full weights, plus the optimizer state, into `directory`."""
        self.model.save_pretrained(directory)
        torch.save(self.optimizer.state_dict(), f"{directory}/optimizer.pt")

    def load(self, directory: str) -> None:
        from safetensors.torch import load_file

        if self.has_adapter:
            from peft import set_peft_model_state_dict

            state = load_file(f"{directory}/adapter_model.safetensors", device=str(self.device))
            result = set_peft_model_state_dict(self.model, state)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(
                    f"checkpoint {directory} does not fit this adapter: {result.unexpected_keys}"
                )
        optimizer_file = f"{directory}/optimizer.pt"
        try:  # weights_only: a checkpoint is data, never code (a pickle could run anything)
            state = torch.load(optimizer_file, map_location=self.device, weights_only=True)
        except FileNotFoundError:
            return
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{optimizer_file} is not a plain optimizer state (refused to unpickle it): {exc}"
            ) from None
        self.optimizer.load_state_dict(state)
