"""The relative LLM judge, against a scripted fake judge server (an httpx transport that answers like an
OpenAI-compatible endpoint and records every request)."""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx
import openai
import pytest

import artrl
from artrl.rewards import (
    JudgeError,
    JudgeOutputError,
    build_judge_messages,
    common_prefix,
    parse_scores,
    ruler_score_group,
    ruler_scores,
)


class FakeJudge:
    """Answers each chat-completions request with the next scripted text (or HTTP status, if an int)."""

    def __init__(self, *script: str | int) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self.client = openai.AsyncOpenAI(
            base_url="http://judge.test/v1",
            api_key="test",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.MockTransport(self.handle)),
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        self.requests.append(json.loads(request.content))
        answer = self.script.pop(0)
        if isinstance(answer, int):
            return httpx.Response(answer, json={"error": {"message": "judge is down"}})
        return httpx.Response(
            200,
            json={
                "id": f"cmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": "judge",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": answer},
                    }
                ],
            },
        )

    def prompt(self, index: int = 0) -> str:
        """Everything the judge was sent in one request, as text."""
        return "\n".join(m["content"] for m in self.requests[index]["messages"])


def answer(*entries: tuple[str, float], fence: bool = False) -> str:
    text = json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": f"why {i}", "score": s} for i, s in entries]}
    )
    return f"```json\n{text}\n```" if fence else text


SYSTEM = {"role": "system", "content": "PREFIX-SYSTEM-MARKER: you are a travel agent"}
TASK = {"role": "user", "content": "PREFIX-TASK-MARKER: book a flight to Oslo"}


def conversations(n: int = 3) -> list[list[dict[str, Any]]]:
    return [[SYSTEM, TASK, {"role": "assistant", "content": f"SUFFIX-{i}-MARKER"}] for i in range(n)]


def group(n: int = 3) -> artrl.TrajectoryGroup:
    return artrl.TrajectoryGroup(
        artrl.Trajectory(
            messages_and_choices=messages, reward=float(i), metrics={"turns": 1}, logs=["rollout"]
        )
        for i, messages in enumerate(conversations(n))
    )


async def test_shuffled_ids_map_by_id() -> None:
    fake = FakeJudge(answer(("t3", 0.9), ("t1", 0.1), ("t2", 0.5)))
    scores = await ruler_scores(conversations(), judge=fake.client, model="judge")
    assert scores == [(0.1, "why t1"), (0.5, "why t2"), (0.9, "why t3")]
    assert len(fake.requests) == 1
    assert fake.requests[0]["model"] == "judge"
    assert "response_format" not in fake.requests[0]


async def test_shared_prefix_sent_once_and_each_suffix_once() -> None:
    fake = FakeJudge(answer(("t1", 1), ("t2", 0), ("t3", 0.5)))
    await ruler_scores(conversations(), judge=fake.client, model="judge", json_mode=True)
    prompt = fake.prompt()
    assert prompt.count("PREFIX-SYSTEM-MARKER") == 1
    assert prompt.count("PREFIX-TASK-MARKER") == 1
    for i in range(3):
        assert prompt.count(f"SUFFIX-{i}-MARKER") == 1
    user = fake.requests[0]["messages"][1]["content"]
    assert (
        user.index("PREFIX-TASK-MARKER") < user.index('<trajectory id="t1">') < user.index("SUFFIX-0-MARKER")
    )
    assert fake.requests[0]["response_format"] == {"type": "json_object"}


async def test_missing_score_is_retried() -> None:
    fake = FakeJudge(answer(("t1", 0.2), ("t3", 0.3)), answer(("t2", 0.8), ("t1", 0.2), ("t3", 0.3)))
    scores = await ruler_scores(conversations(), judge=fake.client, model="judge")
    assert [s for s, _ in scores] == [0.2, 0.8, 0.3]
    assert len(fake.requests) == 2


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (answer(("t1", 0.2), ("t3", 0.3)), "missing scores for t2"),
        (answer(("t1", 0.2), ("t2", 0.1), ("t3", 0.3), ("t9", 1)), "unknown ids t9"),
    ],
)
async def test_invalid_on_every_attempt_raises_a_clear_error(bad: str, expected: str) -> None:
    fake = FakeJudge(bad, bad, bad)
    with pytest.raises(JudgeError) as info:
        await ruler_scores(conversations(), judge=fake.client, model="judge", max_attempts=3)
    assert len(fake.requests) == 3
    message = str(info.value)
    assert expected in message and "3 attempt" in message and "why t3" in message  # the output's tail
    assert info.value.attempts == 3 and info.value.last_output == bad


