"""What a program that set up no logging sees of long work: artrl's INFO lines on stderr (a model loading,
vLLM starting) and a bar for each training call, through one facility (artrl.progress_bar); nothing added
where the program configured logging itself or said ARTRL_LOG_LEVEL=off. In fresh interpreters: pytest's own
logging setup would hide what a plain script gets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SAY = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.ERROR)
from artrl.log_handler import ensure_log_handler
ensure_log_handler(); ensure_log_handler()
logging.getLogger("artrl.local.somewhere").info("an info line")
logging.getLogger("artrl.local.somewhere").warning("a warning line")
"""


def said(how: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SAY, how],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_artrl_says_what_it_does_unless_the_program_set_up_logging_or_said_off():
    lines = said("plain").splitlines()
    assert len(lines) == 2 and "INFO" in lines[0] and lines[0].endswith("an info line")  # once, not twice
    assert said("plain", ARTRL_LOG_LEVEL="warning").strip().endswith("a warning line")
    assert "an info line" not in said("plain", ARTRL_LOG_LEVEL="WARNING")
    assert (
        said("plain", ARTRL_LOG_LEVEL="off") == "a warning line\n"
    )  # (Python's own default: warnings, bare)
    assert "is not a level" in said("plain", ARTRL_LOG_LEVEL="loud")
    # the program's own configuration wins: its ERROR level, its format, no second handler
    assert said("configured") == ""


TRAIN = """
import asyncio, sys
import artrl

async def main(base):
    async with artrl.LocalBackend(path=sys.argv[2], trainer=artrl.TrainerConfig(progress=True)) as backend:
        model = artrl.TrainableModel(name="bar", project="p", base_model=base)
        await model.register(backend)
        client = model.openai_client()
        ask = [{"role": "user", "content": "hi"}]
        choices = [(await client.chat.completions.create(model="bar", messages=ask, max_tokens=4, seed=i)).choices[0]
                   for i in range(2)]
        group = artrl.TrajectoryGroup(artrl.Trajectory(messages_and_choices=[*ask, c], reward=r)
                                      for c, r in zip(choices, (0.0, 1.0)))
        await model.train([group])

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.slow
def test_loading_and_each_training_call_show_progress_on_stderr(tiny_model_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TRAIN, str(tiny_model_dir), str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "artrl INFO" in err and f"loading {tiny_model_dir}" in err and "loaded in" in err
    # the call's bar with its rows, shown done when the call ends (its phases in between: when it lasts)
    assert "bar step 1 (" in err and "| 2/2 [" in err, err[-2000:]
