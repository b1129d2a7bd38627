"""The model names a gateway answers to: the model's name, whatever step it serves now, and `name@step`,
which pins a request to one step (an evaluation that must not drift to newer weights mid-way).

The served step starts at the step the weights were loaded from (0 = the base model) and moves when
training publishes a new checkpoint (`LocalService.weights_updated`). Only the step being served answers:
neither engine keeps older weights to generate with, so `name@older` is a 404 that says how to serve it.
"""

from __future__ import annotations

from typing import Any

from artrl.local.gateway.protocol import RequestError


class ServedNames:
    def __init__(self, names: list[str], step: int = 0) -> None:
        self.names = list(names)
        self.step = step  # read by the gateway's thread, set by the trainer's wiring (one int: atomic)

    def check(self, requested: str) -> bool:
        """Accept `requested` (True: pinned to the step served, `name@step`) or raise the 404 that says
        what is served."""
        step = self.step  # read once: a publish may move it meanwhile
        if requested in self.names:
            return False
        if requested in (f"{n}@{step}" for n in self.names):
            return True
        base, at, suffix = requested.rpartition("@")
        if at and base in self.names:
            if not suffix.isdigit():
                message = f"model {requested!r}: a step is a number, as in '{base}@{step}'"
            else:
                asked = int(suffix)
                message = (
                    f"step {asked} of {base!r} is not served here: this gateway serves step {step} "
                    f"(as {base!r} or '{base}@{step}'). "
                    + (
                        f"To evaluate an older step, serve its checkpoint: `artrl serve RUN_DIR --step {asked}`"
                        if asked < step
                        else f"Step {asked} is not trained yet."
                    )
                )
        else:
            message = f"model {requested!r} is not served here; available: {self.listed()}"
        raise RequestError(message, param="model", code="model_not_found", status=404)

    def listed(self) -> list[str]:
        step = self.step
        return [x for n in self.names for x in (n, f"{n}@{step}")]

    def entries(self) -> list[dict[str, Any]]:
        """/v1/models `data`: each name, then its pinned alias (with `parent`, as vLLM lists adapters)."""
        step = self.step
        out: list[dict[str, Any]] = []
        for name in self.names:
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "artrl"})
            pinned = {"id": f"{name}@{step}", "object": "model", "created": 0, "owned_by": "artrl"}
            out.append({**pinned, "root": name, "parent": name})
        return out
