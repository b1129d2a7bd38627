from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from artrl.local.models.tiny_model import build_tiny_model


def digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.suffix in (".json", ".safetensors", ".jinja")
    }


def test_build_is_deterministic_and_loads_like_any_hf_model(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    again = build_tiny_model(tmp_path / "again")
    assert digest(again) == digest(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen3" and config.head_dim >= 32
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"


def test_template_renders_tools_calls_and_results(tokenizer):
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Play."},
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "move", "arguments": '{"d": "N"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "wall"},
        {"role": "assistant", "content": "Done."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "move", "arguments": {"d": "N"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\nwall\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nDone.<|im_end|>\n")
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(encoded) == text
    marked = tokenizer.apply_chat_template(
        messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = tokenizer.decode(
        [t for t, m in zip(marked["input_ids"], marked["assistant_masks"], strict=True) if m]
    )
    assert (
        trained
        == '<tool_call>\n{"name": "move", "arguments": {"d": "N"}}\n</tool_call><|im_end|>Done.<|im_end|>'
    )


def test_cli_builds_a_model(tmp_path):
    out = tmp_path / "cli-model"
    subprocess.run(
        [sys.executable, "-m", "artrl.cli", "tiny-model", str(out)], check=True, capture_output=True
    )
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
