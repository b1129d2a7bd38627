"""What a click on a trajectory costs the dashboard: its step's files are parsed once while unchanged (not
the whole step again per click), and a tokenizer that cannot load (a hub id offline) is not tried again at
every view, only after TOKENIZER_RETRY_S or once the run saves its own."""

from __future__ import annotations

import json

import pytest
import transformers

from artrl.local.dashboard import runs, token_rows
from artrl.local.dashboard.app import trajectory_view
from artrl.storage import write_step_rows

GROUP = {"trajectories": [{"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": 1.0}]}
ROW = {"group": 0, "trajectory": 0, "row": 0, "trained": True, "ids": [1, 2, 3], "mask": [0, 1, 1]}


@pytest.fixture
def run(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps({"base_model": "someone/not-in-the-cache"}))
    (tmp_path / "trajectories" / "train").mkdir(parents=True)
    (tmp_path / "trajectories" / "train" / "0001.jsonl").write_text(json.dumps(GROUP) + "\n")
    write_step_rows(tmp_path, 1, [ROW])
    return tmp_path


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """What was parsed: each step file (its groups) and each step's rows file."""
    parsed: list[str] = []
    parse_groups, read_step_rows = runs.parse_groups, token_rows.read_step_rows

    def groups(path):
        parsed.append("groups")
        return parse_groups(path)

    def rows(folder, step):
        parsed.append("rows")
        return read_step_rows(folder, step)

    monkeypatch.setattr(runs, "parse_groups", groups)
    monkeypatch.setattr(token_rows, "read_step_rows", rows)
    return parsed


@pytest.fixture
def offline_hub(monkeypatch) -> list[str]:
    """AutoTokenizer as offline: every load fails (after the hub's retries, in life); the sources tried."""
    tried: list[str] = []

    def from_pretrained(source, *args, **kwargs):
        tried.append(source)
        raise OSError(f"offline: cannot reach the hub for {source}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return tried


def test_views_of_one_step_parse_its_files_once_until_it_changes(run, parses, offline_hub):
    first, second = (trajectory_view(run, "train", 1, 0, 0, 100) for _ in range(2))
    assert first == second and first["rows_source"] == "trained" and first["reward"] == 1.0
    assert parses == ["groups", "rows"]
    with (run / "trajectories" / "train" / "0001.jsonl").open("a") as f:  # a running training appends
        f.write(json.dumps(GROUP) + "\n")
    trajectory_view(run, "train", 1, 1, 0, 100)
    assert parses == ["groups", "rows", "groups"]


def test_a_tokenizer_that_did_not_load_is_tried_again_only_later(run, offline_hub, monkeypatch):
    for _ in range(3):
        assert not trajectory_view(run, "train", 1, 0, 0, 100)["token_text"]
    hub = "someone/not-in-the-cache"
    assert offline_hub == [str(run / "tokenizer"), hub]  # once, not once per view
    (run / "tokenizer").mkdir()  # the run saved its tokenizer: tried at once
    trajectory_view(run, "train", 1, 0, 0, 100)
    assert offline_hub.count(hub) == 2
    trajectory_view(run, "train", 1, 0, 0, 100)
    assert offline_hub.count(hub) == 2
    monkeypatch.setattr(token_rows, "TOKENIZER_RETRY_S", 0.0)  # as if a minute went by
    trajectory_view(run, "train", 1, 0, 0, 100)
    assert offline_hub.count(hub) == 3
