"""Training rows from trajectories: exactly the tokens the model saw and sampled.

Walk a trajectory's sampled calls in order: its main conversation's, then each additional history's. If a
call's prompt ids start with an existing row (an earlier call's prompt + sampled ids, and so on back), extend
the longest such row with the new prompt tokens (mask 0) and the new sampled tokens (mask 1); otherwise start
a new row (a fork: a sub-agent, a summary, an edited history). A call that appears in several histories (the
same prompt and sampled ids: shared context) is trained once. Every row of a trajectory gets weight
1 / (its number of rows), so a trajectory counts once however it forks, and all its histories share its reward.

Assistant turns without recorded ids (plain dicts, or choices from another provider) are only trained if the
caller opts in: the whole conversation is then rendered with the chat template and its assistant mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from artrl.trajectory import History, Trajectory

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

    def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [NO_LOGPROB] * len(ids)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.mask)


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


def recorded_rows(traj: Trajectory, index: int) -> list[Row]:
    rows: list[Row] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for choice in (c for history in _histories(traj) for c in history.choices()):
        recorded = _recorded(choice)
        assert recorded is not None
        prompt, sampled, logprobs = recorded
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


def rendered_row(traj: History, index: int, tokenizer: Any) -> Row:
    """The conversation rendered by the chat template; trainable = the template's assistant spans."""
    encoded = tokenizer.apply_chat_template(
        traj.messages(), tools=traj.tools or None, return_dict=True, return_assistant_tokens_mask=True
    )
    mask = [int(bool(m)) for m in encoded["assistant_masks"]]
    if not any(mask):
        raise UntrackedTurnsError(
            "the chat template marks no assistant tokens (it needs {% generation %} … {% endgeneration %} "
            "around assistant turns) so rendered turns cannot be trained"
        )
    return Row(list(encoded["input_ids"]), mask, [NO_LOGPROB] * len(mask), index)


def trajectory_rows(traj: Trajectory, index: int, tokenizer: Any, allow_rendered: bool) -> list[Row]:
    if has_untracked_turns(traj):
        if not allow_rendered:
            raise UntrackedTurnsError(
                f"trajectory {index} has assistant turns without recorded token ids (plain assistant dicts or "
                "choices from another server). Sample them through the artrl gateway, or opt in to training "
                "a re-rendering with TrainConfig(allow_rendered_turns=True)."
            )
        histories = [h for h in _histories(traj) if any(map(_is_assistant, h.messages_and_choices))]
        rows = [rendered_row(h, index, tokenizer) for h in histories]
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
