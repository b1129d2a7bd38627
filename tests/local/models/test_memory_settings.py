"""The settings real models need (issue 17, part 1): gradient checkpointing changes no gradient, and the
loading options reach `from_pretrained` (revision from a hub cache, remote code only when asked,
attention implementation, 4-bit refused clearly where it cannot run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import artrl
from artrl.config import EngineConfig, LoadConfig, SFTConfig, TrainConfig
from artrl.local.models.loading import load_model_and_tokenizer
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer


def _rows() -> list[Row]:
    rows = []
    for i in range(3):
        row = Row(trajectory=i, advantage=1.0 if i % 2 else -1.0)
        row.extend(list(range(10 + i, 40 + i)), sampled=False)
        row.extend(list(range(100 + i, 130 + i)), sampled=True, logprobs=[-2.0] * 30)
        rows.append(row)
    return rows


def _layer_calls(model) -> list[int]:
    """A counter of decoder layer 0's MLP calls (a checkpointed layer's forward runs again in the backward,
    where torch runs no module hooks: the MLP's forward itself is counted)."""
    calls = [0]
    layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
    mlp = layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


@pytest.mark.parametrize("lora", [artrl.LoraConfig(), None], ids=["lora", "full"])
def test_gradient_checkpointing_changes_no_gradient(tiny_model_dir, lora):
    from artrl.local.train.batch import TrainingBatch

    results = []
    for checkpointing in (False, True):
        model, _ = load_model_and_tokenizer(str(tiny_model_dir), EngineConfig())
        torch.manual_seed(0)  # the same adapter initialisation both times
        model = attach_adapter(model, lora)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        trainer = Trainer(model, pad_id=0)
        trainer.ready()  # (its one-time check runs the model once)
        calls = _layer_calls(model)
        config = TrainConfig(learning_rate=1e-3, gradient_checkpointing=checkpointing, max_grad_norm=None)
        metrics = trainer.step(TrainingBatch(rows=_rows()), config)
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((metrics, weights, calls[0]))
        assert (
            not model.training and not (model.get_base_model() if lora else model).is_activation_checkpointing
        )
    (plain, plain_weights, plain_calls), (checked, checked_weights, checked_calls) = results
    assert (plain_calls, checked_calls) == (1, 2)  # the layer really ran again in the backward pass
    assert checked["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert checked["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for name, weight in plain_weights.items():
        assert torch.allclose(checked_weights[name], weight, atol=1e-6), name


async def test_sft_with_gradient_checkpointing_trains_and_serves(fresh_model):
    """Through the public API: an SFT call with checkpointing on, then generation (which never checkpoints)."""
    model = fresh_model
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    result = await model.train_sft(
        [artrl.Trajectory(messages_and_choices=messages)], SFTConfig(gradient_checkpointing=True)
    )
    assert result.metrics["optimizer_steps"] == 1
    out = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages[:1], max_tokens=3
    )
    assert out.choices[0].finish_reason in ("stop", "length")


