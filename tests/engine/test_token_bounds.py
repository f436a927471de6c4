"""Prompts that surely fit are not tokenized twice (dask_pcm.engine.model.prompt_problems):
the bound holds for every text, and what does not surely fit is counted exactly."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import dask_pcm.engine.model as model_module
from dask_pcm.engine.llm import CausalLM, LanguageModel
from dask_pcm.engine.model import (
    count_tokens,
    max_tokens,
    prompt_problem,
    prompt_problems,
    token_bounds,
)

TEXTS = [
    "",
    "Nikolaj Coster-Waldau worked with the Fox Broadcasting Company.",
    "Ærøskøbing, Zürich, São Paulo, Kraków: façade naïve coöperate",
    "北京是中华人民共和国的首都。東京は日本の首都です。",
    "emoji 🧪🔬🧬👩🏽‍🔬 and 🇩🇰",
    "<|im_start|>user\nIs it true?<|im_end|>\n<|im_start|>assistant\n",
    "   \t\n  spaces    and\ttabs\n\n\n",
    "ﷺ ﬁ ㎏ Ⅻ",  # characters a normalizer would expand
]


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir) -> LanguageModel:
    return CausalLM(device="cpu")(str(tiny_model_dir))


def test_the_bound_is_never_below_the_tokens(tiny_lm):
    bounds = token_bounds(tiny_lm, TEXTS)
    assert bounds is not None  # a byte-level tokenizer without a normalizer
    for text, bound, tokens in zip(TEXTS, bounds, count_tokens(tiny_lm, TEXTS), strict=True):
        assert tokens <= bound, text


def test_prompts_that_surely_fit_are_not_tokenized(tiny_lm, monkeypatch):
    def counted(lm, texts):
        raise AssertionError(f"tokenized {texts!r}")

    monkeypatch.setattr(model_module, "count_tokens", counted)
    assert prompt_problems(tiny_lm, TEXTS) == [None] * len(TEXTS)


def test_what_may_not_fit_is_counted_and_judged_exactly(tiny_lm):
    context = max_tokens(tiny_lm)
    assert context is not None
    # Bytes beyond the context, but few tokens (a repeated word merges): fits after counting.
    merged = "the " * (context // 2)
    too_long = " ".join(f"w{i}" for i in range(context))
    texts = [*TEXTS, merged, too_long]
    expected = [prompt_problem(tiny_lm, n) for n in count_tokens(tiny_lm, texts)]
    assert prompt_problems(tiny_lm, texts) == expected
    assert expected[-1] is not None and "context" in expected[-1]
    assert expected[-2] is None


def test_a_tokenizer_with_a_normalizer_gives_no_bound(tiny_lm):
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "fi": 1}, unk_token="[UNK]"))
    backend.normalizer = normalizers.NFKC()  # "ﬁ" (3 bytes) becomes "fi"; "ﷺ" 18 characters
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    lm = SimpleNamespace(
        tokenizer=tokenizer,
        model=tiny_lm.model,
        memory_budget=tiny_lm.memory_budget,
        device=tiny_lm.device,
        source="normalizing tokenizer",
        label="normalizing tokenizer",
        lock=threading.Lock(),
    )
    assert token_bounds(lm, TEXTS) is None
    expected = [prompt_problem(lm, n) for n in count_tokens(lm, TEXTS)]
    assert prompt_problems(lm, TEXTS) == expected
