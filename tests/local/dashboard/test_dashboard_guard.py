"""Who can read the dashboard (issue 43, item 6): it shows every trajectory, so a web page that rebinds its
DNS name to 127.0.0.1 reads nothing, and it listens beyond loopback only with a key (as the gateway does),
which its page then sends."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from artrl.config import DashboardConfig
from artrl.local.dashboard.app import start_dashboard


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(**config):
        server = start_dashboard(tmp_path, DashboardConfig(port=0, **config))
        servers.append(server)
        return f"http://{server.host}:{server.port}"

    yield start
    for server in servers:
        server.stop()


def test_a_rebound_name_reads_nothing(serve):
    base = serve()
    port = base.rsplit(":", 1)[1]
    with httpx.Client(base_url=base, timeout=30) as client:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
            for path in ("/api/runs", "/api/config", "/"):
                refused = client.get(path, headers={"host": host})
                assert refused.status_code == 421, (host, path, refused.text)
                assert "does not answer for Host" in refused.json()["error"]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]"):
            assert client.get("/api/runs", headers={"host": host}).json() == []


def test_beyond_loopback_the_dashboard_needs_a_key(monkeypatch):
    monkeypatch.delenv("ARTRL_DASHBOARD_KEY", raising=False)
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(ValueError, match=r"api_key=.*allow_unauthenticated=True"):
            DashboardConfig(host=host)
        assert DashboardConfig(host=host, api_key="k").api_key == "k"
        assert DashboardConfig(host=host, allow_unauthenticated=True).host == host
    assert DashboardConfig().api_key is None
    monkeypatch.setenv(
        "ARTRL_DASHBOARD_KEY", "from-env"
    )  # (`artrl dashboard --host ...` takes it from there)
    assert DashboardConfig(host="0.0.0.0").api_key == "from-env"


def test_with_a_key_the_api_needs_it_and_the_page_does_not(serve):
    base = serve(api_key="sekret")
    with httpx.Client(base_url=base, timeout=30) as client:
        refused = client.get("/api/runs")
        assert refused.status_code == 401 and "#curves?key=KEY" in refused.json()["error"]
        assert client.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        keyed = {"Authorization": "Bearer sekret"}
        assert client.get("/api/runs", headers=keyed).json() == []
        # the key decides: any Host may carry it (a rebound page cannot)
        assert client.get("/api/runs", headers={**keyed, "host": "gpu-box.example"}).status_code == 200
        assert client.get("/").status_code == 200  # the page itself holds no data


@pytest.mark.slow
async def test_the_page_sends_the_key_from_its_address(serve):
    import os

    if not (os.environ.get("ARTRL_CHROMIUM") or shutil.which("chromium")):
        pytest.fail("no chromium: run `bash scripts/setup_browser.sh` (CI does) or set ARTRL_CHROMIUM")
    from dashboard_browser import launch
    from playwright.sync_api import sync_playwright

    base = serve(api_key="sekret")

    def visit(address: str) -> tuple[str, str]:
        with sync_playwright() as p:
            browser = launch(p)
            try:
                page = browser.new_page()
                page.goto(address, timeout=60_000)
                page.wait_for_selector("body[data-ready='1'], p.error", timeout=60_000)
                errors = page.locator("p.error").all_inner_texts()
                return " ".join(errors), page.url
            finally:
                browser.close()

    errors, url = await asyncio.to_thread(visit, f"{base}/#curves?key=sekret")
    assert errors == ""
    assert "sekret" not in url  # kept by the tab, not in its address
    errors, _ = await asyncio.to_thread(visit, f"{base}/#curves")
    assert "this dashboard has a key" in errors
