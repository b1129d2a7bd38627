"""The dashboard in a real headless browser (Debian's chromium, `bash scripts/setup_browser.sh`): the curves
render, a trajectory opens with its trained tokens highlighted, and a run that is training updates the page
without a reload. Screenshots are saved under the test's tmp folder."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest
from dashboard_browser import CHROMIUM_ARGS, chromium, problems, visit
from two_turn_rollouts import two_turns

import artrl
from artrl.config import DashboardConfig
from artrl.local.dashboard.app import start_dashboard

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_chromium() -> None:
    import os

    if not (os.environ.get("ARTRL_CHROMIUM") or shutil.which("chromium")):
        pytest.fail("no chromium: run `bash scripts/setup_browser.sh` (CI does) or set ARTRL_CHROMIUM")


async def train_step(model, seed: int) -> None:
    group = artrl.TrajectoryGroup(
        await asyncio.gather(*(two_turns(model, seed + i, float(i % 2)) for i in range(4)))
    )
    await model.train([group], artrl.TrainConfig(learning_rate=1e-3))
    await model.log([group], split="val")


async def test_curves_and_a_trajectory_with_trained_tokens(tiny_model_dir, tmp_path):
    async with artrl.LocalBackend(path=tmp_path / "runs") as backend:
        model = artrl.TrainableModel(name="agent", project="browser", base_model=str(tiny_model_dir))
        await model.register(backend)
        for step in range(2):
            await train_step(model, 10 * step)
    server = start_dashboard(tmp_path / "runs", DashboardConfig(port=0))
    try:
        out = tmp_path / "screenshots"
        out.mkdir()
        seen = await asyncio.to_thread(visit, f"http://{server.host}:{server.port}/", out, "browser/agent")
    finally:
        server.stop()
    assert problems(seen) == []
    assert {"train/reward_mean", "val/reward_mean", "train/loss", "train/logprob_mismatch_mean"} <= set(
        seen["metrics"]
    )
    assert "val/turns_mean" in seen["metrics"]  # a metric of the trajectories, as an evaluation logged it
    assert seen["lines"] >= seen["charts"] > 10
    assert (seen["split"], seen["step"]) == ("train", "2")
    assert seen["messages"] == 5 and seen["rows"] == 1
    assert seen["trained_tokens"] > 0 and seen["prompt_tokens"] > 0
    assert "trainer logprob" in seen["token_title"] and "advantage" in seen["token_title"]
    for name in ("curves", "trajectory", "trajectory-advantage", "trajectory-mismatch"):
        assert (out / f"dashboard-{name}.png").stat().st_size > 10_000


def _watch(base: str, opened: threading.Event, result: dict) -> None:
    """Open the curves; once `opened` is set the test trains: wait for a second point and a second run."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page()
            page.goto(f"{base}#curves", timeout=60_000)
            page.wait_for_selector("svg.chart[data-metric='train/reward_mean'] circle", timeout=60_000)
            points = "svg.chart[data-metric='train/reward_mean'] circle"
            result["points_before"] = page.locator(points).count()
            result["runs_before"] = page.locator("#runs li input").count()
            page.evaluate("window.__sameDocument = true")  # gone if the page reloaded
            opened.set()
            page.wait_for_function(
                f'document.querySelectorAll("{points}").length >= 3 '
                "&& document.querySelectorAll('#runs li input').length >= 2",
                timeout=120_000,
            )
            result["points_after"] = page.locator(points).count()
            result["runs_after"] = page.locator("#runs li input").count()
            result["same_document"] = page.evaluate("window.__sameDocument === true")
        finally:
            browser.close()


async def test_a_running_training_updates_the_page_without_reload(tiny_model_dir, tmp_path):
    root: Path = tmp_path / "runs"
    async with artrl.LocalBackend(path=root) as backend:
        model = artrl.TrainableModel(name="agent", project="live", base_model=str(tiny_model_dir))
        await model.register(backend)
        await train_step(model, 0)
        server = start_dashboard(root, DashboardConfig(port=0, poll_interval_s=0.5))
        opened, result = threading.Event(), {}
        try:
            watcher = asyncio.create_task(
                asyncio.to_thread(_watch, f"http://{server.host}:{server.port}/", opened, result)
            )
            assert await asyncio.to_thread(opened.wait, 90), f"the page did not open: {result}"
            await train_step(model, 20)  # a new step of this run...
            other = artrl.TrainableModel(name="second", project="live", base_model=str(tiny_model_dir))
            await other.register(backend)  # ...and a new run
            await train_step(other, 40)
            await watcher
        finally:
            server.stop()
    assert result == {
        "points_before": 1,
        "runs_before": 1,
        "points_after": 3,  # step 2 of the first run, step 1 of the second
        "runs_after": 2,
        "same_document": True,
    }
