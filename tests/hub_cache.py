"""A Hugging Face hub cache holding a local model folder under a hub id: `from_pretrained("org/name")` then
finds it offline through huggingface_hub's real resolution (HF_HUB_CACHE + HF_HUB_OFFLINE=1), as on a machine
that downloaded it before. No hub is reachable from the test machines."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_model(model_dir: Path, repo_id: str, cache: Path, revision: str = "main") -> dict[str, str]:
    """`model_dir` laid out in `cache` as huggingface_hub leaves a download of `repo_id` at `revision`: each
    file a blob named by its hash, a snapshot of links to the blobs, refs/REVISION naming the snapshot.
    Returns the environment that makes the id resolve there, offline."""
    entry = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()  # (a made-up commit hash)
    blobs, snapshot = entry / "blobs", entry / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(model_dir.iterdir()):
        if file.is_file():
            data = file.read_bytes()
            blob = blobs / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = snapshot / file.name
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(blob, snapshot))
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / revision).write_text(commit)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
