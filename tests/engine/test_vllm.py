"""vLLM as a context's engine (dask_pcm.vllm_lm): the built-in tasks, dask-pcm batch and
run_fever on it, against vLLM's own ``run_batch`` and the Hugging Face engine; and nothing of
it left behind once released.

Marker ``vllm``: these run where vLLM is installed (``bash ci/vllm/setup.sh`` makes such a
venv) and skip with the reason elsewhere, unless ``PCM_REQUIRE_VLLM=1`` (as in CI's vLLM job)
makes that a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import psutil
import pytest
from openai.types.chat import ChatCompletion

import dask_pcm
from dask_pcm.apps import llm
from dask_pcm.engine.vllm import VLLM
from dask_pcm.testing.models import build_tiny_llama
from tests.apps import PERSON_SCHEMA
from tests.conftest import cluster_client

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    _reason = "vLLM is not installed here (bash ci/vllm/setup.sh makes a venv with it)"
    if os.environ.get("PCM_REQUIRE_VLLM"):
        pytest.fail(_reason, pytrace=False)
    pytest.skip(_reason, allow_module_level=True)

# A KV cache that fits any CI machine (vLLM's CPU default takes most of the host's memory).
SMALL = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
SYSTEM = "You answer in one short sentence. " * 12  # longer than a KV block (128 on CPUs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose heads vLLM's CPU attention takes (64 wide)."""
    folder = tmp_path_factory.mktemp("vllm-models") / "tiny-llama-64"
    return build_tiny_llama(folder, hidden_size=128, num_heads=2)


@pytest.fixture(scope="module")
def engines(model_dir: Path):
    """The tiny model on both engines, in this process: (Hugging Face, vLLM)."""
    hf = dask_pcm.CausalLM(device="cpu")(str(model_dir))
    vm = VLLM.of(**SMALL)(str(model_dir))
    yield hf, vm
    vm.close()


def chats(n: int) -> list[dict]:
    """``n`` chats: a shared long system prompt for two in three, questions of mixed length."""
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"Question {i}: " + "what next? " * (i % 5)}]
        if i % 3:
            turns.insert(0, {"role": "system", "content": SYSTEM})
        out.append({"messages": turns})
    return out


def test_greedy_text_and_choice_scores_are_the_hf_engines(engines):
    hf, vm = engines
    rows = chats(12)
    ours = llm.generate(rows, context=hf, max_tokens=8)
    theirs = llm.generate(rows, context=vm, max_tokens=8)
    # The same tokens, so the same text; but for a random model's last invalid bytes, which
    # vLLM's detokenizer holds back as it holds back half a character.
    assert [r["text"].rstrip("\ufffd") for r in theirs] == [
        r["text"].rstrip("\ufffd") for r in ours
    ]
    assert [r["completion_tokens"] for r in theirs] == [r["completion_tokens"] for r in ours]
    assert [r["prompt_tokens"] for r in theirs] == [r["prompt_tokens"] for r in ours]
    # Asked again, the prompts are found in vLLM's prefix cache, and answered the same.
    again = llm.generate(rows, context=vm, max_tokens=8)
    shared = [r["cached_tokens"] for i, r in enumerate(again) if i % 3]
    assert min(shared) > 0 and [r["text"] for r in again] == [r["text"] for r in theirs]

    scored = [
        {"prompt": f"Claim {i} is", "choices": [" true", " false", " unknown"]} for i in range(6)
    ]
    a = llm.score_choices(scored, context=hf)
    b = llm.score_choices(scored, context=vm)
    assert [r["best"] for r in b] == [r["best"] for r in a]
    for x, y in zip(a, b, strict=True):
        assert y["scores"] == pytest.approx(x["scores"], abs=1e-3)


