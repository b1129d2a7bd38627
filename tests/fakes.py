"""Fakes for tests: a real implementation of the Engine contract that plays back scripted token ids.

The gateway under test (templates, continuation, tool parsing, HTTP) is the real one; only the choice of
tokens is scripted, so tests can make a model "call a tool" deterministically.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from artrl.local.engine import SequenceStream
from artrl.local.sampling import SamplingParams, TokenChoice


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
