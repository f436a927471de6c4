"""Prompt prefixes kept as key/value states: the same scores as whole prompts, for every
built-in template, within the cache's byte budget."""

from __future__ import annotations

import dask.config
import pytest
import torch

from dask_pcm.fever import demo_claims, get_templates
from dask_pcm.fever.scoring import score_logits
from dask_pcm.fever.units import template_head
from dask_pcm.loaders.llm import CausalLM
from dask_pcm.loaders.prefix import PrefixCache, shared_prefix


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
    import dask_pcm.loaders.prefix as prefix_module

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
