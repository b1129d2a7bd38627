"""The vLLM engine: token ids in, sampled token ids and logprobs out, over vLLM's /v1/completions.

The gateway keeps everything about chat templates, continuation and tool calls; vLLM only ever sees the
exact prompt token ids the gateway built (`prompt` as a list of ids), and returns the sampled ids
(`return_token_ids`) with their logprobs (vLLM's default `raw_logprobs`: the model's distribution at
temperature 1, the convention of the embedded engine and of the trainer). Stopping is the gateway's: vLLM
stops only at the gateway's end-of-turn ids (`ignore_eos`, `stop_token_ids`), and the stop token is kept.

Weights follow training: each step's adapter is loaded at runtime as `{model}@{step}` and new requests go
to it; adapters older than `lora_window` steps are unloaded. Full fine-tuning restarts the server on the
step's checkpoint (a supervised server only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from artrl.config import VLLMConfig
from artrl.local.engine import EngineError, SamplingParams, SequenceStream, TokenChoice
from artrl.local.vllm_server import VLLMServer

log = logging.getLogger(__name__)

_ABORT_POLL_S = 0.25  # how often an in-flight request checks whether its consumers all went away


def completion_request(model: str, prompt_ids: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    """The body of a token-in /v1/completions request (streamed)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": params.top_logprobs,  # the sampled token's logprob always; k alternatives besides
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": sorted(params.stop_token_ids),
        "ignore_eos": True,  # only the gateway's stop ids end a turn
        "skip_special_tokens": False,
        "detokenize": True,
        "stream": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def _token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def choice_tokens(choice: dict[str, Any], top_k: int) -> list[TokenChoice]:
    """The new tokens of one streamed completions choice (`token_ids` plus `logprobs`).

    vLLM's `top_logprobs` hold the k most likely tokens plus the sampled one: the k best are kept."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(t) for t in logprobs.get("tokens") or []]
    if len(values) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} token ids but {len(values)} logprobs in one chunk")
    tops = logprobs.get("top_logprobs") or [None] * len(ids)
    tokens = []
    for token_id, value, top in zip(ids, values, tops, strict=True):
        ranked = sorted(((_token_id(k), float(v)) for k, v in (top or {}).items()), key=lambda kv: -kv[1])
        tokens.append(TokenChoice(int(token_id), float(value), tuple(ranked[:top_k])))
    return tokens


class VLLMEngine:
    """The Engine contract over a vLLM server (one started by artrl, or one at `config.url`)."""

    def __init__(
        self,
        base_url: str,
        served_name: str,
        model_name: str,
        max_context: int,
        config: VLLMConfig,
        server: VLLMServer | None,
        api_key: str | None = None,
        restart: Callable[[str], VLLMServer] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._restart = (
            restart  # full fine-tuning: a server on a checkpoint folder (None: one artrl did not start)
        )
        self._trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="artrl-trainer")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.served_name = served_name  # the base model's name on the vLLM server
        self.target = served_name  # what requests ask vLLM for: the base, or the latest adapter
        self.model_name = model_name  # the artrl model's name: adapters are `{model_name}@{step}`
        self.config = config
        self.server = server
        self.loaded: list[str] = []  # adapters loaded by us, oldest first
        self._max_context = max_context
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._closed = False
        self._tasks: set[asyncio.Task] = set()

    @property
    def max_context(self) -> int:
        return self._max_context

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        streams = [SequenceStream(loop) for _ in range(n)]
        # vLLM refuses n > 1 for greedy sampling: one greedy sequence is every sequence
        body = completion_request(self.target, prompt_ids, params, 1 if params.temperature == 0 else n)
        task = loop.create_task(self._run(body, streams))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)
        return streams

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = self._clients[loop] = httpx.AsyncClient(timeout=timeout, limits=limits)
        return client

    async def _run(self, body: dict[str, Any], streams: list[SequenceStream]) -> None:
        """Stream one completions request into `streams`; every stream ends, whatever happens."""
        ended = [False] * len(streams)

        def end_all(reason: str, error: str | None = None) -> None:
            for i, stream in enumerate(streams):
                if not ended[i]:
                    ended[i] = True
                    stream.end(reason, error)  # type: ignore[arg-type]

        reader = asyncio.ensure_future(self._read(body, streams, ended))
        try:
            while not reader.done():  # a consumer that went away frees vLLM's slot now, not at the next token
                await asyncio.wait([reader], timeout=_ABORT_POLL_S)
                if not reader.done() and all(s.aborted for s in streams):
                    reader.cancel()
                    await asyncio.wait([reader])
                    end_all("abort")
                    return
            reader.result()
            end_all("error", "vLLM's stream ended without a finish reason")
        except asyncio.CancelledError:
            reader.cancel()
            end_all("abort")
            raise
        except EngineError as exc:
            end_all("error", str(exc))
        except Exception as exc:  # whatever went wrong, every stream ends: a consumer never hangs
            end_all("error", self._explain(exc))

    async def _read(self, body: dict[str, Any], streams: list[SequenceStream], ended: list[bool]) -> None:
        top_k = body["logprobs"]
        fan_out = body["n"] < len(streams)  # greedy: choice 0 feeds every stream
        url = f"{self.base_url}/v1/completions"
        async with asyncio.timeout(self.config.request_timeout_s):
            async with self._client().stream("POST", url, json=body, headers=self._headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise EngineError(f"vLLM answered {response.status_code}: {response.text[:2000]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        server = self.server  # read once: a weight reload may replace it meanwhile
                        where = f" (its log: {server.log_path})" if server else ""
                        raise EngineError(f"vLLM failed mid-stream{where}: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        targets = range(len(streams)) if fan_out else [choice["index"]]
                        tokens = choice_tokens(choice, top_k)
                        reason = choice.get("finish_reason")
                        if reason == "abort":  # not ours (ours close the connection): a shutdown or pause
                            raise EngineError("vLLM aborted the request (its server is stopping or paused)")
                        for i in targets:
                            if ended[i] or streams[i].aborted:
                                continue
                            for token in tokens:
                                streams[i].push(token)
                            if reason is not None:
                                ended[i] = True
                                streams[i].end("length" if reason == "length" else "stop")
                    if all(ended):
                        return

    def _explain(self, exc: BaseException) -> str:
        server = self.server  # read once: a weight reload may replace it meanwhile
        if server is not None and not server.alive:
            return server.describe_exit()
        if isinstance(exc, TimeoutError):
            return f"vLLM did not finish within {self.config.request_timeout_s:g} s (VLLMConfig.request_timeout_s)"
        return f"request to vLLM at {self.base_url} failed: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ administration (any event loop)
    async def _admin(
        self, path: str, body: dict[str, Any] | None = None, method: str = "POST"
    ) -> httpx.Response:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, headers=self._headers) as http:
            try:
                response = await http.request(method, f"{self.base_url}{path}", json=body)
            except httpx.HTTPError as exc:
                raise EngineError(self._explain(exc)) from exc
        if response.status_code != 200:
            raise EngineError(f"vLLM {path} answered {response.status_code}: {response.text[:2000]}")
        return response

    async def load_adapter(self, step: int, path: str) -> None:
        """Load a step's PEFT adapter folder as `{model}@{step}`, send new requests to it, unload beyond the
        window."""
        name = f"{self.model_name}@{step}"
        # in place: a server that outlived an earlier run may hold the name already
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._admin("/v1/load_lora_adapter", body)
        if name in self.loaded:
            self.loaded.remove(name)
        self.loaded.append(name)
        self.target = name
        while len(self.loaded) > self.config.lora_window:
            old = self.loaded.pop(0)
            try:
                await self._admin("/v1/unload_lora_adapter", {"lora_name": old})
            except EngineError as exc:  # a leftover adapter costs memory, not correctness
                log.warning("could not unload adapter %s: %s", old, exc)

    async def reload_weights(self, start_server: Callable[[], VLLMServer] | None) -> None:
        """Full fine-tuning: replace the server by one on the new checkpoint (`start_server()` makes it)."""
        if self.server is None or start_server is None:
            raise EngineError(
                "full fine-tuning with a vLLM server artrl did not start (VLLMConfig.url) cannot reload the "
                "weights; train a LoRA, or let artrl start the server"
            )
        old, self.server = self.server, None
        await asyncio.to_thread(old.stop)
        server = await asyncio.to_thread(start_server)
        self.base_url, self._headers = server.base_url, {"Authorization": f"Bearer {server.api_key}"}
        self.server = server

    # ------------------------------------------------------------------ around training
    async def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """On the trainer's own thread: vLLM holds its own copy of the weights and goes on generating."""
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn)

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """Where the user shares one GPU between vLLM and the trainer (VLLMConfig.sleep_while_training), vLLM
        sleeps inside the block and wakes up after it, failed or not."""
        if not self.config.sleep_while_training:
            yield
            return
        try:
            await self.sleep()
            yield
        finally:
            try:  # a failure here must not cost the step its checkpoint: publish wakes it again
                await self.wake_up()
            except EngineError as exc:
                log.warning("vLLM did not wake up after training: %s", exc)

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        """Load the step's adapter as `{model}@{step}`; after full fine-tuning, restart on the checkpoint."""
        if self.config.sleep_while_training:
            await self.wake_up()  # awake already, unless waking after training failed
        if adapter:
            await self.load_adapter(step, checkpoint)
        else:
            restart = self._restart
            await self.reload_weights(None if restart is None else lambda: restart(checkpoint))

    async def sleep(self) -> None:
        """GPU sharing: free vLLM's GPU memory (level 1: weights to CPU, KV cache dropped) for training.
        Requests in flight finish first (`mode=wait`); new ones wait for `wake_up`."""
        await self._admin("/sleep?level=1&mode=wait")

    async def wake_up(self) -> None:
        await self._admin("/wake_up")

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = self._clients, {}
        here = asyncio.get_running_loop()
        try:
            for loop, client in clients.items():
                if loop is here:
                    await client.aclose()
                elif loop.is_running():  # the gateway's loop, in its own thread; it may stop meanwhile
                    done = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.aclose(), loop))
                    await asyncio.wait([done], timeout=5)
        finally:
            if self.server is not None:
                await asyncio.to_thread(self.server.stop)
            self._trainer_thread.shutdown(wait=True)
