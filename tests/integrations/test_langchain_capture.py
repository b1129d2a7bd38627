"""`artrl.capture` of a real LangChain / LangGraph agent (installed from PyPI) through the embedded gateway."""

from __future__ import annotations

import asyncio
import itertools
import types

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from fakes import encode
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

import artrl
from artrl.local.train.rows import trajectory_rows

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "apples"}}\n</tool_call><|im_end|>'
ANSWER = "There are 42 apples.<|im_end|>"


@tool
def lookup(key: str) -> str:
    """Stock of an item."""
    return {"apples": "42"}.get(key, "0")


@pytest.fixture
def no_token_counting(monkeypatch):
    """tiktoken downloads its encodings on first use: nothing on the agent's path may count tokens."""
    import tiktoken

    def refuse(*args, **kwargs):
        raise AssertionError("tiktoken was called (it would download an encoding)")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


def assert_continued(traj: artrl.Trajectory, tokenizer) -> None:
    """Each call's prompt continues the previous call's prompt + sampled ids; one row, mask 1 on samples."""
    choices = traj.choices()
    for before, after in itertools.pairwise(choices):
        prefix = before.prompt_token_ids + before.token_ids
        assert after.prompt_token_ids[: len(prefix)] == prefix
        assert after.prompt_source == "continuation"
    (row,) = trajectory_rows(traj, 0, tokenizer, allow_rendered=False)
    last = choices[-1]
    assert row.ids == last.prompt_token_ids + last.token_ids
    sampled = [i for i, m in enumerate(row.mask) if m]
    expected: list[int] = []
    for c in choices:
        start = len(c.prompt_token_ids)
        expected += range(start, start + len(c.token_ids))
    assert sampled == expected
    assert [row.ids[i] for i in sampled] == [t for c in choices for t in c.token_ids]


# LangGraph 1.x points to `langchain.agents.create_agent` (another package); this one stays until LangGraph 2
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
async def test_langgraph_react_agent_is_captured_token_exact(scripted, tokenizer, no_token_counting):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, CALL), encode(tokenizer, ANSWER)]
    model = types.SimpleNamespace(name="scripted", inference_base_url=base_url, inference_api_key="x")
    agent = create_react_agent(artrl.langchain_chat_model(model, max_tokens=64), [lookup])
    async with artrl.capture(model) as cap:
        result = await agent.ainvoke(
            {"messages": [("system", "You are a shop assistant."), ("user", "How many apples?")]}
        )
    assert result["messages"][-1].content == "There are 42 apples."
    traj = cap.trajectory
    assert len(cap.records) == 2 and traj.additional_histories == []
    first, second = traj.choices()
    assert first.token_ids == encode(tokenizer, CALL) and second.token_ids == encode(tokenizer, ANSWER)
    assert first.message.tool_calls[0].function.name == "lookup"
    assert [t["function"]["name"] for t in traj.tools] == ["lookup"]
    messages = traj.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == "42"
    assert messages[3]["tool_call_id"] == first.message.tool_calls[0].id
    assert_continued(traj, tokenizer)


async def test_langchain_chat_on_the_served_model_trains(fresh_model, tokenizer, no_token_counting):
    model = fresh_model
    trajectories = []
    for reward in (1.0, 0.0):
        chat = artrl.langchain_chat_model(model, max_tokens=8, seed=int(reward))
        async with artrl.capture(model) as cap:
            messages = [HumanMessage("Apples?")]
            messages.append(await chat.ainvoke(messages))
            messages.append(HumanMessage("go on"))
            messages.append(await chat.ainvoke(messages))
        assert all(isinstance(m, AIMessage) for m in messages[1::2])
        cap.trajectory.reward = reward
        assert len(cap.trajectory.choices()) == 2
        assert_continued(cap.trajectory, tokenizer)
        trajectories.append(cap.trajectory)
    result = await model.train([artrl.TrajectoryGroup(trajectories)])
    assert result.step == 1 and result.metrics["rows"] == 2


async def test_sync_invoke_from_a_thread_is_captured(scripted, tokenizer, no_token_counting):
    engine, base_url = scripted
    engine.scripts = [encode(tokenizer, CALL), encode(tokenizer, ANSWER)]
    model = types.SimpleNamespace(name="scripted", inference_base_url=base_url, inference_api_key="x")
    chat = artrl.langchain_chat_model(model, max_tokens=64).bind_tools([lookup])
    chat.invoke("outside")  # not recorded: no capture open
    engine.scripts = [encode(tokenizer, CALL), encode(tokenizer, ANSWER)]

    def sync_agent() -> str:
        messages = [HumanMessage("How many apples?")]
        reply = chat.invoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]))
        return chat.invoke(messages).content

    async with artrl.capture(model) as cap:
        assert await asyncio.to_thread(sync_agent) == "There are 42 apples."
    assert len(cap.records) == 2
    assert [m["role"] for m in cap.trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    assert_continued(cap.trajectory, tokenizer)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
async def test_langgraph_react_agent_on_the_served_model_trains(fresh_model, tokenizer, no_token_counting):
    """The ReAct agent against the real embedded engine (random weights: it answers without a tool call;
    max_tokens=8 is too short for one), captured per rollout, trained as one group."""
    model = fresh_model
    trajectories = []
    for reward in (1.0, 0.0):
        agent = create_react_agent(
            artrl.langchain_chat_model(model, max_tokens=8, seed=int(reward)), [lookup]
        )
        async with artrl.capture(model) as cap:
            await agent.ainvoke({"messages": [("user", "How many apples?")]})
        assert cap.trajectory.choices() and cap.trajectory.tools[0]["function"]["name"] == "lookup"
        assert_continued(cap.trajectory, tokenizer)
        cap.trajectory.reward = reward
        trajectories.append(cap.trajectory)
    result = await model.train([artrl.TrajectoryGroup(trajectories)])
    assert result.step == 1 and result.metrics["rows"] == 2
