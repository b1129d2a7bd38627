"""Capture records → Trajectory (main conversation + additional histories), and the gateway's CaptureStore."""

from __future__ import annotations

import pytest

from artrl import Trajectory
from artrl.capturing.histories import trajectory_from_records
from artrl.config import GatewayConfig
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.protocol import RequestError
from artrl.local.train.rows import trajectory_rows

SYSTEM = {"role": "system", "content": "main agent"}
USER = {"role": "user", "content": "q"}


def choice(prompt: list[int], sampled: list[int], content: str | None = "x", calls=None, index: int = 0):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "finish_reason": "tool_calls" if calls else "stop",
        "message": message,
        "logprobs": None,
        "prompt_token_ids": prompt,
        "token_ids": sampled,
        "token_logprobs": [-0.5] * len(sampled),
        "prompt_source": "rendered",
    }


def record(messages, *choices, tools=None):
    return {"id": "r", "messages": messages, "tools": tools, "choices": list(choices)}


CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_main_chain_subagent_and_json_round_trip():
    first = choice([1, 2], [3], content=None, calls=CALL)
    # the client re-serialises arguments and sends "" for None: still the same turn
    resent = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL[0], "function": {"name": "f", "arguments": '{"a":1}'}}],
    }
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    sub = choice([9], [10], content="summary")
    last = choice([1, 2, 3, 4], [5], content="done")
    records = [
        record([SYSTEM, USER], first, tools=[{"type": "function", "function": {"name": "f"}}]),
        record([{"role": "system", "content": "sub agent"}, USER], sub),  # a sub-agent, finished in between
        record([SYSTEM, USER, resent, tool], last, tools=[{"type": "function", "function": {"name": "f"}}]),
    ]
    traj = trajectory_from_records(records)
    items = traj.messages_and_choices
    assert items[:2] == [SYSTEM, USER] and items[3] == tool
    assert [c.token_ids for c in traj.choices()] == [[3], [5]]
    assert traj.tools == [{"type": "function", "function": {"name": "f"}}]
    (history,) = traj.additional_histories
    assert history.messages()[0]["content"] == "sub agent"
    assert [c.token_ids for c in history.choices()] == [[10]]
    again = Trajectory.model_validate_json(traj.model_dump_json())
    assert [c.token_ids for c in again.additional_histories[0].choices()] == [[10]]
    rows = trajectory_rows(again, 0, None, allow_rendered=False)
    assert [r.ids for r in rows] == [[1, 2, 3, 4, 5], [9, 10]]
    assert [r.weight for r in rows] == [0.5, 0.5]


def test_branches_share_their_beginning_and_train_it_once():
    a = choice([1], [2], content="a")
    b1 = choice([1, 2, 3], [4], content="b1")
    b2 = choice([1, 2, 3], [5], content="b2")  # a retry of the second turn
    c = choice([1, 2, 3, 4, 6], [7], content="c")
    turn2 = [USER, {"role": "assistant", "content": "a"}, USER]
    records = [
        record([USER], a),
        record(turn2, b1),
        record(turn2, b2),
        record([*turn2, {"role": "assistant", "content": "b1"}, USER], c),
    ]
    traj = trajectory_from_records(records)
    assert [ch.message.content for ch in traj.choices()] == ["a", "b1", "c"]
    (retry,) = traj.additional_histories
    assert [ch.message.content for ch in retry.choices()] == ["a", "b2"]
    rows = trajectory_rows(traj, 0, None, allow_rendered=False)
    assert [r.ids for r in rows] == [[1, 2, 3, 4, 6, 7], [1, 2, 3, 5]]
    assert [r.mask for r in rows] == [
        [0, 1, 0, 1, 0, 1],
        [0, 0, 0, 1],
    ]  # "a" is trained once, in the first row


