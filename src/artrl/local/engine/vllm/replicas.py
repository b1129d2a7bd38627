"""The vLLM servers behind one gateway, and what they must serve (the supervisor that keeps them alive:
vllm_supervisor.py).

Adapters: every step's adapter goes into every replica that is up (concurrently) before requests ask for it;
a replica takes a request only if it holds that request's adapter, so one that came back meanwhile, refused
the load, or turned out to have lost the adapter (a 404) is sent nothing for it until the supervisor has
loaded it. Calls to every replica (an adapter load, sleep/wake, a full-weights restart) tolerate replicas
that are down: a replica that failed the call is probed (in threads, concurrently); one that is still up and
did not take it is an error, one that is down is left to the supervisor; no replica taking the call is an
error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from artrl.config import VLLMConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.vllm.supervisor import Replica, StartServer, Supervisor

__all__ = ["Refused", "Replica", "ReplicaSet", "StartServer"]

log = logging.getLogger(__name__)


class Refused(EngineError):
    """A replica answered an administrative call with an error status: it is alive, and did not take it."""


class ReplicaSet(Supervisor):
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
        self.incoming: str | None = None  # the checkpoint a rolling reload is bringing up (not current yet)
        self._start = start  # None: servers artrl does not own (it cannot restart them)
        self._on_restart = on_restart or (lambda index: None)
        self.hold_restarts = threading.Event()  # set while the replicas sleep for training
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
        """Replicas that are up, run the current weights and hold `target` (the base model, or an adapter
        loaded into them)."""
        return [
            r.index
            for r in self.replicas
            if r.state == "up"
            and r.weights == self.weights
            and (target == self.base_name or target in r.adapters)
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
            raise Refused(f"{replica.name()}: {path} answered {response.status_code}: {response.text[:2000]}")

    def load_into(self, replica: Replica, name: str) -> None:
        """Load adapter `name` into `replica` (in place: a server may hold the name from an earlier run), then
        unload its adapters beyond the window. Not counted if the replica went down or got a new server
        meanwhile (its `life` changed)."""
        body = {"lora_name": name, "lora_path": self.adapter_paths[name], "load_inplace": True}
        with replica.lock:
            life = replica.life
            self.admin(replica, "/v1/load_lora_adapter", body)
            if replica.life != life:
                log.info("%s changed while loading %s: the supervisor loads it again", replica.name(), name)
                return
            replica.adapters.append(name)  # before the older entry goes: never absent meanwhile
            if replica.adapters.count(name) > 1:
                replica.adapters.remove(name)
            while len(replica.adapters) > self.config.lora_window:
                old = replica.adapters.pop(0)
                try:
                    self.admin(replica, "/v1/unload_lora_adapter", {"lora_name": old})
                except EngineError as exc:  # a leftover adapter costs memory, not correctness
                    log.warning("could not unload adapter %s: %s", old, exc)

    def lost(self, replica: Replica, name: str) -> None:
        """`replica` answered 404 for adapter `name` (its list was stale): it gets no request for it until the
        supervisor loads it again. A rebinding, not under replica.lock: the event loop calls this, and must
        not wait for a restart."""
        replica.adapters = [a for a in replica.adapters if a != name]
        self.suspect(replica.index)

    async def _each(
        self, call: Callable[[Replica], None], replicas: list[Replica], what: str, refusals_ok: bool
    ) -> list[tuple[Replica, BaseException]]:
        """`call` on `replicas` (in threads, concurrently); returns the failures tolerated. A replica that
        failed is probed (in threads, concurrently): still up, its error is raised; down, it is left to the
        supervisor. With `refusals_ok`, a replica that answered with an error status is alive and tolerated
        (the supervisor tries again)."""
        results = await asyncio.gather(
            *(asyncio.to_thread(call, r) for r in replicas), return_exceptions=True
        )
        failed = [(r, e) for r, e in zip(replicas, results, strict=True) if isinstance(e, BaseException)]
        unanswered = [(r, e) for r, e in failed if not (refusals_ok and isinstance(e, Refused))]
        up = await asyncio.gather(*(asyncio.to_thread(self.still_up, r) for r, _ in unanswered))
        for (_, error), still_up in zip(unanswered, up, strict=True):
            if still_up:
                raise error
        for replica, error in failed:
            log.warning("%s did not take %s (the supervisor takes over): %s", replica.name(), what, error)
        return failed

    async def load_everywhere(self, name: str, path: str) -> None:
        """Load an adapter into every replica that is up, concurrently (see the module's rules); one that
        refused it or went down is loaded by the supervisor later. No replica taking it is an error."""
        self.adapter_paths[name] = path
        up = [r for r in self.replicas if r.state == "up"]
        failed = await self._each(lambda r: self.load_into(r, name), up, f"adapter {name}", refusals_ok=True)
        if not any(name in r.adapters for r in self.replicas):
            why = "".join(f" {e}." for _, e in failed)
            raise EngineError(
                f"adapter {name} could not be loaded into any replica.{why} {self.unavailable(name)}"
            )

    async def broadcast(self, path: str) -> None:
        """The same administrative call to every replica that is up (sleep, wake_up); one that is down is
        skipped. Replicas up but none taking it is an error."""
        up = [r for r in self.replicas if r.state == "up"]
        failed = await self._each(lambda r: self.admin(r, path), up, path, refusals_ok=False)
        if up and len(failed) == len(up):
            raise EngineError(f"no vLLM replica took {path}:" + "".join(f" {e}." for _, e in failed))

    async def reload(self, checkpoint: str, in_flight: Callable[[int], int] = lambda index: 0) -> None:
        """Full fine-tuning: the replicas restart on `checkpoint`, rolling. With two or more, half of them
        restart first, one at a time (each once its requests in flight ended, within drain_timeout_s), kept
        out of service while the others serve the old weights; then the new weights are current (requests go
        to those), and the supervisor restarts the rest. One replica restarts at once. A replica that does not
        come up is left to the supervisor; none on the new weights is an error."""
        if self._start is None:
            raise EngineError(
                "full fine-tuning with a vLLM server artrl did not start (VLLMConfig.url) cannot reload the "
                "weights; train a LoRA, or let artrl start the server"
            )
        live = [r for r in self.replicas if r.state != "failed"]
        first = live[: max(1, len(live) // 2)] if len(live) > 1 else live

        def restart(replica: Replica) -> None:
            with replica.lock:
                replica.state = "reloading"  # (out of service: no new request)
                deadline = time.monotonic() + self.config.drain_timeout_s
                while in_flight(replica.index) and time.monotonic() < deadline:
                    time.sleep(0.05)
                try:
                    self.replace_server(replica, checkpoint)
                except Exception as exc:  # the supervisor tries again
                    replica.state, replica.down_reason = "down", f"its restart on {checkpoint} failed: {exc}"
                    log.warning("%s: %s", replica.name(), replica.down_reason)

        self.incoming = checkpoint  # (the supervisor leaves a replica up on it alone meanwhile)
        try:
            if len(live) > 1:
                for replica in first:
                    await asyncio.to_thread(restart, replica)
            else:
                await asyncio.gather(*(asyncio.to_thread(restart, r) for r in live))
            if not any(r.state == "up" and r.weights == checkpoint for r in self.replicas):
                raise EngineError(
                    f"no vLLM replica came up on {checkpoint}: {self.unavailable(self.base_name)}"
                )
            self.weights = checkpoint  # requests go to the replicas on it; the supervisor restarts the others
        finally:
            self.incoming = None
        self._wake.set()
