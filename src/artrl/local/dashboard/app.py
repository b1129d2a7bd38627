"""The dashboard's web app: a read-only JSON API over the run folders under a root, and one static page
(plain HTML, CSS and JavaScript shipped in the package: nothing to build at install).

Every request passes the gateway's guard (gateway/guard.py) first: without a key only a loopback name or
address, the bound host or an allowed name as `Host` (a page that rebinds its DNS name to 127.0.0.1 reads
nothing); with a key (`DashboardConfig.api_key`), every /api/ route needs it (the page reads it from its
address, `#curves?key=KEY`, and sends it as a Bearer token).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from artrl.config import DashboardConfig, is_loopback
from artrl.local.dashboard.runs import (
    RunNotFound,
    clean_history,
    conversation,
    find_runs,
    group_summaries,
    read_groups,
    read_spec,
    recorded_steps,
    run_folder,
    run_summary,
    trajectory_at,
)
from artrl.local.dashboard.token_rows import recorded_rows, token_text, trained_rows, view_rows
from artrl.local.gateway.guard import Guard, Rules, TrustedHosts

STATIC = Path(__file__).parent / "static"
PAGES = {"": "index.html", "dashboard.js": "dashboard.js", "dashboard.css": "dashboard.css"}
MEDIA = {"html": "text/html", "js": "text/javascript", "css": "text/css"}


def trajectory_view(
    folder: Path, split: str, step: int, group: int, index: int, max_tokens: int
) -> dict[str, Any]:
    """One trajectory: its conversation(s), reward and metrics, and its rows token by token."""
    traj = trajectory_at(read_groups(folder, split, step), group, index)
    rows = trained_rows(folder, step, group, index) if split == "train" else None
    source = "trained" if rows is not None else "recorded"
    if rows is None:
        rows = recorded_rows(traj)
    text = token_text(folder, read_spec(folder).get("base_model"))
    return {
        "split": split,
        "step": step,
        "group": group,
        "index": index,
        "reward": traj.get("reward"),
        "metrics": traj.get("metrics", {}),
        "metadata": traj.get("metadata", {}),
        "logs": traj.get("logs", []),
        "messages": conversation(traj),
        "additional_histories": [conversation(h) for h in traj.get("additional_histories", [])],
        "rows_source": source,
        "token_text": text.available,
        "rows": view_rows(rows, text, max_tokens),
    }


def _refusal(status: int, message: str, code: str) -> JSONResponse:
    if code == "invalid_api_key":
        message = "this dashboard has a key: open the page as http://HOST:PORT/#curves?key=KEY"
    return JSONResponse({"error": message}, status_code=status)


def create_dashboard_app(root: str | Path, config: DashboardConfig) -> FastAPI:
    root_path = Path(root).resolve()
    app = FastAPI(title="artrl dashboard", docs_url=None, redoc_url=None)
    rules = Rules(
        TrustedHosts(config.host, config.allowed_hosts), _refusal, config.api_key, keyed_paths=("/api/",)
    )
    app.add_middleware(Guard, rules=rules)

    @app.exception_handler(RunNotFound)
    async def not_found(request: Request, exc: RunNotFound) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.get("/api/config")
    async def settings() -> dict[str, Any]:
        return {"root": str(root_path), "poll_interval_s": config.poll_interval_s}

    @app.get("/api/runs")
    async def runs() -> list[dict[str, Any]]:
        found = await asyncio.to_thread(find_runs, root_path)
        return [await asyncio.to_thread(run_summary, run, folder) for run, folder in found.items()]

    @app.get("/api/history")
    async def history(run: str = Query(...)) -> list[dict[str, Any]]:
        return await asyncio.to_thread(clean_history, run_folder(root_path, run))

    @app.get("/api/steps")
    async def steps(run: str = Query(...)) -> dict[str, list[int]]:
        return await asyncio.to_thread(recorded_steps, run_folder(root_path, run))

    @app.get("/api/groups")
    async def groups(run: str = Query(...), split: str = Query(...), step: int = Query(..., ge=0)):
        folder = run_folder(root_path, run)
        return await asyncio.to_thread(lambda: group_summaries(read_groups(folder, split, step)))

    @app.get("/api/trajectory")
    async def trajectory(
        run: str = Query(...),
        split: str = Query(...),
        step: int = Query(..., ge=0),
        group: int = Query(..., ge=0),
        index: int = Query(..., ge=0),
    ) -> dict[str, Any]:
        folder = run_folder(root_path, run)
        return await asyncio.to_thread(
            trajectory_view, folder, split, step, group, index, config.max_tokens_shown
        )

    @app.get("/{page:path}")
    async def static(page: str) -> FileResponse:
        name = PAGES.get(page)
        if name is None:
            raise RunNotFound(f"no page {page!r}")
        return FileResponse(STATIC / name, media_type=MEDIA[name.rsplit(".", 1)[1]])

    return app


def start_dashboard(root: str | Path, config: DashboardConfig):
    """The dashboard on its own thread (returns the running server: `.base_url`, `.stop()`)."""
    from artrl.config import GatewayConfig
    from artrl.local.gateway.server import GatewayServer

    # (the app checks hosts and its key itself: the server's config only says where it listens)
    where = GatewayConfig(  # (a dashboard serves no model: it leaves the process's heap alone)
        host=config.host, port=config.port, allow_unauthenticated=True, freeze_startup_heap=False
    )
    server = GatewayServer(create_dashboard_app(root, config), where)
    server.start(timeout_s=30)
    return server


def run(root: str | Path, config: DashboardConfig) -> None:
    """Serve until interrupted."""
    import uvicorn

    if not Path(root).is_dir():
        raise FileNotFoundError(f"{root} is not a folder: point the dashboard at a LocalBackend's path")
    if not is_loopback(config.host) and config.api_key is None:  # (allow_unauthenticated=True)
        print(f"artrl dashboard: listening on {config.host}: anyone who reaches it can read the trajectories")
    host = f"[{config.host}]" if ":" in config.host else config.host
    page = f"http://{host}:{config.port}/" + ("#curves?key=KEY (its api_key)" if config.api_key else "")
    print(f"artrl dashboard over {Path(root).resolve()}: {page}  (Ctrl-C stops it)")
    uvicorn.run(create_dashboard_app(root, config), host=config.host, port=config.port, log_level="warning")
