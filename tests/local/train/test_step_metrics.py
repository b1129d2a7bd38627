"""A training step's row says what users look for (issue 44): their own trajectory metrics, the rate of
rollouts that raised, the sampled tokens per trajectory and the learning rate, in the history (and so in
the trackers, which get every history row)."""

from __future__ import annotations

from openai.types.chat.chat_completion import Choice

import artrl
from artrl.storage import read_history


def sampled(reward: float, tokens: int, win: bool) -> artrl.Trajectory:
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "x"},
            "prompt_token_ids": [1, 2, 3, 4],
            "token_ids": list(range(7, 7 + tokens)),
            "token_logprobs": [-1.0] * tokens,
        }
    )
    return artrl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward, metrics={"win": win}
    )


async def test_a_steps_row_holds_the_users_metrics_exceptions_and_learning_rate(fresh_model, tmp_path):
    group = artrl.TrajectoryGroup(
        [sampled(1.0, 2, True), sampled(0.0, 4, False), sampled(1.0, 3, True)],
        exceptions=[ValueError("tool timed out")],
    )
    result = await fresh_model.train([group], artrl.TrainConfig(learning_rate=3e-4))
    for metrics in (result.metrics, read_history(tmp_path / "artrl" / "fresh" / "tiny")[-1]):
        assert metrics["win_mean"] == 2 / 3
        assert metrics["exception_rate"] == 1 / 4
        assert metrics["completion_tokens_mean"] == 3.0
        assert metrics["learning_rate"] == 3e-4
        assert metrics["reward_mean"] == 2 / 3
