"""GPU workers without a GPU: torch.cuda mocked, the real loader and the tiny model on the CPU.

What a mixed cluster relies on: the dtype follows the worker's own compute capability, a GPU
that torch cannot use is reported (not a silent CPU fallback), batches fit the memory the
method needs and shrink after an out-of-memory error, a failed load frees what it loaded.
"""

from __future__ import annotations

import time
import types
from types import SimpleNamespace

import pytest
import torch
import transformers

import dask_pcm.engine.gpu as gpu
import dask_pcm.engine.llm as llm
import dask_pcm.engine.prefix as prefix
from dask_pcm.engine.gpu import plan_device, prompt_bytes, rows_that_fit
from dask_pcm.engine.llm import CausalLM
from dask_pcm.exceptions import ContextLoadError, DeviceMemoryError
from tests.conftest import run_in_threads

GiB = 2**30
TITAN_X = ("NVIDIA TITAN X (Pascal)", (6, 1))
T4 = ("Tesla T4", (7, 5))
A10 = ("NVIDIA A10", (8, 6))
RECENT_WHEEL = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def fake_torch(card=A10, arch=RECENT_WHEEL, available=True) -> SimpleNamespace:
    """A torch namespace whose cuda module describes one GPU."""
    name, capability = card
    props = SimpleNamespace(
        name=name, major=capability[0], minor=capability[1], total_memory=24 * GiB
    )
    cuda = SimpleNamespace(
        is_available=lambda: available,
        current_device=lambda: 0,
        get_device_capability=lambda index=0: capability,
        get_device_properties=lambda index=0: props,
        get_device_name=lambda index=0: name,
        get_arch_list=lambda: list(arch),
    )
    return SimpleNamespace(
        cuda=cuda, device=torch.device, __version__="2.13.0", version=SimpleNamespace(cuda="12.8")
    )


@pytest.mark.parametrize(
    "card, dtype", [(A10, "bfloat16"), (T4, "float16"), (("Tesla P100", (6, 0)), "float32")]
)
def test_auto_dtype_follows_the_workers_compute_capability(card, dtype):
    arch = ["sm_60", *RECENT_WHEEL]
    plan = plan_device(fake_torch(card, arch), "auto", "auto")
    assert (plan.device, plan.dtype, plan.capability, plan.warning) == (
        "cuda:0",
        dtype,
        card[1],
        None,
    )
    assert plan.gpu == card[0]
    # Asked for, a dtype is kept whatever the card.
    assert plan_device(fake_torch(card, arch), "auto", "bfloat16").dtype == "bfloat16"


def test_a_gpu_the_torch_build_lacks_kernels_for_is_reported_not_silently_skipped():
    plan = plan_device(fake_torch(TITAN_X, RECENT_WHEEL), "auto", "auto")
    assert (plan.device, plan.dtype) == ("cpu", "float32")
    assert plan.warning is not None
    assert "TITAN X" in plan.warning and "6.1" in plan.warning and "sm_61" in plan.warning


def test_a_gpu_torch_cannot_see_is_reported(monkeypatch):
    monkeypatch.setattr(gpu, "installed_gpus", lambda: 2)
    cpu_only = fake_torch(available=False)
    cpu_only.version.cuda = None
    plan = plan_device(cpu_only, "auto", "auto")
    assert plan.device == "cpu"
    assert "2 NVIDIA GPU(s)" in plan.warning and "CPU-only build" in plan.warning
    monkeypatch.setattr(gpu, "installed_gpus", lambda: 0)
    assert plan_device(cpu_only, "auto", "auto").warning is None  # a CPU machine: nothing to say


def test_the_batch_estimate_counts_the_key_value_cache_of_generation():
    # SmolLM2-1.7B in bfloat16 on an A10: ~19 GiB free after the weights.
    config = SimpleNamespace(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=32,
        num_hidden_layers=24,
        intermediate_size=8192,
        vocab_size=49152,
    )
    budget = int(19 * GiB * gpu.BATCH_MEMORY_FRACTION)
    scoring = rows_that_fit(budget, prompt_bytes(config, 2, 512, "logits"))
    generating = rows_that_fit(budget, prompt_bytes(config, 2, 512, "generate", 8))
    cache = 2 * 24 * 32 * 64 * (512 + 8) * 2  # K and V, every layer, bfloat16
    assert generating * cache <= budget  # the old estimate gave 256 rows: ~25 GiB of cache
    assert generating < scoring <= gpu.GPU_MAX_BATCH_SIZE
    assert generating >= 16  # and it is not needlessly small