def test_logprobs_json_and_sampling_on_vllm(engines):
    hf, vm = engines
    rows = [{"prompt": f"Person {i}:"} for i in range(4)]
    with_lp = llm.generate(rows, context=vm, max_tokens=6, logprobs=3)
    ref = llm.generate(rows, context=hf, max_tokens=6, logprobs=3)
    for x, y in zip(ref, with_lp, strict=True):
        assert len(y["logprobs"]) == len(x["logprobs"])
        for a, b in zip(x["logprobs"], y["logprobs"], strict=True):
            assert a["token"] == b["token"] and b["logprob"] == pytest.approx(
                a["logprob"], abs=1e-3
            )
            assert [t["token"] for t in b["top_logprobs"]] == [
                t["token"] for t in a["top_logprobs"]
            ]
    shaped = llm.generate(rows, context=vm, max_tokens=60, json_schema=PERSON_SCHEMA)
    for r in shaped:
        if r["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r["text"]), PERSON_SCHEMA)
    drawn = [llm.generate(rows, context=vm, max_tokens=6, temperature=1.0, seed=7) for _ in "ab"]
    assert [r["text"] for r in drawn[0]] == [r["text"] for r in drawn[1]]  # seeded per row


def test_embeddings_on_a_pooling_engine_are_the_hf_engines(model_dir, engines):
    hf, generating = engines
    pooled = VLLM.of(runner="pooling", **SMALL)(str(model_dir))
    try:
        rows = [{"text": f"Sentence number {i} " + "and more " * i} for i in range(5)]
        for normalize in (True, False):
            ours = llm.embed(rows, context=hf, normalize=normalize)
            theirs = llm.embed(rows, context=pooled, normalize=normalize)
            for x, y in zip(ours, theirs, strict=True):
                assert y["tokens"] == x["tokens"]
                assert y["embedding"] == pytest.approx(x["embedding"], abs=1e-4)
        with pytest.raises(ValueError, match="runner 'generate'"):
            llm.generate([{"prompt": "x"}], context=pooled)
        with pytest.raises(ValueError, match="runner 'pooling'"):
            llm.embed(rows, context=generating)
    finally:
        pooled.close()


def test_fever_on_vllm_predicts_what_the_hf_engine_predicts(model_dir, tmp_path):
    claims = tmp_path / "claims.jsonl"
    labels = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")
    claims.write_text(
        "".join(
            json.dumps({"id": i, "label": labels[i % 3], "claim": f"Fact {i} holds."}) + "\n"
            for i in range(30)
        )
    )
    runs = {}
    with cluster_client(n_workers=1, processes=True) as client:
        for engine in ("hf", "vllm"):
            runs[engine] = dask_pcm.run_fever(
                claims, model=model_dir, templates=["direct", "few-shot", "chat-direct"],
                cluster=client, claims_per_task=8, progress=False, engine=engine,
            )  # fmt: skip
    hf, vm = (runs[e].predictions.sort_values(["template", "claim_id"]) for e in ("hf", "vllm"))
    assert list(vm["predicted"]) == list(hf["predicted"])
    for label in labels:
        column = f"score_{label}"
        assert list(vm[column]) == pytest.approx(list(hf[column]), abs=1e-3)


def _requests(path: Path, n: int, model: str) -> Path:
    with open(path, "w") as f:
        for i, row in enumerate(chats(n)):
            body = {"model": model, "messages": row["messages"], "max_tokens": 8, "temperature": 0}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")  # fmt: skip
    return path


def _texts(path: Path) -> dict[str, str]:
    answers = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        body = ChatCompletion.model_validate(record["response"]["body"])
        answers[record["custom_id"]] = body.choices[0].message.content
    return answers


def test_dask_pcm_batch_on_vllm_answers_as_vllm_run_batch(model_dir, tmp_path):
    """The same chat requests (a system and a user message) through ``dask-pcm batch
    --engine vllm`` and through ``python -m vllm.entrypoints.openai.run_batch``: greedy text
    identical, every answer parsed by the openai package's model."""
    requests = _requests(tmp_path / "requests.jsonl", 24, model_dir.name)
    theirs = tmp_path / "run_batch.jsonl"
    subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(requests),
         "-o", str(theirs), "--model", str(model_dir), "--served-model-name", model_dir.name,
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(64 << 20)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    out = tmp_path / "answers"
    done = subprocess.run(
        [sys.executable, "-m", "dask_pcm.cli", "batch", "-i", str(requests), "-o", str(out),
         "--model", str(model_dir), "--engine", "vllm", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ours = _texts(out / "output.jsonl")
    assert len(ours) == 24 and ours == _texts(theirs)
    status = json.loads((out / "batch.json").read_text())
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 24
    assert status["usage"]["input_tokens_details"]["cached_tokens"] > 0


def _vllm_children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_unregister_and_worker_close_leave_no_vllm_process(model_dir):
    """The engine runs in the worker's own process: no process of it while it serves, its
    memory given back on unregister, and the worker gone on close."""
    ctx = dask_pcm.vllm_lm(model_dir, name="engine", **SMALL)
    with cluster_client(n_workers=1, processes=True) as client:
        (pid,) = client.run(os.getpid).values()
        before = {p.pid for p in _vllm_children(pid)}
        dask_pcm.register(client, ctx)
        fut = dask_pcm.submit(
            client, lambda: dask_pcm.get_context("engine").complete("Hi", 4), context="engine"
        )
        assert isinstance(fut.result(timeout=300), str)
        serving = [p for p in _vllm_children(pid) if p.pid not in before]
        assert not serving, [p.cmdline() for p in serving]
        held = client.run(lambda: psutil.Process().memory_info().rss)[
            next(iter(client.scheduler_info()["workers"]))
        ]
        dask_pcm.unregister(client, "engine")
        after = client.run(lambda: psutil.Process().memory_info().rss)[
            next(iter(client.scheduler_info()["workers"]))
        ]
        assert after < held, (held, after)
        assert not [p for p in _vllm_children(pid) if p.pid not in before]
        # A second engine starts in the same worker after the first was shut down.
        dask_pcm.register(client, ctx)
        again = dask_pcm.submit(
            client, lambda: dask_pcm.get_context("engine").complete("Hi", 4), context="engine"
        )
        assert again.result(timeout=300) == fut.result()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_vllm_context_on_slurm_jobs_survives_a_scancel_mid_run(tmp_path, model_dir):
    """Two SLURM worker jobs serve a vLLM context; once some units are written, one job is
    ``scancel``led while its engine serves. Every request is answered once, the replacement
    job's worker copies the template from the peer (no byte from the source) and starts its
    engine."""
    import threading

    import dask
    from distributed import Client

    from dask_pcm.apps.openai_batch import run_requests
    from tests.conftest import one_host_batch_cluster, require_batch_system, wait_for

    require_batch_system(
        "sinfo", "SLURM", "; `sudo bash ci/slurm/setup.sh` starts one", "PCM_REQUIRE_SLURM"
    )
    requests = _requests(tmp_path / "requests.jsonl", 90, model_dir.name)
    out = tmp_path / "answers"
    settings = {"distributed.deploy.lost-worker-timeout": "2s"}
    with (
        dask.config.set(settings),
        one_host_batch_cluster("slurm", tmp_path, 2, memory="4GB", walltime="00:30:00") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=180)
        first = set(client.scheduler_info()["workers"])
        ctx = dask_pcm.vllm_lm(model_dir, name="openai-batch-llm", **SMALL)
        dask_pcm.register(client, ctx)
        cancelled: dict[str, str] = {}

        def cancel_one() -> None:
            wait_for(lambda: len(list(out.glob("part-*.parquet"))) >= 1, 300, "a first segment")
            victim = sorted(client.scheduler_info()["workers"])[0]
            job = cluster.workers[client.scheduler_info()["workers"][victim]["name"]].job_id
            subprocess.run(["scancel", job], check=True)
            cancelled["job"] = job

        killer = threading.Thread(target=cancel_one)
        killer.start()
        outcome = run_requests(
            requests, out, model=model_dir, cluster=client, requests_per_unit=3,
            progress=False, engine="vllm",
        )  # fmt: skip
        killer.join()
        assert "job" in cancelled, "the run ended before a job was cancelled"
        wait_for(
            lambda: len(set(client.scheduler_info()["workers"]) - first) >= 1,
            180,
            "the replacement job's worker",
        )
        joined = sorted(set(client.scheduler_info()["workers"]) - first)

        def table():
            return dask_pcm.status(client, ["openai-batch-llm"]).set_index("worker")

        wait_for(lambda: (table().reindex(joined)["state"] == "ready").all(), 300, "its engine")
        row = table().loc[joined[0]]
        assert row["template_held"] and row["bytes_from_source"] == 0, row.to_dict()
    got = [
        json.loads(line)["custom_id"] for line in (out / "output.jsonl").read_text().splitlines()
    ]
    assert outcome.failed == 0 and len(got) == 90 and len(set(got)) == 90
