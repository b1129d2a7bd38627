"""The vLLM engine: token ids in, sampled token ids and logprobs out, over vLLM's token-in/token-out
/inference/v1/generate (the servers artrl starts) or /v1/completions (a server at a url; VLLMConfig.wire).

The gateway keeps everything about chat templates, continuation and tool calls; vLLM only ever sees the
exact prompt token ids the gateway built, and returns the sampled ids with their logprobs (vLLM's default
`raw_logprobs`: the model's distribution at temperature 1, the convention of the embedded engine and of the
trainer). Stopping is the gateway's: vLLM
stops only at the gateway's end-of-turn ids (`ignore_eos`, `stop_token_ids`), and the stop token is kept.

Weights follow training: each step's adapter is loaded at runtime as `{model}@{step}` and new requests go
to it; adapters older than `lora_window` steps are unloaded. Full fine-tuning restarts the servers on the
step's checkpoint (supervised servers only), rolling: with several replicas some serve while others restart.

Several servers (`VLLMConfig.replicas`, or several urls) serve one model: the router (replica_router.py)
picks each request's replica, the replica set (vllm_replicas.py) keeps them alive and loaded. A request
that fails on a replica before any of its tokens reached the gateway is sent to another; once tokens were
streamed it fails, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

import aiohttp

from artrl.config import EngineConfig, VLLMConfig
from artrl.local.concurrency.idle_thread import IdleEndingExecutor
from artrl.local.concurrency.torch_threads import with_default_threads
from artrl.local.engine.contract import EngineError, SamplingParams, SequenceStream
from artrl.local.engine.vllm.completions import (
    WIRES,
    ModelNotFound,
    ReplicaFailure,
    forget_session,
    open_session,
    read_completion_stream,
)
from artrl.local.engine.vllm.replicas import Replica, ReplicaSet, StartServer
from artrl.local.engine.vllm.router import ReplicaRouter, Route
from artrl.local.engine.vllm.server import VLLMServer

log = logging.getLogger(__name__)

_ABORT_POLL_S = 0.25  # how often an in-flight request checks whether its consumers all went away


class VLLMEngine:
    """The Engine contract over one or more vLLM servers (started by artrl, or at `config.url`)."""

    def __init__(
        self,
        replicas: list[Replica],
        served_name: str,
        model_name: str,
        max_context: int,
        config: VLLMConfig,
        start: StartServer | None = None,
        trainer_thread_idle_s: float = EngineConfig.model_fields["engine_thread_idle_s"].default,
        trainer_thread: Executor | None = None,
    ) -> None:
        self.config = config
        self.router = ReplicaRouter(len(replicas), config.affinity_entries)
        self._router_lock = threading.Lock()  # requests may come from more than one event loop
        self.replicas = ReplicaSet(replicas, config, served_name, start, on_restart=self._forget_replica)
        # (its thread ends when idle, its OpenMP team with it: see idle_thread); a given one is shared by
        # several models' engines (their training calls take turns on it) and outlives this engine
        self._owns_trainer_thread = trainer_thread is None
        self._trainer_thread = trainer_thread or IdleEndingExecutor(trainer_thread_idle_s, "artrl-trainer")
        self.served_name = served_name  # the base model's name on the vLLM servers
        self.model_name = model_name  # the artrl model's name: adapters are `{model_name}@{step}`
        self.loaded: list[str] = []  # adapters loaded by us, oldest first
        self._max_context = max_context
        self._clients: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        # generate: vLLM's token-in/token-out endpoint, on the servers artrl starts (--enable-scale-out)
        self.wire = config.wire_for(started=start is not None)
        self.replicas.supervise()

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def target(self) -> str:
        """What requests ask vLLM for: the base model, or the latest adapter."""
        return self.replicas.target

    @property
    def server(self) -> VLLMServer | None:
        """The first replica's server (None: one artrl did not start)."""
        return self.replicas[0].server

    @property
    def base_url(self) -> str:
        return self.replicas[0].base_url

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: url, state, restarts, adapters held, requests served and sequences in flight."""
        with self._router_lock:
            served, in_flight = list(self.router.served), list(self.router.in_flight)
        return [
            {**s, "served": served[i], "in_flight": in_flight[i]} for i, s in enumerate(self.replicas.stats())
        ]

    def _forget_replica(self, index: int) -> None:
        with self._router_lock:
            self.router.restarted(index)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        streams = [SequenceStream(loop) for _ in range(n)]
        task = loop.create_task(self._run(list(prompt_ids), params, streams))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)
        return streams

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            # a loop that ended (one `asyncio.run` per call) never asks again: its client goes, unclosed
            # (closing needs that loop; its connections went with it), else one leaks per loop ever used
            for other in list(self._clients):  # (a copy: other loops' threads may add theirs meanwhile)
                if other.is_closed() and (ended := self._clients.pop(other, None)) is not None:
                    forget_session(ended)
            client = self._clients[loop] = open_session(self.config.connect_timeout_s)
        return client

    async def _run(
        self, prompt_ids: list[int], params: SamplingParams, streams: list[SequenceStream]
    ) -> None:
        """Stream one request into `streams` from a replica, from another one if it fails before any token
        was streamed; every stream ends, whatever happens."""
        ended = [False] * len(streams)
        sampled: list[list[int]] = [[] for _ in streams]  # what each stream got (the router remembers it)

        def end_all(reason: str, error: str | None = None) -> None:
            for i, stream in enumerate(streams):
                if not ended[i]:
                    ended[i] = True
                    stream.end(reason, error)  # type: ignore[arg-type]

        target = self.target  # read once: a publish may move it meanwhile
        # vLLM refuses n > 1 for greedy sampling: one greedy sequence is every sequence
        make_body = WIRES[self.wire][1]
        n = 1 if params.temperature == 0 else len(streams)
        body = make_body(target, prompt_ids, params, n, self.config.stream_interval)
        tried: set[int] = set()
        notes: list[str] = []
        while True:
            with self._router_lock:
                eligible = [i for i in self.replicas.eligible(target) if i not in tried]
                route = self.router.route(prompt_ids, len(streams), eligible) if eligible else None
            if route is None:
                end_all("error", " ".join([*notes, self.replicas.unavailable(target)]))
                return
            replica = self.replicas[route.replica]
            try:
                await self._stream_from(replica, body, streams, ended, sampled)
                self._done(route, sampled)
                end_all("abort")  # what is left: streams whose consumers went away
                return
            except asyncio.CancelledError:
                self._done(route)
                end_all("abort")
                raise
            except Exception as exc:
                self._done(route)
                reason = str(exc) if isinstance(exc, EngineError) else self._explain(exc, replica)
                stale = isinstance(exc, ModelNotFound) and target != self.replicas.base_name
                if stale:  # its adapter list was stale: nothing streamed, so another replica may serve it
                    self.replicas.lost(replica, target)
                    reason = f"{replica.name()} does not hold {target} ({reason})"
                replica_failed = stale or isinstance(
                    exc, ReplicaFailure | aiohttp.ClientConnectionError | aiohttp.ClientPayloadError
                )
                if replica_failed:
                    self.replicas.suspect(route.replica)
                if not replica_failed or any(sampled) or all(s.aborted for s in streams):
                    streamed = (
                        " (after some of its tokens were streamed: not retried)" if any(sampled) else ""
                    )
                    end_all("error", f"{reason}{streamed}")
                    return
                tried.add(route.replica)
                notes.append(f"{reason}.")
                log.warning("%s; trying another replica", reason)

    def _done(self, route: Route, completions: list[list[int]] | None = None) -> None:
        with self._router_lock:
            self.router.done(route, [ids for ids in completions or () if ids])

    async def _stream_from(
        self,
        replica: Replica,
        body: dict[str, Any],
        streams: list[SequenceStream],
        ended: list[bool],
        sampled: list[list[int]],
    ) -> None:
        """Returns once every stream ended or all consumers went away (then vLLM's slot is freed now, not at
        the next token); raises what the replica did wrong."""
        timeout_s = self.config.request_timeout_s
        reader = asyncio.ensure_future(
            read_completion_stream(
                self._client(), timeout_s, replica, self.wire, body, streams, ended, sampled
            )
        )
        try:
            while not reader.done():
                await asyncio.wait([reader], timeout=_ABORT_POLL_S)
                if not reader.done() and not all(ended) and all(s.aborted for s in streams):
                    reader.cancel()
                    await asyncio.wait([reader])
                    for i, stream in enumerate(streams):
                        if not ended[i]:
                            ended[i] = True
                            stream.end("abort")
                    return
            reader.result()
        finally:
            reader.cancel()

    def _explain(self, exc: BaseException, replica: Replica) -> str:
        server = replica.server  # read once: a restart may replace it meanwhile
        if server is not None and not server.alive:
            return f"{replica.name()}: {server.describe_exit()}"
        if isinstance(exc, TimeoutError):
            return f"vLLM did not finish within {self.config.request_timeout_s:g} s (VLLMConfig.request_timeout_s)"
        return f"request to {replica.name()} failed: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ administration (any event loop)
    async def load_adapter(self, step: int, path: str) -> None:
        """Load a step's PEFT adapter folder as `{model}@{step}` into every replica, then send new requests to
        it; older adapters beyond the window are unloaded."""
        name = f"{self.model_name}@{step}"
        await self.replicas.load_everywhere(name, path)
        if name in self.loaded:
            self.loaded.remove(name)
        self.loaded.append(name)
        del self.loaded[: -self.config.lora_window]
        self.replicas.target = name
        for replica in self.replicas.replicas:  # one that came back during the load: before it takes requests
            if replica.state == "up" and name not in replica.adapters:
                self.replicas.suspect(replica.index)

    async def reload_weights(self, checkpoint: str) -> None:
        """Full fine-tuning: the replicas restart on the new checkpoint, rolling (ReplicaSet.reload)."""
        await self.replicas.reload(checkpoint, lambda index: self.router.in_flight[index])

    # ------------------------------------------------------------------ around training
    async def run_exclusive(self, fn: Callable[[], Any], *, changes_weights: bool = True) -> Any:
        """On the trainer's own thread: vLLM holds its own copy of the weights and goes on generating."""
        # (torch's default threads: an embedded engine in this process may have changed the count new
        # threads start with, see torch_threads)
        return await asyncio.get_running_loop().run_in_executor(
            self._trainer_thread, with_default_threads(fn)
        )

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """Where the user shares one GPU between vLLM and the trainer (VLLMConfig.sleep_while_training), vLLM
        sleeps inside the block and wakes up after it, failed or not."""
        if not self.config.sleep_while_training:
            yield
            return
        self.replicas.hold_restarts.set()  # a replica restarted now would take the trainer's GPU memory
        try:
            await self.sleep()
            yield
        finally:
            try:  # a failure here must not cost the step its checkpoint: publish wakes it again
                await self.wake_up()
            except EngineError as exc:
                log.warning("vLLM did not wake up after training: %s", exc)
            finally:
                self.replicas.hold_restarts.clear()

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        """Load the step's adapter as `{model}@{step}`; after full fine-tuning, restart on the checkpoint."""
        if self.config.sleep_while_training:
            await self.wake_up()  # awake already, unless waking after training failed
        if adapter:
            await self.load_adapter(step, checkpoint)
        else:
            await self.reload_weights(checkpoint)

    async def sleep(self) -> None:
        """GPU sharing: free vLLM's GPU memory (level 1: weights to CPU, KV cache dropped) for training.
        Requests in flight finish first (`mode=wait`); new ones wait for `wake_up`."""
        await self.replicas.broadcast("/sleep?level=1&mode=wait")

    async def wake_up(self) -> None:
        await self.replicas.broadcast("/wake_up")

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = self._clients, {}
        here = asyncio.get_running_loop()
        try:
            for loop, client in clients.items():
                if loop is here:
                    await client.close()
                elif loop.is_running():  # the gateway's loop, in its own thread; it may stop meanwhile
                    done = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.close(), loop))
                    await asyncio.wait([done], timeout=5)
                elif loop.is_closed():
                    forget_session(client)
        finally:
            await asyncio.to_thread(self.replicas.close)
            if self._owns_trainer_thread:
                self._trainer_thread.shutdown(wait=True)