class FakeCuda:
    """The real torch.cuda, patched to say it has one GPU of ``card`` (tensors stay on the
    CPU: moving a model or inputs to "cuda" is recorded, not done)."""

    def __init__(self, monkeypatch, card=T4, free=64 * 2**20):
        name, capability = card
        self.moved_to: list[str] = []
        self.inputs_to: list[str] = []
        self.emptied = 0
        props = SimpleNamespace(
            name=name, major=capability[0], minor=capability[1], total_memory=16 * GiB
        )
        for attr, value in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "current_device": lambda: 0,
            "get_device_capability": lambda index=0: capability,
            "get_device_properties": lambda index=0: props,
            "get_arch_list": lambda: list(RECENT_WHEEL),
            "mem_get_info": lambda device=None: (free, 16 * GiB),
            "reset_peak_memory_stats": lambda device=None: None,
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 123_456,
            "empty_cache": self._empty,
        }.items():
            monkeypatch.setattr(torch.cuda, attr, value)
        fake = self

        def batch_to(encoding, device, *args, **kwargs):
            fake.inputs_to.append(str(device))
            return encoding

        def tensor_to(tensor, device):
            fake.inputs_to.append(str(device))
            return tensor

        monkeypatch.setattr(transformers.BatchEncoding, "to", batch_to)
        monkeypatch.setattr(prefix, "to_device", tensor_to)
        real_load = llm._from_pretrained
        self.models: list = []

        def load(resolved, dtype):
            model, tokenizer = real_load(resolved, dtype)
            real_to = model.to

            def to(self, *args, **kwargs):
                target = str(args[0] if args else kwargs.get("device"))
                if target.startswith("cuda"):
                    fake.moved_to.append(target)
                    return self
                return real_to(*args, **kwargs)

            model.to = types.MethodType(to, model)
            fake.models.append(model)
            return model, tokenizer

        monkeypatch.setattr(llm, "_from_pretrained", load)

    def _empty(self) -> None:
        self.emptied += 1


def test_auto_loads_on_the_gpu_in_its_dtype_with_inputs_on_that_device(monkeypatch, tiny_model_dir):
    cuda = FakeCuda(monkeypatch, T4)
    lm = CausalLM()(tiny_model_dir)
    assert (lm.device, lm.dtype, lm.warning) == ("cuda:0", "float16", None)
    assert cuda.moved_to == ["cuda:0"]
    assert next(lm.model.parameters()).dtype == torch.float16
    assert lm.memory_budget == int(64 * 2**20 * gpu.BATCH_MEMORY_FRACTION)
    per_prompt = prompt_bytes(lm.model.config, 2, llm.TOKENS_PER_PROMPT, "logits")
    assert lm.batch_size == rows_that_fit(lm.memory_budget, per_prompt)
    assert lm.nbytes == 123_456  # the allocator's count, not the parameters'
    assert cuda.inputs_to and set(cuda.inputs_to) == {"cuda:0"}  # the warm-up's inputs
    lm.next_token_logits(["a claim"])
    assert cuda.inputs_to[-1] == "cuda:0"


def _forward_failing_above(monkeypatch, rows: int) -> list[int]:
    """Make every forward pass of more than ``rows`` prompts run out of memory; the sizes tried."""
    tried: list[int] = []
    real = transformers.LlamaForCausalLM.forward

    def forward(self, input_ids=None, **kwargs):
        tried.append(int(input_ids.shape[0]))
        if input_ids.shape[0] > rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)
    return tried


def test_out_of_memory_in_the_warm_up_halves_the_batch_the_worker_keeps(
    monkeypatch, tiny_model_dir
):
    FakeCuda(monkeypatch, A10, free=256 * 2**20)
    tried = _forward_failing_above(monkeypatch, 2)
    lm = CausalLM()(tiny_model_dir)
    assert tried[0] > 2  # the warm-up ran at the size chosen from memory...
    assert lm.batch_size == 2  # ... and the size that worked is kept
    tried.clear()
    lm.next_token_logits([f"claim {i}" for i in range(5)])
    assert tried == [2, 2, 1]


def test_out_of_memory_in_the_warm_up_at_one_prompt_fails_the_load_and_frees_it(
    monkeypatch, tiny_model_dir
):
    cuda = FakeCuda(monkeypatch, A10)
    _forward_failing_above(monkeypatch, 0)
    with pytest.raises(ContextLoadError, match=r"DeviceMemoryError.*one prompt per pass"):
        CausalLM()(tiny_model_dir)
    (model,) = cuda.models
    assert {p.device.type for p in model.parameters()} == {"meta"}  # weights freed
    assert cuda.emptied >= 1


