"""The trainer's forward: log π(target | context) and the entropy at every trainable position of a
micro-batch, through the model's decoder and its lm_head (only at those positions).

A micro-batch whose rows share a prompt (`MicroBatch.shared`: a group's rollouts of one scenario) computes
that prompt once: the decoder runs over the shared positions of one row, keeping its keys and values (a
`DynamicCache`), which are repeated for every row, and then over each row's own positions, which attend to
them. Gradients flow back through the repeated keys and values into the one prompt computation, so the
result is the computation over the whole rows (the same math; fp32 sums in another order). The maze demo's
GRPO rows are ~46% such repeated prompt tokens.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from artrl.local.train.pack import MicroBatch


def unwrapped(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (the model itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


LOGITS_CHUNK_BYTES = 256 * 2**20  # fp32 logits one lm_head chunk may hold when no chunk size is given


def _autocast(inner: Any) -> contextlib.AbstractContextManager[Any]:
    """Base weights in bf16/fp16: the forward under autocast at that dtype, so that the fp32 LoRA adapter's
    products run at it too (its weights stay the fp32 masters the optimizer updates; on a CPU the skinny
    fp32 products of a rank-8 adapter were ~40% of a bf16 step). fp32 weights: nothing changes."""
    weight = inner.get_input_embeddings().weight
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return torch.autocast(device_type=weight.device.type, dtype=weight.dtype)


def _head_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's own forward does to the lm_head's output before its logits (this module calls the
    head itself): Gemma's final soft-capping, Cohere's logit scale, Granite's logits scaling; else nothing.
    Without it the trainer's logprobs would not be the engine's (which runs the model's forward)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)  # (Cohere: a multiplier)
    divisor = getattr(text, "logits_scaling", None)  # (Granite: a divisor)

    def transform(logits: torch.Tensor) -> torch.Tensor:  # (c, V) fp32
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if isinstance(scale, (int, float)) and scale != 1:
            logits = logits * scale
        if isinstance(divisor, (int, float)) and divisor != 1:
            logits = logits / divisor
        return logits

    return transform


def _padding_mask(attention: torch.Tensor) -> torch.Tensor | None:
    """The attention mask the decoder needs: None (causal attention alone) when every row's padding is on
    its right, as `collate` makes it. A real position then attends only to earlier positions, which are all
    real; a padding position's output is never a target. So the logprobs and gradients at trainable
    positions are the same, and attention takes its causal kernel (tiny model's SFT step: 94 -> 83 ms)
    instead of building a (B, 1, T, T) mask. Anything else (left padding, holes): the mask as given."""
    right_padded = bool((attention[:, 1:] <= attention[:, :-1]).all()) and bool(attention[:, 0].all())
    return None if right_padded else attention


class _TargetLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] per row and the distribution's entropy (not differentiated), with the
    backward written out: softmax(logits) * -g, plus g at the target, computed in place in the softmax the
    forward kept. One fresh (c, V) buffer for forward and backward together, where `log_softmax` + `gather`
    take five (its output, a zero-filled gradient, `log_softmax_backward`'s, the entropy's two): on a CPU
    most of their time is the first touch of fresh pages (`small`'s bf16 GRPO step: ~35 of ~250 ms)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> Any:
        # logits (c, V) fp32, targets (c,) int64
        top = logits.amax(-1, keepdim=True)  # (c, 1)
        probs = torch.sub(logits, top).exp_()  # (c, V) exp(logits - top)
        total = probs.sum(-1, keepdim=True)  # (c, 1)
        lse = (top + total.log())[:, 0]  # (c,)
        probs.div_(total)  # (c, V) softmax
        picked = logits.gather(-1, targets[:, None])[:, 0] - lse  # (c,)
        if with_entropy:  # H = lse - sum(p * logits); a product per row (no (c, V) temporary), in fp32
            with torch.autocast(logits.device.type, enabled=False):
                entropy = lse - (probs[:, None, :] @ logits[:, :, None])[:, 0, 0]  # (c,)
        else:
            entropy = torch.zeros_like(picked)
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx: Any, grad_picked: torch.Tensor, _grad_entropy: Any) -> Any:
        probs, targets = ctx.saved_tensors  # (c, V), (c,)
        # (the softmax is this function's own: overwritten, as it is needed once; a second backward through
        # the same graph needs retain_graph, and autograd then refuses the changed tensor)
        grad = probs.mul_(-grad_picked[:, None])  # (c, V)
        grad.scatter_add_(-1, targets[:, None], grad_picked[:, None])
        return grad, None, None


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits)[targets], entropy) per row, (c,) each, from fp32 logits (c, V); the entropy
    is detached (zeros without `with_entropy`). Gradients flow to the logits through the first."""
    return _TargetLogprobs.apply(logits, targets, with_entropy)


def token_logprobs(
    model: Any, batch: MicroBatch, chunk: int | None, with_entropy: bool = True, via_forward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token t+1 | tokens ≤ t) (or of `batch.targets[t]`, when given) and that distribution's
    entropy, (B, T-1) each, at the positions whose target is trainable (`batch.mask`; 0 elsewhere).

    Rows sharing their first `batch.shared` positions compute them once (this module's docstring). Only
    those positions go through the lm_head, `chunk` at a time (None: as many as LOGITS_CHUNK_BYTES of
    fp32 logits hold); with more than one chunk each runs under activation checkpointing, so the
    (positions x vocab) logits never exist at once, forward or backward.

    `via_forward`: the logits of the model's whole forward instead (every position through the head, no
    shared prompt), for a model whose forward does more after its head than `_head_transform` knows
    (`head_is_the_models`).
    """
    inner = unwrapped(model)
    head = inner.get_output_embeddings()
    if chunk is None:
        chunk = max(64, LOGITS_CHUNK_BYTES // (4 * head.weight.shape[0]))
    where = batch.mask.nonzero(as_tuple=True)  # ((N,), (N,)) trainable target positions (all >= start)
    targets = (batch.ids[:, 1:] if batch.targets is None else batch.targets)[where]  # (N,)
    with _autocast(inner):
        if via_forward:
            logits = inner(input_ids=batch.ids, attention_mask=_padding_mask(batch.attention)).logits
            picked_hidden, to_logits = logits[:, :-1][where], torch.Tensor.float  # (N, V): logits already
        else:
            hidden, start = _hidden(inner, batch)  # (B, T - start, H): positions start.. of every row
            picked_hidden = hidden[:, :-1][where[0], where[1] - start]  # (N, H)
            transform = _head_transform(inner.config)

            def to_logits(h: torch.Tensor) -> torch.Tensor:  # (c, H) -> (c, V)
                return transform(head(h).float())

    def piece(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return target_logprobs(to_logits(h), y, with_entropy)  # (c,), (c,)

    recompute = torch.is_grad_enabled() and len(targets) > chunk and not via_forward
    with _autocast(inner):  # (a recomputed chunk restores the autocast state it was computed under)
        parts = [
            checkpoint(piece, picked_hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
            if recompute
            else piece(picked_hidden[s : s + chunk], targets[s : s + chunk])
            for s in range(0, len(targets), chunk)
        ]
    none = picked_hidden.new_zeros(0, dtype=torch.float32)
    lp = torch.cat([p[0] for p in parts]) if parts else none  # (N,)
    entropy = torch.cat([p[1] for p in parts]) if parts else none  # (N,)
    shape = batch.mask.shape  # (B, T-1)
    full_lp = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put(where, lp)  # (B, T-1)
    full_entropy = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put(where, entropy)  # (B, T-1)
    return full_lp, full_entropy


def head_is_the_models(model: Any) -> bool:
    """Whether the head and `_head_transform` give the model's own logits, checked on a short input (an
    architecture may do more after its head: Falcon-H1's multiplier, HyperCLOVAX's scaling...). Run it where
    the training runs (a torch forward on another thread gives that thread an OpenMP team of its own)."""
    inner = unwrapped(model)
    head = inner.get_output_embeddings()
    ids = ((torch.arange(8) * 37 + 11) % head.weight.shape[0]).to(head.weight.device)[None]  # (1, 8)
    training = inner.training
    inner.eval()
    try:
        with torch.no_grad(), _autocast(inner):
            hidden = inner.get_decoder()(input_ids=ids).last_hidden_state  # (1, 8, H)
            mine = _head_transform(inner.config)(head(hidden).float())  # (1, 8, V)
            theirs = inner(input_ids=ids).logits.float()  # (1, 8, V)
    finally:
        inner.train(training)
    return bool((mine - theirs).abs().max() <= 1e-2 * theirs.abs().max() + 1e-3)


def shares_prefixes(model: Any) -> bool:
    """Whether the decoder's cache is plain keys and values in every layer (full or sliding attention), so
    that a shared prompt can be computed once: its forward takes a cache, the model keeps no recurrent
    state (transformers' `_is_stateful`: RWKV, xLSTM, Mamba and its hybrids) and no layer is of another kind
    (linear attention)."""
    inner = unwrapped(model)
    config = inner.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    return (
        not getattr(inner, "_is_stateful", False)
        and _cache_argument(type(inner.get_decoder())) is not None
        and (layer_types is None or set(layer_types) <= {"full_attention", "sliding_attention"})
    )


@functools.cache
def _cache_argument(decoder: type) -> str | None:
    """The forward's cache argument: transformers 5.2x renamed `past_key_values` to `cache` (the old name is
    deprecated); None if it takes neither by name."""
    parameters = inspect.signature(decoder.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def _hidden(inner: Any, batch: MicroBatch) -> tuple[torch.Tensor, int]:
    """The decoder's hidden states (B, T - start, H) of positions start.. of every row, and start: 0, or
    with a shared prompt (`batch.shared` = P) P - 1, its last position being each row's first (it predicts
    the row's first own token)."""
    decoder = inner.get_decoder()
    start = batch.shared - 1
    if start < 1:
        return decoder(
            input_ids=batch.ids, attention_mask=_padding_mask(batch.attention)
        ).last_hidden_state, 0
    from transformers import DynamicCache

    cache = DynamicCache(config=inner.config)
    name = _cache_argument(type(decoder)) or "past_key_values"  # (shares_prefixes checked it has one)
    decoder(input_ids=batch.ids[:1, :start], **{name: cache}, use_cache=True)  # the prompt, once
    cache.batch_repeat_interleave(
        batch.ids.shape[0]
    )  # (its keys and values for every row; grads summed back)
    own = decoder(
        input_ids=batch.ids[:, start:],  # (B, T - start)
        attention_mask=_padding_mask(batch.attention),  # (over the cached positions and these)
        **{name: cache},
        use_cache=True,
    )
    return own.last_hidden_state, start
