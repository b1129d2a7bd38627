"""`artrl server BASE_MODEL`: the training server in the foreground, until Ctrl-C (or SIGTERM), after which
every hosted model's engine, gateway and trainer is closed."""

from __future__ import annotations

from collections.abc import Callable

from artrl.config import EngineConfig, ServerConfig
from artrl.local.server.app import create_server_app
from artrl.local.server.hosted import HostedModels
from artrl.local.server.tenants import Tenants


def run_server(config: ServerConfig, engine: EngineConfig, say: Callable[[str], None] = print) -> None:
    import uvicorn

    tenants = Tenants.from_file(config.keys)  # (a bad keys file fails here, before anything starts)
    app = create_server_app(HostedModels(config, engine), tenants)
    who = "keys from " + config.keys if config.keys else "no keys: every caller is tenant 'default'"
    say(
        f"artrl server: trains models on {config.base_model} at http://{config.host}:{config.port} "
        f"({who}; run folders under {config.path}). Clients: artrl.RemoteBackend(url, api_key=...)"
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=30)