async def test_request_failure_is_a_judge_error() -> None:
    fake = FakeJudge(500)
    with pytest.raises(JudgeError, match="judge request to 'judge' failed") as info:
        await ruler_scores(conversations(), judge=fake.client, model="judge")
    assert isinstance(info.value.__cause__, openai.APIError)


async def test_cache_hit_makes_no_call() -> None:
    cache: dict[str, Any] = {}
    fake = FakeJudge(answer(("t1", 0.2), ("t2", 0.4), ("t3", 0.6)))
    first = await ruler_scores(conversations(), judge=fake.client, model="judge", cache=cache)
    again = await ruler_scores(conversations(), judge=fake.client, model="judge", cache=cache)
    assert first == again and len(fake.requests) == 1 and len(cache) == 1
    fake.script.append(answer(("t1", 0.2), ("t2", 0.4), ("t3", 0.6)))
    await ruler_scores(conversations(), judge=fake.client, model="judge", cache=cache, rubric="other")
    assert len(fake.requests) == 2  # a different rubric is a different key


async def test_group_keeps_original_reward_and_explanation() -> None:
    original = group()
    before = original.model_dump()
    fake = FakeJudge(answer(("t2", 0.75), ("t3", 0.0), ("t1", 1.0)))
    scored = await ruler_score_group(original, judge=fake.client, model="judge")
    assert scored is not None and scored is not original
    assert [t.reward for t in scored] == [1.0, 0.75, 0.0]
    assert [t.metrics["independent_reward"] for t in scored] == [0.0, 1.0, 2.0]
    assert [t.metrics["ruler_score"] for t in scored] == [1.0, 0.75, 0.0]
    assert scored.trajectories[0].metrics["turns"] == 1
    assert scored.trajectories[1].logs[0] == "rollout" and "why t2" in scored.trajectories[1].logs[1]
    assert original.model_dump() == before


async def test_group_with_tool_calls_and_none_content() -> None:
    call = {
        "index": 0,
        "finish_reason": "tool_calls",
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
            ],
        },
    }
    trajectories = [
        artrl.Trajectory(
            messages_and_choices=[TASK, call, {"role": "tool", "tool_call_id": "c1", "content": r}]
        )
        for r in ("RESULT-A", "RESULT-B")
    ]
    fake = FakeJudge(answer(("t1", 0.3), ("t2", 0.6)))
    scored = await ruler_score_group(artrl.TrajectoryGroup(trajectories), judge=fake.client, model="judge")
    assert scored is not None and [t.reward for t in scored] == [0.3, 0.6]
    prompt = fake.prompt()
    assert prompt.count('"tool_calls"') == 1 and '"content":null' in prompt  # shared, sent once
    assert prompt.count("RESULT-A") == 1 and prompt.count("RESULT-B") == 1


async def test_swallow_exceptions_drops_the_group() -> None:
    bad = answer(("t1", 0.5))
    fake = FakeJudge(bad, bad)
    assert (
        await ruler_score_group(
            group(), judge=fake.client, model="judge", max_attempts=2, swallow_exceptions=True
        )
        is None
    )
    fake.script.extend([bad, bad])
    with pytest.raises(JudgeError):
        await ruler_score_group(group(), judge=fake.client, model="judge", max_attempts=2)


async def test_as_after_each_in_gather() -> None:
    fake = FakeJudge(answer(("t1", 0.1), ("t2", 0.9)), "not json", "still not json")

    async def rollout(i: int) -> artrl.Trajectory:
        return artrl.Trajectory(messages_and_choices=[TASK, {"role": "assistant", "content": f"a{i}"}])

    judged = functools.partial(
        ruler_score_group, judge=fake.client, model="judge", max_attempts=2, swallow_exceptions=True
    )
    groups = await artrl.gather_trajectory_groups([[rollout(0), rollout(1)]], after_each=judged, pbar=False)
    assert [t.reward for t in groups[0]] == [0.1, 0.9]
    dropped = await artrl.gather_trajectory_groups([[rollout(0), rollout(1)]], after_each=judged, pbar=False)
    assert dropped == [] and len(fake.requests) == 3


async def test_small_groups_are_returned_without_a_call() -> None:
    fake = FakeJudge()
    single = group(1)
    assert await ruler_score_group(single, judge=fake.client, model="judge") is single
    assert await ruler_score_group(artrl.TrajectoryGroup([]), judge=fake.client, model="judge") is not None
    assert fake.requests == []


