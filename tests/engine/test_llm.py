"""The causal LM loader (dask_pcm.engine.llm), on the tiny model and once on the real embedded model."""

from __future__ import annotations

import pickle
import shutil
import threading
import time
import weakref

import pytest
import torch
from dask.base import tokenize

import dask_pcm.templates.embedded
from dask_pcm.engine.llm import CausalLM, LanguageModel
from dask_pcm.engine.model import build_for_one_task
from dask_pcm.exceptions import ContextLoadError, ModelSourceError
from dask_pcm.templates.embedded import embedded_model_dir


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir) -> LanguageModel:
    return CausalLM(device="cpu")(str(tiny_model_dir))


def test_loads_ready_for_inference(tiny_lm, tiny_model_dir):
    assert isinstance(tiny_lm, LanguageModel)
    assert tiny_lm.device == "cpu"
    assert tiny_lm.source == str(tiny_model_dir.resolve())
    assert not tiny_lm.model.training
    params = list(tiny_lm.model.parameters())
    assert params and all(not p.requires_grad for p in params)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
    assert tiny_lm.tokenizer.padding_side == "left"
    assert tiny_lm.tokenizer.pad_token is not None
    assert tiny_lm.nbytes == sum(p.numel() * 4 for p in params)


def test_a_cpu_build_warms_up_once_unless_it_serves_one_task(tiny_model_dir, monkeypatch):
    passes = []
    forward = LanguageModel.next_token_logits

    def counted(self, prompts, *args, **kwargs):
        passes.append(len(prompts))
        return forward(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LanguageModel, "next_token_logits", counted)
    CausalLM(device="cpu")(tiny_model_dir)
    assert len(passes) == 1  # the warm-up, paid at load by a model that serves many tasks
    with build_for_one_task():
        CausalLM(device="cpu")(tiny_model_dir)
    assert len(passes) == 1  # a per-task build: its task is its only pass


def test_auto_options_pick_cpu_float32_here(tiny_model_dir):
    lm = CausalLM()(tiny_model_dir)
    assert lm.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert next(lm.model.parameters()).dtype == torch.float32


def test_explicit_dtype(tiny_model_dir):
    lm = CausalLM(device="cpu", dtype="bfloat16")(tiny_model_dir)
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    logits = lm.next_token_logits(["The claim is"])
    assert logits.dtype == torch.float32  # always handed back as float32


