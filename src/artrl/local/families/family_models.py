"""Tiny models of real chat-model families, built offline: each family's real chat template (from the `trl`
package) and its special tokens, and weights briefly fine-tuned to write that family's tool calls.

They stand in for Qwen2.5, Qwen3, Qwen3.5, Llama 3.1, gpt-oss, GLM-4.5 and Gemma 4 in tests and demos on a machine
that cannot download them: the same tokens, templates and stop tokens, a tiny network (Qwen3 or Llama
architecture). `artrl tiny-model DIR --family NAME` builds one; the same arguments give the same folder.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artrl.config import TINY_MODEL_PRESETS


@dataclass(frozen=True)
class FamilySpec:
    chat_template: str  # name of a real template in trl.chat_template_utils
    special: tuple[str, ...]  # added as special tokens (dropped by skip_special_tokens)
    text: tuple[str, ...] = ()  # added as ordinary (non-special) tokens
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    bos: str | None = None
    stops: tuple[str, ...] = ()  # generation_config.eos_token_id (the model's own stop tokens)
    architecture: str = "qwen3"
    thinking: bool = False  # writes reasoning (trained with and without enable_thinking)
    thinking_default: bool = True  # the template thinks unless told enable_thinking=False
    # every turn reasons when thinking (Gemma 4 opens the thought channel in the prompt after a tool result)
    always_reasons: bool = False
    kwargs_variants: tuple[dict[str, Any], ...] = field(default_factory=lambda: ({},))


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_THINK = ("<think>", "</think>")

FAMILY_MODELS: dict[str, FamilySpec] = {
    # the Hermes family with its tool-call markers as *special* tokens (decoding must keep them)
    "qwen2_5": FamilySpec(
        "qwen2_5_chat_template", (*_CHATML, *_HERMES), stops=("<|im_end|>", "<|endoftext|>")
    ),
    "qwen3": FamilySpec(
        "qwen3_chat_template",
        _CHATML,
        text=(*_HERMES, *_THINK),
        stops=("<|im_end|>", "<|endoftext|>"),
        thinking=True,
        kwargs_variants=({}, {"enable_thinking": False}),
    ),
    "qwen3_5": FamilySpec(
        "qwen3_5_nothink_chat_template",
        _CHATML,
        text=(*_HERMES, *_THINK),
        stops=("<|im_end|>", "<|endoftext|>"),
        thinking=True,
        thinking_default=False,
        kwargs_variants=({}, {"enable_thinking": True}),
    ),
    "llama3_1": FamilySpec(
        "llama3_1_chat_template",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        bos="<|begin_of_text|>",
        stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        architecture="llama",
    ),
    "gpt_oss": FamilySpec(
        "gptoss_chat_template",
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        eos="<|return|>",
        pad="<|endoftext|>",
        stops=("<|return|>", "<|call|>"),
        thinking=True,
    ),
    "gemma4": FamilySpec(
        "gemma4_v5_chat_template",
        (
            "<pad>",
            "<eos>",
            "<bos>",
            "<|turn>",
            "<turn|>",
            "<|think|>",
            "<|channel>",
            "<channel|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
        ),
        eos="<turn|>",
        pad="<pad>",
        bos="<bos>",
        stops=("<eos>", "<turn|>", "<|tool_response>"),
        architecture="llama",
        thinking=True,
        thinking_default=False,
        always_reasons=True,
        kwargs_variants=({}, {"enable_thinking": True}),
    ),
    "glm4_5": FamilySpec(
        "glm4moe_chat_template",
        (
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            *_HERMES,
            *_THINK,
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        eos="<|endoftext|>",
        stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
        thinking=True,
        kwargs_variants=({}, {"enable_thinking": False}),
    ),
}

# The tools the fixtures are trained to call (tests send these schemas). They are exactly what LangChain makes of
# `@tool def add(a: int, b: int) -> int: """Add two numbers."""` (and `lookup(key: str)`), so a LangGraph agent
# renders the same prompt.
FIXTURE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "type": "object",
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a word.",
            "parameters": {"properties": {"key": {"type": "string"}}, "required": ["key"], "type": "object"},
        },
    },
]
FIT_TOKENS_PER_MICROBATCH = 4096  # padded tokens (rows x longest) of one micro-batch of the fixture fit
_WORDS = ("apple", "pear", "stock", "north", "paris", "tokyo", "secret", "price", "door", "maze")


def fixture_conversation(rng: random.Random, spec: FamilySpec, index: int) -> dict[str, Any]:
    """One generated conversation: tool calls answered by results, then an answer (or a plain chat)."""
    kwargs = rng.choice(spec.kwargs_variants)
    thinking = spec.thinking and kwargs.get("enable_thinking", spec.thinking_default)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    if rng.random() < 0.15:
        messages += [
            {"role": "user", "content": f"Say {rng.choice(_WORDS)}."},
            {"role": "assistant", "content": "Hello there."},
        ]
        return {"messages": messages, "tools": None, "kwargs": kwargs}
    a, b = rng.randrange(10), rng.randrange(10)
    key = rng.choice(_WORDS)
    plan = rng.choice([["add"], ["lookup"], ["add", "lookup"], ["lookup", "add"]])
    ask = " Then ".join(f"add {a} and {b}." if t == "add" else f"look up {key}." for t in plan)
    messages.append({"role": "user", "content": ask[0].upper() + ask[1:]})
    for turn, tool in enumerate(plan):
        arguments = {"a": a, "b": b} if tool == "add" else {"key": key}
        result = str(a + b) if tool == "add" else f"{key} is {rng.choice(_WORDS)}"
        call_id = f"call_{index}_{turn}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arguments)},
        }
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        if thinking and (
            spec.always_reasons or rng.random() < 0.85
        ):  # sometimes a call without reasoning (as a forced tool_choice makes)
            message["reasoning_content"] = f"I should call {tool}."
        messages += [message, {"role": "tool", "tool_call_id": call_id, "content": result}]
    final: dict[str, Any] = {"role": "assistant", "content": f"Done: {result}."}
    if thinking:
        final["reasoning_content"] = "I have the result."
    messages.append(final)
    return {"messages": messages, "tools": FIXTURE_TOOLS, "kwargs": kwargs}


def _tokenizer(spec: FamilySpec, template: str, corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(spec.text),
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=spec.eos, pad_token=spec.pad, bos_token=spec.bos, unk_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": list(spec.special)})
    fast.add_tokens(list(spec.text))
    fast.chat_template = template
    return fast


def _corpus_text(template: str, spec: FamilySpec, conv: dict[str, Any]) -> str:
    """A conversation rendered with the family's template before its tokenizer exists (tokenizer corpus)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from artrl.local.chat_format.template_inputs import template_messages

    rendered, _ = render_jinja_template(
        conversations=[template_messages(conv["messages"])],
        tools=conv["tools"],
        chat_template=template,
        bos_token=spec.bos or "",
        eos_token=spec.eos,
        **conv["kwargs"],
    )
    return rendered[0]


