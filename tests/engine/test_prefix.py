"""Prompt prefixes kept as key/value states: the same scores as whole prompts, for every
built-in template, within the cache's byte budget."""

from __future__ import annotations

import dask.config
import pytest
import torch

import dask_pcm.engine.passes as passes_module
import dask_pcm.engine.prefix as prefix_module
from dask_pcm.apps.fever import demo_claims, get_templates
from dask_pcm.apps.fever.scoring import score_generate, score_logits
from dask_pcm.apps.fever.units import template_head
from dask_pcm.engine.llm import CausalLM
from dask_pcm.engine.prefix import (
    MIN_PREFIX_TOKENS,
    PACK_TOKENS,
    PrefixCache,
    balanced,
    pack,
    shared_prefix,
)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return CausalLM(device="cpu")(tiny_model_dir)


@pytest.mark.parametrize("template", get_templates(None), ids=lambda t: t.name)
def test_every_builtin_template_scores_the_same_with_its_prefix_kept(lm, template):
    claims = [c.claim for c in demo_claims().claims[:12]]
    prompts = [template.render(c, lm.tokenizer) for c in claims]
    head = template_head(template, lm.tokenizer)
    assert all(p.startswith(head) for p in prompts)
    whole = score_logits(lm, prompts, template.answers)
    kept = score_logits(lm, prompts, template.answers, prefix=head)
    assert [r["predicted"] for r in kept] == [r["predicted"] for r in whole]
    scores = [k for k in whole[0] if k.startswith("score_")]
    got = torch.tensor([[r[k] for k in scores] for r in kept])
    want = torch.tensor([[r[k] for k in scores] for r in whole])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_prefix_runs_once_and_later_calls_reuse_it(lm, monkeypatch):
    import dask_pcm.engine.prefix as prefix_module

    template = get_templates("few-shot")[0]
    head = template_head(template, lm.tokenizer)
    lm.prefix_cache.clear()
    runs = []
    real = prefix_module.prefix_states
    monkeypatch.setattr(prefix_module, "prefix_states", lambda *a: runs.append(a[1]) or real(*a))
    for start in (0, 4, 8):
        chunk = [c.claim for c in demo_claims().claims[start : start + 4]]
        lm.next_token_logits([template.render(c, lm.tokenizer) for c in chunk], prefix=head)
    assert len(runs) == 1 and len(lm.prefix_cache) == 1
    assert lm.prefix_cache_bytes == lm.prefix_cache.nbytes > 0


def test_prompts_of_mixed_lengths_come_back_in_their_order(lm):
    prompts = ["a", "the claim that runs on " * 6, "short one", "the claim " * 3]
    together = lm.next_token_logits(prompts)
    alone = torch.cat([lm.next_token_logits([p]) for p in prompts])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_the_shared_prefix_stops_where_tokenizations_differ():
    assert shared_prefix([[5, 6, 7, 8], [5, 6, 9]], [5, 6, 7]) == 2
    assert shared_prefix([[5, 6, 7, 8], [5, 6, 7, 9]], [5, 6]) == 2  # no further than the text
    assert shared_prefix([[5]], [5]) == 0  # every prompt keeps a token of its own


def test_the_cache_keeps_within_its_budget_least_recently_used_out():
    state = [(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))]  # 512 bytes
    cache = PrefixCache(limit=1200)
    cache.put((1,), state)
    cache.put((2,), state)
    assert cache.get((1,)) is state  # now (2,) is the least recently used
    cache.put((3,), state)
    assert cache.get((2,)) is None and cache.get((1,)) is state and cache.nbytes == 1024
    cache.put((4,), [(torch.zeros(1, 2, 40, 8), torch.zeros(1, 2, 40, 8))])  # over the budget
    assert cache.get((4,)) is None and cache.nbytes == 1024


def test_a_loader_without_a_prefix_budget_keeps_none(tiny_model_dir):
    with dask.config.set({"pcm.worker.prefix-cache": None}):
        plain = CausalLM(device="cpu")(tiny_model_dir)
    assert plain.prefix_cache is None
    template = get_templates("few-shot")[0]
    prompts = [template.render("Snow is white.", plain.tokenizer)] * 2
    head = template_head(template, plain.tokenizer)
    torch.testing.assert_close(
        plain.next_token_logits(prompts, prefix=head), plain.next_token_logits(prompts)
    )


