"""A capture's records → one Trajectory: the main conversation plus additional histories.

Every sampled choice of every record is a node. A node's parent is the choice whose request messages + its
assistant message form the longest prefix of this request's messages (the latest such choice on a tie), so
each conversation is a path of nodes from a root (a request continuing nothing recorded) to a leaf.
Messages are compared exactly as the gateway compares them for continuation (`artrl.canonical`): by role,
text content, tool calls (id, name, parsed arguments) and tool_call_id, ignoring other fields and noise.

The main conversation is the longest path (most sampled turns; on a tie the one whose last call finished
latest). Every other leaf's path becomes an additional history. Paths share their common beginning, and the
shared choices appear in each history; training counts each sampled call once (`artrl.local.train.rows`).
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice

from artrl.canonical import message_key
from artrl.trajectory import History, MessageOrChoice, Trajectory


class _Node:
    def __init__(self, record: int, choice: Choice, messages: list[Any], tools: Any, key: tuple[str, ...]):
        self.record, self.choice, self.messages, self.tools, self.key = record, choice, messages, tools, key
        self.parent: _Node | None = None
        self.children = 0

    def path(self) -> list[_Node]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


_SDK_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


def _choice(raw: dict[str, Any]) -> Choice:
    """A recorded choice as the openai SDK's Choice. A finish reason the SDK does not know (the engine's
    "abort": a sequence cut off when the engine closed) becomes "length", the original kept as
    `artrl_finish_reason`, so that one such call does not lose the whole capture."""
    reason = raw.get("finish_reason")
    if reason not in _SDK_FINISH_REASONS:
        raw = {**raw, "finish_reason": "length", "artrl_finish_reason": reason}
    return Choice.model_validate(raw)


def _nodes(records: list[dict[str, Any]]) -> list[_Node]:
    by_key: dict[tuple[str, ...], _Node] = {}  # request messages + assistant message → the latest such choice
    nodes: list[_Node] = []
    for i, record in enumerate(records):
        messages = list(record.get("messages") or [])
        request = tuple(message_key(m) for m in messages)
        parent = next(
            (by_key[request[:n]] for n in range(len(request), 0, -1) if request[:n] in by_key), None
        )
        for raw in record.get("choices") or []:
            choice = _choice(raw)
            key = (*request, message_key(raw.get("message")))
            node = _Node(i, choice, messages, record.get("tools"), key)
            node.parent = parent
            if parent is not None:
                parent.children += 1
            by_key[key] = node
            nodes.append(node)
    return nodes


def _history(path: list[_Node]) -> History:
    """The leaf's request messages with each earlier node's assistant turn replaced by its Choice."""
    leaf = path[-1]
    items: list[MessageOrChoice] = list(leaf.messages)
    for node in path[:-1]:
        items[len(node.messages)] = node.choice
    items.append(leaf.choice)
    return History(messages_and_choices=items, tools=leaf.tools)


def trajectory_from_records(records: list[dict[str, Any]]) -> Trajectory:
    """Records in completion order (as `DELETE /v1/captures/{id}` returns them) → Trajectory (reward 0)."""
    nodes = _nodes(records)
    leaves = [(node, node.path()) for node in nodes if node.children == 0]
    if not leaves:
        return Trajectory()
    main_leaf, main_path = max(leaves, key=lambda leaf: (len(leaf[1]), leaf[0].record))
    main = _history(main_path)
    others = [_history(path) for leaf, path in leaves if leaf is not main_leaf]
    return Trajectory(
        messages_and_choices=main.messages_and_choices, tools=main.tools, additional_histories=others
    )
