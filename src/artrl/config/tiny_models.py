"""Shapes of the models `artrl tiny-model` builds offline, and their presets."""

from __future__ import annotations

from artrl.config.frozen import _Frozen


class TinyModelConfig(_Frozen):
    """Shape of a model that `artrl tiny-model` builds offline (a Qwen3-architecture causal LM).

    head_dim stays >= 32 so that vLLM can serve the same folder.
    """

    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    seed: int = 0


TINY_MODEL_PRESETS: dict[str, TinyModelConfig] = {
    # 229,824 parameters: the test and demo model.
    "tiny": TinyModelConfig(),
    # 27,272,704 parameters: the benchmark model (per-token cost of a real, if small, transformer).
    "small": TinyModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
