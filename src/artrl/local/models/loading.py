"""Loading a base model and its tokenizer: a hub id or any local Hugging Face folder, one code path."""

from __future__ import annotations

import threading
from typing import Any

import torch

from artrl.config import EngineConfig, LoadConfig

# transformers builds a model under a process-wide "meta device" context (and PEFT wraps modules likewise): two
# models loading at once in one process (two `register` calls gathered) corrupt each other ("Cannot copy out
# of meta tensor"). Loading takes this lock; serving and training never do.
LOADING = threading.Lock()


def pick_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model_and_tokenizer(
    base_model: str, config: EngineConfig, weights_from: str | None = None
) -> tuple[Any, Any]:
    """`base_model` is what `from_pretrained` takes: a folder (e.g. from `artrl tiny-model`) or a hub id.

    `weights_from` (a full-weights checkpoint folder) replaces the base weights; the tokenizer stays the base's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = pick_device(config)
    dtype = pick_dtype(config, device)
    options = model_options(config, device, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_model, **tokenizer_options(config.load))
        model = AutoModelForCausalLM.from_pretrained(weights_from or base_model, dtype=dtype, **options)
    except OSError as exc:
        raise ValueError(
            f"could not load base_model={base_model!r}: {exc}. Give a Hugging Face model folder "
            "(build one offline with `artrl tiny-model DIR`) or a hub id this machine can download."
        ) from exc
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"{base_model!r} ships its own model code; load it only if you trust it, with "
            "EngineConfig(load=artrl.LoadConfig(trust_remote_code=True))"
        ) from None
    if tokenizer.chat_template is None:
        raise ValueError(f"{base_model!r} has no chat template; artrl trains chat models")
    if "device_map" in options:  # placed by accelerate (or bitsandbytes)
        check_placement(model, config)
    else:
        model.to(device)
    model.eval()
    if config.cpu_attention and config.load.attn_implementation is None:  # for generation and training
        from artrl.local.kernels.cpu_attention import use_cpu_attention

        use_cpu_attention(model)
    return model, tokenizer


def tokenizer_options(load: LoadConfig) -> dict[str, Any]:
    return {"revision": load.revision, "trust_remote_code": load.trust_remote_code}


def model_options(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """`from_pretrained` keyword arguments from the engine's LoadConfig (ValueError for a setting this
    machine cannot honour, saying what would)."""
    load = config.load
    options: dict[str, Any] = tokenizer_options(load)
    # transformers (>= 5.24) swaps layers for the hub's `kernels` package by default on CUDA, and refuses to
    # load when that package is missing: artrl runs the model's own layers (and its own fused ones), which
    # its logprob parity is tested against, and a hub kernel would need a download besides
    options["use_kernels"] = False
    if load.attn_implementation is not None:
        options["attn_implementation"] = load.attn_implementation
    if load.quantization == "4bit":
        if device.type != "cuda":
            raise ValueError(
                f"LoadConfig(quantization='4bit') needs a CUDA GPU (bitsandbytes' NF4 kernels); this engine runs "
                f"on {device.type}. On a CPU use EngineConfig(dtype='bfloat16') to halve the weights' memory"
            )
        import importlib.util

        from transformers import BitsAndBytesConfig

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("LoadConfig(quantization='4bit') needs bitsandbytes: pip install bitsandbytes")
        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        options["device_map"] = {"": device.index or 0}
    if load.device_map is not None:
        options["device_map"] = load.device_map
    return options


def check_placement(model: Any, config: EngineConfig) -> None:
    """A model that `device_map` spread over several devices serves only through vLLM: the embedded engine
    keeps its batch's keys and values on one device (ValueError saying what to do)."""
    devices = {str(p.device) for p in model.parameters()} | {
        str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()
    }
    if config.kind == "hf" and len(devices) > 1:
        raise ValueError(
            f"LoadConfig(device_map=...) put the model on {sorted(devices)}; the embedded engine generates on "
            "one device. Serve it with EngineConfig(kind='vllm') (its tensor_parallel_size spreads vLLM's copy; "
            "device_map then places the trainer's), or give a device_map that keeps it on one device"
        )


def load_tokenizer(model: str, **hub_options: Any) -> Any:
    """The tokenizer of a model folder or hub id (ValueError with what to do when it cannot be loaded);
    `hub_options`: from_pretrained's `revision`, `trust_remote_code`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, **hub_options)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load the tokenizer of {model!r}: {exc}") from None


def stop_ids_of(model: str, revision: str | None = None) -> list[int]:
    """The model's own stop tokens: generation_config.json's eos_token_id (none if it has no such file)."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(model, revision=revision).eos_token_id
    except (OSError, ValueError):
        return []
    return configured if isinstance(configured, list) else [] if configured is None else [configured]


def context_length(model: Any, config: EngineConfig) -> int:
    model_max = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if config.max_context is not None:
        return min(config.max_context, model_max) if model_max else config.max_context
    if not model_max:
        raise ValueError("the model config has no max_position_embeddings; set EngineConfig(max_context=...)")
    return model_max


def end_of_turn_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a completion: the tokenizer's eos plus the model's generation_config eos ids (the
    chat format adds its family's stop tokens)."""
    ids = {tokenizer.convert_tokens_to_ids(tokenizer.eos_token)} if tokenizer.eos_token is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [] if configured is None else [configured])
    return frozenset(ids)
