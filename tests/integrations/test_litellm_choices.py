"""A choice that comes back through litellm keeps the tokens the model sampled (ART's
`convert_litellm_choice_to_openai`, artrl.integrations.litellm_choices)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (litellm's import would fetch it, 3 tries)
from litellm import acompletion
from litellm.litellm_core_utils.llm_response_utils.convert_dict_to_response import (
    convert_to_model_response_object,
)
from litellm.types.utils import ModelResponse
from openai.types.chat.chat_completion import Choice

from artrl.integrations.litellm_choices import convert_litellm_choice_to_openai
from artrl.local.train.rows import _recorded
from artrl.trajectory import Trajectory, TrajectoryGroup

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read_email", "arguments": '{"message_id": "m1"}'},
}


def through_litellm(message: dict, **choice_fields) -> object:
    """The choice of a gateway's answer as litellm hands it to the caller (its OpenAI-compatible route)."""
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "agent",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message, **choice_fields}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    response = convert_to_model_response_object(response_object=answer, model_response_object=ModelResponse())
    return response.choices[0]


def test_the_gateways_token_fields_survive_litellm_and_reach_the_trainer():
    tokens = {"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9], "token_logprobs": [-0.5, -0.25]}
    choice = through_litellm(
        {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [TOOL_CALL]},
        **tokens,
        prompt_source="rendered",
    )
    # where litellm puts the fields of a choice that it does not know
    assert choice.provider_specific_fields["token_ids"] == [8, 9]
    converted = convert_litellm_choice_to_openai(choice)
    assert isinstance(converted, Choice) and converted.finish_reason == "tool_calls"
    assert converted.model_extra["token_ids"] == [8, 9]
    assert converted.model_extra["prompt_source"] == "rendered"
    assert converted.message.model_extra["reasoning_content"] == "look it up"
    assert converted.message.tool_calls[0].function.arguments == '{"message_id": "m1"}'
    assert _recorded(converted) == ([5, 6, 7], [8, 9], [-0.5, -0.25])  # what a train step reads
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, converted])
    assert traj.messages()[-1]["tool_calls"][0]["id"] == "call_1"
    (stored,) = Trajectory.model_validate_json(traj.model_dump_json()).choices()
    assert stored.model_extra["token_ids"] == [8, 9]


def test_a_choice_from_another_server_has_no_token_fields_and_only_assistants_convert():
    converted = convert_litellm_choice_to_openai(through_litellm({"role": "assistant", "content": "hi"}))
    assert converted.message.content == "hi" and converted.message.tool_calls is None
    assert _recorded(converted) is None  # trained only re-rendered: TrainConfig(allow_rendered_turns=True)
    choice = through_litellm({"role": "assistant", "content": "hi"})
    choice.message.role = "user"
    with pytest.raises(ValueError, match="only assistant"):
        convert_litellm_choice_to_openai(choice)


@pytest.mark.slow
async def test_turns_sampled_through_litellm_continue_and_train_token_exactly(fresh_model):
    """ART·E's loop: litellm's `hosted_vllm/` route to the gateway, each choice converted and kept, the next
    call sent `traj.messages()`: the gateway continues its own ids, and one row per trajectory trains."""
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], tools=tools)
    for turn in range(3):
        response = await acompletion(
            model=f"hosted_vllm/{fresh_model.name}",
            base_url=fresh_model.inference_base_url,
            api_key=fresh_model.inference_api_key,
            messages=traj.messages(),
            tools=tools,
            max_completion_tokens=6,
            extra_body={"ignore_eos": True},  # (6 tokens whatever the tiny model samples: no early stop)
            timeout=60,
        )
        choice = convert_litellm_choice_to_openai(response.choices[0])
        assert choice.model_extra["prompt_source"] == ("rendered" if turn == 0 else "continuation")
        assert len(choice.model_extra["token_ids"]) == 6
        traj.messages_and_choices += [choice, {"role": "user", "content": f"and {turn}?"}]
    other = traj.model_copy(update={"reward": 1.0})
    result = await fresh_model.train([TrajectoryGroup([traj, other])])
    assert (result.metrics["rows"], result.metrics["trainable_tokens"]) == (2, 36)
