from __future__ import annotations

import subprocess
import sys

from openai.types.chat.chat_completion import Choice

from artrl import Trajectory, TrajectoryGroup


def make_choice() -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"k": 1}'},
                    }
                ],
            },
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [4, 5],
            "token_logprobs": [-0.5, -1.25],
            "prompt_source": "rendered",
        }
    )


def test_json_round_trip_keeps_ids_and_logprobs():
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "hi"},
            make_choice(),
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "assistant", "content": "from another provider"},
        ],
        tools=[{"type": "function", "function": {"name": "lookup"}}],
        reward=0.5,
        metrics={"turns": 2},
        metadata={"scenario": 7},
    )
    traj.log("note")
    again = Trajectory.model_validate_json(traj.model_dump_json())
    assert isinstance(again.messages_and_choices[1], Choice)
    choice = again.choices()[0]
    assert (choice.prompt_token_ids, choice.token_ids, choice.token_logprobs) == (
        [1, 2, 3],
        [4, 5],
        [-0.5, -1.25],
    )
    assert again.messages() == traj.messages()
    assert again.reward == 0.5 and again.logs == ["note"] and again.metadata == {"scenario": 7}
    assert isinstance(again.messages_and_choices[3], dict)


def test_messages_turns_choices_into_assistant_messages():
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, make_choice()])
    assert traj.messages()[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"k": 1}'}}
        ],
    }


def test_group_from_any_iterable():
    group = TrajectoryGroup(Trajectory(reward=r) for r in (0.0, 1.0))
    assert len(group) == 2 and [t.reward for t in group] == [0.0, 1.0]
    assert TrajectoryGroup.model_validate_json(group.model_dump_json()).trajectories[1].reward == 1.0


async def test_track_duration_and_finish_add_arts_duration_metrics():
    """ART's rollouts time their parts (`async with traj.track_duration("llm_completion"):`) and end with
    `return traj.finish()`, which sets `duration` (seconds since the trajectory was made)."""
    traj = Trajectory(metrics={"answer_correct": 1})
    async with traj.track_duration("llm_completion"):
        pass
    first = traj.metrics["llm_completion_duration"]
    async with traj.track_duration("llm_completion"):  # summed over the blocks of one name
        pass
    assert 0.0 <= first <= traj.metrics["llm_completion_duration"]
    try:
        async with traj.track_duration("judge"):
            raise TimeoutError
    except TimeoutError:
        pass
    assert traj.finish() is traj and traj.metrics["duration"] >= 0.0
    assert set(traj.metrics) == {"answer_correct", "llm_completion_duration", "judge_duration", "duration"}


def test_import_artrl_pulls_no_torch():
    code = (
        "import sys, artrl; artrl.Trajectory; artrl.LocalBackend; assert 'torch' not in sys.modules, 'torch'; "
        "assert 'transformers' not in sys.modules; assert 'fastapi' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_trajectory_says_which_policy_versions_sampled_it():
    """Each choice carries the step of the weights that sampled it (the gateway's `policy_step`); a choice
    from elsewhere carries none; the stamps survive a round trip through JSON (the run's saved rows)."""
    from artrl.trajectory import History

    def stamped(step: int | None) -> Choice:
        data = make_choice().model_dump()
        data.pop("policy_step", None)
        return Choice.model_validate(data if step is None else {**data, "policy_step": step})

    user = {"role": "user", "content": "go"}
    traj = Trajectory(
        messages_and_choices=[user, stamped(3), stamped(None), stamped(4)],
        additional_histories=[History(messages_and_choices=[user, stamped(2)])],
    )
    assert traj.policy_versions() == [3, 4, 2]
    assert Trajectory.model_validate_json(traj.model_dump_json()).policy_versions() == [3, 4, 2]
    assert Trajectory(messages_and_choices=[user, stamped(None)]).policy_versions() == []
