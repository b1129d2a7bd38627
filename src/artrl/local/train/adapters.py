"""A model's LoRA adapter: attached (PEFT), saved as a checkpoint's weights, loaded back. A model may hold
several adapters by name (a training server's models on one base copy): saving and loading act on its
active one, in the files a model holding only it would have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artrl.config import LoraConfig


def attach_adapter(model: Any, lora: LoraConfig | None, name: str = "default") -> Any:
    """Wrap `model` with a fresh LoRA adapter named `name` (None = full fine-tuning: every weight trainable)."""
    if lora is None:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora), adapter_name=name)


def add_adapter(model: Any, lora: LoraConfig, name: str) -> None:
    """One more fresh adapter on a PeftModel, named `name`, made the active one (trainable; the others not)."""
    model.add_adapter(name, peft_config(lora))
    model.set_adapter(name)


def peft_config(lora: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def save_weights(model: Any, directory: str) -> None:
    """The model's weights into `directory`: its active adapter in PEFT's format (the one adapter of a model
    holding several, as a model holding only it would save it), or the full weights."""
    adapter = getattr(model, "active_adapter", None)
    # (PEFT's "auto" asks the hub for the base's config.json at every save of a hub id's adapter, to find a
    # resized vocabulary: artrl never resizes it, and a step's checkpoint makes no network call)
    peft = {"save_embedding_layers": False} if hasattr(model, "peft_config") else {}
    if adapter is None or adapter == "default":
        model.save_pretrained(directory, **peft)
        return
    model.save_pretrained(directory, selected_adapters=[adapter], **peft)  # (into directory/{adapter}/)
    inner = Path(directory) / adapter
    for file in inner.iterdir():
        file.replace(Path(directory) / file.name)
    inner.rmdir()


def load_adapter(model: Any, directory: str) -> None:
    """The adapter weights of checkpoint `directory` into `model`'s active adapter (a PeftModel with the same
    LoRA config)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    state = load_file(f"{directory}/adapter_model.safetensors", device=str(device))
    result = set_peft_model_state_dict(model, state, adapter_name=model.active_adapter)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"checkpoint {directory} does not fit this adapter: {result.unexpected_keys}")
