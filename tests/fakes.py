"""Fakes for tests: a real implementation of the Engine contract that plays back scripted token ids.

The gateway under test (templates, continuation, tool parsing, HTTP) is the real one; only the choice of
tokens is scripted, so tests can make a model "call a tool" deterministically (`encode` writes a script).
Also engines that are slow or instant, a model whose forwards a hook sees, and a fake vLLM server's stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from artrl.local.engine.contract import SequenceStream
from artrl.local.engine.hf.sampling import SamplingParams, TokenChoice


@dataclass
class ScriptedEngine:
    """Each `generate` call streams the next script (a list of token ids) for each of its n sequences."""

    scripts: list[list[int]] = field(default_factory=list)
    max_context: int = 2048
    prompts: list[list[int]] = field(default_factory=list)
    logprob: float = -0.25

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        self.prompts.append(list(prompt_ids))
        loop = asyncio.get_running_loop()
        streams = []
        for _ in range(n):
            script = self.scripts.pop(0)
            stream = SequenceStream(loop)
            reason = "length"
            for i, token in enumerate(script[: params.max_tokens]):
                stream.push(TokenChoice(token, self.logprob - i * 0.01))
                if token in params.stop_token_ids:
                    reason = "stop"
                    break
            stream.end(reason)  # type: ignore[arg-type]
            streams.append(stream)
        return streams

    async def close(self) -> None:
        return None


def encode(tokenizer, text: str) -> list[int]:
    """`text`'s token ids, as a ScriptedEngine script (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class SlowEngine:
    """Streams token `token` every `interval` seconds until max_tokens or until the consumer aborts; records
    each stream so tests can see whether (and when) the gateway stopped generating. `held`: each stream, after
    its tokens, stays open until `release()` (a request in flight for as long as a test needs it)."""

    token: int = 5
    interval: float = 0.05
    max_context: int = 2048
    held: bool = False
    streams: list[SequenceStream] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    # `generate` runs on the gateway's own thread and loop, not the test's: thread-safe signals
    _made: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(n):
            stream = SequenceStream(loop)
            with self._made:
                self.streams.append(stream)
                self._made.notify_all()
            self.tasks.append(asyncio.create_task(self._drip(stream, params.max_tokens)))
            out.append(stream)
        return out

    async def started(self, n: int = 1, within_s: float = 30.0) -> list[SequenceStream]:
        """The streams, once `generate` has made at least `n`. A client's answer or timeout says nothing about
        that: the gateway renders the prompt in an executor before it calls `generate` (and, for a client
        that left meanwhile, still calls it, then aborts at its next disconnect poll)."""

        def wait() -> bool:
            with self._made:
                return self._made.wait_for(lambda: len(self.streams) >= n, within_s)

        assert await asyncio.to_thread(wait), f"{len(self.streams)} of {n} streams within {within_s} s"
        return list(self.streams)

    def release(self) -> None:
        """Held streams end (and later ones are not held)."""
        self._released.set()

    async def _drip(self, stream: SequenceStream, max_tokens: int) -> None:
        for _ in range(max_tokens):
            if stream.aborted:
                stream.end("abort")
                return
            stream.push(TokenChoice(self.token, -0.5))
            await asyncio.sleep(self.interval)
        while self.held and not self._released.is_set():  # (polled: release() comes from another thread)
            if stream.aborted:
                stream.end("abort")
                return
            await asyncio.sleep(self.interval)
        stream.end("length")

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()


async def aborted(stream: SequenceStream, within_s: float = 30.0) -> bool:
    """Whether the gateway aborted `stream` within `within_s` (polled, so a prompt abort returns at once; the
    bound is generous because the gateway polls for a disconnect only every 0.25 s, on a possibly busy core)."""
    for _ in range(int(within_s / 0.05)):
        if stream.aborted:
            break
        await asyncio.sleep(0.05)
    return stream.aborted


@dataclass
class InstantEngine:
    """Answers every sequence at once with `tokens` (then a stop): the gateway at full speed, for fuzzing."""

    tokens: list[int] = field(default_factory=lambda: [5, 6])
    stop: int = 2
    max_context: int = 2048

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        loop = asyncio.get_running_loop()
        streams = []
        for _ in range(n):
            stream = SequenceStream(loop)
            for token in [*self.tokens, self.stop][: params.max_tokens]:
                stream.push(TokenChoice(token, -0.1))
            stream.end("stop")
            streams.append(stream)
        return streams

    async def close(self) -> None:
        return None


def instrumented_model(inner, on_forward):
    """A real model behind a hook that sees every forward's input first: the hook may record it, or raise the
    way an out-of-memory or a kernel error would (a fake of a failing or counted model, not a mock: the rest
    is the real computation). An nn.Module, so an engine can inspect it like any model."""
    import torch

    class Instrumented(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep, cache=None):
            on_forward(input_ids, position_ids)
            return self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                cache=cache,
            )

    return Instrumented()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(model, rank: int = 8, alpha: int = 16):
    """`model` under a PEFT LoRA whose B matrices are random (a fresh adapter adds nothing, which would hide a
    wrong merge or fold); seeded, so two calls on equal models give equal adapters."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)  # (lora_A's initialisation)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def sse(*chunks: dict) -> bytes:
    """A vLLM server's streamed completion: each chunk as an SSE `data:` event, then `[DONE]`."""
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
