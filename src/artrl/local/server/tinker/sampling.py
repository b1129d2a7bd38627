"""Tinker sampling clients on the server: `save_weights_and_get_sampling_client` gives a sampler of a
training client's adapter (the weights it has when it samples: the SDK's RL loops save, sample, then train
again, in that order); `create_sampling_client(model_path=tinker://...)` one of saved weights (frozen: an
adapter of its own on the shared model), `create_sampling_client(base_model=...)` one of the base model.
`sample` runs on the shared engine (its rows batched with every model's), `compute_logprobs` (prompt
logprobs) on the engine's thread; both answer the SDK's protobuf SampleResponse. Stops are token ids (the
SDK's renderers give ids); stop strings and top-k are refused with what to send instead."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from artrl.local.engine.contract import SamplingParams
from artrl.local.server.tinker.futures import UserError
from artrl.local.server.tinker.wire import messages
from artrl.local.train.tinker.steps import TinkerSteps, TokenDatum


@dataclass
class Sampler:
    """What a sampling client samples: `generate(ids, params, n)` its streams, `logprobs(ids)` its prompt
    logprobs (NaN first), `stop_ids()` the tokens it stops at unless told otherwise."""

    tenant: str
    generate: Callable[[list[int], SamplingParams, int], Awaitable[list[Any]]]
    logprobs: Callable[[list[int]], Awaitable[list[float]]]
    stop_ids: Callable[[], Awaitable[frozenset[int]]]
    model_path: str | None = None


def live_sampler(tenant: str, service: Any) -> Sampler:
    """A sampler of a training client's adapter as it is when each call runs (its LocalService's engine)."""

    async def generate(ids: list[int], params: SamplingParams, n: int) -> list[Any]:
        return service.engine.generate(ids, params, n)

    async def stop_ids() -> frozenset[int]:
        return service.chat_format.stop_ids

    return Sampler(tenant, generate, lambda ids: prompt_logprobs(service, ids), stop_ids)


def frozen_sampler(tenant: str, shared: Any, folder: Path | None, path: str | None, keep: int) -> Sampler:
    """A sampler of the adapter saved in `folder` (None: the base model) on the shared model `shared`."""

    def adapter() -> str | None:  # (blocking; a saved adapter unloaded since is loaded again)
        if folder is None:
            shared.base_engine()
            return None
        if not (folder / "adapter_model.safetensors").is_file():
            raise UserError(f"checkpoint {path!r} was deleted")
        return shared.saved_adapter(folder, keep)

    async def generate(ids: list[int], params: SamplingParams, n: int) -> list[Any]:
        name = await asyncio.to_thread(adapter)
        return shared.engine.generate(ids, params, n, adapter=name)

    async def logprobs(ids: list[int]) -> list[float]:
        name = await asyncio.to_thread(adapter)
        future = shared.engine.call(lambda: plain_logprobs(shared.model, ids, name), changes_weights=False)
        return await asyncio.wrap_future(future)

    async def stop_ids() -> frozenset[int]:
        return await asyncio.to_thread(shared.stop_ids)

    return Sampler(tenant, generate, logprobs, stop_ids, path)


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
    params = sampling_params(body.get("sampling_params") or {}, await sampler.stop_ids())
    pb = messages()
    response = pb.SampleResponse()
    if params.max_tokens > 0:
        streams = await sampler.generate(ids, params, n)
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
        values = await sampler.logprobs(ids)
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


def plain_logprobs(model: Any, ids: list[int], adapter: str | None) -> list[float]:
    """Prompt logprobs of `ids` through the PEFT `model` with `adapter` (None: the base), on the engine's
    thread: one forward, no gradient (a sampler's weights are frozen)."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([ids], device=next(model.parameters()).device)
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=x).logits
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=x).logits
        values = logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
    return [math.nan, *values.tolist()]
