"""`artrl env`: what a bug report needs to say about this machine and its packages (versions, devices),
read without importing anything heavy but torch (for its devices)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = (
    "artrl",
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "openai",
    "anthropic",
    "httpx",
    "tinker",
    "langchain-openai",
    "trl",
    "vllm",
)


def environment(vllm_python: str | None = None) -> dict[str, Any]:
    """Python, the platform, the CPU count this process may use, each package's version (None: not
    installed), torch's devices, and vLLM in its own environment (`vllm_python`, default .venv-vllm's)."""
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES},
    }
    try:
        import torch

        report["torch_devices"] = {
            "cuda": torch.cuda.is_available(),
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "cuda_version": torch.version.cuda,
            "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        }
    except ImportError:
        report["torch_devices"] = None
    report["vllm_environment"] = _vllm_version(vllm_python or ".venv-vllm/bin/python")
    return report


def as_text(report: dict[str, Any]) -> str:
    lines = [f"{key}: {report[key]}" for key in ("python", "platform", "cpus_usable")]
    lines += [f"{name}: {version or '-'}" for name, version in report["packages"].items()]
    lines.append(f"torch devices: {report['torch_devices']}")
    lines.append(f"vLLM's own environment: {report['vllm_environment'] or '-'}")
    return "\n".join(lines)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_version(python: str) -> str | None:
    """vLLM's version in its own environment (where artrl starts its servers), or None."""
    if not (Path(python).exists() or shutil.which(python)):
        return None
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__, end='')"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"vllm {done.stdout} ({python})" if done.returncode == 0 else None