def test_n_choices_unfollowed_ones_become_histories():
    records = [
        record([USER], choice([1], [2], "a", index=0), choice([1], [3], "b", index=1)),
        record([USER, {"role": "assistant", "content": "b"}, USER], choice([1, 3, 4], [5], "c")),
    ]
    traj = trajectory_from_records(records)
    assert [ch.message.content for ch in traj.choices()] == ["b", "c"]
    assert [[ch.message.content for ch in h.choices()] for h in traj.additional_histories] == [["a"]]


def test_no_records_is_an_empty_trajectory():
    traj = trajectory_from_records([])
    assert traj.messages_and_choices == [] and traj.additional_histories == []


def test_capture_store_limits_and_unknown_ids():
    store = CaptureStore(GatewayConfig(max_open_captures=2, max_capture_records=1))
    a, b = store.open(), store.open()
    with pytest.raises(RequestError, match="2 captures are open") as exc:
        store.open()
    assert exc.value.status == 429
    store.check(a)
    store.add(a, {"n": 1})
    with pytest.raises(RequestError, match="already holds 1 records") as exc:
        store.check(a)
    assert exc.value.status == 413  # permanent: not a 429 that clients retry
    assert store.close(a) == [{"n": 1}]
    assert store.close(a) == [{"n": 1}]  # again (a lost reply): the same records, for a grace period
    with pytest.raises(RequestError, match="not open on this gateway") as exc:
        store.check(a)  # but it records nothing more
    assert exc.value.status == 404
    store.add(a, {"n": 2})  # a call finishing after its capture closed is dropped
    assert store.close(a) == [{"n": 1}]
    assert store.close(b) == [] and len(store) == 0
    with pytest.raises(RequestError, match="not open on this gateway") as exc:
        store.close("cap-unknown")
    assert exc.value.status == 404


def test_captures_are_bounded_in_bytes():
    """A capture holds at most max_bytes of records (as JSON), all of them max_total_bytes: a request beyond
    is refused before it generates (before, only the record count was bounded)."""
    store = CaptureStore(GatewayConfig(max_capture_bytes=2000, max_captured_bytes=3000))
    a, b = store.open(), store.open()
    store.add(a, {"messages": "x" * 1900})
    store.check(a)
    store.add(a, {"messages": "x" * 100})
    with pytest.raises(RequestError, match="bytes of records") as exc:
        store.check(a)
    assert exc.value.status == 413 and store.total_bytes > 2000
    store.add(b, {"messages": "y" * 990})
    with pytest.raises(RequestError, match="open captures hold"):
        store.check(b)


def test_closed_captures_expire_after_their_grace():
    store = CaptureStore(GatewayConfig(capture_close_grace_s=0.0))
    a = store.open()
    store.add(a, {"n": 1})
    store.close(a)
    store.open()  # expires what is due
    assert store.total_bytes == 0
    with pytest.raises(RequestError):
        store.close(a)


def test_idle_captures_expire_to_make_room():
    store = CaptureStore(GatewayConfig(max_open_captures=1, capture_idle_expiry_s=0.0))
    old = store.open()
    new = store.open()
    with pytest.raises(RequestError):
        store.check(old)
    store.check(new)


def test_idle_captures_expire_when_another_opens():
    store = CaptureStore(GatewayConfig(capture_idle_expiry_s=0.0))
    stale = store.open()
    fresh = store.open()  # the first one idled past the expiry
    assert len(store) == 1
    with pytest.raises(RequestError, match="not open"):
        store.check(stale)
    store.check(fresh)


def test_an_aborted_call_does_not_lose_the_capture():
    """The engine ends sequences it cuts off on close with finish_reason "abort", which the openai SDK's
    Choice does not accept: it becomes "length" and the original is kept."""
    choice = {
        "index": 0,
        "finish_reason": "abort",
        "message": {"role": "assistant", "content": "par"},
        "prompt_token_ids": [1, 2],
        "token_ids": [3],
        "token_logprobs": [-0.5],
    }
    traj = trajectory_from_records([{"messages": [{"role": "user", "content": "q"}], "choices": [choice]}])
    (recorded,) = traj.choices()
    assert recorded.finish_reason == "length" and recorded.artrl_finish_reason == "abort"
    assert recorded.token_ids == [3]
