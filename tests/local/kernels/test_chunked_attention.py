"""The training attention (local/kernels/chunked_attention.py): outputs and gradients equal plain attention's (fp64,
through autograd) for causal and masked attention, grouped heads, one chunk or many, probabilities kept or
recomputed, in fp32 and bf16; rows that see nothing stay finite and give no gradient."""

from __future__ import annotations

import pytest
import torch

import artrl.local.kernels.chunked_attention as chunked
from artrl.local.kernels.chunked_attention import chunked_attention


def _plain(query, key, value, mask, scale):  # (B, H, q, D), (B, H_kv, T, D) x2 -> (B, q, H, D), in fp64
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    q_length, length = query.shape[2], key.shape[2]
    if mask is None:
        mask = torch.ones(q_length, length, dtype=torch.bool).tril(length - q_length)[None, None]
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~mask, torch.finfo(query.dtype).min)
    return (torch.softmax(scores, -1) @ value).transpose(1, 2)


def _inputs(batch, heads, kv_heads, q_length, length, dim, masked):
    g = torch.Generator().manual_seed(batch * 100 + q_length)
    query = torch.randn(batch, q_length, heads, dim, generator=g).transpose(1, 2)  # (as the models give it)
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    mask = None
    if masked:  # causal over a prefix; row 0 left-padded (3 keys), its first two queries see nothing
        mask = torch.ones(q_length, length, dtype=torch.bool).tril(length - q_length)
        mask = mask[None, None].repeat(batch, 1, 1, 1)
        mask[0, :, :, :3] = False
        mask[0, :, :2] = False
    weights = torch.randn(batch, q_length, heads, dim, generator=g)  # of the outputs, in the loss
    if masked:  # (as in training: the output of a query that sees nothing, padding, reaches no loss)
        weights[~mask[:, 0].any(-1)] = 0
    return query, key, value, mask, weights


def _run(fn, tensors, mask, weights, dtype):
    leaves = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in tensors]
    out = fn(*leaves, mask, 0.125)
    (out.double() * weights.double()).sum().backward()
    return [out.detach().double()] + [t.grad.double() for t in leaves]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("chunk_bytes", [8 * 2**20, 20_000])
@pytest.mark.parametrize(
    "shape,masked",
    [
        ((2, 4, 2, 7, 7, 32), False),  # causal self-attention, two query heads per key/value head
        ((2, 4, 2, 5, 12, 32), True),  # new tokens over a prefix, with padding
        ((3, 8, 4, 33, 50, 64), True),
        ((3, 8, 8, 33, 50, 64), False),  # one query head per key/value head, causal over a prefix
        ((3, 6, 2, 40, 40, 16), True),
    ],
)
def test_equals_plain_attention_with_its_gradients(
    monkeypatch, dtype, tolerance, keep, chunk_bytes, shape, masked
):
    monkeypatch.setattr(chunked, "KEEP_PROBS_BYTES", 64 * 2**20 if keep else 0)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", chunk_bytes)  # 20 kB: chunks of a few queries
    query, key, value, mask, weights = _inputs(*shape, masked)
    ours = _run(chunked_attention, (query, key, value), mask, weights, dtype)
    reference = _run(_plain, (query, key, value), mask, weights, torch.float64)
    if masked:  # the blind queries: a uniform mix in both (over other keys), left out of the comparison
        blind = ~mask[:, 0].any(-1)  # (B, q)
        ours[0][blind] = reference[0][blind] = 0
    for name, mine, theirs in zip(("out", "query", "key", "value"), ours, reference, strict=True):
        error = float((mine - theirs).abs().max() / theirs.abs().max())
        assert error < tolerance, (name, error)
    assert ours[0].dtype == torch.float64 and ours[0].shape == (shape[0], shape[3], shape[1], shape[5])


