"""The batch layer's built-in LLM tasks (dask_pcm.apps.llm) on the tiny random Llama."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

import dask_pcm
from dask_pcm.apps import llm
from dask_pcm.engine.generation import completion, continuation_start
from dask_pcm.engine.model import count_tokens
from tests.apps import PERSON_SCHEMA

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
    head_tokens = len(lm.tokenizer(head)["input_ids"])
    assert {r.pop("cached_tokens") for r in whole} == {0}
    cached = {r.pop("cached_tokens") for r in kept}
    assert len(cached) == 1 and head_tokens - 2 <= cached.pop() <= head_tokens
    assert kept == whole
    assert len(lm.prefix_cache) == 1  # the shared start, computed once and kept
    longest = max(count_tokens(lm, [r["prompt"] for r in rows]))
    assert widths[0] >= head_tokens - 2  # the prefix's own pass, then the rest only
    assert max(widths[1:]) <= longest - head_tokens + 2


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 1.5, "seed": 7}], ids=["greedy", "sampled"]
)
def test_each_group_of_rows_that_begin_alike_keeps_its_own_prefix(lm, options):
    """One odd prompt in a unit costs the others nothing: rows that share a long start run
    after its kept states, the odd one alone; texts and scores as without any kept prefix."""
    heads = ["You answer questions about places and people in a few words. " * 3,
             "Reply with one short phrase; never explain the answer you give. " * 3]  # fmt: skip
    prompts = [heads[i % 2] + PROMPTS[i % 4] + f" {i}" for i in range(9)] + ["Odd one out:"]
    rows = rows_of(prompts)
    whole = llm.generate(rows, context=replace(lm, prefix_cache=None), max_tokens=6, **options)
    lm.prefix_cache.clear()
    kept = llm.generate(rows, context=lm, max_tokens=6, **options)
    cached = [r.pop("cached_tokens") for r in kept]
    for r in whole:
        r.pop("cached_tokens")
    assert kept == whole
    for i, n in enumerate(cached[:9]):  # each row the tokens of its own group's start
        assert len(lm.tokenizer(heads[i % 2])["input_ids"]) - 2 <= n
    assert cached[9] == 0
    assert len(lm.prefix_cache) == 2
    choices = [" yes", " no", " maybe"]
    plain = llm.score_choices(rows, context=replace(lm, prefix_cache=None), choices=choices)
    grouped = llm.score_choices(rows, context=lm, choices=choices)
    for a, b in zip(plain, grouped, strict=True):
        assert a["best_index"] == b["best_index"]
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-4)


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
        # Tokenized as the template wrote it, as transformers' own chat path does (and
        # vLLM's): no special tokens added.
        ids = lm.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert got[0]["prompt_tokens"] == len(ids)
        assert len(ids) == len(lm.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        # A template that writes <s> itself gets it once.
        lm.tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
        with_bos = llm.generate([{"messages": chat}], context=lm, max_tokens=6)[0]
        assert with_bos["prompt_tokens"] == got[0]["prompt_tokens"] + 1
        assert with_bos == llm.generate(rows_of([rendered]), context=lm, max_tokens=6)[0]
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


# logprobs, json_schema, sample and cached_tokens.

SCHEMA = PERSON_SCHEMA


def token_ids_by_bytes(lm):
    """Each token's id by its bytes (unique in the tiny byte-level vocabulary)."""
    from dask_pcm.engine.tokens import token_bytes

    vocab = range(len(lm.tokenizer))
    by_bytes = {bytes(b): i for i, b in zip(vocab, token_bytes(lm.tokenizer, vocab), strict=True)}
    assert len(by_bytes) == len(lm.tokenizer)
    return by_bytes


