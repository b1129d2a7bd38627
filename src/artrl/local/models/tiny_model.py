"""Build a small, standard causal LM (Qwen3 architecture) and its tokenizer offline and deterministically.

The result is an ordinary Hugging Face model folder: `base_model=` loads it through exactly the code
that loads a hub model, and vLLM can serve it (head_dim >= 32).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from artrl.config import TINY_MODEL_PRESETS, TinyModelConfig
from artrl.local.models.chat_template import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    MARKUP_TOKENS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)

_WORDS = [
    "the",
    "a",
    "an",
    "is",
    "are",
    "was",
    "be",
    "to",
    "of",
    "and",
    "in",
    "on",
    "for",
    "with",
    "at",
    "by",
    "from",
    "as",
    "it",
    "this",
    "that",
    "what",
    "which",
    "who",
    "how",
    "when",
    "where",
    "why",
    "yes",
    "no",
    "not",
    "all",
    "any",
    "some",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "number",
    "secret",
    "guess",
    "higher",
    "lower",
    "correct",
    "wrong",
    "key",
    "value",
    "item",
    "items",
    "inventory",
    "count",
    "price",
    "stock",
    "find",
    "search",
    "look",
    "move",
    "left",
    "right",
    "up",
    "down",
    "north",
    "south",
    "east",
    "west",
    "wall",
    "door",
    "room",
    "maze",
    "start",
    "goal",
    "found",
    "result",
    "results",
    "query",
    "answer",
    "question",
    "user",
    "assistant",
    "tool",
    "call",
    "calls",
    "function",
    "name",
    "arguments",
    "weather",
    "city",
    "today",
    "tomorrow",
    "temperature",
    "email",
    "send",
    "read",
    "list",
    "get",
    "set",
    "add",
    "remove",
    "update",
    "check",
    "order",
    "status",
    "done",
    "error",
    "please",
    "thank",
    "you",
    "hello",
    "sorry",
    "can",
    "could",
    "would",
    "should",
    "will",
    "may",
    "must",
    "try",
    "again",
    "next",
    "step",
    "game",
    "play",
    "win",
    "lose",
    "score",
    "total",
    "sum",
    "first",
    "last",
    "more",
    "less",
    "than",
    "equal",
    "between",
    "try",
    "value",
    "values",
    "true",
    "false",
    "null",
    "none",
    "empty",
    "apple",
    "banana",
    "cherry",
    "paris",
    "london",
    "tokyo",
    "berlin",
    "rome",
    "madrid",
    "amount",
    "quantity",
    "report",
]

_TOOL_NAMES = ("guess", "lookup", "search", "get_weather", "move", "look", "add", "check_stock", "send_email")


def _random_json_value(rng: random.Random) -> object:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randrange(0, 1000)
    if kind == 1:
        return rng.choice(_WORDS)
    if kind == 2:
        return [rng.randrange(0, 100) for _ in range(rng.randrange(1, 4))]
    return rng.choice([True, False, None])


def _corpus(seed: int, n_docs: int = 3000) -> list[str]:
    """Generated text that looks like rendered agent conversations (for tokenizer training only)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 25)))
        name = rng.choice(_TOOL_NAMES)
        args = {rng.choice(_WORDS): _random_json_value(rng) for _ in range(rng.randrange(1, 4))}
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": words[:40],
                "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in args}},
            },
        }
        docs.append(
            "<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(schema) + "\n</tools><|im_end|>\n"
            "<|im_start|>user\n" + words.capitalize() + "?<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>\n"
            + json.dumps({"name": name, "arguments": args})
            + "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
            + json.dumps({"result": _random_json_value(rng)})
            + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            + f"The answer is {rng.randrange(0, 10000)}. {words}.<|im_end|>\n"
        )
    return docs


def _train_tokenizer(config: TinyModelConfig):
    """A byte-level BPE tokenizer trained on the generated corpus, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size - len(MARKUP_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(config.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None, bos_token=None
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = config.max_position_embeddings
    return fast


def init_network(
    shape: TinyModelConfig,
    vocab_size: int,
    *,
    eos_id: int | list[int],
    pad_id: int,
    bos_id: int | None = None,
    architecture: str = "qwen3",
):
    """A randomly initialised causal LM of `shape` (Qwen3 or Llama architecture), seeded by `shape.seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = (
        (LlamaConfig, LlamaForCausalLM) if architecture == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    model_config = config_class(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        return model_class(model_config)


def build_tiny_model(out_dir: str | os.PathLike[str], config: TinyModelConfig | str = "tiny") -> Path:
    """Build (or rebuild) a model folder at `out_dir`; the same config always gives the same bytes."""
    from transformers import GenerationConfig

    if isinstance(config, str):
        if config not in TINY_MODEL_PRESETS:
            raise ValueError(f"unknown preset {config!r}; choose one of {sorted(TINY_MODEL_PRESETS)}")
        config = TINY_MODEL_PRESETS[config]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(config)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {config.vocab_size}")
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    model = init_network(config, config.vocab_size, eos_id=eos_id, pad_id=pad_id)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "artrl_tiny_model.json").write_text(json.dumps(config.model_dump(), indent=2) + "\n")
    return out
