"""The embedded engine's decode steps and prefills on CPU for Llama-layout models, without the module tree.

A decode step computes one token per running sequence. Through the transformers forward it is ~57 small
matrix products (27M model) and several hundred small ops, each behind an nn.Module call, a PEFT wrapper, a
mask builder and a cache object: at 8 sequences about a third of the step is Python, and the products
themselves run through a kernel that re-lays out its weight on every call. A prefill (`prefill`: S new
tokens per row on top of cached ones) pays the same per op, and the transformers path also repeats every
key/value head per query head when there is a mask. This forward instead:

- runs the same computation as the transformers code of Llama, Qwen2, Qwen3 and Mistral (full attention),
  op for op where it matters for the numbers (RMS norms in fp32 then the weight in the model's dtype,
  rotary embeddings from the model's own rotary module, residuals in the same order), so its logits match
  the model's forward (`tests/local/engine/hf/test_fused_decode.py`: equal in bf16, ~1e-6 in fp32);
- multiplies by q/k/v and by gate/up concatenated (one product each), with LoRA folded in (W + s·B·A, or
  the merged weights `merged_lora` swapped in);
- packs each large weight once per weight version for oneDNN (`torch.ops.mkldnn`), which otherwise repacks
  it on every call: fp32 products at 8 rows ~3x faster, bf16 ~1.5x;
- in bf16/fp16 attends over the cache buffers' whole width (`GrowingLayer.wide`, the unused columns masked):
  torch's bf16 batched product copies a view of the filled columns first, 16 copies of the whole cache per
  step of the 27M model (decode step at 32 x 350 tokens: 37 → 23 ms);
- normalises and rotates the queries and keys of all heads in one pass each (Qwen3's q_norm and k_norm
  weights side by side), and in a prefill shares each key/value head among its query heads in the
  attention kernel (decode step 23 → 17 ms at 32 x 350; the 27M model's prefills in the rollout benchmark
  take 1.2x less time);
- runs each step's decoder layers as one TorchScript call (`scripted_layers.py`: the layer math lives
  there, run eagerly where TorchScript is off or fails), so the engine thread takes the interpreter lock
  back a few times per step instead of once per operation while the gateway's threads run Python.

With `adapters=True` (a model holding several LoRA adapters, rows of different ones in one step) the
products use the base weights, and each adapter's rows add its own low-rank products (`adapter_factors.py`).

The weights are rebuilt after every engine job (a training step may have changed them): `stale()`, then
`build()` before the next step; with adapters, a job of one adapter rebuilds only that adapter's factors. Anything outside the checked layout (another architecture, a sliding
window, a LoRA variant, an adapter on the embeddings) keeps the transformers forward. Costs one more copy
of the decoder's linear weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from artrl.local.engine.hf.adapter_factors import Factors, adapter_factors, adapter_names, row_masks
from artrl.local.engine.hf.kv_cache import BatchCache
from artrl.local.engine.hf.scripted_layers import decode_layers, prefill_layers, scripted
from artrl.local.kernels.merged_lora import folded, mergeable

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
HALF = (torch.bfloat16, torch.float16)
PACK_MIN_ELEMENTS = 1 << 17  # smaller weights multiply faster unpacked (the tiny model's)


@dataclass
class _Product:
    """y = x·Wᵀ + b with W (out, in) as given, or packed for oneDNN."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class _Flat(NamedTuple):
    """The layer loops (`scripted_layers`: compiled by TorchScript, or the same functions run eagerly) and
    the layers' weights as the lists they take."""

    decode: Any
    prefill: Any
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    packed: list[bool]
    norms: list[torch.Tensor]
    eps: list[float]


