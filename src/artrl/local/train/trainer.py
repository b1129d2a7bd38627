"""GRPO updates of the weights the engine serves: one model object, one copy of the base weights.

The LoRA adapter (or, for small models, every weight) is trained in place on the model that the embedded
engine generates with. The backend runs each training call on the engine's own thread (`HFEngine.call`):
generation pauses between two token steps, and the next token is sampled from the updated weights.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch

from artrl.config import SFTConfig, TrainConfig
from artrl.local.train.adapters import load_adapter, save_weights
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.fused_lora import FusedLoraTraining
from artrl.local.train.fused_norm import FusedNormTraining
from artrl.local.train.logprobs import head_is_the_models, shares_prefixes, token_logprobs, unwrapped
from artrl.local.train.loss import policy_loss, sft_loss
from artrl.local.train.pack import MicroBatch, collate, pack, pack_by_prompt, shared_prompt
from artrl.local.train.progress import TrainProgress
from artrl.local.train.rollback import CallStart
from artrl.local.train.rows import NO_LOGPROB, Row, trained_targets
from artrl.local.train.step_totals import GRPOTotals, OneProcess, Reduction

log = logging.getLogger(__name__)


def _record_logprobs(
    batch: TrainingBatch, at: list[int], lp: torch.Tensor, mb: MicroBatch, before_update: bool
) -> None:
    """Keep the trainer's logprob of each trained token of these rows (`at`: their places in batch.rows),
    for the step's record: token t of a row gets lp[b, t-1] (None where its mask is 0)."""
    values, mask = lp.detach().float().tolist(), mb.mask.tolist()  # (B, T-1) each
    for b, i in enumerate(at):
        n = len(batch.rows[i].ids)
        batch.trainer_logprobs[i] = [None] + [values[b][t] if mask[b][t] else None for t in range(n - 1)]
        batch.before_update[i] = before_update


Logprobs = Callable[[MicroBatch, "int | None", bool], tuple[torch.Tensor, torch.Tensor]]


def check_train_config(config: TrainConfig, has_adapter: bool) -> None:
    if config.kl_coef > 0 and not has_adapter:
        raise ValueError("kl_coef > 0 needs a LoRA adapter (the base policy is the adapter disabled)")


def sft_lr_factor(step: int, steps: int, final: float) -> float:
    """The learning rate's factor at optimizer step `step` of `steps`: 1 at the first, `final` at the last."""
    return 1.0 - (1.0 - final) * step / max(1, steps - 1)


def idle_row(rows: list[Row]) -> Row:
    """Two real tokens, the second a target (one logprob: token_logprobs computes targets only), for an
    idle pass (`Trainer._idle_pass`); its loss is multiplied by 0 there."""
    ids = (min(rows, key=lambda r: len(r.ids)).ids * 2)[:2]  # (a row of one token: twice)
    return Row(ids=ids, mask=[0, 1], logprobs=[NO_LOGPROB, NO_LOGPROB], weight=0.0)


