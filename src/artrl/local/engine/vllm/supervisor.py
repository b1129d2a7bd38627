"""One vLLM replica's state, and the supervisor thread that keeps the replicas alive: it checks every replica
(its process, its /health), restarts one that died (a server artrl started) or waits for one that went away
(a server at `VLLMConfig.url`), and loads the served adapter into a replica before it takes requests again.

What counts as dead: the process exited, or `health_failures_before_restart` checks in a row got no answer
(connection refused, a broken connection) or a 5xx. Any other answer (a 401 from an auth layer, a 404 from a
proxy without /health) means the server is there. A /health that times out counts only while no token came
from that replica since the previous check: a busy server may answer late, and it is not killed for that.
Restarts wait while the replicas sleep for training (`hold_restarts`): a new server would take the GPU
memory the trainer uses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx

from artrl.config import VLLMConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.vllm.server import VLLMServer

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
    restarts_in_a_row: int = 0  # restarts with no token served in between (max_restarts bounds them)
    health_failures: int = 0
    down_reason: str | None = None  # why it went down last
    life: int = 0  # bumped when it goes down or gets a new server: a load into an earlier life does not count
    tokens_seen: int = (
        0  # streamed chunks received from it (the supervisor tells a busy server from a dead one)
    )
    tokens_at_check: int = 0
    weights: str | None = None  # full fine-tuning: the checkpoint its server runs (None: the base)
    # held while its server changes and around an adapter load (re-entrant: a restart loads the adapter)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def name(self) -> str:
        return f"vLLM replica {self.index} ({self.base_url})"


class Supervisor:
    """The supervision half of ReplicaSet (vllm_replicas.py), which sets these attributes."""

    replicas: list[Replica]
    config: VLLMConfig
    base_name: str
    target: str
    weights: str | None
    incoming: str | None
    hold_restarts: threading.Event  # set while the replicas sleep for training
    _start: StartServer | None
    _on_restart: Callable[[int], None]
    _wake: threading.Event
    _closed: threading.Event
    _thread: threading.Thread | None
    _restarts: list[threading.Thread]

    def load_into(self, replica: Replica, name: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ probes
    _probe_http: httpx.Client | None = None

    def _prober(self) -> httpx.Client:
        """One client for every health probe (building one costs ~20 ms of CPU, its SSL context: every 2 s per
        replica, on the process that serves the gateway); httpx clients are safe across threads."""
        if self._probe_http is None:
            self._probe_http = httpx.Client(timeout=self.config.connect_timeout_s)
        return self._probe_http

    def probe(self, replica: Replica) -> tuple[str, bool] | None:
        """None when the replica answers /health below 500; else why not, and whether it only timed out."""
        try:
            status = self._prober().get(f"{replica.base_url}/health", headers=replica.headers).status_code
        except httpx.TimeoutException as exc:
            return f"/health timed out ({type(exc).__name__} after {self.config.connect_timeout_s:g} s)", True
        except (httpx.HTTPError, RuntimeError) as exc:  # (RuntimeError: the engine closed meanwhile)
            return f"/health failed: {type(exc).__name__}: {exc}", False
        return (f"/health answered {status}", False) if status >= 500 else None

    def still_up(self, replica: Replica) -> bool:
        """Blocking (up to connect_timeout_s): whether a replica that failed a call is still there."""
        if replica.state != "up" or (replica.server is not None and not replica.server.alive):
            return False
        return self.probe(replica) is None

    # ------------------------------------------------------------------ supervision
    def supervise(self) -> None:
        self._prober()  # (made here, before any thread probes)
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
            busy = replica.tokens_seen != replica.tokens_at_check  # tokens came since the last check
            replica.tokens_at_check = replica.tokens_seen
            if replica.server is not None and not replica.server.alive:
                self._down(replica, replica.server.describe_exit())
            elif replica.weights != self.weights and self._start is not None and not self._incoming(replica):
                # (a rolling reload's rest; one already up on the incoming weights waits for them to be current)
                self._down(replica, f"it runs {replica.weights or 'the base weights'}, not {self.weights}")
                replica.restarts_in_a_row -= 1  # (a planned restart: not one towards max_restarts)
            elif (failure := self.probe(replica)) is not None:
                reason, timed_out = failure
                replica.health_failures = 0 if timed_out and busy else replica.health_failures + 1
                if replica.health_failures >= self.config.health_failures_before_restart:
                    quiet = ", no token from it meanwhile" if timed_out else ""
                    self._down(replica, f"{reason} ({replica.health_failures} checks in a row{quiet})")
            else:
                replica.health_failures = 0
                if busy:
                    replica.restarts_in_a_row = 0
                if self.target != self.base_name and self.target not in replica.adapters:
                    try:  # it came back while a step was published, refused the load, or lost the adapter
                        self.load_into(replica, self.target)
                    except EngineError as exc:
                        log.warning(
                            "loading %s into %s failed (tried again): %s", self.target, replica.name(), exc
                        )
        if replica.state != "down" or self.hold_restarts.is_set():
            return
        if self._start is None:  # not ours: back when it answers again
            if self.probe(replica) is None:
                self._bring_up(replica)
        elif replica.restarts_in_a_row >= self.config.max_restarts:
            replica.state = "failed"
            log.error(
                "%s stays down after %d restarts in a row: %s",
                replica.name(),
                replica.restarts_in_a_row,
                replica.down_reason,
            )
        else:
            replica.state = "starting"
            self._restarts = [t for t in self._restarts if t.is_alive()]
            self._restarts.append(threading.Thread(target=self._restart, args=(replica,), daemon=True))
            self._restarts[-1].start()

    def _incoming(self, replica: Replica) -> bool:
        """Whether the replica runs the weights a rolling reload is bringing up (current once it ends)."""
        return self.incoming is not None and replica.weights == self.incoming

    def _down(self, replica: Replica, reason: str) -> None:
        log.warning("%s is down: %s", replica.name(), reason[:2000])
        replica.state, replica.down_reason, replica.adapters = "down", reason, []
        replica.life += 1
        replica.health_failures = 0
        self._on_restart(replica.index)

    def _restart(self, replica: Replica) -> None:
        with replica.lock:
            if self._closed.is_set() or replica.state != "starting":
                return
            replica.restarts += 1
            replica.restarts_in_a_row += 1
            log.warning("restarting %s (restart %d)", replica.name(), replica.restarts)
            try:
                self.replace_server(replica)
            except Exception as exc:
                replica.state, replica.down_reason = "down", f"its restart failed: {exc}"

    def replace_server(self, replica: Replica, weights: str | None = None) -> None:
        """Stop the replica's server, start a new one on `weights` (default: the current ones), load the
        adapter, mark it up (the caller holds replica.lock and has taken it out of "up")."""
        assert self._start is not None
        weights = self.weights if weights is None else weights
        replica.adapters = []
        replica.life += 1
        if replica.server is not None:
            replica.server.stop()
        server = self._start(replica.index, weights, self._closed)
        replica.weights = weights
        replica.server, replica.base_url, replica.api_key = server, server.base_url, server.api_key
        replica.life += 1
        if self._closed.is_set():
            server.stop()
            return
        self._bring_up(replica)

    def _bring_up(self, replica: Replica) -> None:
        self._on_restart(replica.index)
        if self.target != self.base_name:
            self.load_into(replica, self.target)
        replica.health_failures, replica.state = 0, "up"
        replica.tokens_at_check = replica.tokens_seen
        log.info("%s is up", replica.name())

    def close(self) -> None:
        """Stop supervising and stop every server artrl started (concurrently)."""
        self._closed.set()
        self._wake.set()
        for thread in [self._thread, *self._restarts]:  # a start in progress stops at its next poll
            if thread is not None:
                thread.join(timeout=self.config.connect_timeout_s + 5)
        if self._probe_http is not None:
            self._probe_http.close()
        stoppers = []
        for replica in self.replicas:
            replica.state = "stopped"
            if replica.server is not None:
                stoppers.append(threading.Thread(target=replica.server.stop))
                stoppers[-1].start()
        for thread in stoppers:
            with contextlib.suppress(RuntimeError):
                thread.join()
