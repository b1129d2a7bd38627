"""Training rows and masks: golden cases (extension, forks, untracked turns) and the debug view."""

from __future__ import annotations

import math

import pytest
from openai.types.chat.chat_completion import Choice

from artrl import History, Trajectory
from artrl.local.train.rows import UntrackedTurnsError, format_row, trajectory_rows


def choice(prompt: list[int], sampled: list[int], content: str = "x") -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": content},
            "prompt_token_ids": prompt,
            "token_ids": sampled,
            "token_logprobs": [-0.1 * (i + 1) for i in range(len(sampled))],
        }
    )


def test_rows_extend_and_fork():
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            choice([1, 2, 3], [4, 5]),
            {"role": "user", "content": "more"},
            choice([1, 2, 3, 4, 5, 6, 7], [8, 9]),
            choice([1, 2, 10], [11]),  # a side call that does not continue the conversation: a fork
        ]
    )
    rows = trajectory_rows(traj, 3, None, allow_rendered=False)
    assert [r.ids for r in rows] == [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 10, 11]]
    assert [r.mask for r in rows] == [[0, 0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 1]]
    assert [r.weight for r in rows] == [0.5, 0.5]
    assert [r.trajectory for r in rows] == [3, 3]
    first = rows[0].logprobs
    assert [first[i] for i in (3, 4, 7, 8)] == pytest.approx([-0.1, -0.2, -0.1, -0.2])
    assert all(math.isnan(first[i]) for i in (0, 1, 2, 5, 6))


def test_untracked_assistant_turns_need_opt_in(tokenizer, chat_format):
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "an answer from elsewhere"},
        ]
    )
    with pytest.raises(UntrackedTurnsError, match="allow_rendered_turns"):
        trajectory_rows(traj, 0, chat_format, allow_rendered=False)
    (row,) = trajectory_rows(traj, 0, chat_format, allow_rendered=True)
    trained = tokenizer.decode([t for t, m in zip(row.ids, row.mask, strict=True) if m])
    assert trained == "an answer from elsewhere<|im_end|>"
    assert all(math.isnan(x) for x in row.logprobs)


def test_choice_without_ids_counts_as_untracked(tokenizer):
    foreign = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    )
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, foreign])
    with pytest.raises(UntrackedTurnsError):
        trajectory_rows(traj, 0, tokenizer, allow_rendered=False)


def test_trajectory_without_sampled_turns_has_no_rows():
    assert (
        trajectory_rows(Trajectory(messages_and_choices=[{"role": "user", "content": "q"}]), 0, None, False)
        == []
    )


def test_format_row_marks_sampled_spans(tokenizer):
    ids = tokenizer("<|im_start|>assistant\nHello<|im_end|>", add_special_tokens=False)["input_ids"]
    prompt_len = len(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    traj = Trajectory(messages_and_choices=[choice(ids[:prompt_len], ids[prompt_len:])])
    (row,) = trajectory_rows(traj, 0, tokenizer, False)
    assert format_row(row, tokenizer.decode) == "<|im_start|>assistant\n⟦Hello<|im_end|>⟧"


def test_a_call_extends_the_longest_row_it_continues_and_histories_add_rows():
    traj = Trajectory(
        messages_and_choices=[
            choice([1, 2], [3]),
            choice([1, 9], [10]),  # a side call between two turns of the main conversation
            choice([1, 2, 3, 4], [5]),  # continues the first row, not the last one
        ],
        additional_histories=[
            History(messages_and_choices=[{"role": "user", "content": "s"}, choice([7], [8])])
        ],
    )
    rows = trajectory_rows(traj, 0, None, allow_rendered=False)
    assert [r.ids for r in rows] == [[1, 2, 3, 4, 5], [1, 9, 10], [7, 8]]
    assert [r.weight for r in rows] == pytest.approx([1 / 3] * 3)


def test_untracked_turns_in_a_history_need_opt_in(tokenizer, chat_format):
    history = History(
        messages_and_choices=[{"role": "user", "content": "s"}, {"role": "assistant", "content": "a"}]
    )
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], additional_histories=[history])
    with pytest.raises(UntrackedTurnsError):
        trajectory_rows(traj, 0, chat_format, allow_rendered=False)
    (row,) = trajectory_rows(traj, 0, chat_format, allow_rendered=True)
    assert tokenizer.decode([t for t, m in zip(row.ids, row.mask, strict=True) if m]) == "a<|im_end|>"
