"""`artrl.Model`: a prompted model that artrl does not train, on any OpenAI-compatible endpoint.

A baseline to compare the trained model with (its evaluations logged in the same project, under its own
name), or the judge of `artrl.rewards.ruler_score_group`. ART's `art.Model`, with the same fields.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Generic

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from artrl.config import ClientConfig
from artrl.model import ModelConfig

if TYPE_CHECKING:
    import openai

    from artrl.model import Backend


class Model(BaseModel, Generic[ModelConfig]):
    """A model served elsewhere (OpenAI, a vLLM server, another artrl gateway), prompted as it is.
    `Model[MyConfig](..., config=MyConfig(...))` carries the user's own settings, as TrainableModel does."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="this model's name in artrl (its folder for logged evaluations)")
    project: str
    config: ModelConfig | None = Field(default=None, description="the user's own settings (ART's `config=`)")
    inference_base_url: str | None = Field(
        default=None, description="the endpoint's base URL (…/v1); None = $OPENAI_BASE_URL, else OpenAI's"
    )
    inference_api_key: str | None = Field(default=None, description="None = $OPENAI_API_KEY")
    inference_model_name: str | None = Field(
        default=None, description="the endpoint's name for the model; None = `name`"
    )
    client: ClientConfig = Field(default_factory=ClientConfig)

    _backend: Backend | None = PrivateAttr(default=None)

    @field_validator("name", "project")
    @classmethod
    def _safe(cls, value: str) -> str:
        from artrl.model import _SAFE_NAME

        if not _SAFE_NAME.match(value):
            raise ValueError(f"{value!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
        return value

    @property
    def trainable(self) -> bool:
        return False

    async def register(self, backend: Backend) -> None:
        """Attach a backend, for `log` (nothing is loaded or served: the endpoint is someone else's)."""
        self._backend = backend

    def get_inference_name(self, step: int | None = None) -> str:
        if step not in (None, 0):
            raise ValueError(
                f"{self.name!r} is a prompted model: it has no step {step} (only its weights as served)"
            )
        return self.inference_model_name or self.name

    def _client_options(self, overrides: dict[str, Any]) -> dict[str, Any]:
        api_key = self.inference_api_key or os.environ.get("OPENAI_API_KEY")
        if api_key is None:
            raise ValueError(
                f"model {self.name!r} has no API key: set inference_api_key= or $OPENAI_API_KEY "
                "(any non-empty string for a local server without keys)"
            )
        options: dict[str, Any] = {
            "api_key": api_key,
            "timeout": self.client.timeout_s,
            "max_retries": self.client.max_retries,
        }
        if self.inference_base_url:
            options["base_url"] = self.inference_base_url
        return {**options, **overrides}

    def openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(**self._client_options(kwargs))

    def openai_sync_client(self, **kwargs: Any) -> openai.OpenAI:
        import openai

        return openai.OpenAI(**self._client_options(kwargs))

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.acompletion` that reach this model."""
        params: dict[str, Any] = {"model": f"openai/{self.get_inference_name(step)}", "temperature": 1.0}
        options = self._client_options({})
        params["api_key"] = options["api_key"]
        if "base_url" in options:
            params["base_url"] = options["base_url"]
        return params

    async def get_step(self) -> int:
        return 0

    async def log(
        self,
        groups: Any = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record this model's evaluation rollouts in its own folder of the project (as TrainableModel.log)."""
        from artrl.model import TrainableModel

        return await TrainableModel.log(self, groups, split, metrics=metrics, step=step)  # type: ignore[arg-type]

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"model {self.name!r}: `await model.register(backend)` before logging")
        return self._backend
