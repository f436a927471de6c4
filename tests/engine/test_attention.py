"""Block-local attention for rows end to end after a kept prefix: each query scored against
the prefix and its own row only, as the prompt alone would be; ragged rows, grouped-query
attention, a fallback where a model's attention cannot be replaced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dask_pcm.engine.prefix as prefix_module
from dask_pcm.engine.attention import NAME, applies, blocks_of, rows_attention
from dask_pcm.engine.prefix import balanced, forward, packed, prefix_states

HEADS, KV_HEADS, DIM = 6, 2, 8  # three query heads per key/value head


def alone(query, key, value, prefix_keys, prefix_values, lengths, scale):
    """Each row on its own: its queries against the prefix's keys and its own keys up to
    themselves, every query head with its key/value head (plain softmax attention)."""
    group = query.shape[1] // key.shape[1]
    out, start = [], 0
    for n in lengths:
        q = query[0, :, start : start + n]
        k = torch.cat([prefix_keys[0], key[0, :, start : start + n]], 1)
        v = torch.cat([prefix_values[0], value[0, :, start : start + n]], 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) * scale
        width = prefix_keys.shape[2]
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores[:, :, width:] = scores[:, :, width:].masked_fill(later, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))  # [n, heads, dim]
        start += n
    return torch.cat(out)[None]


@pytest.mark.parametrize(
    ("lengths", "block"),
    [([1, 5, 2, 7, 3], 8), ([1, 5, 2, 7, 3], 64), ([4], 8), ([1, 1, 1], 2), ([9, 2], 4)],
)
def test_each_query_sees_the_prefix_and_its_own_row_only(lengths, block):
    torch.manual_seed(0)
    tokens, width, scale = sum(lengths), 5, DIM**-0.5
    # As a model's layers hand them over: [1, heads, tokens, dim], laid token by token.
    query = torch.randn(1, tokens, HEADS, DIM).transpose(1, 2)
    key = torch.randn(1, tokens, KV_HEADS, DIM).transpose(1, 2)
    value = torch.randn(1, tokens, KV_HEADS, DIM).transpose(1, 2)
    prefix = [(torch.randn(1, KV_HEADS, width, DIM), torch.randn(1, KV_HEADS, width, DIM))]
    layer = SimpleNamespace(layer_idx=0)
    rows = [[0] * n for n in lengths]
    _, mask, _, starts = packed(rows, balanced(lengths, block), 0, width)
    blocks = blocks_of(lengths, starts, mask, torch.float32, "cpu")

    def attend():
        return rows_attention(
            layer, query, key, value, None, scaling=scale, pcm_blocks=blocks, pcm_prefix=prefix
        )

    got, weights = attend()
    assert weights is None and got.shape == (1, tokens, HEADS, DIM)
    want = alone(query, key, value, *prefix[0], lengths, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Another row's keys and values change nothing of the first row.
    first = lengths[0]
    key[0, :, first:] += 10.0
    value[0, :, first:] -= 3.0
    torch.testing.assert_close(attend()[0][:, :first], got[:, :first], atol=1e-6, rtol=0)


def _gqa_llama(attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).eval()


def _whole(model, prefix, rows, keep):
    """The last ``keep`` positions' logits of each prompt (prefix + row) run alone."""
    out = []
    for row in rows:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prefix + row]), use_cache=False).logits[0]
        kept = logits[-min(keep, len(row)) :]
        out.append(torch.cat([kept[:1].expand(keep - len(kept), -1), kept]))
    return torch.stack(out)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_pass_after_a_kept_prefix_is_one_sequence_scored_as_each_prompt_alone(attention):
    model = _gqa_llama(attention)
    prefix = [5, 17, 3, 44, 9, 21]
    rows = [[7], [8, 1, 2, 60], [33, 34], [2, 2, 2, 2, 2, 2, 2], [90, 12, 4]]
    states = prefix_states(model, prefix, "cpu")
    seen = []

    def watch(module, args, kwargs):
        seen.append((tuple(kwargs["input_ids"].shape), model.config._attn_implementation))

    for keep in (1, 3):
        want = _whole(model, prefix, rows, keep)
        hook = model.register_forward_pre_hook(watch, with_kwargs=True)
        try:
            got = forward(model, rows, 0, "cpu", states, len(prefix), keep=keep)
        finally:
            hook.remove()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # One sequence of the rows' own tokens, no padding, under the rows' attention; the
    # model's own attention back after the pass.
    assert seen == [((1, sum(map(len, rows))), NAME)] * 2
    assert model.config._attn_implementation == attention and applies(model)


def test_a_pass_after_a_kept_prefix_builds_its_blocks_once_and_heads_only_kept_rows(
    monkeypatch,
):
    # What a pass pays beyond the matrix products must not grow with its layers or its
    # positions: the blocks (gather, scatter, mask) are built once per pass, not per layer,
    # and the language-model head sees each row's last `keep` positions only, not every
    # position of the sequence (its vocabulary-wide product is the pass's largest).
    model = _gqa_llama()
    prefix = [5, 17, 3, 44, 9, 21]
    rows = [[7], [8, 1, 2, 60], [33, 34], [2, 2, 2, 2, 2, 2, 2], [90, 12, 4]]
    states = prefix_states(model, prefix, "cpu")
    built = []

    def counted(*args, **kwargs):
        built.append(1)
        return blocks_of(*args, **kwargs)

    monkeypatch.setattr(prefix_module, "blocks_of", counted)
    heads = []
    hook = model.lm_head.register_forward_pre_hook(
        lambda module, args: heads.append(tuple(args[0].shape))
    )
    try:
        for keep in (1, 3):
            forward(model, rows, 0, "cpu", states, len(prefix), keep=keep)
    finally:
        hook.remove()
    assert model.config.num_hidden_layers > 1 and built == [1, 1]
    hidden = model.config.hidden_size
    assert heads == [(1, len(rows), hidden), (1, sum(min(3, len(r)) for r in rows), hidden)]


def test_a_model_whose_attention_cannot_be_replaced_keeps_the_masked_packing(monkeypatch):
    model = _gqa_llama()
    model.config.attn_logit_softcapping = 50.0  # a cap the rows' attention does not apply
    assert not applies(model) and prefix_module.packable(model)
    prefix = [5, 17, 3, 44, 9]
    rows = [[7], [8, 1, 2, 60], [33, 34]]
    states = prefix_states(model, prefix, "cpu")
    monkeypatch.setattr(prefix_module, "PACK_TOKENS", 5)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        got = forward(model, rows, 0, "cpu", states, len(prefix))
    finally:
        hook.remove()
    assert shapes == [(2, 5)]  # packed: [7] + [8, 1, 2, 60], then [33, 34] padded
    torch.testing.assert_close(got, _whole(model, prefix, rows, 1), atol=1e-5, rtol=0)
