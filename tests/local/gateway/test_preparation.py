"""The gateway's preparation thread (issue 43, item 7): a small request is not queued behind big ones sent
just before it; the bodies it holds are bounded (429); a body that stalls mid-upload is refused (408) and
gives its in-flight slot back, so stalled uploads cannot lock everyone else out. A small request that finds
the thread idle is prepared at once on the caller's thread (issue 45), never beside another preparation."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from artrl.local.gateway.preparation import INLINE_BYTES, Preparation
from artrl.local.gateway.protocol import RequestError


def occupy(preparation: Preparation) -> tuple[threading.Event, object]:
    """The preparation thread busy until the event is set: (the event, that work's future)."""
    started, busy = threading.Event(), threading.Event()
    future = preparation.submit(1, lambda: (started.set(), busy.wait()))
    assert started.wait(30)
    return busy, future


def test_a_small_request_goes_before_big_ones_that_came_just_before_it():
    preparation = Preparation(max_bytes=64 << 20)
    done: list[str] = []
    busy, blocker = occupy(preparation)
    big = [preparation.submit(8 << 20, lambda i=i: done.append(f"big{i}")) for i in range(3)]
    small = preparation.submit(1024, lambda: done.append("small"))
    busy.set()
    for future in (blocker, *big, small):
        future.result(timeout=30)
    assert done == ["small", "big0", "big1", "big2"]  # (first come first served: small last)
    assert preparation.held == 0


def test_the_bodies_held_are_bounded():
    preparation = Preparation(max_bytes=10_000)
    busy = threading.Event()
    first = preparation.submit(8_000, busy.wait)
    with pytest.raises(RequestError) as refused:
        preparation.submit(4_000, lambda: None)
    assert refused.value.status == 429 and "max_preparing_bytes" in str(refused.value)
    busy.set()
    first.result(timeout=30)
    preparation.submit(4_000, lambda: None).result(timeout=30)  # (room again)
    preparation.close()
    with pytest.raises(RequestError, match="shutting down"):
        preparation.submit(1, lambda: None)


def test_closing_cancels_what_waits():
    preparation = Preparation(max_bytes=1 << 20)
    busy, running = occupy(preparation)
    waiting = preparation.submit(1, lambda: None)
    preparation.close()
    busy.set()
    running.result(timeout=30)
    assert waiting.cancelled() and preparation.held == 0


def test_a_small_request_is_prepared_at_once_when_nothing_else_is():
    preparation = Preparation(max_bytes=1 << 20)
    assert preparation.run_now(1024, threading.get_ident) == (True, threading.get_ident())
    assert preparation.run_now(INLINE_BYTES + 1, threading.get_ident) == (False, None)  # big: the thread's
    busy, running = occupy(preparation)
    assert preparation.run_now(1, lambda: "at once") == (False, None)  # never beside another preparation
    waiting = preparation.submit(1, lambda: "queued")
    assert preparation.run_now(1, lambda: "at once") == (False, None)  # nor before one that waits
    busy.set()
    running.result(timeout=30)
    assert waiting.result(timeout=30) == "queued"

    def refused() -> None:
        raise RequestError("no", status=400)

    with pytest.raises(RequestError):
        preparation.run_now(1, refused)
    assert preparation.run_now(1, lambda: 5) == (True, 5)  # (its failure left the thread idle)
    assert preparation.held == 0


def test_the_thread_waits_while_a_request_is_prepared_at_once():
    preparation = Preparation(max_bytes=1 << 20)
    order: list[str] = []

    def at_once():
        queued = preparation.submit(1, lambda: order.append("queued"))
        time.sleep(0.2)  # (time for the thread to take it, were it allowed to)
        order.append("at once")
        return queued

    done, queued = preparation.run_now(1, at_once)
    assert done
    queued.result(timeout=30)
    assert order == ["at once", "queued"]


def stalled_upload(base_url: str) -> socket.socket:
    """A request whose body stops after 10 of its 1,000 declared bytes."""
    url = urlparse(base_url)
    conn = socket.create_connection((url.hostname, url.port), timeout=60)
    head = (
        f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    conn.sendall(head.encode() + b'{"model": ')
    return conn


async def test_stalled_uploads_are_refused_and_give_their_slots_back(slow):
    _, service = slow(max_inflight_requests=2, body_read_timeout_s=1.0)
    stalled = [stalled_upload(service.base_url) for _ in range(2)]
    try:
        answers = await asyncio.gather(*(asyncio.to_thread(conn.recv, 4096) for conn in stalled))
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"did not arrive within 1 s" in answer
    finally:
        for conn in stalled:
            conn.close()
    async with httpx.AsyncClient(timeout=30) as client:  # (both slots free again)
        body = {"model": "slow", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        reply = await client.post(f"{service.base_url}/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