def check_logprobs(lm, prompt, result, k):
    """The result's logprobs are those of one plain forward pass over prompt + tokens."""
    by_bytes = token_ids_by_bytes(lm)
    entries = result["logprobs"]
    tokens = [by_bytes[bytes(e["bytes"])] for e in entries]
    eos = result["finish_reason"] == "stop" and result["completion_tokens"] == len(tokens) + 1
    assert result["completion_tokens"] == len(tokens) + eos
    start = lm.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = lm.model(torch.tensor([start + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(start) - 1 :]
    for j, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        assert entry["token"] == lm.tokenizer.decode([token])
        assert entry["logprob"] == pytest.approx(float(expected[j, token]), abs=1e-4)
        top = entry["top_logprobs"]
        assert len(top) == k
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        reference = expected[j].topk(k).values.tolist()
        assert values == pytest.approx(reference, abs=1e-4)
        for t in top:
            assert t["logprob"] == pytest.approx(
                float(expected[j, by_bytes[bytes(t["bytes"])]]), abs=1e-4
            )
            assert t["token"] == lm.tokenizer.decode([by_bytes[bytes(t["bytes"])]])


@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 1.5, "seed": 7}, {"json_schema": SCHEMA, "temperature": 1.0, "seed": 2}],
    ids=["greedy", "sampled", "json"],
)
def test_logprobs_are_those_of_a_plain_forward_pass_batched_alone_or_after_a_kept_prefix(
    lm, options
):
    head = "You answer questions about places and people in a few words. " * 2
    for prompts in (PROMPTS, [head + p for p in PROMPTS]):
        lm.prefix_cache.clear()
        batched = llm.generate(rows_of(prompts), context=lm, max_tokens=12, logprobs=3, **options)
        assert (batched[0]["cached_tokens"] > 0) == (prompts[0].startswith(head))
        alone = [
            llm.generate(rows_of([p]), context=lm, max_tokens=12, logprobs=3, **options)[0]
            for p in prompts
        ]
        for prompt, one, together in zip(prompts, alone, batched, strict=True):
            assert one["text"] == together["text"]
            check_logprobs(lm, prompt, one, 3)
            check_logprobs(lm, prompt, together, 3)
    # Without logprobs, the same results but for the key.
    plain = llm.generate(rows_of(prompts), context=lm, max_tokens=12, **options)
    assert [{k: v for k, v in r.items() if k != "logprobs"} for r in batched] == plain


def test_under_greedy_the_token_is_the_most_likely_and_k_zero_gives_no_alternatives(lm):
    out = llm.generate(rows_of(PROMPTS), context=lm, max_tokens=6, logprobs=2)
    for result in out:
        assert len(result["logprobs"]) == 6
        for entry in result["logprobs"]:
            assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]
        # The tokens' bytes hold the text, and at most a character cut in half after it.
        held = b"".join(bytes(e["bytes"]) for e in result["logprobs"])
        assert held.decode(errors="replace") in (result["text"], result["text"] + "\ufffd")
    zero = llm.generate(rows_of(PROMPTS[:1]), context=lm, max_tokens=4, logprobs=0)[0]
    assert [e["top_logprobs"] for e in zero["logprobs"]] == [[]] * 4
    for wrong in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            llm.generate(rows_of(PROMPTS[:1]), context=lm, logprobs=wrong)


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 1.0, "seed": 4}], ids=["greedy", "sampled"]
)
def test_json_schema_answers_are_valid_json(lm, options):
    import json

    import jsonschema

    rows = rows_of(PROMPTS * 2)
    out = llm.generate(rows, context=lm, max_tokens=200, json_schema=SCHEMA, **options)
    assert {r["finish_reason"] for r in out} == {"stop"}
    for result in out:
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
        assert result["completion_tokens"] < 200
    # A row that ended does not upset the others: batched as alone.
    alone = [
        llm.generate([row], context=lm, max_tokens=200, json_schema=SCHEMA, **options)[0]
        for row in rows[:4]
    ]
    assert [r["text"] for r in alone] == [r["text"] for r in out[:4]]
    # Cut short: JSON unfinished, "length".
    short = llm.generate(rows, context=lm, max_tokens=5, json_schema=SCHEMA, **options)
    assert {r["finish_reason"] for r in short} == {"length"}
    assert all(r["text"].startswith('{"') for r in short)


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 1.0, "seed": 1}], ids=["greedy", "sampled"]
)
def test_json_object_mode_gives_json_objects(lm, options):
    import json

    out = llm.generate(
        rows_of(PROMPTS), context=lm, max_tokens=100, json_schema={"type": "object"}, **options
    )
    assert all(r["text"].startswith("{") for r in out)
    finished = [json.loads(r["text"]) for r in out if r["finish_reason"] == "stop"]
    assert finished and all(isinstance(x, dict) for x in finished)


