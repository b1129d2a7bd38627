"""The pure half of the relative judge: the shared prefix, the judge's prompt, and validating its answer.

No I/O here: these functions take message lists (chat-completions dicts) and text, so they are tested
without a server. `artrl.rewards.ruler` sends the prompt and retries.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Message = Mapping[str, Any]

DEFAULT_RUBRIC = """\
- The trajectories are attempts at the same task; judge them relative to each other.
- A trajectory that achieves the task's goal scores higher than one that does not.
- Between two that achieve it equally, the more efficient one (fewer wasted turns, tool calls or words)
  scores higher.
- Use the whole range 0 to 1: the best trajectory near 1, the worst near 0; equally good trajectories get
  equal scores."""

OUTPUT_FORMAT = """\
Answer with one JSON object and nothing else, in this format:
{"scores": [{"trajectory_id": "<id>", "explanation": "<one or two sentences>", "score": <number from 0 to 1>}]}
Give exactly one entry per trajectory id, using the ids exactly as written."""


class JudgeOutputError(ValueError):
    """The judge's answer is not valid: not JSON, not the schema, or not exactly one score per id."""


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON: equal values give equal strings (non-JSON values fall back to `str`)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def common_prefix(
    message_lists: Sequence[Sequence[Message]],
) -> tuple[list[Message], list[list[Message]]]:
    """The longest run of whole messages every list starts with, and what each list adds after it.

    Messages are compared by their canonical JSON (key order does not matter). Fewer than two lists share
    nothing: the prefix is empty and each list is its own suffix.
    """
    lists = [list(messages) for messages in message_lists]
    if len(lists) < 2:
        return [], lists
    length = 0
    for column in zip(*lists, strict=False):
        first = canonical_json(column[0])
        if any(canonical_json(m) != first for m in column[1:]):
            break
        length += 1
    return lists[0][:length], [messages[length:] for messages in lists]


def render_messages(messages: Sequence[Message]) -> str:
    """One message per line, as compact JSON (keeps roles, tool calls and `None` contents exact)."""
    return "\n".join(canonical_json(dict(m)) for m in messages)


def build_judge_messages(
    prefix: Sequence[Message], suffixes_by_id: Mapping[str, Sequence[Message]], rubric: str
) -> list[dict[str, str]]:
    """The judge's conversation: a system message (rubric and answer format) and one user message holding
    the shared context once, then each trajectory's continuation under its id."""
    system = (
        "You are a careful judge of AI agent trajectories. You will see several trajectories that attempt "
        "the same task, and score each one relative to the others.\n\n"
        f"Rubric:\n{rubric.strip()}\n\n{OUTPUT_FORMAT}"
    )
    parts = [
        f"There are {len(suffixes_by_id)} trajectories, with ids: {', '.join(suffixes_by_id)}. "
        "Each message is shown as one line of JSON."
    ]
    if prefix:
        parts.append(
            f"All trajectories start with this shared context:\n<context>\n{render_messages(prefix)}\n</context>"
        )
        parts.append("Each trajectory then continues as follows.")
    for trajectory_id, suffix in suffixes_by_id.items():
        body = render_messages(suffix) if suffix else "(no further messages)"
        parts.append(f'<trajectory id="{trajectory_id}">\n{body}\n</trajectory>')
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def cache_key(model: str, rubric: str, judge_messages: Sequence[Message]) -> str:
    """A content key for a judge call: sha256 of the canonical JSON of (model, rubric, messages)."""
    payload = canonical_json({"model": model, "rubric": rubric, "messages": list(judge_messages)})
    return hashlib.sha256(payload.encode()).hexdigest()


class _Score(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)


class _Scores(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scores: list[_Score]


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def _load_json(text: str) -> Any:
    stripped = text.strip()
    fenced = _FENCE.search(stripped)
    if fenced:
        stripped = fenced.group(1)
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as first:
        start, end = stripped.find("{"), stripped.rfind("}")
        if 0 <= start < end:  # prose around one object: try the object alone
            try:
                return json.loads(stripped[start : end + 1])
            except json.JSONDecodeError:
                pass
        raise JudgeOutputError(f"judge output is not JSON ({first.msg} at char {first.pos})") from None


def _describe(error: ValidationError, data: Any) -> str:
    items = data.get("scores") if isinstance(data, dict) else None
    problems = []
    for e in error.errors(include_url=False):
        loc = e["loc"]
        where = ".".join(str(part) for part in loc) or "the answer"
        if len(loc) >= 2 and loc[0] == "scores" and isinstance(loc[1], int) and isinstance(items, list):
            entry = items[loc[1]] if loc[1] < len(items) else None
            if isinstance(entry, dict) and "trajectory_id" in entry:
                where += f" (trajectory {entry['trajectory_id']!r})"
        value = f", got {e['input']!r}" if e["type"] != "missing" else ""
        problems.append(f"{where}: {e['msg']}{value}")
    return "; ".join(problems)


def parse_scores(text: str, ids: Sequence[str]) -> dict[str, tuple[float, str]]:
    """Validate the judge's answer and return ``{id: (score, explanation)}`` for exactly the given ids.

    Accepts the JSON object alone, inside a ```json fence, or with prose around it. Raises
    `JudgeOutputError` naming the problem: not JSON, a schema violation (a score that is not a finite number
    in [0, 1], a missing field), or ids that are missing, unknown or given more than once.
    """
    data = _load_json(text)
    try:
        parsed = _Scores.model_validate(data)
    except ValidationError as error:
        raise JudgeOutputError(f"judge output does not match the schema: {_describe(error, data)}") from None
    expected = list(ids)
    seen: dict[str, tuple[float, str]] = {}
    duplicated: list[str] = []
    for item in parsed.scores:
        if item.trajectory_id in seen and item.trajectory_id not in duplicated:
            duplicated.append(item.trajectory_id)
        seen[item.trajectory_id] = (item.score, item.explanation)
    missing = [i for i in expected if i not in seen]
    unknown = [i for i in seen if i not in set(expected)]
    problems = []
    if missing:
        problems.append(f"missing scores for {', '.join(missing)}")
    if unknown:
        problems.append(f"scores for unknown ids {', '.join(unknown)}")
    if duplicated:
        problems.append(f"more than one score for {', '.join(duplicated)}")
    if problems:
        raise JudgeOutputError(
            f"judge output must score each of {', '.join(expected)} exactly once: {'; '.join(problems)}"
        )
    return {i: seen[i] for i in expected}
