"""ART's names for artrl's settings, so that code written for ART runs with `import artrl as art`.

Pure translation, no I/O: each function takes what an ART call passes and returns artrl's config, or raises
a `TypeError` that names what artrl does not have (never silently ignores a setting). `docs/from-art.md`
lists the correspondences.
"""

from __future__ import annotations

from typing import Any

from artrl.config import LoraConfig, TrainConfig

# ART's keyword arguments of `backend.train(model, groups, ...)` and keys of `_config=` (art.dev.TrainConfig)
# -> artrl's TrainConfig field
TRAIN_NAMES: dict[str, str] = {
    "learning_rate": "learning_rate",
    "beta": "kl_coef",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "scale_rewards": "scale_rewards",
    "truncated_importance_sampling": "tis_cap",
    "logprob_calculation_chunk_size": "logprob_chunk_size",
    "allow_training_without_logprobs": "allow_rendered_turns",
    "kl_penalty_coef": "kl_coef",
    "loss_fn": "loss",  # ("ppo" or "cispo": the losses both have)
    "normalize_advantages": "scale_rewards",  # (dividing each group's advantages by its std)
}
# accepted and without effect in artrl: every step is saved, progress goes to the history and trackers
IGNORED_TRAIN_NAMES = frozenset({"save_checkpoint", "verbose"})

# PEFT's / ART's LoRA names (`peft_args`, `lora_config`) -> artrl's LoraConfig field
LORA_NAMES: dict[str, str] = {
    "r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "target_modules",
}


def train_config(base: TrainConfig | None, art_settings: dict[str, Any]) -> TrainConfig:
    """`base` (or the defaults) with ART-named settings applied (`learning_rate=`, `_config={...}` keys)."""
    config = base or TrainConfig()
    update: dict[str, Any] = {}
    for name, value in art_settings.items():
        if name in IGNORED_TRAIN_NAMES:
            continue
        field = TRAIN_NAMES.get(name, name if name in TrainConfig.model_fields else None)
        if field is None:
            raise TypeError(
                f"artrl has no training setting {name!r}; ART's names it knows: {', '.join(sorted(TRAIN_NAMES))}; "
                "or use artrl.TrainConfig's own fields"
            )
        if field == "tis_cap" and value is not None and float(value) <= 0:
            value = None
        update[field] = value
    return TrainConfig.model_validate({**config.model_dump(), **update}) if update else config


# PEFT settings artrl's adapters do not have, with the value that means "not used"
PEFT_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None}


def lora_config(value: Any) -> LoraConfig | None:
    """ART's `lora_config=`: an artrl.LoraConfig, None (full fine-tuning), a `peft.LoraConfig`, or a mapping
    with PEFT's names (r, lora_alpha, lora_dropout, target_modules: "all-linear" is artrl's default, the
    decoder's linear layers) or artrl's. A PEFT setting artrl's adapters do not have (DoRA, rsLoRA, a
    bias, modules_to_save) is refused, never ignored."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    elif type(value).__name__ == "LoraConfig" and hasattr(value, "lora_alpha"):  # (peft's, a dataclass)
        used = [k for k, off in PEFT_UNSUPPORTED.items() if getattr(value, k, off) not in (off, False, None)]
        if used:
            raise ValueError(
                f"artrl's LoRA adapters are plain LoRA: the peft.LoraConfig sets {', '.join(used)}, which they "
                "do not have; leave those unset"
            )
        value = {k: getattr(value, k) for k in LORA_NAMES}
    elif not isinstance(value, dict):
        raise ValueError(
            f"lora_config must be an artrl.LoraConfig, a peft.LoraConfig or a dict, not {type(value).__name__}"
        )
    else:
        used = [k for k, off in PEFT_UNSUPPORTED.items() if k in value and value[k] not in (off, False, None)]
        if used:
            raise ValueError(f"artrl's LoRA adapters are plain LoRA: {', '.join(used)} is not supported")
        value = {k: v for k, v in value.items() if k not in PEFT_UNSUPPORTED}
    if value.get("target_modules") in ("all-linear", None):
        value = {
            k: v for k, v in value.items() if k != "target_modules"
        }  # (artrl's default: the same layers)
    fields: dict[str, Any] = {}
    for name, setting in value.items():
        field = LORA_NAMES.get(name, name if name in LoraConfig.model_fields else None)
        if field is None:
            raise ValueError(
                f"artrl's LoRA has no setting {name!r}; it takes {', '.join(sorted(LORA_NAMES))} "
                f"(PEFT's names) or {', '.join(LoraConfig.model_fields)}"
            )
        if field == "target_modules":  # (a name, or names: peft keeps them as a set)
            setting = (
                (setting,)
                if isinstance(setting, str)
                else tuple(sorted(setting) if isinstance(setting, set) else setting)
            )
        fields[field] = setting
    return LoraConfig(**fields)


def history_metric(name: str) -> str:
    """ART's history metric names -> artrl's: ART logs a split's mean reward as 'val/reward', artrl as
    'val/reward_mean' (and a trajectory metric `acc` as 'val/acc_mean')."""
    split, _, metric = name.rpartition("/")
    if split and metric == "reward":
        return f"{split}/reward_mean"
    return name
