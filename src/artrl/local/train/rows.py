"""Training rows from trajectories: exactly the tokens the model saw and sampled.

Walk a trajectory's sampled calls in order: its main conversation's, then each additional history's. If a
call's prompt ids start with an existing row (an earlier call's prompt + sampled ids, and so on back), extend
the longest such row with the new prompt tokens (mask 0) and the new sampled tokens (mask 1); otherwise start
a new row (a fork: a sub-agent, a summary, an edited history). A call that appears in several histories (the
same prompt and sampled ids: shared context) is trained once. Every row of a trajectory gets weight
1 / (its number of rows), so a trajectory counts once however it forks, and all its histories share its reward.

Assistant turns without recorded ids (plain dicts, or choices from another provider) are only trained if the
caller opts in (SFT always does): each turn is then tokenised as the gateway would have recorded it had it
sampled that turn (`rendered_rows`), which needs no `{% generation %}` marks in the template.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from artrl.local.chat_format import ChatFormat, TemplateRenderError
from artrl.local.chat_format.turns import UnrenderableTurnError, simulate_turns
from artrl.trajectory import History, Trajectory, choice_to_message

NO_LOGPROB = math.nan  # on prompt tokens, and on rendered turns (no behaviour logprob was recorded)


class UntrackedTurnsError(ValueError):
    """A trajectory has assistant turns whose token ids were not recorded by the gateway."""


@dataclass
class Row:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 exactly on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob of each sampled token
    trajectory: int = 0  # index of its trajectory in the batch
    weight: float = 1.0
    advantage: float = 0.0  # its trajectory's (GRPO; 0 for SFT)
    # the token each position t predicts, where it is not ids[t + 1] (a Tinker datum's targets), len(ids) - 1
    targets: list[int] | None = None

    def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [NO_LOGPROB] * len(ids)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.mask)


def trained_targets(rows: list[Row]) -> float:
    """N: the weighted count of trained target tokens of one optimizer step (targets are positions 1..): the
    normaliser of its token-mean losses."""
    return sum(r.weight * (r.trainable_tokens - r.mask[0]) for r in rows)


def _recorded(choice: Choice) -> tuple[list[int], list[int], list[float]] | None:
    extra = choice.model_extra or {}
    prompt, sampled, logprobs = (
        extra.get("prompt_token_ids"),
        extra.get("token_ids"),
        extra.get("token_logprobs"),
    )
    if not isinstance(prompt, list) or not isinstance(sampled, list):
        return None
    if not isinstance(logprobs, list) or len(logprobs) != len(sampled):
        logprobs = [NO_LOGPROB] * len(sampled)
    return prompt, sampled, [float(x) for x in logprobs]


def _histories(traj: Trajectory) -> list[History]:
    return [traj, *traj.additional_histories]


def _is_assistant(item: Any) -> bool:
    return isinstance(item, Choice) or (isinstance(item, dict) and item.get("role") == "assistant")


def has_untracked_turns(traj: Trajectory) -> bool:
    for history in _histories(traj):
        for item in history.messages_and_choices:
            if isinstance(item, Choice) and _recorded(item) is None:
                return True
            if isinstance(item, dict) and item.get("role") == "assistant":
                return True
    return False


def rows_from_calls(calls: list[tuple[list[int], list[int], list[float] | None]], index: int) -> list[Row]:
    """Rows of one trajectory from its calls in order, each (prompt ids, sampled ids, their logprobs)."""
    rows: list[Row] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for prompt, sampled, logprobs in calls:
        key = (tuple(prompt), tuple(sampled))
        if key in seen:
            continue
        seen.add(key)
        continued = [r for r in rows if prompt[: len(r.ids)] == r.ids]
        row = max(continued, key=lambda r: len(r.ids)) if continued else None
        if row is None:
            row = Row(trajectory=index)
            rows.append(row)
        row.extend(prompt[len(row.ids) :], sampled=False)
        row.extend(sampled, sampled=True, logprobs=logprobs)
    return rows


def recorded_rows(traj: Trajectory, index: int) -> list[Row]:
    calls = []
    for choice in (c for history in _histories(traj) for c in history.choices()):
        recorded = _recorded(choice)
        assert recorded is not None
        calls.append(recorded)
    return rows_from_calls(calls, index)


def _training_messages(history: History) -> list[dict[str, Any]]:
    """The conversation as template messages, with the reasoning of sampled choices kept."""
    out = []
    for item in history.messages_and_choices:
        if isinstance(item, Choice):
            message = choice_to_message(item)
            reasoning = (item.message.model_extra or {}).get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                message["reasoning_content"] = reasoning
            out.append(message)
        else:
            out.append(item)
    return out


def rendered_rows(
    history: History, index: int, chat_format: ChatFormat, template_kwargs: dict[str, Any] | None = None
) -> list[Row]:
    """Rows of a conversation whose assistant turns were not sampled through the gateway: each turn as the
    gateway would have recorded it (prompt continued or rendered, the turn's text as "sampled" ids; see
    `chat_format.turns`). No behaviour logprobs; works on any template, with or without generation marks."""
    try:
        turns = simulate_turns(chat_format, _training_messages(history), history.tools, template_kwargs)
    except (UnrenderableTurnError, TemplateRenderError) as exc:
        raise UntrackedTurnsError(f"trajectory {index}: {exc}") from None
    return rows_from_calls([(t.prompt_ids, t.sampled_ids, None) for t in turns], index)


def trajectory_rows(
    traj: Trajectory,
    index: int,
    chat_format: ChatFormat,
    allow_rendered: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[Row]:
    if has_untracked_turns(traj):
        if not allow_rendered:
            raise UntrackedTurnsError(
                f"trajectory {index} has assistant turns without recorded token ids (plain assistant dicts or "
                "choices from another server). Sample them through the artrl gateway, or opt in to training "
                "a re-rendering with TrainConfig(allow_rendered_turns=True)."
            )
        histories = [h for h in _histories(traj) if any(map(_is_assistant, h.messages_and_choices))]
        rows = [row for h in histories for row in rendered_rows(h, index, chat_format, template_kwargs)]
    else:
        rows = recorded_rows(traj, index)
    for row in rows:
        row.weight = 1.0 / len(rows)
    return [row for row in rows if row.trainable_tokens > 0]


def format_row(row: Row, decode: Callable[[list[int]], str]) -> str:
    """A readable view of a row: prompt text as is, sampled (trained) spans inside ⟦ ⟧."""
    out: list[str] = []
    start = 0
    for i in range(1, len(row.ids) + 1):
        if i == len(row.ids) or row.mask[i] != row.mask[start]:
            text = decode(row.ids[start:i])
            out.append(f"⟦{text}⟧" if row.mask[start] else text)
            start = i
    return "".join(out)
