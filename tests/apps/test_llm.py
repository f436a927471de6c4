"""The batch layer's built-in LLM tasks (dask_pcm.apps.llm) on the tiny random Llama."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import dask_pcm
from dask_pcm.apps import llm
from dask_pcm.engine.generation import completion, continuation_start
from dask_pcm.engine.model import count_tokens

PROMPTS = [
    "Paris is the",
    "The quick brown fox jumps over the lazy dog and the",
    "Water",
    "Marie Curie won two Nobel Prizes. Albert Einstein developed",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return dask_pcm.CausalLM(device="cpu")(str(tiny_model_dir))


def rows_of(prompts):
    return [{"prompt": p} for p in prompts]


def test_greedy_text_is_the_models_generate_alone_or_batched(lm):
    out = llm.generate(rows_of(PROMPTS), context=lm, max_tokens=10)
    assert [r["text"] for r in out] == lm.generate(PROMPTS, 10)
    alone = [llm.generate(rows_of([p]), context=lm, max_tokens=10)[0] for p in PROMPTS]
    assert alone == out
    counts = count_tokens(lm, PROMPTS)
    assert [r["prompt_tokens"] for r in out] == counts
    # The random model never says EOS within 10 tokens: every row ran to the limit.
    assert {(r["finish_reason"], r["completion_tokens"]) for r in out} == {("length", 10)}


def test_sampling_is_reproducible_per_seed_whatever_the_packing(lm):
    def texts(rows, seed):
        out = llm.generate(rows, context=lm, max_tokens=12, temperature=1.5, seed=seed)
        return [r["text"] for r in out]

    together = texts(rows_of(PROMPTS), 7)
    alone = [texts(rows_of([p]), 7)[0] for p in PROMPTS]
    reversed_ = texts(rows_of(PROMPTS[::-1]), 7)[::-1]
    assert together == alone == reversed_
    other = texts(rows_of(PROMPTS), 8)
    assert all(a != b for a, b in zip(together, other, strict=True))
    greedy = [r["text"] for r in llm.generate(rows_of(PROMPTS), context=lm, max_tokens=12)]
    assert together != greedy


@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 1.5, "seed": 7}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}],
    ids=["greedy", "sampled", "nucleus"],
)
def test_generation_keeps_the_prompts_shared_start_and_gives_the_same_text(lm, options):
    head = "You answer questions about places and people in a few words. " * 3
    rows = rows_of([head + p for p in PROMPTS])
    whole = llm.generate(rows, context=replace(lm, prefix_cache=None), max_tokens=10, **options)
    lm.prefix_cache.clear()
    widths = []
    hook = lm.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    try:
        kept = llm.generate(rows, context=lm, max_tokens=10, **options)
    finally:
        hook.remove()
    assert kept == whole
    assert len(lm.prefix_cache) == 1  # the shared start, computed once and kept
    head_tokens = len(lm.tokenizer(head)["input_ids"])
    longest = max(count_tokens(lm, [r["prompt"] for r in rows]))
    assert widths[0] >= head_tokens - 2  # the prefix's own pass, then the rest only
    assert max(widths[1:]) <= longest - head_tokens + 2


def test_a_tiny_nucleus_samples_the_greedy_tokens(lm):
    greedy = llm.generate(rows_of(PROMPTS), context=lm, max_tokens=8)
    nucleus = llm.generate(
        rows_of(PROMPTS), context=lm, max_tokens=8, temperature=1.0, top_p=1e-9, seed=3
    )
    assert nucleus == greedy


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_stop_string_cuts_the_text_and_sets_the_finish_reason(lm, temperature):
    row = rows_of(PROMPTS[:1])
    full = llm.generate(row, context=lm, max_tokens=12, temperature=temperature, seed=1)[0]
    # A plain character some way into the text, so that generation ends before the limit.
    stop = next(c for c in full["text"][2:] if c.isascii() and c.isalnum())
    cut = llm.generate(
        row, context=lm, max_tokens=12, temperature=temperature, seed=1, stop=["zzz", stop]
    )[0]
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    assert cut["completion_tokens"] < 12
    assert cut["prompt_tokens"] == full["prompt_tokens"]
    assert llm.generate(row, context=lm, max_tokens=12, stop="zzz")[0]["finish_reason"] == "length"


def test_the_end_of_sequence_token_ends_the_text(lm):
    tok = lm.tokenizer
    tokens = [*tok("Paris is", add_special_tokens=False)["input_ids"], tok.eos_token_id, 5, 6]
    result = completion(tok, tokens, {tok.eos_token_id}, [], prompt_tokens=3)
    assert result == {
        "text": "Paris is",
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": len(tokens) - 2,
    }


def test_chat_messages_go_through_the_chat_template_or_a_plain_fallback(lm):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Water"}]
    saved = lm.tokenizer.chat_template
    try:
        lm.tokenizer.chat_template = CHAT_TEMPLATE
        rendered = "[system] Be brief.\n[user] Water\n[assistant]"
        got = llm.generate([{"messages": chat, "prompt": "ignored"}], context=lm, max_tokens=6)
        assert got == llm.generate(rows_of([rendered]), context=lm, max_tokens=6)
        # A template that writes <s> itself does not get a second one from the tokenizer.
        lm.tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
        with_bos = llm.generate([{"messages": chat}], context=lm, max_tokens=6)[0]
        assert with_bos["prompt_tokens"] == got[0]["prompt_tokens"]
        lm.tokenizer.chat_template = None
        fallback = "system: Be brief.\nuser: Water\nassistant:"
        got = llm.generate([{"messages": chat}], context=lm, max_tokens=6)
        assert got == llm.generate(rows_of([fallback]), context=lm, max_tokens=6)
    finally:
        lm.tokenizer.chat_template = saved


def reference_score(lm, prompt, choice):
    """Unbatched: one forward pass over prompt + choice, the choice's log-probabilities."""
    full = lm.tokenizer(prompt + choice)["input_ids"]
    start = len(lm.tokenizer(prompt)["input_ids"])
    assert full[:start] == lm.tokenizer(prompt)["input_ids"]  # a clean boundary here
    with torch.inference_mode():
        logprobs = torch.log_softmax(lm.model(torch.tensor([full])).logits[0].float(), -1)
    return sum(float(logprobs[j - 1, full[j]]) for j in range(start, len(full)))


