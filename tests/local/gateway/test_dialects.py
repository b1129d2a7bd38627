"""The Responses API and Anthropic Messages on the gateway, driven by the real `openai` SDK (`client.responses`),
an OpenAI Agents SDK agent and the real `anthropic` SDK: tool turns that continue token-exactly, streaming,
captures, and a training step on what they sampled. Gemma 4's tiny fixture model (thinking on: reasoning
items and thinking blocks too), on the embedded engine and on vLLM."""

from __future__ import annotations

import asyncio
import itertools
import json

import openai
import pytest

import artrl
from artrl.local.families.family_models import FIXTURE_TOOLS

pytestmark = pytest.mark.slow  # serves and trains a family's tiny model
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
TASK = "Look up paris. Then add 2 and 5."
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in FIXTURE_TOOLS]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in FIXTURE_TOOLS
]


def run_tool(name: str, arguments: dict) -> str:
    if name == "add":
        try:
            return str(int(arguments["a"]) + int(arguments["b"]))
        except (KeyError, TypeError, ValueError) as exc:
            return f"Error: {exc!r}"
    return f"{arguments.get('key', '?')} is tokyo"


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
async def served_gemma(request, family_dirs, tmp_path_factory):
    """The Gemma 4 family model served on each engine (conftest's `served` is the tiny Qwen3 model)."""
    backend = artrl.LocalBackend(path=tmp_path_factory.mktemp("dialects"), engine=request.param)
    model = artrl.TrainableModel(name="gemma", project="dialects", base_model=str(family_dirs("gemma4")))
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture
async def trainee(served_gemma, request, tmp_path):
    """`served_gemma`'s twin on a backend of its own, for the tests that train: the others assert what the
    untrained weights do (a tool call at temperature 0), so `served_gemma` must stay untrained whatever order
    tests run in."""
    backend = artrl.LocalBackend(path=tmp_path, engine=engine_beside(served_gemma))
    # its own name: on vLLM its adapters load into `served_gemma`'s server as `{name}@{step}`, one per test
    name = f"{served_gemma.name}-{request.node.originalname}"
    model = artrl.TrainableModel(name=name, project="dialects", base_model=served_gemma.base_model)
    await model.register(backend)
    yield model
    await backend.close()


def engine_beside(model: artrl.TrainableModel) -> artrl.EngineConfig:
    """The engine of `model`'s backend; on vLLM, the server it started (another would start for ~40 s): the
    requests of `model` ask that server for the base weights, whatever adapters others load into it."""
    backend = model._backend
    if backend.engine_config.kind != "vllm":
        return backend.engine_config
    server = backend.service(model).engine.server
    vllm = artrl.VLLMConfig(url=server.base_url, api_key=server.api_key)
    return artrl.EngineConfig(kind="vllm", vllm=vllm)


def assert_continues(trajectory: artrl.Trajectory) -> None:
    choices = trajectory.choices()
    assert len(choices) >= 3 and all(c.prompt_source == "continuation" for c in choices[1:])
    for before, after in itertools.pairwise(choices):
        prefix = before.prompt_token_ids + before.token_ids
        assert after.prompt_token_ids[: len(prefix)] == prefix


async def responses_rollout(model, seed: int) -> artrl.Trajectory:
    """Three calls chained by previous_response_id, each after the tools' results."""
    client = model.openai_client()
    given: list = [{"role": "user", "content": TASK}]
    previous = None
    async with artrl.capture(model) as capture:
        for _ in range(3):
            response = await client.responses.create(
                model=model.name,
                input=given,
                tools=RESPONSES_TOOLS,
                previous_response_id=previous,
                max_output_tokens=64,
                temperature=1.0,
                extra_body={**THINK, "seed": seed},
            )
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                break
            given = [
                {
                    "type": "function_call_output",
                    "call_id": c.call_id,
                    "output": run_tool(c.name, json.loads(c.arguments)),
                }
                for c in calls
            ]
            previous = response.id
    return capture.trajectory


async def test_responses_tool_turns_continue_and_train(trainee):
    trajectories = await asyncio.gather(*(responses_rollout(trainee, seed) for seed in range(4)))
    longest = max(trajectories, key=lambda t: len(t.choices()))
    assert_continues(longest)
    assert all((c.message.model_extra or {}).get("reasoning_content") for c in longest.choices())
    for i, t in enumerate(trajectories):
        t.reward = float(i % 2)
    result = await trainee.train([artrl.TrajectoryGroup(trajectories)], artrl.TrainConfig(learning_rate=1e-3))
    assert result.metrics["optimizer_steps"] == 1 and result.metrics["rows"] >= 4


