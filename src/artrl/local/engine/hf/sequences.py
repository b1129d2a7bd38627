"""What the embedded engine runs: a sampled sequence (its stream, its sampling, its adapter), a waiting
request (a prompt and its sequences), the running batch's rows with their KV cache, and how sequences end."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from artrl.local.engine.contract import SequenceStream
from artrl.local.engine.hf.kv_cache import BatchCache
from artrl.local.engine.hf.sampling import SamplingParams


@dataclass
class RunningSequence:
    stream: SequenceStream
    params: SamplingParams
    generator: random.Random | None  # (seeded requests: the row's own draws, see sampling.uniforms)
    generated: int = 0
    last_token: int = 0
    position: int = 0  # position id of last_token
    done: bool = False  # engine side: ended (stop, length or abort) and to be dropped from the batch
    tokens: list[int] = field(default_factory=list)  # prompt + sampled (for the prefix cache)
    reusable: bool = False  # ended by stop or length: its keys and values may serve a later prompt
    adapter: str | None = (
        None  # the LoRA adapter it samples from (an engine serving several; None: the model)
    )
    version: int = 0  # its weights' version when it came (HFEngine.weights_version)

    def finish(self, reason) -> None:
        if not self.done:
            self.done = True
            self.reusable = reason in ("stop", "length")
            self.stream.end(reason)


@dataclass
class Request:
    prompt_ids: list[int]
    sequences: list[RunningSequence]
    adapter: str | None = None  # (its sequences' adapter)


@dataclass
class Batch:
    """Running sequences and their left-padded KV cache. Row i of every tensor belongs to sequences[i]."""

    sequences: list[RunningSequence] = field(default_factory=list)
    cache: BatchCache | None = None  # per layer (B, H_kv, T, D), grown in place by decode steps
    mask: torch.Tensor | None = None  # (B, T) long, 0 on padding


def one_row_per_prompt(requests: list[Request]) -> list[Request]:
    """Requests with the same prompt (a group's rollouts, sent one by one) joined into one: their prompt is
    prefilled once and its keys, values and logits fan out to all their sequences."""
    joined: dict[tuple[str | None, tuple[int, ...]], Request] = {}
    for request in requests:
        key = (request.adapter, tuple(request.prompt_ids))
        if key in joined:
            joined[key].sequences.extend(request.sequences)
        else:
            joined[key] = Request(request.prompt_ids, list(request.sequences), request.adapter)
    return list(joined.values())


def fail_sequences(sequences: list[RunningSequence], message: str, reason: str = "error") -> None:
    for seq in sequences:
        if not seq.done:
            seq.done = True
            seq.stream.end(reason, message)  # type: ignore[arg-type]