def test_common_prefix() -> None:
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    b = [{"content": "hi", "role": "user"}, {"role": "assistant", "content": "other"}]
    prefix, suffixes = common_prefix([a, b])
    assert prefix == [a[0]] and suffixes == [a[1:], b[1:]]
    assert common_prefix([a, a]) == (a, [[], []])
    assert common_prefix([a]) == ([], [a])
    assert common_prefix([a, a[:1]]) == ([a[0]], [a[1:], []])


def test_build_judge_messages_without_prefix() -> None:
    messages = build_judge_messages([], {"t1": [TASK], "t2": []}, "RUBRIC-MARKER")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "RUBRIC-MARKER" in messages[0]["content"] and '"trajectory_id"' in messages[0]["content"]
    assert "<context>" not in messages[1]["content"]
    assert "(no further messages)" in messages[1]["content"]


def test_parse_scores_accepts_fences_and_prose() -> None:
    expected = {"t1": (0.0, "why t1"), "t2": (1.0, "why t2")}
    assert parse_scores(answer(("t2", 1), ("t1", 0), fence=True), ["t1", "t2"]) == expected
    assert parse_scores("Here you go: " + answer(("t1", 0), ("t2", 1)) + " Done.", ["t1", "t2"]) == expected
    assert parse_scores('{"scores": [{"trajectory_id": "t1", "score": 0.5}]}', ["t1"]) == {"t1": (0.5, "")}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("I think t1 is best", "not JSON"),
        (
            '{"scores": [{"trajectory_id": "t1", "score": 1.5}, {"trajectory_id": "t2", "score": 0}]}',
            r"scores\.0\.score \(trajectory 't1'\).*less than or equal to 1",
        ),
        (
            '{"scores": [{"trajectory_id": "t1", "score": -0.1}, {"trajectory_id": "t2", "score": 0}]}',
            "greater than or equal to 0",
        ),
        (
            '{"scores": [{"trajectory_id": "t1", "score": NaN}, {"trajectory_id": "t2", "score": 0}]}',
            r"trajectory 't1'.*finite",
        ),
        (
            '{"scores": [{"trajectory_id": "t1", "score": "high"}, {"trajectory_id": "t2", "score": 0}]}',
            "valid number",
        ),
        (
            '{"scores": [{"trajectory_id": "t1"}, {"trajectory_id": "t2", "score": 0}]}',
            r"scores\.0\.score.*Field required",
        ),
        ('{"ranking": ["t1", "t2"]}', r"scores: Field required"),
        (answer(("t1", 0.1), ("t1", 0.2), ("t2", 0.3)), "more than one score for t1"),
        (answer(("t1", 0.1)), "must score each of t1, t2 exactly once: missing scores for t2"),
        (answer(("t1", 0.1), ("t2", 0.1), ("x", 0.1)), "unknown ids x"),
    ],
)
def test_parse_scores_rejects(text: str, match: str) -> None:
    with pytest.raises(JudgeOutputError, match=match):
        parse_scores(text, ["t1", "t2"])


async def test_a_model_served_by_artrl_is_the_judge(tokenizer) -> None:
    """The judge endpoint is artrl's own gateway (a real HTTP server; its engine's tokens are scripted): the
    judge prompt goes through the chat template, the answer comes back as the assistant's content."""
    from fakes import ScriptedEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    engine = ScriptedEngine()
    service = LocalService.serve("judge", None, tokenizer, engine, EngineConfig(), GatewayConfig())
    try:
        malformed = '{"scores": [{"trajectory_id": "t1", "score": 1}]}<|im_end|>'  # t2 missing: retried
        good = answer(("t2", 0.25), ("t1", 1.0)) + "<|im_end|>"
        engine.scripts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (malformed, good)]
        judge = openai.AsyncOpenAI(base_url=service.base_url, api_key="x", max_retries=0)
        scored = await ruler_score_group(group(2), judge=judge, model="judge", max_tokens=512)
        assert scored is not None and [t.reward for t in scored] == [1.0, 0.25]
        assert len(engine.prompts) == 2  # one call per attempt
        sent = tokenizer.decode(engine.prompts[0])
        assert sent.count("PREFIX-TASK-MARKER") == 1 and "SUFFIX-1-MARKER" in sent
    finally:
        service.server.stop()
