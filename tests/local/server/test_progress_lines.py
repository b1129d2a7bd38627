"""A streamed training call's answer: progress lines as the call moves (queued, training with its rows,
saving), then its result, or its refusal or failure as an error line; the call outlives a client that goes
away. Each state is awaited before the next is set: no timing is assumed."""

from __future__ import annotations

import asyncio
import json

import pytest

from artrl.local.server.progress_lines import progress_lines, started
from artrl.local.server.refusals import Refused
from artrl.local.train.progress import TrainProgress


async def next_line(lines, timeout: float = 30.0) -> dict:
    return json.loads(await asyncio.wait_for(anext(lines), timeout))


async def line_where(lines, check) -> dict:
    while True:
        message = await next_line(lines)
        if check(message):
            return message


async def test_progress_then_the_result():
    progress, answer = TrainProgress(), asyncio.get_running_loop().create_future()
    lines = progress_lines(answer, progress)
    progress.phase = "queued"
    assert (await next_line(lines))["progress"]["phase"] == "queued"
    progress.start(8)
    progress.rows_done = 3
    seen = await line_where(lines, lambda m: m["progress"]["rows_done"] == 3)
    assert seen["progress"] == {"phase": "training", "rows_done": 3, "rows_total": 8, "optimizer_steps": 0}
    progress.phase = "saving"
    await line_where(lines, lambda m: m["progress"]["phase"] == "saving")
    answer.set_result({"step": 4})
    assert await line_where(lines, lambda m: "result" in m) == {"result": {"step": 4}}
    with pytest.raises(StopAsyncIteration):
        await anext(lines)


@pytest.mark.parametrize(
    ("failure", "status"),
    [(Refused(429, "too many calls", "limit_reached"), 429), (RuntimeError("boom"), 500)],
)
async def test_a_refusal_or_a_failure_ends_with_an_error_line(failure, status):
    answer = asyncio.get_running_loop().create_future()
    lines = progress_lines(answer, TrainProgress())
    answer.set_exception(failure)
    error = (await line_where(lines, lambda m: "error" in m))["error"]
    assert error["status"] == status and str(failure) in error["message"]


async def test_a_client_going_away_leaves_the_call_running():
    """The stream ends with its client; the call it reported on goes on to its end (a resend with the same
    request id streams it on)."""
    outcome = asyncio.get_running_loop().create_future()

    async def call() -> dict:
        return await outcome

    task = started(call())
    lines = progress_lines(task, TrainProgress())
    await next_line(lines)  # (the first progress line: the stream is running)
    await lines.aclose()
    assert not task.done()
    outcome.set_result({"step": 1})
    assert await task == {"step": 1}
