"""`TrainableModel`: the user's handle on a model that artrl serves (and later trains)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

import artrl.art_names as art_names
from artrl.config import (
    CheckpointRetention,
    ClientConfig,
    LoraConfig,
    SFTConfig,
    TrackerName,
    TrainConfig,
)
from artrl.random_ids import random_hex
from artrl.sdk_http import httpx_package
from artrl.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import openai

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ModelConfig = TypeVar("ModelConfig")  # the user's own settings of a model (ART's typed config)


class Backend(Protocol):
    """What a model needs from a backend (the local one today; others later)."""

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        """Serve the model; return (OpenAI base URL, API key)."""
        ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> TrainResult: ...

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> TrainResult: ...

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]: ...

    async def export(self, model: TrainableModel, directory: str) -> None:
        """Write the current weights (and tokenizer) as a Hugging Face folder."""
        ...

    async def delete_checkpoints(self, model: TrainableModel, retention: CheckpointRetention) -> list[int]:
        """Delete the checkpoints `retention` does not keep (never the latest); return the deleted steps."""
        ...

    async def close(self) -> None: ...

    def client_transport(self, model: TrainableModel, sync: bool = False, httpx: Any = None) -> Any:
        """An httpx transport (async, or `sync`) that reaches the model's server without the network (same
        process), or None: clients use HTTP. `httpx`: the package of the client it is for (`httpx` or
        `httpx2`, artrl.sdk_http.httpx_package; None: the openai SDK's)."""
        ...


class TrainResult(BaseModel):
    step: int  # the step just completed (its checkpoint is saved)
    metrics: dict[str, float | int]


def config_json(config: Any) -> Any:
    """A model's own settings (`TrainableModel(config=...)`) as JSON: a pydantic model dumped, else as given
    when JSON can hold it, else its repr."""
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError):
        return repr(config)


