"""The base of every config: frozen (a config is a value), and a misspelt keyword is an error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