def _hub_cache(root: Path, repo: str, snapshots: dict[str, Path]) -> Path:
    """An offline Hugging Face hub cache holding `repo` at several commits (name -> model folder)."""
    base = root / f"models--{repo.replace('/', '--')}"
    for commit, folder in snapshots.items():
        shutil.copytree(folder, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(next(iter(snapshots)))
    return root


def test_revision_picks_the_snapshot(tiny_model_dir, tmp_path, monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["max_position_embeddings"] = 1234  # the second commit differs visibly
    (other / "config.json").write_text(json.dumps(config))
    first, second = "a" * 40, "b" * 40
    cache = _hub_cache(tmp_path / "hub", "artrl-test/tiny", {first: tiny_model_dir, second: other})
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # (read when a call resolves a hub id)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    default, _ = load_model_and_tokenizer("artrl-test/tiny", EngineConfig())
    pinned, _ = load_model_and_tokenizer("artrl-test/tiny", EngineConfig(load=LoadConfig(revision=second)))
    assert default.config.max_position_embeddings != 1234
    assert pinned.config.max_position_embeddings == 1234


CUSTOM_CONFIG = """
from transformers import Qwen3Config

class CustomConfig(Qwen3Config):
    model_type = "artrl_custom"
"""
CUSTOM_MODEL = """
from transformers import Qwen3ForCausalLM
from .configuration_custom import CustomConfig

class CustomModel(Qwen3ForCausalLM):
    config_class = CustomConfig
"""


def test_remote_code_runs_only_when_asked(tiny_model_dir, tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_custom.py").write_text(CUSTOM_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "artrl_custom"
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_model_and_tokenizer(str(folder), EngineConfig())
    model, _ = load_model_and_tokenizer(str(folder), EngineConfig(load=LoadConfig(trust_remote_code=True)))
    assert type(model).__name__ == "CustomModel"


def test_attention_implementation_is_used_as_given(tiny_model_dir):
    default, _ = load_model_and_tokenizer(str(tiny_model_dir), EngineConfig())
    eager, _ = load_model_and_tokenizer(
        str(tiny_model_dir), EngineConfig(load=LoadConfig(attn_implementation="eager"))
    )
    assert default.config._attn_implementation == "artrl_cpu"  # artrl's CPU attention unless told otherwise
    assert eager.config._attn_implementation == "eager"


def test_device_map_reaches_from_pretrained_and_a_split_model_needs_vllm(tiny_model_dir):
    import torch

    from artrl.local.models.loading import check_placement, model_options

    placement = {"": "cpu"}
    config = EngineConfig(load=LoadConfig(device_map=placement))
    assert model_options(config, torch.device("cpu"), torch.float32)["device_map"] == placement
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), config)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model.lm_head.to("meta")  # a model spread over two devices
    with pytest.raises(ValueError, match="the embedded engine generates on one device"):
        check_placement(model, EngineConfig())
    check_placement(model, EngineConfig(kind="vllm"))  # the trainer's copy may span GPUs


def test_models_load_without_the_hubs_kernels(tiny_model_dir):
    """transformers swaps in the `kernels` package's layers by default where it can (on CUDA it refused to load
    without that package: every GPU-check setting failed so on an H200); artrl runs the model's own layers."""
    import torch

    from artrl.local.models.loading import model_options

    assert model_options(EngineConfig(), torch.device("cuda"), torch.bfloat16)["use_kernels"] is False
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), EngineConfig())
    assert model.use_kernels is False


async def test_device_map_with_trainer_ranks_is_refused(tiny_model_dir, tmp_path):
    backend = artrl.LocalBackend(
        path=tmp_path,
        engine=EngineConfig(load=LoadConfig(device_map="auto")),
        trainer=artrl.TrainerConfig(ranks=2),
    )
    model = artrl.TrainableModel(name="d", project="p", base_model=str(tiny_model_dir))
    with pytest.raises(ValueError, match="use one or the other"):
        await model.register(backend)
    await backend.close()


def test_4bit_is_refused_clearly_where_it_cannot_run(tiny_model_dir):
    config = EngineConfig(device="cpu", load=LoadConfig(quantization="4bit"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        load_model_and_tokenizer(str(tiny_model_dir), config)


async def test_4bit_full_fine_tuning_is_refused(tiny_model_dir, tmp_path):
    backend = artrl.LocalBackend(path=tmp_path, engine=EngineConfig(load=LoadConfig(quantization="4bit")))
    model = artrl.TrainableModel(name="q", project="p", base_model=str(tiny_model_dir), lora=None)
    with pytest.raises(ValueError, match="only through a LoRA adapter"):
        await model.register(backend)
    await backend.close()


def test_vllm_gets_the_load_settings():
    from artrl.local.engine.vllm.server import load_args

    load = LoadConfig(revision="v1", trust_remote_code=True, quantization="4bit")
    assert load_args(load, full_weights=False) == [
        "--revision", "v1", "--trust-remote-code", "--quantization", "bitsandbytes"
    ]  # fmt: skip
    assert "--revision" not in load_args(load, full_weights=True)  # a checkpoint folder has no revisions