class TrainableModel(BaseModel, Generic[ModelConfig]):
    """A model artrl serves and trains. `TrainableModel[MyConfig](..., config=MyConfig(...))` carries the
    user's own settings (ART's typed config) as `model.config`, kept in the run's model.json and the
    trackers' run config."""

    model_config = ConfigDict(extra="forbid")

    name: str
    project: str
    base_model: str = Field(description="Hugging Face hub id or local model folder")
    config: ModelConfig | None = Field(
        default=None, description="the user's own settings (a pydantic model or a dict), as ART's `config=`"
    )
    lora: LoraConfig | None = Field(
        default_factory=LoraConfig, description="the trained adapter; None = full fine-tuning (small models)"
    )
    client: ClientConfig = Field(default_factory=ClientConfig)
    chat_format: str | None = Field(
        default=None,
        description="the model family's chat format (hermes, qwen3, qwen3_5, llama3_json, gpt_oss, glm4_moe, gemma4, "
        "plain); None = detected from the tokenizer's chat template (`artrl check-template` shows which)",
    )
    report_to: tuple[TrackerName, ...] = Field(
        default=(),
        description="experiment trackers that receive every history row: 'wandb' (WANDB_MODE=offline works), "
        "'tensorboard', 'trackio' (each an optional install: pip install 'artrl[trackers]')",
    )
    retention: CheckpointRetention | None = Field(
        default=None, description="checkpoints kept after every step; None = all of them"
    )

    _backend: Backend | None = PrivateAttr(default=None)
    _base_url: str | None = PrivateAttr(default=None)
    _api_key: str = PrivateAttr(default="artrl")
    # one AsyncOpenAI per event loop (an httpx pool belongs to the loop that made it)
    _clients: weakref.WeakKeyDictionary = PrivateAttr(default_factory=weakref.WeakKeyDictionary)

    @model_validator(mode="before")
    @classmethod
    def _art_lora_config(cls, data: Any) -> Any:
        """ART's `lora_config=` (a LoraConfig, or PEFT's names: r, lora_alpha, ...) is artrl's `lora=`."""
        if isinstance(data, dict) and "lora_config" in data:
            if "lora" in data:
                raise ValueError("give lora= or lora_config= (ART's name for it), not both")
            data = dict(data)
            data["lora"] = art_names.lora_config(data.pop("lora_config"))
        return data

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, value: Any) -> Any:
        """`report_to="wandb"` (TRL's string form) is `("wandb",)`; "none" is none."""
        if isinstance(value, str):
            return () if value == "none" else (value,)
        return value

    @field_validator("name", "project")
    @classmethod
    def _safe(cls, value: str) -> str:
        if not _SAFE_NAME.match(value):
            raise ValueError(
                f"{value!r} must be 1-128 characters of letters, digits, '.', '_' or '-' "
                "(it names a folder and the served model)"
            )
        return value

    async def register(self, backend: Backend) -> None:
        """Load the model in `backend` and start serving it."""
        self._base_url, self._api_key = await backend.register(self)
        self._backend = backend
        self._clients.clear()  # (a client of an earlier registration may hold a transport to a stopped server)

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered: `await model.register(backend)` first"
            )
        return self._backend

    @property
    def trainable(self) -> bool:
        return True

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model` to request: the name (the weights of the latest step), or `name@step`, which the gateway
        answers only while it serves that step (ART's name for it)."""
        return self.name if step is None else f"{self.name}@{step}"

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.acompletion` that reach this model (litellm's OpenAI-compatible route)."""
        return {
            "model": f"openai/{self.get_inference_name(step)}",
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key,
            "temperature": 1.0,
        }

    @property
    def inference_base_url(self) -> str:
        self._require_backend()
        assert self._base_url is not None
        return self._base_url

    @property
    def inference_api_key(self) -> str:
        self._require_backend()
        return self._api_key

    def _client_options(self, overrides: dict[str, Any]) -> dict[str, Any]:
        return {
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key,
            "timeout": self.client.timeout_s,
            "max_retries": self.client.max_retries,
            **overrides,
        }

    def openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` bound to the served model (keyword arguments override the defaults).

        Without keyword arguments, calls from the same event loop share one client and its connection pool:
        building a client costs tens of milliseconds (an SSL context), which a rollout per call would pay.
        Its calls made inside an `artrl.capture(model)` block are recorded there (an httpx request hook adds
        the capture's header; unless you pass your own `http_client`).
        """

        options = self._client_options(kwargs)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if kwargs or loop is None:
            return _clients()[0](**self._with_capture_hook(options, async_client=True))
        key = (options["base_url"], options["api_key"])
        cached = self._clients.get(loop)
        if cached is None or cached[0] != key or cached[1].is_closed():  # closed by `async with`
            client = _clients()[0](**self._with_capture_hook(options, async_client=True))
            cached = self._clients[loop] = (key, client)
        return cached[1]

    def openai_sync_client(self, **kwargs: Any) -> openai.OpenAI:
        """The synchronous twin of `openai_client`, for agent code that is not async (recorded by an
        `artrl.capture` block too, including from `asyncio.to_thread`, which copies the context)."""
        return _clients()[1](**self._with_capture_hook(self._client_options(kwargs), async_client=False))

    def anthropic_client(self, **kwargs: Any) -> Any:
        """An `anthropic.AsyncAnthropic` bound to the served model (the gateway's `/v1/messages`), recorded
        by `artrl.capture` blocks like `openai_client()`'s calls (`pip install anthropic`)."""
        import anthropic

        # its own SDK's HTTP client: anthropic and openai may build on different httpx packages (httpx, httpx2)
        options = self._with_capture_hook(self._client_options(kwargs), async_client=True, sdk=anthropic)
        options["base_url"] = options["base_url"].removesuffix("/").removesuffix("/v1")
        return anthropic.AsyncAnthropic(**options)

    def _with_capture_hook(
        self, options: dict[str, Any], async_client: bool, sdk: Any = None
    ) -> dict[str, Any]:
        """Options with `sdk`'s own HTTP client (openai's by default) whose request hook tags calls made inside
        `artrl.capture` blocks; a client of this model's own server in this process goes without the network
        (in_process.py)."""
        if "http_client" in options:
            return options
        if sdk is None:
            import openai as sdk

        from artrl.capturing.block import tag_request, tag_request_async

        client_class = sdk.DefaultAsyncHttpxClient if async_client else sdk.DefaultHttpxClient
        transport = None
        if options["base_url"] == self._base_url and self._backend is not None:
            httpx = httpx_package(client_class)  # (anthropic and openai may build on different ones)
            transport = self._backend.client_transport(self, sync=not async_client, httpx=httpx)
        extra = {} if transport is None else {"transport": transport}
        hook = tag_request_async if async_client else tag_request
        return {**options, "http_client": client_class(event_hooks={"request": [hook]}, **extra)}

    async def get_step(self) -> int:
        """The latest training step of this model (0 before any training)."""
        return await self._require_backend().get_step(self)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> TrainResult:
        """GRPO on scored groups: one optimizer step (see TrainConfig), a checkpoint, a history row.

        The served model is the updated one as soon as this returns (and, with the embedded engine, from the
        next generated token on). `_config` takes ART's `art.dev.TrainConfig` keys (see artrl.art_names);
        `verbose` is ART's and changes nothing.
        """
        config = art_names.train_config(config, dict(_config or {}))
        return await self._require_backend().train(self, list(groups), config)

    async def train_sft(self, trajectories: list[Trajectory], config: SFTConfig | None = None) -> TrainResult:
        """Supervised fine-tuning on the assistant tokens of `trajectories` (recorded ids where the gateway
        sampled them, the chat template's assistant mask otherwise): a warm start before RL."""
        return await self._require_backend().train_sft(self, list(trajectories), config or SFTConfig())

    async def export(self, directory: str) -> None:
        """Save the current weights + tokenizer as a Hugging Face folder (see LocalBackend.export)."""
        await self._require_backend().export(self, directory)

    async def delete_checkpoints(
        self,
        keep_last: int | None = 1,
        keep_best: str | None = None,
        best_mode: Literal["max", "min"] = "max",
        *,
        best_checkpoint_metric: str | None = None,
    ) -> list[int]:
        """Delete checkpoints but the newest `keep_last` and the best by `keep_best` ('split/metric' of the
        history, e.g. 'val/reward_mean'); the latest is always kept. Returns the deleted steps.
        `best_checkpoint_metric` is ART's name for `keep_best` (its 'val/reward' is artrl's 'val/reward_mean')."""
        if isinstance(keep_last, str):
            raise TypeError(
                f"delete_checkpoints({keep_last!r}): the first argument is keep_last (a count); pass the metric "
                "as keep_best= (or best_checkpoint_metric=, ART's name)"
            )
        if best_checkpoint_metric is not None:
            if keep_best is not None:
                raise ValueError("give keep_best= or best_checkpoint_metric= (ART's name for it), not both")
            keep_best = art_names.history_metric(best_checkpoint_metric)
        retention = CheckpointRetention(keep_last=keep_last, keep_best=keep_best, best_mode=best_mode)
        return await self._require_backend().delete_checkpoints(self, retention)

    async def log(
        self,
        groups: Iterable[TrajectoryGroup | Trajectory | BaseException] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record evaluation rollouts (trajectories + a history row at the current step) without training.

        As in ART: `groups` may be groups, or trajectories (and exceptions) that form one group, or None with
        only `metrics` (added to the row as '<split>/<name>'); `step` places the row (default: the current)."""
        if not _SAFE_NAME.match(split):
            raise ValueError(f"split {split!r} must be letters, digits, '.', '_' or '-'")
        items = list(groups or [])
        if items and not all(isinstance(g, TrajectoryGroup) for g in items):
            items = [TrajectoryGroup(items)]  # (a TypeError names an item that is neither)
        if not items and not metrics:
            raise ValueError("nothing to log: give trajectories or groups, or metrics=")
        return await self._require_backend().log(self, items, split, metrics=metrics, step=step)


@functools.cache
def _clients() -> tuple[type[openai.AsyncOpenAI], type[openai.OpenAI]]:
    """openai's two clients, whose retry idempotency keys are made without a system call (each request's
    `uuid4` released the interpreter lock to the engine thread for up to 5 ms; see artrl.random_ids)."""
    import openai

    class _Keys:
        def _idempotency_key(self) -> str:
            return f"artrl-retry-{random_hex()}"

    class AsyncOpenAI(_Keys, openai.AsyncOpenAI):
        pass

    class OpenAI(_Keys, openai.OpenAI):
        pass

    return AsyncOpenAI, OpenAI
