"""``dask-pcm doctor`` / ``dask_pcm.doctor``: a plain CPU report here, and with torch.cuda
mocked what a GPU worker would be told."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import dask_pcm
from dask_pcm.cli import main
from dask_pcm.diagnosis import WorkerReport, _shared_gpus, examine, format_reports
from tests.engine.test_gpu import A10, RECENT_WHEEL, TITAN_X, FakeCuda


def test_cli_on_this_machine_reports_the_cpu_plainly(tiny_model_dir, tmp_path):
    out = tmp_path / "doctor.json"
    result = CliRunner().invoke(
        main, ["doctor", "--model", str(tiny_model_dir), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "no GPU on this worker: the context runs on the CPU" in result.output
    assert "float32, 8 prompts per pass" in result.output
    assert "OK" in result.output
    (report,) = json.loads(out.read_text())
    assert (report["device"], report["dtype"], report["batch_size"]) == ("cpu", "float32", 8)
    assert report["advice"] == [] and report["error"] is None


def test_a_model_that_cannot_load_is_an_error_and_exit_status_one(tmp_path):
    missing = tmp_path / "no-such-model"
    result = CliRunner().invoke(main, ["doctor", "--model", str(missing), "--no-compare"])
    assert result.exit_code == 1
    assert "ERROR" in result.output and str(missing) in result.output


def test_doctor_examines_every_worker(make_cluster, tiny_model_dir):
    client = make_cluster(n_workers=2)
    reports = dask_pcm.doctor(client, model=str(tiny_model_dir), compare=False)
    workers = sorted(client.cluster.scheduler.workers)
    assert sorted(r.worker for r in reports) == workers
    assert {(r.device, r.dtype, r.batch_size) for r in reports} == {("cpu", "float32", 8)}


def test_a_gpu_worker_is_compared_with_cpu_float32(monkeypatch, tiny_model_dir):
    FakeCuda(monkeypatch, A10, free=64 * 2**20)
    report = examine(str(tiny_model_dir), dtype="float32")
    assert (report.device, report.gpu, report.capability) == ("cuda:0", "NVIDIA A10", "8.6")
    assert (report.free_memory, report.total_memory) == (64 * 2**20, 16 * 2**30)
    assert report.agreement.startswith("6/6 next tokens as CPU float32")
    assert report.ok, report.advice
    text = format_reports([report])
    assert "cuda:0 (NVIDIA A10, compute capability 8.6)" in text and "OK" in text


def test_a_pascal_card_gets_float32_and_says_why(monkeypatch, tiny_model_dir):
    cuda = FakeCuda(monkeypatch, TITAN_X, free=64 * 2**20)
    monkeypatch.setattr("torch.cuda.get_arch_list", lambda: ["sm_60", *RECENT_WHEEL])
    report = examine(str(tiny_model_dir), compare=False)
    assert (report.device, report.dtype) == ("cuda:0", "float32")
    assert any("compute capability 6.1: float32" in a for a in report.advice)
    assert cuda.moved_to == ["cuda:0"]


def test_a_gpu_this_torch_cannot_use_is_advice(monkeypatch, tiny_model_dir):
    FakeCuda(monkeypatch, TITAN_X)  # the recent wheel: no kernels for compute capability 6.1
    report = examine(str(tiny_model_dir), compare=False)
    assert report.device == "cpu"
    assert any("not supported by torch" in a for a in report.advice)
    assert "ADVICE" in format_reports([report])


@pytest.mark.parametrize("visible, shared", [("0", True), (None, True)])
def test_two_workers_on_one_gpu_are_told_how_to_split_them(visible, shared):
    reports = [
        WorkerReport(f"tcp://w{i}", host="node1", device="cuda:0", visible_devices=visible)
        for i in range(2)
    ]
    reports.append(WorkerReport("tcp://w3", host="node1", device="cuda:0", visible_devices="1"))
    _shared_gpus(reports)
    assert all("2 workers on node1 use cuda:0" in r.advice[0] for r in reports[:2])
    assert reports[2].advice == []
