"""The vLLM servers behind one gateway, kept alive: a supervisor thread checks every replica (its process,
its /health), restarts one that died (a server artrl started) or waits for one that went away (a server at
`VLLMConfig.url`), and loads the served adapter into a replica before it takes requests again.

Adapters: every step's adapter goes into every replica that is up (concurrently) before requests ask for it;
a replica takes a request only if it holds that request's adapter, so one that came back meanwhile is sent
nothing until the supervisor has loaded the current adapter into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from artrl.config import VLLMConfig
from artrl.local.engine import EngineError
from artrl.local.vllm_server import VLLMServer

log = logging.getLogger(__name__)

State = Literal["up", "down", "starting", "reloading", "failed", "stopped"]
# (replica, full-weights checkpoint or None, an event that cancels the start) -> its server, started
StartServer = Callable[[int, "str | None", threading.Event], VLLMServer]


@dataclass
class Replica:
    """One vLLM server: started by artrl (`server`), or one at a url it does not own."""

    index: int
    base_url: str
    api_key: str | None = None
    server: VLLMServer | None = None
    state: State = "up"
    adapters: list[str] = field(default_factory=list)  # loaded here, oldest first
    restarts: int = 0
    health_failures: int = 0
    down_reason: str | None = None  # why it went down last
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # held while its server changes

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def name(self) -> str:
        return f"vLLM replica {self.index} ({self.base_url})"


class ReplicaSet:
    """The replicas, their supervisor, and what they must serve (`target`, `adapter_paths`, `weights`)."""

    def __init__(
        self,
        replicas: list[Replica],
        config: VLLMConfig,
        base_name: str,
        start: StartServer | None = None,
        on_restart: Callable[[int], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.config = config
        self.base_name = base_name  # the base model's name on the servers
        self.target = base_name  # what requests ask for: the base, or the latest adapter
        self.adapter_paths: dict[str, str] = {}
        self.weights: str | None = None  # full fine-tuning: the checkpoint the servers run
        self._start = start  # None: servers artrl does not own (it cannot restart them)
        self._on_restart = on_restart or (lambda index: None)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarts: list[threading.Thread] = []

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __len__(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ routing
    def eligible(self, target: str) -> list[int]:
        """Replicas that are up and hold `target` (the base model, or an adapter loaded into them)."""
        return [
            r.index
            for r in self.replicas
            if r.state == "up" and (target == self.base_name or target in r.adapters)
        ]

    def suspect(self, index: int) -> None:
        """A request failed on `index`: check it now rather than at the next interval."""
        self._wake.set()

    def unavailable(self, target: str) -> str:
        """Why no replica can serve `target` now."""
        parts = []
        for r in self.replicas:
            if r.state == "up":
                lacks = target != self.base_name and target not in r.adapters
                why = f"does not hold {target!r} yet" if lacks else "failed this request"
            else:
                why = f"is {r.state}" + (f": {r.down_reason}" if r.down_reason else "")
            parts.append(f"{r.name()} {why}")
        return "no vLLM replica can take the request: " + "; ".join(parts)

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.index,
                "url": r.base_url,
                "state": r.state,
                "restarts": r.restarts,
                "adapters": list(r.adapters),
            }
            for r in self.replicas
        ]

    # ------------------------------------------------------------------ administration
    def admin(
        self, replica: Replica, path: str, body: dict[str, Any] | None = None, method: str = "POST"
    ) -> None:
        """One administrative call to one replica (blocking, bounded by the request timeout)."""
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        try:
            with httpx.Client(timeout=timeout, headers=replica.headers) as http:
                response = http.request(method, f"{replica.base_url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{replica.name()}: {path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(
                f"{replica.name()}: {path} answered {response.status_code}: {response.text[:2000]}"
            )

    def load_into(self, replica: Replica, name: str) -> None:
        """Load adapter `name` into `replica` (in place: a server may hold the name from an earlier run), then
        unload its adapters beyond the window."""
        body = {"lora_name": name, "lora_path": self.adapter_paths[name], "load_inplace": True}
        self.admin(replica, "/v1/load_lora_adapter", body)
        if name in replica.adapters:
            replica.adapters.remove(name)
        replica.adapters.append(name)
        while len(replica.adapters) > self.config.lora_window:
            old = replica.adapters.pop(0)
            try:
                self.admin(replica, "/v1/unload_lora_adapter", {"lora_name": old})
            except EngineError as exc:  # a leftover adapter costs memory, not correctness
                log.warning("could not unload adapter %s: %s", old, exc)

    async def load_everywhere(self, name: str, path: str) -> None:
        """Load an adapter into every replica that is up, concurrently. A replica that fails it and is no
        longer up is left to the supervisor (which loads the current adapter when it returns); a live replica
        refusing it, or none taking it, is an error."""
        self.adapter_paths[name] = path
        up = [r for r in self.replicas if r.state == "up"]
        results = await asyncio.gather(
            *(asyncio.to_thread(self.load_into, r, name) for r in up), return_exceptions=True
        )
        errors = [(r, e) for r, e in zip(up, results, strict=True) if isinstance(e, BaseException)]
        for replica, error in errors:
            if self._still_up(replica):
                raise error
            log.warning(
                "%s went down while loading %s: the supervisor loads it when it is back", replica.name(), name
            )
        if not any(name in r.adapters for r in self.replicas):
            raise EngineError(
                f"adapter {name} could not be loaded into any replica. {self.unavailable(name)}"
            )

    async def broadcast(self, path: str) -> None:
        """The same administrative call to every replica that is up (sleep, wake_up)."""
        up = [r for r in self.replicas if r.state == "up"]
        await asyncio.gather(*(asyncio.to_thread(self.admin, r, path) for r in up))

    async def reload(self, checkpoint: str) -> None:
        """Full fine-tuning: every replica restarts on `checkpoint` (concurrently)."""
        if self._start is None:
            raise EngineError(
                "full fine-tuning with a vLLM server artrl did not start (VLLMConfig.url) cannot reload the "
                "weights; train a LoRA, or let artrl start the server"
            )
        self.weights = checkpoint

        def restart(replica: Replica) -> None:
            with replica.lock:
                replica.state = "reloading"
                try:
                    self._replace_server(replica)
                except Exception as exc:  # the supervisor tries again
                    replica.state, replica.down_reason = "down", f"its restart on {checkpoint} failed: {exc}"
                    raise

        await asyncio.gather(*(asyncio.to_thread(restart, r) for r in self.replicas if r.state != "failed"))

    def _still_up(self, replica: Replica) -> bool:
        if replica.state != "up" or (replica.server is not None and not replica.server.alive):
            return False
        return self._healthy(replica)

    def _healthy(self, replica: Replica) -> bool:
        try:
            with httpx.Client(timeout=self.config.connect_timeout_s) as http:
                return http.get(f"{replica.base_url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    # ------------------------------------------------------------------ supervision
    def supervise(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="artrl-vllm-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.config.health_check_interval_s)
            self._wake.clear()
            for replica in self.replicas:
                if self._closed.is_set():
                    return
                try:
                    self._check(replica)
                except Exception:  # the supervisor itself must go on
                    log.exception("checking %s failed", replica.name())

    def _check(self, replica: Replica) -> None:
        if replica.state == "up":
            if replica.server is not None and not replica.server.alive:
                self._down(replica, replica.server.describe_exit())
            elif not self._healthy(replica):
                replica.health_failures += 1
                if replica.health_failures >= self.config.health_failures_before_restart:
                    self._down(replica, f"no answer to /health {replica.health_failures} times in a row")
            else:
                replica.health_failures = 0
                if self.target != self.base_name and self.target not in replica.adapters:
                    self.load_into(replica, self.target)  # it came back while a step was published
        if replica.state == "down":
            if self._start is None:  # not ours: back when it answers again
                if self._healthy(replica):
                    self._bring_up(replica)
            elif replica.restarts >= self.config.max_restarts:
                replica.state = "failed"
                log.error(
                    "%s stays down after %d restarts: %s",
                    replica.name(),
                    replica.restarts,
                    replica.down_reason,
                )
            else:
                replica.state = "starting"
                self._restarts = [t for t in self._restarts if t.is_alive()]
                self._restarts.append(threading.Thread(target=self._restart, args=(replica,), daemon=True))
                self._restarts[-1].start()

    def _down(self, replica: Replica, reason: str) -> None:
        log.warning("%s is down: %s", replica.name(), reason[:2000])
        replica.state, replica.down_reason, replica.adapters = "down", reason, []
        replica.health_failures = 0
        self._on_restart(replica.index)

    def _restart(self, replica: Replica) -> None:
        with replica.lock:
            if self._closed.is_set() or replica.state != "starting":
                return
            replica.restarts += 1
            log.warning("restarting %s (restart %d)", replica.name(), replica.restarts)
            try:
                self._replace_server(replica)
            except Exception as exc:
                replica.state, replica.down_reason = "down", f"its restart failed: {exc}"

    def _replace_server(self, replica: Replica) -> None:
        """Stop the replica's server, start a new one on the current weights, load the adapter, mark it up
        (the caller holds replica.lock and has taken it out of "up")."""
        assert self._start is not None
        replica.adapters = []
        if replica.server is not None:
            replica.server.stop()
        server = self._start(replica.index, self.weights, self._closed)
        replica.server, replica.base_url, replica.api_key = server, server.base_url, server.api_key
        if self._closed.is_set():
            server.stop()
            return
        self._bring_up(replica)

    def _bring_up(self, replica: Replica) -> None:
        self._on_restart(replica.index)
        if self.target != self.base_name:
            self.load_into(replica, self.target)
        replica.health_failures, replica.state = 0, "up"
        log.info("%s is up", replica.name())

    def close(self) -> None:
        """Stop supervising and stop every server artrl started (concurrently)."""
        self._closed.set()
        self._wake.set()
        for thread in [self._thread, *self._restarts]:  # a start in progress stops at its next poll
            if thread is not None:
                thread.join(timeout=self.config.connect_timeout_s + 5)
        stoppers = []
        for replica in self.replicas:
            replica.state = "stopped"
            if replica.server is not None:
                stoppers.append(threading.Thread(target=replica.server.stop))
                stoppers[-1].start()
        for thread in stoppers:
            with contextlib.suppress(RuntimeError):
                thread.join()