@pytest.mark.parametrize("template", get_templates(None), ids=lambda t: t.name)
def test_every_builtin_template_generates_the_same_tokens_with_its_prefix_kept(lm, template):
    claims = [c.claim for c in demo_claims().claims[:6]]
    prompts = [template.render(c, lm.tokenizer) for c in claims]
    head = template_head(template, lm.tokenizer)
    lm.prefix_cache.clear()
    kept = score_generate(lm, prompts, template.answers, 8, prefix=head)
    whole = score_generate(lm, prompts, template.answers, 8)
    assert kept == whole
    assert len({row["generated"] for row in whole}) > 1  # not one text for every claim
    shared = shared_prefix(lm.tokenizer(prompts)["input_ids"], lm.tokenizer(head)["input_ids"])
    assert len(lm.prefix_cache) == (shared >= MIN_PREFIX_TOKENS)  # and it was kept


def test_greedy_generation_is_what_transformers_generates(lm):
    prompts = ["The claim is", "A much longer prompt about rivers and mountains is", "x"]
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = lm.model.generate(**enc, max_new_tokens=6, do_sample=False)
    want = lm.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert lm.generate(prompts, 6) == want
    assert [lm.complete(p, 6) for p in prompts] == want


def test_short_rows_after_a_kept_prefix_share_one_pass_and_score_as_alone(lm, monkeypatch, request):
    template = get_templates("few-shot")[0]
    head = template_head(template, lm.tokenizer)
    prompts = [template.render(c.claim, lm.tokenizer) for c in demo_claims().claims[:20]]
    alone = torch.cat([lm.next_token_logits([p]) for p in prompts])
    lm.next_token_logits(prompts, prefix=head)  # the prefix's states, kept
    ids = lm.tokenizer(prompts)["input_ids"]
    shared = shared_prefix(ids, lm.tokenizer(head)["input_ids"])
    own = sorted(len(seq) - shared for seq in ids)
    sequences = balanced(own, PACK_TOKENS)
    calls = []
    hook = lm.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    request.addfinalizer(hook.remove)
    kept = lm.next_token_logits(prompts, prefix=head)
    torch.testing.assert_close(kept, alone, atol=1e-4, rtol=0)
    # 20 rows, more than batch_size: one pass, its rows end to end in one sequence (the
    # rows' attention, engine.attention), no padding.
    assert lm.batch_size == 8 and len(sequences) <= 8
    assert calls == [(1, sum(own))]
    # Shorter sequences: more of them, in as many passes as batch_size asks.
    monkeypatch.setattr(passes_module, "PACK_TOKENS", 40)
    monkeypatch.setattr(prefix_module, "PACK_TOKENS", 40)
    calls.clear()
    torch.testing.assert_close(lm.next_token_logits(prompts, prefix=head), alone, atol=1e-4, rtol=0)
    count = len(pack(own, 40))
    assert len(calls) == -(-count // 8) and sum(n for _, n in calls) == sum(own)
    # Where the rows' attention does not apply: packed sequences under a mask.
    monkeypatch.setattr(prefix_module, "applies", lambda model: False)
    calls.clear()
    torch.testing.assert_close(lm.next_token_logits(prompts, prefix=head), alone, atol=1e-4, rtol=0)
    assert [n for n, _ in calls] == [8] * (count // 8) + ([count % 8] if count % 8 else [])


def test_sequences_are_balanced_in_as_few_as_packing_needs():

    # 16 claims of 18 tokens: 288, over one sequence of 256; two of 144, not 252 and 36
    # (a pass is as wide as its longest sequence).
    sixteen = balanced([18] * 16, 256)
    assert [len(seq) for seq in sixteen] == [8, 8]
    lengths = [3, 9, 4, 4, 7, 1, 8, 2, 6, 5, 5, 3]
    for limit in (9, 12, 16, 20, 57, 100):
        greedy, even = pack(lengths, limit), balanced(lengths, limit)
        assert len(even) == len(greedy)
        assert sorted(i for seq in even for i in seq) == list(range(len(lengths)))
        assert all(seq == sorted(seq) for seq in even)  # in order, end to end
        width = [max(sum(lengths[i] for i in seq) for seq in s) for s in (greedy, even)]
        assert width[1] <= width[0] <= limit
    assert balanced([300, 5], 256) == pack([300, 5], 256)  # a row over the limit stays alone


def test_the_packed_layout_lets_each_row_see_the_prefix_and_itself():
    from dask_pcm.engine.prefix import pack, packed

    rows = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    sequences = pack([len(r) for r in rows], limit=6)
    assert sequences == [[0, 1, 2], [3]]
    ids, mask, positions, starts = packed(rows, sequences, pad_id=0, prefix_len=2)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]]
    assert positions.tolist() == [[2, 3, 4, 2, 2, 3], [2, 2, 2, 3, 4, 5]]
    assert starts == [(0, 0), (0, 3), (0, 4), (1, 2)]
    seen = mask[0, 0, 5].tolist()  # the last token of row 2: the prefix, its row up to itself
    assert seen == [True, True, False, False, False, False, True, True]
    assert mask[1, 0, 0].tolist() == [True, True, True, False, False, False, False, False]