def build_family_model(
    out_dir: str | os.PathLike[str], family: str, *, steps: int = 300, seed: int = 0
) -> Path:
    """Build the tiny `family` model folder at `out_dir` (see FAMILY_MODELS), deterministically."""
    import trl.chat_template_utils as trl_templates
    from transformers import GenerationConfig

    from artrl.local.chat_format import ChatFormat
    from artrl.local.chat_format.turns import simulate_turns
    from artrl.local.models.tiny_model import init_network
    from artrl.local.train.rows import rows_from_calls

    if family not in FAMILY_MODELS:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILY_MODELS)}")
    spec = FAMILY_MODELS[family]
    template = getattr(trl_templates, spec.chat_template)
    shape = TINY_MODEL_PRESETS["tiny"]
    rng = random.Random(f"{family}-{seed}")
    conversations = [fixture_conversation(rng, spec, i) for i in range(400)]
    corpus = [_corpus_text(template, spec, c) for c in conversations]
    tokenizer = _tokenizer(spec, template, corpus, shape.vocab_size)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.stops]
    fmt = ChatFormat.for_tokenizer(tokenizer, extra_stop_ids=stop_ids)
    rows = []
    for i, conv in enumerate(conversations):
        turns = simulate_turns(fmt, conv["messages"], conv["tools"], conv["kwargs"])
        rows += rows_from_calls([(t.prompt_ids, t.sampled_ids, None) for t in turns], i)
    model = init_network(
        shape.model_copy(update={"seed": seed}),
        len(tokenizer),
        eos_id=stop_ids,
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        architecture=spec.architecture,
    )
    _fit(model, rows, steps, pad_id=tokenizer.pad_token_id, seed=seed)
    model.generation_config = GenerationConfig(
        eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=model.config.bos_token_id
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "artrl_family_model.json").write_text(
        json.dumps({"family": family, "steps": steps, "seed": seed}) + "\n"
    )
    return out


def _fit(model, rows, steps: int, pad_id: int, seed: int, batch: int = 16, lr: float = 3e-3) -> None:
    """Full fine-tuning on the rows' trained tokens (mask 1): per step the token-mean NLL of `batch` random
    rows, through the trainer's own pieces: micro-batches of rows of like length, causal attention without a
    mask, the prompt the rows share (the tools) computed once, the head only at trained positions, fused RMS
    norms. About 0.4x the time per step of the whole batch through the model's forward (padded to its longest
    row, the head over every position): the seven fixtures 165 s on one core at 300 steps, 259 s at 200."""
    import torch

    from artrl.local.train.fused_norm import FusedNormTraining
    from artrl.local.train.logprobs import head_is_the_models, shares_prefixes, token_logprobs
    from artrl.local.train.loss import sft_loss
    from artrl.local.train.pack import collate, pack, pack_by_prompt, shared_prompt
    from artrl.local.train.rows import trained_targets

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # lr decayed linearly to a tenth: the fixtures' decisions (which tool, whether to reason) settle rather
    # than ride the last steps' noise, so another CPU's float order does not flip one
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 - 0.9 * k / max(1, steps))
    via_forward = not head_is_the_models(model)
    sharing = shares_prefixes(model) and not via_forward  # (each step's rows share the tools' prompt)
    norms = FusedNormTraining.of(model)
    if norms is not None:
        norms.fuse()
    model.train()
    for _ in range(steps):
        chosen = rng.sample(rows, min(batch, len(rows)))
        normaliser = max(1.0, trained_targets(chosen))
        for micro in (pack_by_prompt if sharing else pack)(chosen, FIT_TOKENS_PER_MICROBATCH):
            part = [chosen[i] for i in micro]
            mb = collate(part, model.device, pad_id, shared_prompt(part) if sharing else 0)
            lp, _ = token_logprobs(model, mb, None, with_entropy=False, via_forward=via_forward)  # (B, T-1)
            sft_loss(lp, mb.mask, mb.weights, normaliser).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    if norms is not None:
        norms.restore()
    model.eval()