def test_a_schema_llguidance_cannot_compile_raises_value_error(lm):
    for schema, problem in [
        ({"type": "foo"}, "foo"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "object", "default": object()}, "not JSON"),
    ]:
        with pytest.raises(ValueError, match=f"(?s)json_schema .*{problem}"):
            llm.generate(rows_of(PROMPTS[:1]), context=lm, json_schema=schema)


def test_samples_of_one_prompt_draw_their_own_texts_reproducibly(lm):
    import hashlib

    rows = [{"prompt": PROMPTS[0], "sample": n} for n in range(4)]

    def texts(rows, **options):
        out = llm.generate(rows, context=lm, max_tokens=10, temperature=1.0, **options)
        return [r["text"] for r in out]

    drawn = texts(rows, seed=5)
    assert len(set(drawn)) == 4
    assert texts(rows[::-1], seed=5) == drawn[::-1]
    assert texts(rows, seed=6) != drawn
    # Without a sample number (no column, None, NaN): the seed as before the column.
    plain = texts(rows_of(PROMPTS[:1]), seed=5)
    assert texts([{"prompt": PROMPTS[0], "sample": None}], seed=5) == plain
    assert texts([{"prompt": PROMPTS[0], "sample": float("nan")}], seed=5) == plain
    digest = hashlib.sha256(f"5\0{PROMPTS[0]}".encode()).digest()
    assert llm._row_seed(5, PROMPTS[0]) == int.from_bytes(digest[:8], "little") >> 1
    # Another column by name; greedy samples are all the greedy text.
    renamed = [{"prompt": PROMPTS[0], "n": n} for n in range(4)]
    assert texts(renamed, seed=5, sample="n") == drawn
    greedy = llm.generate(rows, context=lm, max_tokens=10)
    assert len({r["text"] for r in greedy}) == 1
    with pytest.raises(ValueError, match="row 1: column 'sample' holds no sample number"):
        texts([rows[0], {"prompt": "Water", "sample": "two"}], seed=5)


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 1.0, "seed": 9}], ids=["greedy", "sampled"]
)
def test_a_pass_run_again_after_running_out_of_memory_starts_its_rows_again(
    monkeypatch, tiny_model_dir, options
):
    import transformers

    lm = dask_pcm.CausalLM(device="cpu", batch_size=4)(str(tiny_model_dir))
    rows = rows_of(PROMPTS)
    run = dict(context=lm, max_tokens=40, json_schema=SCHEMA, logprobs=1, **options)
    expected = llm.generate(rows, **run)
    real = transformers.LlamaForCausalLM.forward
    steps = []

    @functools.wraps(real)  # its signature: the cache's argument name is read from it
    def forward(self, input_ids=None, **kwargs):
        steps.append(input_ids.shape)
        # Out of memory five tokens into a pass of four rows: matchers, recorded steps
        # and generators have moved on by then.
        if input_ids.shape[0] > 2 and len(steps) == 6:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)
    again = llm.generate(rows, **run)
    assert lm.batch_size == 2
    # The same tokens; their log-probabilities as in passes of two rows, within rounding.
    for one, other in zip(again, expected, strict=True):
        assert {**one, "logprobs": None} == {**other, "logprobs": None}
        assert [e["bytes"] for e in one["logprobs"]] == [e["bytes"] for e in other["logprobs"]]
        assert [e["logprob"] for e in one["logprobs"]] == pytest.approx(
            [e["logprob"] for e in other["logprobs"]], abs=1e-5
        )
