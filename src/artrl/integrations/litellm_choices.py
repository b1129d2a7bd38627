"""A choice that came back through litellm, as the OpenAI `Choice` a trajectory trains on (ART's
`art.utils.litellm.convert_litellm_choice_to_openai`), with the tokens the model sampled kept.

litellm rebuilds a response in its own types and moves the fields it does not know from each choice into
`choice.provider_specific_fields`: the gateway's `prompt_token_ids`, `token_ids` and `token_logprobs`
arrive there. They go back onto the returned `Choice` as the extra fields the gateway sent, so training uses
exactly the sampled tokens (without them a turn could only be re-rendered from its text). litellm itself
is not imported: its objects are read by attribute.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice


def _plain(value: Any) -> Any:
    """A litellm object (a pydantic model) as plain data."""
    return value.model_dump() if hasattr(value, "model_dump") else value


def convert_litellm_choice_to_openai(litellm_choice: Any) -> Choice:
    """The `openai` `Choice` of a litellm `Choices` (a non-streamed completion's choice): the assistant
    message with its tool calls (and reasoning, when there is some), finish reason, logprobs, and the fields
    the server added to the choice (artrl's gateway: the prompt and sampled token ids, their logprobs)."""
    message = litellm_choice.message
    if message.role != "assistant":
        raise ValueError(f"only assistant messages become choices, not {message.role!r} ones")
    tool_calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for call in message.tool_calls or []
    ]
    openai_message: dict[str, Any] = {
        "role": "assistant",
        "content": message.content,
        "tool_calls": tool_calls or None,
    }
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning:
        openai_message["reasoning_content"] = reasoning
    logprobs = _plain(getattr(litellm_choice, "logprobs", None))
    extra = _plain(getattr(litellm_choice, "provider_specific_fields", None)) or {}
    return Choice.model_validate(
        {
            **extra,
            "index": litellm_choice.index,
            "finish_reason": litellm_choice.finish_reason,
            "message": openai_message,
            "logprobs": logprobs or None,
        }
    )
