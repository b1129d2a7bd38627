"""`artrl export|merge ... --push-to-hub REPO`: the folder just written, uploaded to a Hugging Face hub repo
(created when missing) with huggingface_hub: its token (`HF_TOKEN`, or `hf auth login`) and endpoint
(`HF_ENDPOINT`) as for any hub call. The folder stays written whatever becomes of the upload; every failure
is one `RunError` saying what to do."""

from __future__ import annotations

import os
from pathlib import Path

from artrl.local.runs.run_folder import RunError

READ_TIMEOUT_S, CONNECT_TIMEOUT_S = (
    120.0,
    10.0,
)  # (per read and per connection: an upload takes what it takes)


def use_hub_timeouts() -> None:
    """huggingface_hub's HTTP client waits for ever by default: its own setting gives this process's hub calls
    per-read and per-connection timeouts. A process-wide setting, so the CLI (a process of its own) makes it,
    not `push_folder` (a library caller keeps its own)."""
    import httpx2  # (huggingface_hub's HTTP client)
    from huggingface_hub import set_client_factory

    def with_timeouts() -> httpx2.Client:
        return httpx2.Client(
            follow_redirects=True, timeout=httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        )

    set_client_factory(with_timeouts)


def push_folder(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Upload `folder` to `repo_id` (a model repo); the URL of the commit."""
    import httpx2  # (huggingface_hub's HTTP client)
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    again = f"the folder {folder} is written: push it again with `hf upload {repo_id} {folder}`"
    if constants.HF_HUB_OFFLINE:
        raise RunError(f"cannot push to {repo_id}: the hub is off (HF_HUB_OFFLINE=1); {again}")

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    except (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError) as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        why = " (no or a wrong token: set HF_TOKEN or run `hf auth login`)" if status in (401, 403) else ""
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RunError(f"could not push to {repo_id}: {first}{why}; {again}") from None
    return str(commit)