def test_out_of_memory_in_a_task_retries_smaller_and_gives_the_same_answers(
    monkeypatch, tiny_model_dir
):
    lm = CausalLM(device="cpu", batch_size=8)(tiny_model_dir)
    prompts = [f"claim {i}: the sky is " + "blue " * i for i in range(7)]
    expected = lm.next_token_logits(prompts)
    texts = lm.generate(prompts[:3], max_new_tokens=2)
    tried = _forward_failing_above(monkeypatch, 3)
    torch.testing.assert_close(lm.next_token_logits(prompts), expected, atol=1e-4, rtol=1e-4)
    assert lm.batch_size == 3  # 7 at once failed, 3 held: remembered for later calls
    assert tried == [7, 3, 3, 1]
    assert lm.generate(prompts[:3], max_new_tokens=2) == texts


def test_out_of_memory_while_generating_lowers_the_generation_passes_too(
    monkeypatch, tiny_model_dir
):
    lm = CausalLM(device="cpu")(tiny_model_dir)  # generation passes larger than scoring's
    prompts = [f"claim {i}: the sky is " + "blue " * i for i in range(7)]
    texts = lm.generate(prompts, max_new_tokens=2)
    tried = _forward_failing_above(monkeypatch, 3)
    assert lm.generate(prompts, max_new_tokens=2) == texts
    assert (lm.batch_size, lm.generate_batch_size) == (3, 3)  # no pass of 7 tried again
    tried.clear()
    assert lm.generate(prompts, max_new_tokens=2) == texts
    assert max(tried) == 3


def test_one_prompt_that_does_not_fit_is_a_clear_error(monkeypatch, tiny_model_dir):
    lm = CausalLM(device="cpu")(tiny_model_dir)
    _forward_failing_above(monkeypatch, 0)
    with pytest.raises(DeviceMemoryError, match=r"one prompt per pass does not fit.*cpu"):
        lm.next_token_logits(["a claim", "another"])


def test_passes_on_a_gpu_take_fewer_rows_for_long_prompts_and_for_generation(tiny_model_dir):
    lm = CausalLM(device="cpu", batch_size=64)(tiny_model_dir)
    element = 4
    short = prompt_bytes(lm.model.config, element, 8, "logits")
    lm.memory_budget = 16 * short
    assert lm.rows_per_pass(["a b c"] * 3, "logits", 0) == 16
    assert lm.rows_per_pass(["word " * 200] * 3, "logits", 0) < 16
    assert lm.rows_per_pass(["a b c"] * 3, "generate", 32) < 16


def test_release_empties_the_cuda_cache(monkeypatch, tiny_model_dir):
    lm = CausalLM(device="cpu")(tiny_model_dir)
    cuda = FakeCuda(monkeypatch)
    CausalLM(device="cpu").release(lm)
    assert cuda.emptied == 1


def test_threads_of_one_worker_take_turns_on_tokenizer_and_model(monkeypatch, tiny_model_dir):
    lm = CausalLM(device="cpu")(tiny_model_dir)
    inside, overlaps = [0], []
    real = transformers.LlamaForCausalLM.forward

    def forward(self, *args, **kwargs):
        inside[0] += 1
        overlaps.append(inside[0])
        time.sleep(0.01)
        try:
            return real(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)

    def work() -> None:
        for i in range(5):
            lm.next_token_logits([f"claim {i}", "the other claim of this batch"])

    assert run_in_threads(work, 4) == []
    assert len(overlaps) == 20 and max(overlaps) == 1


def test_passes_after_a_kept_prefix_count_its_states_and_the_new_tokens(tiny_model_dir):
    from dask_pcm.engine.passes import rows_for

    lm = CausalLM(device="cpu", batch_size=64)(tiny_model_dir)
    head = "An instruction every prompt starts with, long enough to weigh: " * 4
    prompts = [head + f"claim {i} is" for i in range(16)]
    ids = lm.tokenizer(prompts)["input_ids"]
    cached = lm.prefix_cache.states_for(ids, lm.tokenizer(head)["input_ids"], lm.model, "cpu")[0]
    suffix = max(len(seq) for seq in ids) - cached
    config = lm.model.config
    lm.memory_budget = 4 * prompt_bytes(config, 4, suffix, "generate", 12, cached) + 1
    rows = rows_for(lm, suffix, "generate", 12, cached)
    assert rows == 4
    # Without the kept states or the new tokens counted, it would take more.
    assert rows_for(lm, suffix, "generate", 12) > 4
    assert prompt_bytes(config, 4, suffix, "generate", 0, cached) < lm.memory_budget / 4 - 1
    # generate's passes hold that many rows: each row's copy of the kept states, its own
    # tokens and the ones it generates.
    first = []

    def watch(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # a pass's first step
            first.append(kwargs["input_ids"].shape[0])

    hook = lm.model.register_forward_pre_hook(watch, with_kwargs=True)
    texts = lm.generate(prompts, 12, prefix=head)
    hook.remove()
    assert max(first) == rows and sum(first) == 16
    lm.memory_budget = None
    assert lm.generate(prompts, 12) == texts