def test_next_token_logits_shape(tiny_lm):
    logits = tiny_lm.next_token_logits(["Paris is", "The claim is true.", ""])
    assert logits.shape == (3, tiny_lm.model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert logits.device.type == "cpu"
    assert torch.isfinite(logits).all()
    assert tiny_lm.next_token_logits([]).shape == (0, tiny_lm.model.config.vocab_size)


def test_next_token_logits_wants_a_sequence_not_a_string(tiny_lm):
    with pytest.raises(TypeError, match="list"):
        tiny_lm.next_token_logits("Paris is")


def test_left_padding_gives_the_logits_of_the_prompt_alone(tiny_lm):
    short = "Paris is"
    long = "Read the claim and decide whether it is supported, refuted, or unverifiable."
    alone = tiny_lm.next_token_logits([short])[0]
    batch = tiny_lm.next_token_logits([long, short, long])
    assert len(tiny_lm.tokenizer(long).input_ids) > len(tiny_lm.tokenizer(short).input_ids) + 5
    torch.testing.assert_close(batch[1], alone, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batch[0], tiny_lm.next_token_logits([long])[0], atol=1e-4, rtol=1e-4)
    # and the last position is the prompt's own last token, not padding
    assert not torch.allclose(batch[0], batch[1], atol=1e-3)


def test_complete_is_greedy_and_returns_only_new_text(tiny_lm):
    prompt = "The capital of France is"
    first = tiny_lm.complete(prompt, max_new_tokens=4)
    assert isinstance(first, str)
    assert first == tiny_lm.complete(prompt, max_new_tokens=4)
    assert not first.startswith(prompt)
    # the first new token is the argmax of the next-token logits
    top = int(tiny_lm.next_token_logits([prompt])[0].argmax())
    one = tiny_lm.complete(prompt, max_new_tokens=1)
    assert one == tiny_lm.tokenizer.decode([top], skip_special_tokens=True)


def test_chat_prompt_applies_the_template(tiny_lm, tiny_model_dir):
    assert tiny_lm.chat_prompt("Is water wet?") == "<|user|>\nIs water wet?</s>\n<|assistant|>\n"
    plain = CausalLM(device="cpu")(tiny_model_dir)
    plain.tokenizer.chat_template = None
    assert plain.chat_prompt("Is water wet?") == "Is water wet?"


def test_loads_a_gguf_file(tiny_gguf_file, tiny_lm):
    lm = CausalLM(device="cpu")(str(tiny_gguf_file))
    prompts = ["Paris is the capital of", "The claim is"]
    torch.testing.assert_close(
        lm.next_token_logits(prompts), tiny_lm.next_token_logits(prompts), atol=1e-4, rtol=1e-4
    )


def test_corrupt_weights_give_context_load_error_naming_the_path(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(ContextLoadError) as info:
        CausalLM(device="cpu")(str(broken))
    assert str(broken) in str(info.value)
    assert info.value.__cause__ is not None
    assert type(info.value.__cause__).__name__ in str(info.value)


def test_corrupt_gguf_gives_context_load_error_naming_the_path(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    with pytest.raises(ContextLoadError) as info:
        CausalLM(device="cpu")(broken)
    assert str(broken) in str(info.value)


def test_bad_source_stays_a_model_source_error(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ModelSourceError) as info:
        CausalLM()(str(missing))
    assert not isinstance(info.value, ContextLoadError)
    assert str(missing) in str(info.value)


def test_loader_pickles_and_compares_equal():
    loader = CausalLM(device="cpu", dtype="float32")
    clone = pickle.loads(pickle.dumps(loader))
    assert clone == loader
    assert hash(clone) == hash(loader)
    assert tokenize(clone) == tokenize(loader)
    assert tokenize(CausalLM()) != tokenize(loader)
    assert CausalLM() != loader
    assert repr(loader) == "CausalLM(device='cpu', dtype='float32', batch_size=None)"
    assert tokenize(CausalLM(batch_size=4)) != tokenize(CausalLM())
    assert len(pickle.dumps(loader)) < 200  # only the options travel


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="dtype"):
        CausalLM(dtype="float8")
    with pytest.raises(ValueError, match="device"):
        CausalLM(device="")
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            CausalLM(batch_size=bad)  # type: ignore[arg-type]


def test_a_cpu_worker_batches_by_eight_unless_told(tiny_model_dir):
    from dask_pcm.engine.llm import CPU_BATCH_SIZE

    assert CausalLM(device="cpu")(tiny_model_dir).batch_size == CPU_BATCH_SIZE == 8
    assert CausalLM(device="cpu", batch_size=3)(tiny_model_dir).batch_size == 3


def test_a_cpu_worker_generates_in_larger_passes_than_it_scores(monkeypatch, tiny_model_dir):
    """A decode step reads every weight once per pass, whatever its rows: on a CPU more rows
    per pass cost little more. Generation used to take the scoring size, a unit of 16
    chats two passes of 8 (1.4 times the time of one pass of 16, the embedded model)."""
    import transformers

    from dask_pcm.engine.llm import CPU_BATCH_SIZE, CPU_GENERATE_BATCH_SIZE

    lm = CausalLM(device="cpu")(tiny_model_dir)
    prompts = [f"claim {i}: the sky is " + "blue " * (i % 5) for i in range(16)]
    assert lm.rows_per_pass(prompts, "logits") == CPU_BATCH_SIZE == 8
    assert lm.rows_per_pass(prompts, "generate", 4) == CPU_GENERATE_BATCH_SIZE == 32
    texts = lm.generate(prompts, max_new_tokens=3)
    rows: list[int] = []
    real = transformers.LlamaForCausalLM.forward

    def forward(self, input_ids=None, **kwargs):
        rows.append(int(input_ids.shape[0]))
        return real(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)
    assert lm.generate(prompts, max_new_tokens=3) == texts
    assert rows and set(rows) == {16}  # one pass of all 16 rows, each step
    # A batch size given is the size for everything.
    told = CausalLM(device="cpu", batch_size=3)(tiny_model_dir)
    assert told.rows_per_pass(prompts, "generate", 4) == told.rows_per_pass(prompts) == 3


def test_long_lists_run_in_batches_with_the_same_results(tiny_lm):
    prompts = [f"claim {i}: " + "the sky is blue " * (i % 4) for i in range(11)]
    whole = tiny_lm.next_token_logits(prompts)
    generated = tiny_lm.generate(prompts[:5], max_new_tokens=3)
    tiny_lm.batch_size = 3
    try:
        torch.testing.assert_close(tiny_lm.next_token_logits(prompts), whole, atol=1e-4, rtol=1e-4)
        assert tiny_lm.generate(prompts[:5], max_new_tokens=3) == generated
    finally:
        tiny_lm.batch_size = 8


def test_release_frees_the_model(tiny_model_dir):
    loader = CausalLM(device="cpu")
    lm = loader(tiny_model_dir)
    model_ref = weakref.ref(lm.model)
    loader.release(lm)
    assert lm.model is None and lm.tokenizer is None
    assert model_ref() is None


@pytest.mark.slow
def test_embedded_smollm2_answers_and_is_converted_only_once(monkeypatch):
    # Uses the real per-machine cache: the conversion (tens of seconds) happens once per machine.
    lm = CausalLM(device="cpu")(None)
    assert lm.source == str(embedded_model_dir())
    answer = lm.complete(lm.chat_prompt("What is the capital of France?"), max_new_tokens=12)
    assert "Paris" in answer

    def no_conversion(*args, **kwargs):
        raise AssertionError("embedded model converted again")

    monkeypatch.setattr(dask_pcm.templates.embedded, "convert_gguf", no_conversion)
    start = time.perf_counter()
    again = embedded_model_dir()
    assert time.perf_counter() - start < 1
    assert again == embedded_model_dir()
    assert (again / "model.safetensors").is_file()
    assert not list(again.glob("*.bin"))


def test_concurrent_loads_in_one_process_leave_later_loads_intact(tiny_model_dir):
    # Threaded workers load at once; unserialised, transformers left the next model's tied
    # lm_head on the meta device ("Cannot copy out of meta tensor").
    loader = CausalLM(device="cpu")

    def work() -> None:
        for _ in range(4):
            loader.release(loader(str(tiny_model_dir)))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lm = loader(None)  # the embedded model ties lm_head to the embeddings
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()


def test_the_loader_estimates_a_models_memory_from_its_files(tiny_model_dir, tmp_path):
    loader = CausalLM(device="cpu")
    weights = (tiny_model_dir / "model.safetensors").stat().st_size
    estimate = loader.estimate_bytes(str(tiny_model_dir))
    assert weights < estimate < weights + 2**20  # the weights, and the small files beside them
    assert loader.estimate_bytes(str(tmp_path / "missing")) == 0
