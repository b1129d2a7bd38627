"""`artrl dashboard`'s API over a real run: the tiny model trained a step through the gateway (two-turn
rollouts, one of them forked), an evaluation logged; then every endpoint read over HTTP."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from two_turn_rollouts import two_turns

import artrl
from artrl.config import DashboardConfig
from artrl.local.dashboard.app import start_dashboard


@pytest.fixture(scope="module")
async def run_root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    async with artrl.LocalBackend(path=root) as backend:
        model = artrl.TrainableModel(name="agent", project="dash", base_model=str(tiny_model_dir))
        await model.register(backend)
        rewards = [1.0, 0.0, 0.5, 0.25]
        group = artrl.TrajectoryGroup(
            await asyncio.gather(*(two_turns(model, i, r, fork=i == 3) for i, r in enumerate(rewards)))
        )
        flat = artrl.TrajectoryGroup(await asyncio.gather(*(two_turns(model, 10 + i, 0.0) for i in range(2))))
        await model.train([flat, group], artrl.TrainConfig(learning_rate=1e-3))
        await model.log([group], split="val")
    return root


@pytest.fixture(scope="module")
def dashboard(run_root):
    server = start_dashboard(run_root, DashboardConfig(port=0))
    with httpx.Client(base_url=f"http://{server.host}:{server.port}", timeout=30) as client:
        yield client
    server.stop()


def test_runs_history_and_steps(dashboard):
    runs = dashboard.get("/api/runs").json()
    assert [r["id"] for r in runs] == ["dash/agent"]
    assert runs[0]["step"] == 1 and runs[0]["splits"] == ["train", "val"]
    history = dashboard.get("/api/history", params={"run": "dash/agent"}).json()
    assert [(r["step"], r["split"]) for r in history] == [(1, "train"), (1, "val")]
    # 3 one-row trajectories + a forked one (2 rows); the flat group trains nothing
    assert history[0]["rows"] == 5
    assert dashboard.get("/api/steps", params={"run": "dash/agent"}).json() == {"train": [1], "val": [1]}


def test_groups_are_ranked(dashboard):
    groups = dashboard.get("/api/groups", params={"run": "dash/agent", "split": "train", "step": 1}).json()
    assert [g["group"] for g in groups] == [1, 0]  # mean 0.4375 before 0.0
    assert [t["reward"] for t in groups[0]["trajectories"]] == [1.0, 0.5, 0.25, 0.0]
    assert groups[0]["trajectories"][0] == {
        "index": 0,
        "reward": 1.0,
        "metrics": {"turns": 2},
        "messages": 5,
        "sampled_turns": 2,
    }


def _trajectory(dashboard, split: str, group: int, index: int) -> dict:
    params = {"run": "dash/agent", "split": split, "step": 1, "group": group, "index": index}
    response = dashboard.get("/api/trajectory", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_trained_trajectory_token_by_token(dashboard, tokenizer):
    view = _trajectory(dashboard, "train", 1, 0)
    assert view["rows_source"] == "trained" and view["token_text"]
    assert [m["role"] for m in view["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["sampled"] for m in view["messages"]].count(True) == 2
    (row,) = view["rows"]  # the second call continued the first: one row
    assert row["trained"] and row["advantage"] > 0 and row["fork"] is None
    ids = [t[0] for t in row["tokens"]]
    assert "".join(t[1] for t in row["tokens"]) == tokenizer.decode(ids, skip_special_tokens=False)
    sampled = [t for t in row["tokens"] if t[2] == 1]
    assert len(sampled) == row["trained_tokens"] > 0
    # the trainer's logprob of every trained token (but the row's first, which nothing predicts), next to
    # the sampler's: the same weights in fp32, so they agree
    for _id, _text, _mask, sampler, trainer in sampled:
        assert sampler is not None and trainer is not None and math.isclose(sampler, trainer, abs_tol=2e-3)
    assert row["before_update"]
    assert all(t[3] is None and t[4] is None for t in row["tokens"] if t[2] == 0)


def test_a_forked_trajectory_shows_where_it_forks(dashboard):
    view = _trajectory(dashboard, "train", 1, 3)
    first, second = view["rows"]
    assert first["fork"] is None
    assert second["fork"]["from_row"] == 0 and 0 < second["fork"]["at"] < second["length"]
    assert first["weight"] == second["weight"] == 0.5


def test_an_evaluation_shows_its_recorded_rows(dashboard):
    view = _trajectory(dashboard, "val", 0, 0)
    assert view["rows_source"] == "recorded"
    (row,) = view["rows"]
    assert not row["trained"] and row["advantage"] is None and row["trained_tokens"] > 0
    assert all(t[4] is None for t in row["tokens"])


def test_zero_advantage_trajectories_are_shown_as_not_trained(dashboard):
    view = _trajectory(dashboard, "train", 0, 1)
    (row,) = view["rows"]
    assert row["trained"] is False and row["advantage"] == 0.0


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/api/history", {"run": "nope/agent"}, 404),
        ("/api/history", {"run": "../.."}, 404),
        ("/api/history", {"run": "/etc"}, 404),
        ("/api/groups", {"run": "dash/agent", "split": "train", "step": 7}, 404),
        ("/api/groups", {"run": "dash/agent", "split": "../../..", "step": 1}, 404),
        ("/api/groups", {"run": "dash/agent", "split": "train", "step": -1}, 422),
        ("/api/trajectory", {"run": "dash/agent", "split": "train", "step": 1, "group": 9, "index": 0}, 404),
        ("/api/history", {}, 422),
        ("/secret.txt", {}, 404),
    ],
)
def test_bad_requests_are_clear_errors(dashboard, path, params, status):
    response = dashboard.get(path, params=params)
    assert response.status_code == status
    if status == 404:
        assert response.json()["error"]


def test_the_page_and_its_assets_are_served(dashboard):
    page = dashboard.get("/")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert dashboard.get("/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert dashboard.get("/dashboard.css").status_code == 200


async def test_the_rows_record_follows_the_train_config(fresh_model):
    """steps_per_call=2: the second slice's trainer logprobs come after an update (not a mismatch reading);
    save_rows=False keeps no record."""
    from artrl.storage import read_step_rows

    backend = fresh_model._require_backend()
    directory = backend.directory(fresh_model)
    group = artrl.TrajectoryGroup(
        await asyncio.gather(*(two_turns(fresh_model, i, float(i)) for i in range(4)))
    )
    await fresh_model.train([group], artrl.TrainConfig(steps_per_call=2))
    records = read_step_rows(directory, 1)
    assert len(records) == 4 and all(r["trained"] for r in records)
    assert sorted(r["before_update"] for r in records) == [False, False, True, True]
    assert all(len(r["trainer_logprobs"]) == len(r["ids"]) for r in records)
    await fresh_model.train([group], artrl.TrainConfig(save_rows=False))
    assert read_step_rows(directory, 2) == []