def test_choice_scores_match_one_forward_pass_per_choice(lm):
    rows = [
        {"prompt": p, "options": c}
        for p, c in zip(
            PROMPTS,
            [[" capital", " river"], [" cat", " dog", " fox jumps"], [" boils"], [" a", " b"]],
            strict=True,
        )
    ]
    out = llm.score_choices(rows, context=lm, choices="options")
    for row, result in zip(rows, out, strict=True):
        expected = [reference_score(lm, row["prompt"], c) for c in row["options"]]
        assert result["scores"] == pytest.approx(expected, abs=1e-4)
        best = max(range(len(expected)), key=expected.__getitem__)
        assert (result["best_index"], result["best"]) == (best, row["options"][best])
    fixed = llm.score_choices(rows_of(PROMPTS), context=lm, choices=[" true", " false"])
    assert fixed[2]["scores"] == pytest.approx(
        [reference_score(lm, PROMPTS[2], c) for c in (" true", " false")], abs=1e-4
    )


def test_choice_scores_reuse_a_kept_prefix(lm):
    prompt = "Read the claim and decide whether it is supported, refuted, or unverifiable. Answer:"
    choices = [" supported", " refuted", " unverifiable"]
    lm.prefix_cache.clear()
    cached = llm.score_choices(rows_of([prompt]), context=lm, choices=choices)[0]
    assert len(lm.prefix_cache) == 1
    expected = [reference_score(lm, prompt, c) for c in choices]
    assert cached["scores"] == pytest.approx(expected, abs=1e-4)


