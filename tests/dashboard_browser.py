"""Open `artrl dashboard` over PATH in headless Chromium, check what it shows, and save screenshots (used by
tests/local/dashboard/test_dashboard_browser.py, and to make the screenshots in docs/dashboard.md):

    .venv/bin/python tests/dashboard_browser.py --path .artrl --out docs/images

It starts the dashboard on a free loopback port, loads the curves of every run, then opens the best
trajectory of the latest train step and colours its tokens by mask, advantage and mismatch. It prints what
it saw as JSON (charts, lines, rows, trained tokens...) and exits 1 when a page did not show what it should.
Chromium: Debian's (`bash scripts/setup_browser.sh`), or $ARTRL_CHROMIUM; driven by the playwright package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from artrl.config import DashboardConfig
from artrl.local.dashboard.app import start_dashboard

CHROMIUM_ARGS = [  # a closed network: no background connections, no sandbox as root
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    found = os.environ.get("ARTRL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        sys.exit("no chromium: run `bash scripts/setup_browser.sh` or set ARTRL_CHROMIUM")
    return found


def launch(p):
    return p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, timeout=60_000)


def visit(base: str, out: Path, run: str | None) -> dict:
    """Walk the pages in Chromium; what each showed."""
    from playwright.sync_api import sync_playwright

    seen: dict = {}
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            curves(page, base, out, seen)
            trajectory(page, out, run, seen)
        except Exception as exc:  # a selector that never appeared: say what the page said
            raise RuntimeError(f"{exc}\nJavaScript errors on the page: {errors}") from None
        finally:
            browser.close()
    seen["page_errors"] = errors
    return seen


def curves(page, base: str, out: Path, seen: dict) -> None:
    page.goto(f"{base}#curves", timeout=60_000)
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    page.wait_for_selector("svg.chart path.line", state="attached", timeout=30_000)
    seen["runs"] = page.locator("#runs li input[type=checkbox]").count()
    seen["charts"] = page.locator("svg.chart").count()
    seen["lines"] = page.locator("svg.chart path.line").count()
    seen["metrics"] = page.locator("svg.chart").evaluate_all("els => els.map(e => e.dataset.metric)")
    page.screenshot(path=str(out / "dashboard-curves.png"))


def trajectory(page, out: Path, run: str | None, seen: dict) -> None:
    """Open a run, its latest step's best trajectory, and colour its tokens each way."""
    run = run or page.locator("#runs li a").first.inner_text()
    page.locator("#runs li a", has_text=run).first.click()
    page.wait_for_selector(".traj-link", timeout=30_000)
    seen["split"] = page.locator("#traj-split").input_value()
    seen["step"] = page.locator("#traj-step").input_value()
    seen["groups"] = page.locator(".group").count()
    page.locator(".traj-link").first.click()
    page.wait_for_selector(".row-card .token", timeout=30_000)
    seen["messages"] = page.locator("#conversation .msg").count()
    seen["rows"] = page.locator(".row-card").count()
    seen["trained_tokens"] = page.locator(".token.trained").count()
    seen["prompt_tokens"] = page.locator(".token.prompt").count()
    seen["highlighted"] = page.locator(".token.trained").evaluate_all(
        "els => els.filter(e => e.style.background !== '').length"
    )
    seen["token_title"] = page.locator(".token.trained").first.get_attribute("title")
    page.screenshot(path=str(out / "dashboard-trajectory.png"))
    for mode in ("advantage", "mismatch"):
        page.select_option("#colour-by", mode)
        page.wait_for_selector(".row-card .token", timeout=10_000)
        page.screenshot(path=str(out / f"dashboard-trajectory-{mode}.png"))
    seen["url"] = page.url


def problems(seen: dict) -> list[str]:
    wrong = []
    if not seen["charts"] or not seen["lines"]:
        wrong.append("no curves drawn")
    if not seen["groups"]:
        wrong.append("no groups listed")
    if not seen["messages"]:
        wrong.append("the trajectory's conversation is empty")
    if not seen["trained_tokens"] or seen["highlighted"] != seen["trained_tokens"]:
        wrong.append("trained tokens are not all highlighted")
    if seen["page_errors"]:
        wrong.append(f"JavaScript errors: {seen['page_errors']}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="a LocalBackend's folder (or one run's)")
    parser.add_argument("--out", required=True, help="folder for the PNG screenshots")
    parser.add_argument("--run", default=None, help="the run to open (default: the first listed)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = start_dashboard(args.path, DashboardConfig(port=0, poll_interval_s=1.0))
    try:
        seen = visit(f"http://{server.host}:{server.port}/", out, args.run)
    finally:
        server.stop()
    wrong = problems(seen)
    print(json.dumps({**seen, "problems": wrong}, indent=2))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
