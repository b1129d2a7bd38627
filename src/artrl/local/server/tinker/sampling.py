"""Tinker sampling clients on the server: `save_weights_and_get_sampling_client` gives a sampler of a
training client's adapter (the weights it has when it samples: the SDK's RL loops save, sample, then train
again, in that order); `create_sampling_client(base_model=...)` one of the base model. `sample` runs on the
shared engine (its rows batched with every model's), `compute_logprobs` (prompt logprobs) on the engine's
thread; both answer the SDK's protobuf SampleResponse. Stops are token ids (the SDK's renderers give ids);
stop strings and top-k are refused with what to send instead."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from artrl.local.engine.contract import SamplingParams
from artrl.local.server.tinker.futures import UserError
from artrl.local.server.tinker.wire import messages
from artrl.local.train.tinker.steps import TinkerSteps, TokenDatum


@dataclass
class Sampler:
    tenant: str
    service: Any  # the LocalService whose engine samples (a model's adapter, or the base's)
    base_only: bool = False


def prompt_ids(body: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in (body.get("prompt") or {}).get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"only token chunks are sampled here (got {chunk.get('type')!r})")
        tokens += [int(t) for t in chunk.get("tokens") or []]
    if not tokens:
        raise UserError("sample needs a prompt of at least one token")
    return tokens


def sampling_params(settings: dict[str, Any], stop_default: frozenset[int]) -> SamplingParams:
    stop = settings.get("stop")
    if stop is None:
        stops = stop_default
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        stops = frozenset(stop)
    else:
        raise UserError("stop sequences are token ids here (a list of ints), not strings")
    if settings.get("top_k", -1) not in (-1, 0, None):
        raise UserError("top_k is not served: use top_p")
    seed = settings.get("seed")
    return SamplingParams(
        max_tokens=int(settings.get("max_tokens") or 16),
        temperature=float(settings.get("temperature", 1.0)),
        top_p=float(settings.get("top_p", 1.0)),
        seed=int(seed) if seed is not None else None,
        stop_token_ids=stops,
    )


async def sample(sampler: Sampler, body: dict[str, Any]) -> bytes:
    """The SDK's SampleResponse for an `asample` body."""
    ids = prompt_ids(body)
    n = int(body.get("num_samples", 1))
    if not 1 <= n <= 128:
        raise UserError("num_samples must be 1-128")
    params = sampling_params(body.get("sampling_params") or {}, sampler.service.chat_format.stop_ids)
    pb = messages()
    response = pb.SampleResponse()
    if params.max_tokens > 0:
        streams = sampler.service.engine.generate(ids, params, n)
        for stream in streams:
            tokens, logprobs = [], []
            async for choice in stream:
                tokens.append(choice.token_id)
                logprobs.append(choice.logprob)
            sequence = response.sequences.add()
            stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
            sequence.stop_reason = pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH
            sequence.tokens = np.asarray(tokens, np.int32).tobytes()
            sequence.logprobs = np.asarray(logprobs, np.float32).tobytes()
    if body.get("prompt_logprobs"):
        if sampler.base_only:
            raise UserError("prompt logprobs are computed for a training client's sampler only")
        values = await prompt_logprobs(sampler.service, ids)
        response.prompt_logprobs = np.asarray(values, np.float32).tobytes()
    if (
        body.get("topk_prompt_logprobs")
        or body.get("topk_sample_logprobs")
        or body.get("prompt_alt_tokens_k")
    ):
        raise UserError("top-k logprobs and alternative tokens are not served")
    return response.SerializeToString()


async def prompt_logprobs(service: Any, ids: list[int]) -> list[float]:
    """log p(token t | tokens < t) for each prompt token (NaN for the first, which nothing predicts)."""
    if len(ids) < 2:
        return [math.nan] * len(ids)
    datum = TokenDatum(ids[:-1], {"target_tokens": ids[1:], "weights": [0.0] * (len(ids) - 1)})

    def forward() -> list[float]:
        logprobs, _ = TinkerSteps(service.trainer).forward_backward([datum], "cross_entropy", None, True)
        return logprobs[0]

    return [math.nan, *(await service.run_exclusive(forward, changes_weights=False))]
