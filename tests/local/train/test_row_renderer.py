"""RowRenderer: train_sft's rows rendered by worker processes beside this one equal those rendered here, in
order; a bad trajectory's error comes back as it is; a worker that fails costs nothing but its speed."""

from __future__ import annotations

import logging
import random
import sys
import threading

import pytest

import artrl
from artrl.config import SFTConfig
from artrl.local.chat_format import ChatFormat
from artrl.local.train.row_renderer import PARALLEL_FROM, RowRenderer, _Worker, sft_rows
from artrl.local.train.rows import UntrackedTurnsError, trajectory_rows

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


def conversation(i: int) -> artrl.Trajectory:
    rng = random.Random(i)
    messages: list[dict] = [{"role": "user", "content": f"Find {rng.randint(0, 999)}, please."}]
    for k in range(rng.randint(0, 3)):
        call = {
            "id": f"c{i}_{k}",
            "type": "function",
            "function": {"name": "lookup", "arguments": f'{{"key": "{k}"}}'},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"value {rng.random():.3f}"},
        ]
    messages.append({"role": "assistant", "content": f"It is {rng.randint(0, 99)}."})
    return artrl.Trajectory(messages_and_choices=messages, tools=TOOLS)


def as_data(per_trajectory) -> list:
    return [[(r.ids, r.mask, r.trajectory, r.weight) for r in rows] for rows in per_trajectory]


@pytest.fixture
def renderer():
    renderer = RowRenderer()
    yield renderer
    renderer.close()


def test_rows_rendered_by_workers_equal_rows_rendered_here(tokenizer, renderer):
    fmt = ChatFormat.for_tokenizer(tokenizer)
    trajectories = [conversation(i) for i in range(PARALLEL_FROM + 40)]
    here = renderer.rows(trajectories, fmt, {}, 0)
    shared = renderer.rows(trajectories, fmt.clone(), {}, 1)
    assert as_data(shared) == as_data(here)
    assert len(renderer._workers) == 1 and renderer._workers[0].alive  # (kept for the next call)
    worker = renderer._workers[0]
    renderer.close()
    assert worker.process.poll() is not None


async def test_sft_rows_goes_parallel_from_the_threshold(tokenizer, renderer):
    fmt = ChatFormat.for_tokenizer(tokenizer)
    few = [conversation(i) for i in range(3)]
    assert as_data(await sft_rows(renderer, fmt, few, SFTConfig(render_workers=1))) == as_data(
        [trajectory_rows(t, i, fmt, True) for i, t in enumerate(few)]
    )
    assert renderer._workers == []  # (a few trajectories: rendered right here)
    many = [conversation(i) for i in range(PARALLEL_FROM)]
    rows = await sft_rows(renderer, fmt, many, SFTConfig(render_workers=1))
    assert as_data(rows) == as_data(renderer.rows(many, fmt, {}, 0)) and len(renderer._workers) == 1


def test_a_bad_trajectory_raises_its_own_error_from_a_worker(tokenizer, renderer):
    fmt = ChatFormat.for_tokenizer(tokenizer)
    trajectories = [conversation(i) for i in range(PARALLEL_FROM)]
    bad = artrl.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            {"role": "bogus", "content": "x"},
            {"role": "assistant", "content": "a"},
        ]
    )
    trajectories[3] = bad  # (the front of the queue: a worker's first chunk)
    with pytest.raises(UntrackedTurnsError, match=r"trajectory 3: .*unknown role: bogus"):
        renderer.rows(trajectories, fmt, {}, 1)
    assert renderer._workers[0].alive  # (the error came back from the worker, which stays usable)


class LeavingWorker(_Worker):
    """A worker that reads the start of its first request and exits without an answer."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.stdin.buffer.read(1)"]


def test_a_worker_that_fails_leaves_its_chunk_to_this_process(tokenizer, renderer, caplog):
    fmt = ChatFormat.for_tokenizer(tokenizer)
    trajectories = [conversation(i) for i in range(PARALLEL_FROM)]
    renderer._workers = [LeavingWorker()]
    with caplog.at_level(logging.WARNING, logger="artrl.local.train.row_renderer"):
        rows = renderer.rows(trajectories, fmt, {}, 1)
    assert as_data(rows) == as_data(renderer.rows(trajectories, fmt, {}, 0))
    assert "rendered in the training process" in caplog.text
    assert not renderer._workers[0].alive


class FormatOfThisTestModule(ChatFormat):
    """A chat format a worker process cannot unpickle (its class lives in this test module)."""


def test_a_chat_format_a_worker_cannot_load_is_rendered_here(tokenizer, renderer, caplog):
    plain = ChatFormat.for_tokenizer(tokenizer)
    fmt = FormatOfThisTestModule(
        plain.tokenizer, plain.family, plain.detected_by, plain.stop_ids, plain.variables
    )
    trajectories = [conversation(i) for i in range(PARALLEL_FROM)]
    with caplog.at_level(logging.WARNING, logger="artrl.local.train.row_renderer"):
        rows = renderer.rows(trajectories, fmt, {}, 1)
    assert as_data(rows) == as_data(renderer.rows(trajectories, plain, {}, 0))
    assert "cannot load the chat format" in caplog.text
    assert (
        renderer._workers[0].alive and len(renderer._unloadable) == 1
    )  # (the next call renders here at once)


def test_trajectories_that_do_not_pickle_are_rendered_here(tokenizer, renderer, caplog):
    fmt = ChatFormat.for_tokenizer(tokenizer)
    trajectories = [conversation(i) for i in range(PARALLEL_FROM)]
    trajectories[0].metadata["lock"] = threading.Lock()  # (a worker's first chunk: it cannot be sent)
    with caplog.at_level(logging.WARNING, logger="artrl.local.train.row_renderer"):
        rows = renderer.rows(trajectories, fmt, {}, 1)
    assert as_data(rows) == as_data(renderer.rows(trajectories, fmt, {}, 0))
    assert "cannot be sent" in caplog.text and renderer._workers[0].alive
