"""`artrl check-template` on every family fixture and the project's tiny model: its output is what
docs/model-families.md shows, and its table's columns match what the command measures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from artrl.cli import main
from artrl.local.families.family_models import FAMILY_MODELS

DOCS = (Path(__file__).parents[3] / "docs" / "model-families.md").read_text()


def table() -> dict[str, dict[str, str]]:
    lines = DOCS.split("<!-- families-table")[1].splitlines()[1:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    header, body = rows[0], rows[2:]
    return {r[0]: dict(zip(header, r, strict=True)) for r in body}


def documented_output(name: str, extra: str = "") -> str:
    block = re.search(rf"\$ artrl check-template {re.escape(name + extra)}\n(.*?)```", DOCS, re.DOTALL)
    assert block, f"docs/model-families.md shows no check-template output for {name}{extra}"
    return block.group(1).rstrip("\n")


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(["check-template", *args])
    out = capsys.readouterr().out.rstrip("\n")
    return code, out


def yes_no(value: bool | None) -> str:
    return "yes" if value else "no"


# the families last to first: test_families.py, which CI may run on the other worker at the same time, asks for
# them first to last, and the first to ask for a family copies it (or builds it, where the shipped one is not
# today's: conftest's family_dirs) while anyone else who asks waits
@pytest.mark.parametrize("family", list(FAMILY_MODELS)[::-1])
def test_families_match_the_docs(family, family_dirs, capsys):
    folder = str(family_dirs(family))
    code, out = run(capsys, folder)
    assert code == 0
    assert out.split("\n", 1)[1] == documented_output(f"family-models/{family}")
    _, raw = run(capsys, folder, "--json")
    report = json.loads(raw)
    row = table()[family]
    assert row["chat format"] == report["family"]
    assert row["tool parse"] == yes_no(report["tool_call_round_trip"])
    assert row["reasoning split"].split(" ")[0] == yes_no(report["reasoning_round_trip"])
    assert row["prefix-preserving: tool results"] == yes_no(report["continues_after_tool_results"])
    assert row["prefix-preserving: user turn"] == yes_no(report["continues_after_user_turn"])
    assert row["rows per multi-turn trajectory"] == str(report["rows_per_trajectory"])
    assert row["streaming tool deltas"] == "yes"  # asserted end to end by test_families.py


def test_the_tiny_model_matches_the_docs(tiny_model_dir, capsys):
    code, out = run(capsys, str(tiny_model_dir))
    assert code == 0 and out.split("\n", 1)[1] == documented_output("tiny-model")
    report = json.loads(run(capsys, str(tiny_model_dir), "--json")[1])
    assert table()["(artrl tiny)"]["rows per multi-turn trajectory"] == str(report["rows_per_trajectory"])


def test_template_variables_change_the_report(family_dirs, capsys):
    extra = " --kwargs '{\"enable_thinking\": false}'"
    code, out = run(capsys, str(family_dirs("qwen3")), "--kwargs", '{"enable_thinking": false}')
    assert code == 0 and out.split("\n", 1)[1] == documented_output("family-models/qwen3", extra)
    assert run(capsys, str(family_dirs("qwen3")), "--kwargs", '{"thinking": false}')[0] == 2


def test_a_template_artrl_cannot_train_exits_non_zero(tiny_model_dir, tmp_path, capsys):
    """A template whose assistant turns have no end-of-turn token artrl knows: it cannot delimit them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- m.role + ': ' + (m.content or '') + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
    )
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    code, out = run(capsys, str(tmp_path))
    assert code == 1 and "PROBLEM" in out and "NOT trainable" in out


def test_an_unloadable_model_is_a_clear_error(tmp_path, capsys):
    assert main(["check-template", str(tmp_path / "missing")]) == 2
    assert "could not load the tokenizer" in capsys.readouterr().err
