"""Trajectories: what one rollout said and sampled, with its reward. Pure data (pydantic), no torch.

`messages_and_choices` mixes plain message dicts (system/user/tool, or assistant turns from elsewhere) and
OpenAI `Choice` objects returned by the served model: a Choice is a sampled, trainable turn and carries the
exact `prompt_token_ids`, `token_ids` and `token_logprobs` the gateway attached to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, field_validator

MessageOrChoice = Choice | dict[str, Any]


def choice_to_message(choice: Choice) -> dict[str, Any]:
    """The assistant message to send back to the API for a sampled choice."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in choice.message.tool_calls
        ]
    return message


class History(BaseModel):
    """One conversation: messages and sampled choices, and the tools it offered."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _choices_from_json(cls, items: Any) -> Any:
        """JSON has no types: an object with `finish_reason` and `message` is a Choice, the rest messages."""
        if not isinstance(items, list):
            return items
        return [
            Choice.model_validate(x) if isinstance(x, dict) and "finish_reason" in x and "message" in x else x
            for x in items
        ]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-completions messages (choices become assistant messages)."""
        return [choice_to_message(x) if isinstance(x, Choice) else x for x in self.messages_and_choices]

    def choices(self) -> list[Choice]:
        return [x for x in self.messages_and_choices if isinstance(x, Choice)]


class Trajectory(History):
    """A rollout: its main conversation (this History) with its reward.

    `additional_histories` are other conversations of the same rollout (sub-agents, summaries, ...): they are
    trained with the same reward (`artrl.capture` fills them from calls that do not continue the main one).
    """

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)

    def log(self, message: str) -> None:
        self.logs.append(message)


class TrajectoryGroup(BaseModel):
    """Rollouts of one scenario, compared with each other (GRPO's group)."""

    trajectories: list[Trajectory]
    exceptions: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def __init__(self, trajectories: Iterable[Trajectory] | None = None, **data: Any) -> None:
        if trajectories is not None:
            data["trajectories"] = list(trajectories)
        super().__init__(**data)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)