def _effective(module: Any, fold: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias a linear module (plain, or a PEFT LoRA layer) applies at inference (fold=False:
    its base layer's, the adapters' products added per row)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        if type(module) is not torch.nn.Linear:
            raise TypeError(f"{type(module).__name__} is not a plain linear layer")
        return module.weight, module.bias
    if type(base) is not torch.nn.Linear:
        raise TypeError(f"an adapter over {type(base).__name__}")
    weight = base.weight
    if fold and not module.disable_adapters and not module.merged:  # the adapter runs beside W: fold it in
        if not mergeable(module):
            raise TypeError("a LoRA layer artrl cannot fold (a variant such as DoRA, or several adapters)")
        weight = folded(module, weight).to(weight.dtype)
    return weight, base.bias


def _joined(modules: list[Any], fold: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The modules' weights stacked along the output dimension (one product for all)."""
    parts = [_effective(m, fold) for m in modules]
    weight = torch.cat([w for w, _ in parts])  # (sum of outs, in)
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


def _can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed product runs here and agrees with F.linear (a private op: checked, not
    assumed)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(64, 48).to(dtype)
        x = torch.randn(3, 48).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(got.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    except Exception as exc:  # (a torch without the op, a CPU without the kernel)
        log.info("decode products stay unpacked: %s: %s", type(exc).__name__, exc)
        return False


class FusedDecode:
    """Decode steps for one model (see the module docstring); None from `of` where it does not apply."""

    def __init__(self, base: Any, script: bool = True, adapters: bool = False) -> None:
        self._base = base  # the transformers ForCausalLM under any PEFT wrapper
        self._adapters = adapters  # rows of several adapters: base products + each adapter's factors
        self._factors: dict[str, Factors] = {}
        self._dirty: set[str] = set()  # adapters whose factors are to be (re)built
        self._dtype = next(base.parameters()).dtype
        config = base.config
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_dim = base.model.layers[0].self_attn.head_dim
        self._scale = base.model.layers[0].self_attn.scaling
        self._intermediate = config.intermediate_size
        self._pack: bool | None = None  # checked at the first build, on the engine thread: a torch op on
        # another thread would give that thread an OpenMP team of its own, which slows every team down
        self._head: _Product | None = None
        self._script = script  # the layer loops compiled by TorchScript (else run eagerly)
        self._flat: _Flat | None = None  # the layers' weights, built with the head

    @classmethod
    def of(cls, model: Any, adapters: bool = False) -> FusedDecode | None:
        """For a model of a supported layout on the CPU; None otherwise (the transformers forward)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        name = type(base).__name__
        config = getattr(base, "config", None)
        if name not in ARCHITECTURES or config is None:
            return None
        if next(base.parameters()).device.type != "cpu":
            return None
        inner = getattr(base, "model", None)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        why = None
        if getattr(config, "hidden_act", None) != "silu":
            why = f"activation {getattr(config, 'hidden_act', None)!r}"
        elif any(t != "full_attention" for t in layer_types) or (
            name == "MistralForCausalLM" and getattr(config, "sliding_window", None) is not None
        ):
            why = "sliding-window attention"
        elif (
            inner is None
            or not hasattr(inner, "rotary_emb")
            or type(inner.embed_tokens) is not torch.nn.Embedding
        ):
            why = "an unexpected module layout"
        if why is not None:
            log.info("decode steps and prefills through the transformers forward: %s", why)
            return None
        return cls(base, adapters=adapters)

    def check_adapter(self, adapter: str) -> None:
        """TypeError when `adapter` (on the model) cannot run in this forward (adapters=True)."""
        adapter_factors(self._base, adapter)

    @property
    def ready(self) -> bool:
        return self._head is not None and not self._dirty

    def stale(self, adapter: str | None = None) -> None:
        """The weights may have changed (only `adapter`'s, when given with adapters=True): build() again
        before the next step."""
        if adapter is not None and self._adapters and self._head is not None:
            self._dirty.add(adapter)
            return
        self._head, self._flat = None, None

    def _product(self, weight: torch.Tensor, bias: torch.Tensor | None) -> _Product:
        weight = weight.detach()
        if self._pack is None:
            self._pack = _can_pack(weight.dtype)
        if self._pack and weight.numel() >= PACK_MIN_ELEMENTS:
            return _Product(torch.ops.mkldnn._reorder_linear_weight(weight, None), bias, True)
        return _Product(weight.contiguous(), bias, False)

    def _qk_norm(self, attention: Any) -> torch.Tensor:
        """Qwen3's per-head norms of queries and keys as one weight over the joined (H + H_kv, D) heads (one
        pass for both); an empty tensor without them."""
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        if q_norm is None and k_norm is None:
            return attention.q_proj.weight.new_empty(0)
        if q_norm is None or k_norm is None or q_norm.variance_epsilon != k_norm.variance_epsilon:
            raise TypeError("query and key norms that are not alike")
        dim = self._head_dim
        weights = [
            q_norm.weight.detach().expand(self._heads, dim),
            k_norm.weight.detach().expand(self._kv_heads, dim),
        ]
        return torch.cat(weights)  # (H + H_kv, D)

    @torch.no_grad()
    def build(self) -> None:
        """The fused (and packed) weights of the model as it is now (and the adapters' factors). Raises
        TypeError for a module outside the layout (the caller then keeps the transformers forward)."""
        if self._head is None:
            self._build_products()
            self._factors, self._dirty = {}, adapter_names(self._base) if self._adapters else set()
        present = adapter_names(self._base) if self._dirty else set()
        for name in sorted(self._dirty):
            if name in present:
                self._factors[name] = adapter_factors(self._base, name)
            else:
                self._factors.pop(name, None)
        self._dirty = set()

    def _build_products(self) -> None:
        fold = not self._adapters
        weights, biases, packed, norms, eps = [], [], [], [], []
        for block in self._base.model.layers:
            attention, mlp = block.self_attn, block.mlp
            if getattr(attention, "sliding_window", None) is not None:
                raise TypeError("a sliding-window layer")
            for product in (
                self._product(*_joined([attention.q_proj, attention.k_proj, attention.v_proj], fold)),
                self._product(*_effective(attention.o_proj, fold)),
                self._product(*_joined([mlp.gate_proj, mlp.up_proj], fold)),
                self._product(*_effective(mlp.down_proj, fold)),
            ):
                weights.append(product.weight)
                biases.append(product.bias)
                packed.append(product.packed)
            input_norm, post_norm, qk_norm = (
                block.input_layernorm,
                block.post_attention_layernorm,
                self._qk_norm(attention),
            )
            norms += [input_norm.weight.detach(), post_norm.weight.detach(), qk_norm]
            qk_eps = attention.q_norm.variance_epsilon if qk_norm.numel() else 0.0
            eps += [float(input_norm.variance_epsilon), float(post_norm.variance_epsilon), float(qk_eps)]
        decode, prefill = self._loops()
        self._flat = _Flat(decode, prefill, weights, biases, packed, norms, eps)
        self._head = self._product(*_effective(self._base.lm_head, fold))

    def _loops(self) -> tuple[Any, Any]:
        """The layer loops: compiled by TorchScript, or (off, or where it fails) the same functions eagerly."""
        if self._script:
            try:
                return scripted("decode"), scripted("prefill")
            except Exception as exc:  # (a torch without TorchScript, or one that cannot compile them)
                log.info(
                    "decode and prefill layers run eagerly: TorchScript failed (%s: %s)",
                    type(exc).__name__,
                    exc,
                )
                self._script = False
        return decode_layers, prefill_layers

    def __call__(
        self,
        ids: torch.Tensor,  # (B, 1)
        positions: torch.Tensor,  # (B, 1)
        mask: torch.Tensor,  # (B, T + 1) 1 = a token, 0 = left padding
        cache: BatchCache,  # T columns; each layer gets this step's keys and values appended
        adapters: list[str | None] | None = None,  # each row's adapter (adapters=True)
    ) -> torch.Tensor:
        """Logits (B, V) of the next token."""
        assert self._head is not None, "build() first"
        hidden, rotary = self._start(ids, positions)  # (B, 1, E)
        return self._end(self._decode_layers(hidden, rotary, mask, cache, self._lora(adapters, ids.device)))

    def _lora(self, adapters: list[str | None] | None, device: torch.device) -> tuple[list, list, list]:
        """The scripted layers' lora_a, lora_b and masks for rows of these adapters ([] x 3: none)."""
        if not self._adapters or adapters is None:
            return [], [], []
        names, masks = row_masks(adapters, self._dtype, device)
        lora_a = [a for name in names for a, _ in self._factors[name]]
        lora_b = [b for name in names for _, b in self._factors[name]]
        return lora_a, lora_b, masks

    def _decode_layers(
        self, hidden: torch.Tensor, rotary: tuple, mask: torch.Tensor, cache: BatchCache, lora: tuple
    ) -> torch.Tensor:
        """The layers of a decode step (one TorchScript call, see scripted_layers): (B, 1, E)."""
        assert self._flat is not None
        flat = self._flat
        length = cache.length
        for layer in cache.layers:  # (room for this step's column first: the function writes it in place)
            layer.reserve_column()
        wide = hidden.dtype in HALF
        keys = [layer.key_buffer for layer in cache.layers]
        values = [layer.value_buffer for layer in cache.layers]
        try:
            hidden = flat.decode(
                hidden, rotary[0], rotary[1], mask.bool(), *flat[2:], *lora, keys, values,
                length, wide, self._heads, self._kv_heads, self._head_dim, self._intermediate, float(self._scale),
            )  # fmt: skip
        except BaseException:
            for layer in cache.layers:  # (the column some layers got stays zeros, as room must)
                layer.clear_column(length)
            raise
        for layer in cache.layers:
            layer.appended(1)
        return hidden

    def prefill(
        self,
        ids: torch.Tensor,  # (R, S) new tokens, left-padded
        positions: torch.Tensor,  # (R, S)
        mask: torch.Tensor,  # (R, P + S) 1 = a token, 0 = left padding
        past: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (R, H_kv, P, D) keys, values; [] if P = 0
        adapters: list[str | None] | None = None,  # each row's adapter (adapters=True)
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The same forward over S new tokens per row on top of P cached ones (the transformers forward's
        prefill, as `RunningBatch` calls it): logits (R, V) of each row's last position and per layer the
        keys and values (R, H_kv, P + S, D) of all its P + S tokens."""
        assert self._head is not None, "build() first"
        length = ids.shape[1]
        cached = mask.shape[1] - length  # P
        # query i of a row sees the row's tokens (mask) up to its own position (P + i): (R, 1, S, P + S)
        causal = (
            torch.arange(cached + length, device=ids.device)
            <= cached + torch.arange(length, device=ids.device)[:, None]
        )
        attend = (causal & mask.bool()[:, None, :])[:, None]
        hidden, rotary = self._start(ids, positions)  # (R, S, E)
        assert self._flat is not None
        flat = self._flat
        hidden, keys, values = flat.prefill(
            hidden, rotary[0], rotary[1], attend, *flat[2:], *self._lora(adapters, ids.device),
            [k for k, _ in past], [v for _, v in past],
            self._heads, self._kv_heads, self._head_dim, self._intermediate, float(self._scale),
        )  # fmt: skip
        return self._end(hidden), keys, values

    def _start(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The embeddings (B, L, E) and the rotary factors for the positions, as (B, L, 1, D) cos and signed sin."""
        inner = self._base.model
        embed = inner.embed_tokens
        hidden = getattr(embed, "base_layer", embed)(ids)  # (B, L, E) (adapters: never on the embeddings)
        cos, sin = inner.rotary_emb(hidden, positions)  # (B, L, D) each
        half = self._head_dim // 2
        # rotate_half(x)·sin = roll(x, half)·(-sin₁, sin₂): the same products, no concatenation per layer
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # (B, L, D)
        return hidden, (cos.unsqueeze(2), signed_sin.unsqueeze(2))  # (broadcast over the heads)

    def _end(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of the last position."""
        assert self._head is not None
        return self._head(_rms(hidden[:, -1], self._base.model.norm))  # (B, E) -> (B, V)


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Llama-family RMSNorm, op for op: normalised in fp32, then the weight in x's dtype."""
    return _rms_with(x, norm.weight, norm.variance_epsilon)


def _rms_with(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
