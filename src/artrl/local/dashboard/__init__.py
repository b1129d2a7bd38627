"""`artrl dashboard PATH`: a local web page over the runs under PATH (curves, trajectories, training rows)."""

from __future__ import annotations

from artrl.config import DashboardConfig


def serve_dashboard(path: str, config: DashboardConfig | None = None) -> None:
    """Serve the dashboard over the runs under `path` until interrupted (blocking)."""
    from artrl.local.dashboard.app import run

    run(path, config or DashboardConfig())