def test_a_choice_that_merges_with_the_prompts_last_token_is_scored_from_there(lm):
    tok = lm.tokenizer
    prompt, choice = "Paris is the capit", "al"
    full = tok(prompt + choice)["input_ids"]
    alone = tok(prompt)["input_ids"]
    start = continuation_start(alone, full)
    assert full[:start] == alone[:start] and start < len(alone)
    assert tok.decode(full[start:]).endswith("al")
    score = llm.score_choices(rows_of([prompt]), context=lm, choices=[choice])[0]["scores"][0]
    with torch.inference_mode():
        logprobs = torch.log_softmax(lm.model(torch.tensor([full])).logits[0].float(), -1)
    expected = sum(float(logprobs[j - 1, full[j]]) for j in range(start, len(full)))
    assert score == pytest.approx(expected, abs=1e-4)


def test_embeddings_are_unit_vectors_of_hidden_size_whatever_the_padding(lm):
    short, long = "Paris", "The quick brown fox jumps over the lazy dog. " * 3
    batched = llm.embed([{"text": short}, {"text": long}], context=lm)
    alone = llm.embed([{"text": short}], context=lm)
    assert len(batched[0]["embedding"]) == lm.model.config.hidden_size
    assert all(math.isclose(sum(x * x for x in r["embedding"]), 1.0, rel_tol=1e-5) for r in batched)
    assert batched[0]["embedding"] == pytest.approx(alone[0]["embedding"], abs=1e-5)
    assert batched[0]["tokens"] == len(lm.tokenizer(short)["input_ids"])
    raw = llm.embed([{"text": short}], context=lm, normalize=False)[0]["embedding"]
    norm = math.sqrt(sum(x * x for x in raw))
    assert norm != pytest.approx(1.0)
    assert [x / norm for x in raw] == pytest.approx(alone[0]["embedding"], abs=1e-5)


def test_a_prompt_too_long_for_the_context_raises_naming_the_row(lm):
    long = "The quick brown fox jumps over the lazy dog. " * 200  # over 512 tokens
    rows = [{"prompt": "Water", "text": "Water"}, {"prompt": long, "text": long}]
    for run in (
        lambda: llm.generate(rows, context=lm),
        lambda: llm.score_choices(rows, context=lm, choices=[" a"]),
        lambda: llm.embed(rows, context=lm),
    ):
        with pytest.raises(ValueError, match=r"row 1: .*exceed the model's context of 512"):
            run()
    with pytest.raises(ValueError, match=r"row 0: .*\+ 510 to generate exceed"):
        llm.generate(rows[:1], context=lm, max_tokens=510)


def test_rows_without_their_inputs_raise_naming_the_row(lm):
    with pytest.raises(ValueError, match="row 1: no prompt string in 'prompt'"):
        llm.generate([{"prompt": "Water"}, {"question": "Water"}], context=lm)
    with pytest.raises(ValueError, match="row 0: column 'choices' is not a non-empty list"):
        llm.score_choices([{"prompt": "Water", "choices": []}], context=lm)
    with pytest.raises(ValueError, match="row 0: column 'text' holds no string"):
        llm.embed([{"text": None}], context=lm)
    with pytest.raises(ValueError, match="row 0: 'messages' is not a list of"):
        llm.generate([{"messages": ["Water"]}], context=lm)
    # A missing chat as pandas gives it (NaN) leaves the prompt to run.
    nan_chat = llm.generate([{"prompt": "Water", "messages": float("nan")}], context=lm)
    assert nan_chat == llm.generate([{"prompt": "Water"}], context=lm)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([{"prompt": "Water"}], context=lm, temperature=-1)


def test_the_tasks_run_on_a_worker_against_the_registered_context(
    inproc_cluster, tiny_model_dir, lm
):
    _, client = inproc_cluster
    dask_pcm.register(client, dask_pcm.causal_lm(str(tiny_model_dir), name="llm"))
    rows = rows_of(PROMPTS[:2])
    text = dask_pcm.submit(client, llm.generate, rows, context="llm", max_tokens=5).result()
    assert text == llm.generate(rows, context=lm, max_tokens=5)
    scores = dask_pcm.submit(client, llm.score_choices, rows, context="llm", choices=[" a"])
    assert scores.result()[0]["best"] == " a"
    vectors = dask_pcm.submit(client, llm.embed, [{"text": "Water"}], context="llm").result()
    assert vectors[0]["embedding"] == pytest.approx(
        llm.embed([{"text": "Water"}], context=lm)[0]["embedding"], abs=1e-5
    )