@pytest.mark.parametrize("keep", [True, False])
def test_rows_that_see_nothing_get_a_uniform_mix_and_give_no_gradient(monkeypatch, keep):
    monkeypatch.setattr(chunked, "KEEP_PROBS_BYTES", 64 * 2**20 if keep else 0)
    query, key, value, mask, _ = _inputs(2, 4, 2, 5, 12, 32, masked=True)
    query.requires_grad_(True)
    out = chunked_attention(query, key, value, mask, 0.125)
    assert torch.isfinite(out).all()
    mix = value[0].repeat_interleave(2, 0).mean(1)  # (H, D): over the keys of its chunk (one chunk: all)
    assert torch.allclose(out[0, :2], mix.expand(2, -1, -1), atol=1e-5)
    out[0, :2].sum().backward()  # only the blind queries' outputs
    assert torch.equal(query.grad, torch.zeros_like(query.grad))


def test_causal_chunks_read_only_the_keys_their_queries_see():
    """With chunks of one query, query i of a causal attention over a prefix needs T - q + i + 1 keys: the
    keys after that have no effect on its output and get no gradient from it."""
    query, key, value, _, _ = _inputs(1, 2, 1, 6, 10, 16, masked=False)
    key.requires_grad_(True)
    out = chunked_attention(query, key, value, None, 0.25)
    out[0, 0].sum().backward()  # query 0 sees keys 0..4
    assert key.grad[0, 0, 5:].abs().max() == 0 and key.grad[0, 0, :5].abs().max() > 0


@pytest.mark.parametrize("mask_shape", [(1, 1, 9, 14), (3, 1, 1, 14)])
def test_masks_that_broadcast_over_rows_or_queries(monkeypatch, mask_shape):
    """A mask shared by the batch's rows (1, 1, q, T), or one per row shared by its queries (B, 1, 1, T)."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 5_000)  # (chunks of a few queries)
    query, key, value, _, weights = _inputs(3, 4, 2, 9, 14, 16, masked=False)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(mask_shape, generator=g) > 0.3
    mask[..., 0] = True  # (every query sees something)
    ours = _run(chunked_attention, (query, key, value), mask, weights, torch.float32)
    reference = _run(_plain, (query, key, value), mask, weights, torch.float64)
    for mine, theirs in zip(ours, reference, strict=True):
        assert float((mine - theirs).abs().max() / theirs.abs().max()) < 2e-5


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "mistral_sliding", "gemma3"])
@pytest.mark.parametrize("left_padded", [False, True])
def test_bf16_training_in_each_architecture_equals_sdpa(architecture, left_padded):
    """A bf16 model switched to artrl's attention (`use_cpu_attention`) trains through `chunked_attention`:
    its log-probabilities and gradients equal the same model's with transformers' sdpa, causal (no mask) and
    with a left-padded mask, sliding windows (Mistral) and a query-pre-attention scale (Gemma 3) included."""
    import transformers as tf

    from artrl.local.kernels.cpu_attention import NAME, use_cpu_attention

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    config, cls = {
        "qwen3": (tf.Qwen3Config(**shape), tf.Qwen3ForCausalLM),
        "llama": (tf.LlamaConfig(**shape), tf.LlamaForCausalLM),
        "mistral_sliding": (tf.MistralConfig(**shape, sliding_window=8), tf.MistralForCausalLM),
        "gemma3": (
            tf.Gemma3TextConfig(**shape, sliding_window=8, query_pre_attn_scalar=24),
            tf.Gemma3ForCausalLM,
        ),
    }[architecture]
    torch.manual_seed(0)
    model = cls(config).to(torch.bfloat16).train()
    ids = torch.randint(5, 300, (3, 40))
    attention = torch.ones_like(ids)
    if left_padded:
        attention[1, :7] = 0
        attention[2, :15] = 0

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        # (positions whose query is padding see nothing: their outputs are no one's to compare)
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * attention[:, :-1]
        lp.sum().backward()
        return lp.detach(), [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

    reference, reference_grads = run()
    assert use_cpu_attention(model) and model.config._attn_implementation == NAME
    ours, grads = run()
    assert (ours - reference).abs().max() < 0.1
    for mine, theirs in zip(grads, reference_grads, strict=True):
        assert float((mine - theirs).abs().max()) <= 0.05 * float(theirs.abs().max()) + 1e-3