async def test_responses_input_sent_back_whole_continues(served_gemma):
    client = served_gemma.openai_client()
    given: list = [{"role": "user", "content": TASK}]
    async with artrl.capture(served_gemma) as capture:
        first = await client.responses.create(
            model=served_gemma.name, input=given, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64
        )
        call = next(o for o in first.output if o.type == "function_call")
        given += [o.model_dump(exclude_none=True) for o in first.output]
        given.append({"type": "function_call_output", "call_id": call.call_id, "output": "paris is tokyo"})
        await client.responses.create(
            model=served_gemma.name, input=given, tools=RESPONSES_TOOLS, max_output_tokens=8
        )
    assert [c.prompt_source for c in capture.trajectory.choices()] == ["rendered", "continuation"]


async def test_responses_streaming(served_gemma):
    client = served_gemma.openai_client()
    async with artrl.capture(served_gemma) as capture:
        stream = await client.responses.create(
            model=served_gemma.name,
            input="Add 3 and 4.",
            tools=RESPONSES_TOOLS,
            temperature=0,
            max_output_tokens=64,
            stream=True,
        )
        kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    (choice,) = capture.trajectory.choices()
    assert choice.token_ids and choice.prompt_token_ids


async def test_an_agents_sdk_agent(served_gemma):
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)

    def tool(spec: dict) -> FunctionTool:
        async def invoke(_, arguments: str) -> str:
            return run_tool(spec["name"], json.loads(arguments or "{}"))

        return FunctionTool(
            name=spec["name"],
            description=spec["description"],
            params_json_schema=spec["parameters"],
            on_invoke_tool=invoke,
            strict_json_schema=False,
        )

    agent = Agent(
        name="helper",
        model=OpenAIResponsesModel(model=served_gemma.name, openai_client=served_gemma.openai_client()),
        tools=[tool(t["function"]) for t in FIXTURE_TOOLS],
        model_settings=ModelSettings(temperature=0, max_tokens=64, extra_body=THINK),
    )
    async with artrl.capture(served_gemma) as capture:
        await Runner.run(agent, TASK, max_turns=6)
    assert_continues(capture.trajectory)


async def messages_rollout(model, seed: int, turns: int = 3) -> artrl.Trajectory:
    client = model.anthropic_client()
    messages: list = [{"role": "user", "content": TASK}]
    async with artrl.capture(model) as capture:
        for _ in range(turns):
            reply = await client.messages.create(
                model=model.name,
                messages=messages,
                tools=ANTHROPIC_TOOLS,
                max_tokens=64,
                thinking={"type": "enabled", "budget_tokens": 1024},
                extra_body={"temperature": 1.0, "seed": seed},
            )
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            results = [
                {"type": "tool_result", "tool_use_id": u.id, "content": run_tool(u.name, u.input)}
                for u in uses
            ]
            messages.append({"role": "user", "content": results})
    return capture.trajectory


async def test_messages_tool_turns_continue_and_train(trainee):
    trajectories = await asyncio.gather(*(messages_rollout(trainee, seed) for seed in range(4)))
    longest = max(trajectories, key=lambda t: len(t.choices()))
    assert_continues(longest)
    for i, t in enumerate(trajectories):
        t.reward = float(i % 2)
    result = await trainee.train([artrl.TrajectoryGroup(trajectories)], artrl.TrainConfig(learning_rate=1e-3))
    assert result.metrics["optimizer_steps"] == 1


async def test_messages_streaming(served_gemma):
    client = served_gemma.anthropic_client()
    async with (
        artrl.capture(served_gemma) as capture,
        client.messages.stream(
            model=served_gemma.name,
            messages=[{"role": "user", "content": "Add 3 and 4."}],
            tools=ANTHROPIC_TOOLS,
            max_tokens=64,
            extra_body={"temperature": 0},
        ) as stream,
    ):
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.stop_reason in ("tool_use", "end_turn", "max_tokens") and final.content
    (choice,) = capture.trajectory.choices()
    assert choice.token_ids


async def test_bad_requests_are_clear_errors(served_gemma):
    client = served_gemma.openai_client()
    with pytest.raises(openai.BadRequestError, match="previous response 'resp_nope' not found"):
        await client.responses.create(model=served_gemma.name, input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        await client.responses.create(model=served_gemma.name, input="hi", tools=[{"type": "web_search"}])
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="block type 'image' is not supported"):
        await served_gemma.anthropic_client().messages.create(
            model=served_gemma.name,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ],
        )