class Trainer:
    """The training loops over `model`. One process by default; a trainer rank (trainer_rank.py) passes
    `logprobs` (the forward through its FSDP root), `micro_batches` (its share of each step's rows, [] = a
    pass that trains nothing and keeps the ranks' collectives in step) and `across` (metric reduction).
    `fused_lora`: plain LoRA linears train through `fused_lora.FusedLoraLinear` (TrainerConfig.fused_lora);
    `fused_norms`: RMS norms through `fused_norm.FusedRMSNorm` (TrainerConfig.fused_norms);
    `share_prompts`: rows sharing a prompt compute it once (TrainerConfig.share_prompts; logprobs.py);
    `roll_back`: a call that raises after an optimizer step puts the trainable parameters and the optimizer
    state back as they were before the call (`CallStart`, rollback.py): the served weights stay those of the last committed
    step. A trainer rank passes False (a rank that fails stops every rank: the served model never loaded the
    update, and the ranks cannot train again)."""

    def __init__(
        self,
        model: Any,
        pad_id: int,
        logprobs: Logprobs | None = None,
        micro_batches: Callable[[list[Row], int], list[list[int]]] | None = None,
        across: Reduction | None = None,
        fused_lora: bool = False,
        share_prompts: bool = False,
        fused_norms: bool = False,
        roll_back: bool = True,
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        from peft import PeftModel

        self.has_adapter = isinstance(model, PeftModel)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-4)
        self.device = next(model.parameters()).device
        # whether the logits must come from the model's whole forward (checked at the first call, on the
        # thread that trains: head_is_the_models); None = not checked yet, False for given logprobs
        self._via_forward: bool | None = None if logprobs is None else False
        self.logprobs: Logprobs = logprobs or (
            lambda mb, chunk, with_entropy: token_logprobs(
                model, mb, chunk, with_entropy, bool(self._via_forward)
            )
        )
        # (a shared prompt's keys and values come from the decoder's cache: plain attention layers only)
        self.share_prompts = share_prompts and logprobs is None and shares_prefixes(model)
        self.micro_batches = micro_batches
        self.across: Reduction = across or OneProcess()
        self._fused = FusedLoraTraining.of(model) if fused_lora else None
        self._norms = FusedNormTraining.of(model) if fused_norms else None
        self.roll_back = roll_back
        self._before: CallStart | None = None  # the call's state before its first optimizer step
        self.progress = TrainProgress()  # (read by other threads: the training server streams it)

    def step(self, batch: TrainingBatch, config: TrainConfig) -> dict[str, float]:
        """GRPO: rows (with their advantages) → micro-batches → logprobs → loss → backward, then clip and
        step; one optimizer step per `steps_per_call` slice of the rows. Returns the step's metrics."""
        started = time.perf_counter()
        check_train_config(config, self.has_adapter)
        spc = config.steps_per_call
        slices = [batch.rows[k::spc] for k in range(spc)]
        batch.trainer_logprobs = [[] for _ in batch.rows]
        batch.before_update = [False for _ in batch.rows]
        total = GRPOTotals()
        self.progress.start(len(batch.rows))
        try:
            self._begin(config)  # (inside: a failing start still ends in eval mode, its swaps undone)
            for k, rows in enumerate(slices):
                if not rows:
                    continue
                normaliser = trained_targets(rows)  # (of all the slice's rows: every rank sees them all)
                for micro in self._micro_batches(rows, config):
                    if not micro:
                        self._idle_pass(rows, config.logprob_chunk_size, config.kl_coef > 0)
                        continue
                    mb = self._collate([rows[i] for i in micro], config)
                    lp, entropy = self.logprobs(mb, config.logprob_chunk_size, True)  # (B, T-1) each
                    if config.save_rows:  # for the step's record (the dashboard's token view)
                        _record_logprobs(
                            batch, [k + i * spc for i in micro], lp, mb, total.optimizer_steps == 0
                        )
                    lp_ref = self._reference_logprobs(mb, config) if config.kl_coef > 0 else None
                    terms = policy_loss(
                        lp, mb.behaviour, mb.advantages, mb.mask, mb.weights, normaliser, config, lp_ref
                    )
                    terms.loss.backward()
                    total.add(terms, entropy, mb, before_any_update=total.optimizer_steps == 0)
                    self.progress.rows_done += len(micro)
                total.grad_norm = self._optimizer_step(config.max_grad_norm)
                total.optimizer_steps += 1
                self.progress.optimizer_steps = total.optimizer_steps
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._end()
        total.reduce(self.across)
        return total.metrics(time.perf_counter() - started)

    def sft(self, steps: list[list[Row]], config: SFTConfig) -> dict[str, float]:
        """Supervised fine-tuning: one optimizer step per list of rows, the token-mean NLL of the trained
        tokens. Returns the call's metrics."""
        started = time.perf_counter()
        loss = entropy_sum = weight = grad_norm = 0.0
        done = 0
        self.progress.start(sum(len(rows) for rows in steps))
        try:
            self._begin(config)
            for k, rows in enumerate(steps):
                if not rows:
                    continue
                self._set_lr(config.learning_rate * sft_lr_factor(k, len(steps), config.final_lr_fraction))
                normaliser = trained_targets(rows)
                step_loss = 0.0
                for micro in self._micro_batches(rows, config):
                    if not micro:
                        self._idle_pass(rows, config.logprob_chunk_size, False)
                        continue
                    mb = self._collate([rows[i] for i in micro], config)
                    lp, entropy = self.logprobs(mb, config.logprob_chunk_size, True)  # (B, T-1) each
                    micro_loss = sft_loss(lp, mb.mask, mb.weights, normaliser)
                    micro_loss.backward()
                    token_weight = mb.mask * mb.weights[:, None]  # (B, T-1)
                    step_loss += float(micro_loss.detach())
                    entropy_sum += float((entropy * token_weight).sum())
                    weight += float(token_weight.sum())
                    self.progress.rows_done += len(micro)
                grad_norm = self._optimizer_step(config.max_grad_norm)
                loss += step_loss
                done += 1
                self.progress.optimizer_steps = done
        except BaseException:
            self._roll_back()
            raise
        finally:
            self._end()
        loss, entropy_sum, weight = self.across.sum([loss, entropy_sum, weight])
        return {
            "loss": loss / (done or 1),  # mean over optimizer steps of the token-mean NLL
            "entropy": entropy_sum / (weight or 1.0),
            "grad_norm": grad_norm,
            "optimizer_steps": done,
            "trainable_tokens": sum(r.trainable_tokens for rows in steps for r in rows),
            "train_seconds": time.perf_counter() - started,
        }

    def ready(self) -> None:
        """What is checked once, on the thread that trains, before the first training call (which calls it):
        whether the model's logits are its head's (`head_is_the_models`), else they come from its forward."""
        if self._via_forward is not None:
            return
        try:
            self._via_forward = not head_is_the_models(self.model)
        except Exception as exc:  # (a model the short check cannot run: train as before, say why)
            log.warning("could not check %s's logits against its head: %s", type(self.model).__name__, exc)
            self._via_forward = False
        if self._via_forward:
            log.warning(
                "%s does more to its logits than artrl's trainer knows (after its lm_head): the trainer takes "
                "them from the model's whole forward (slower, and no shared prompts); please report it",
                type(unwrapped(self.model)).__name__,
            )
            self.share_prompts = False

    # ---------------------------------------------------------------- the pieces of both loops
    def _begin(self, config: TrainConfig | SFTConfig) -> None:
        self._before = None
        self.ready()
        for group in self.optimizer.param_groups:
            group.update(lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay)
        if config.gradient_checkpointing:  # (on for this call only: generation never checkpoints)
            unwrapped(self.model).activation_checkpointing_enable({"use_reentrant": False})
        self.model.train()
        # (the model's own modules back in _end: saving and merging see them)
        for swap in (self._fused, self._norms):
            if swap is not None:
                swap.fuse()

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _end(self) -> None:
        for swap in (self._fused, self._norms):
            if swap is not None:
                swap.restore()
        self.model.eval()
        inner = unwrapped(self.model)
        if inner.is_activation_checkpointing:
            inner.activation_checkpointing_disable()
            inner.disable_input_require_grads()  # (its embedding hook would outlive the call otherwise)
        self.optimizer.zero_grad(set_to_none=True)
        self._before = None

    def _roll_back(self) -> None:
        """A call that failed after an optimizer step: its parameters and optimizer state as before it."""
        if self._before is not None:
            self._before.restore(self)
            self._before = None

    def _sharing(self, config: TrainConfig | SFTConfig) -> bool:
        """Whether this call computes shared prompts once (not under activation checkpointing, which runs the
        decoder without its cache)."""
        return self.share_prompts and not config.gradient_checkpointing

    def _micro_batches(self, rows: list[Row], config: TrainConfig | SFTConfig) -> list[list[int]]:
        if self.micro_batches is not None:
            return self.micro_batches(rows, config.max_tokens_per_microbatch)
        packing = pack_by_prompt if self._sharing(config) else pack
        return packing(rows, config.max_tokens_per_microbatch)

    def _collate(self, rows: list[Row], config: TrainConfig | SFTConfig) -> MicroBatch:
        """A micro-batch's tensors, with its shared prompt when there is one to compute once."""
        return collate(rows, self.device, self.pad_id, shared_prompt(rows) if self._sharing(config) else 0)

    def _reference_logprobs(self, mb: MicroBatch, config: TrainConfig) -> torch.Tensor:
        """The base policy's logprobs (the adapter disabled: no second copy of the weights), no grad."""
        with torch.no_grad(), self.model.disable_adapter():
            return self.logprobs(mb, config.logprob_chunk_size, False)[0]

    def _idle_pass(self, rows: list[Row], chunk: int | None, with_reference: bool) -> None:
        """The forward and backward passes of a micro-batch that trains nothing (a zero loss): a rank with
        fewer micro-batches than another still joins each of their FSDP collectives, in the same order. Its
        row is the least work there is: the first two tokens of the shortest row (one predicted token)."""
        mb = collate([idle_row(rows)], self.device, self.pad_id)
        lp, _ = self.logprobs(mb, chunk, False)  # (1, T-1)
        if with_reference:
            with torch.no_grad(), self.model.disable_adapter():
                self.logprobs(mb, chunk, False)
        (lp.sum() * 0.0).backward()

    def _optimizer_step(self, max_grad_norm: float | None) -> float:
        limit = max_grad_norm if max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, limit)  # a DTensor when FSDP shards them
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if self.roll_back and self._before is None:  # (the call's first optimizer step)
            self._before = CallStart.of(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ---------------------------------------------------------------- persistence
    def save(self, directory: str) -> None:
        """Adapter (PEFT format) or full weights, plus the optimizer state, into `directory`."""
        save_weights(self.model, directory)
        torch.save(self.optimizer.state_dict(), f"{directory}/optimizer.pt")

    async def run(self, call: Callable[[Trainer], dict[str, float]], engine: Any) -> dict[str, float]:
        """A training call on the served weights themselves: where nothing else touches them (the engine
        decides where: the embedded engine's thread, between two of its steps). Its metrics gain
        `queue_seconds`: how long it waited for its turn there."""
        queued = time.perf_counter()
        self.progress.phase = "queued"

        def turn() -> dict[str, float]:
            waited = time.perf_counter() - queued
            self.progress.phase = "training"
            return {**call(self), "queue_seconds": waited}

        try:
            return await engine.run_exclusive(turn)
        finally:
            self.progress.phase = "saving"  # (the caller writes the checkpoint next; idle after)

    def close(self) -> None:
        """Nothing to stop: this trainer runs in this process."""

    def load(self, directory: str) -> None:
        if self.has_adapter:
            load_adapter(self.model, directory)
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
