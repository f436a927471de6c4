"""One worker setup, whoever starts the worker: a worker of ``local_cluster``, one started by
hand with ``dask-pcm worker``, and the workers of a batch job's command line
(``job_options``, as a Grid Engine job runs it) report the same dask_pcm settings; a plain
``dask worker`` shows what they would be without it."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import time

import dask.config
import distributed
import pytest
from click.testing import CliRunner
from dask_jobqueue.sge import SGEJob
from distributed import Client

import dask_pcm
from dask_pcm.cli import main
from dask_pcm.deploy import preemption, worker_setup
from dask_pcm.deploy.jobqueue import job_options
from dask_pcm.deploy.worker_setup import MALLOC_TRIM, worker_settings


def _job_command(address: str) -> list[str]:
    """The worker command of a Grid Engine job of ``batch_cluster`` (its job script's last
    line): two worker processes, as ``processes=2`` asks."""
    options = job_options("sge", cores=2, memory="2GB", processes=2)
    options.pop("scheduler_options")  # the cluster's, not the job's
    script = SGEJob(scheduler=address, name="job", **options).job_script()
    command = shlex.split(script.strip().splitlines()[-1])
    assert command[1:3] == ["-m", "distributed.cli.dask_worker"] and "--nworkers" in command
    return command


def _stop(process: subprocess.Popen) -> None:
    process.terminate()  # dask worker closes its nannies on SIGTERM
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)


def _wait_for_names(client: Client, names: set[str], timeout: float) -> dict[str, str]:
    """Address of each worker of ``names``, once all are connected."""
    deadline = time.monotonic() + timeout
    while True:
        found = {str(w["name"]): a for a, w in client.scheduler_info()["workers"].items()}
        if names <= set(found):
            return {name: found[name] for name in names}
        assert time.monotonic() < deadline, f"workers {sorted(names - set(found))} never came"
        time.sleep(0.2)


def test_every_launcher_gives_its_workers_the_same_settings(tmp_path, monkeypatch):
    # No GPU for anyone (a host with GPUs would give each worker its own, which differs by
    # design; tests/deploy/test_gpu.py checks that binding), one scratch folder for all.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    env = dict(os.environ, DASK_TEMPORARY_DIRECTORY=str(tmp_path))
    started: list[subprocess.Popen] = []
    with (
        dask.config.set({"temporary-directory": str(tmp_path)}),
        dask_pcm.local_cluster(n_workers=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        address = cluster.scheduler_address
        commands = [
            [sys.executable, "-m", "dask_pcm.cli", "worker", address, "--name", "hand"],
            [*_job_command(address)],
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--name", "plain"],
        ]
        try:
            for command in commands:
                started.append(subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL))
            names = {"0", "hand", "job-0", "job-1", "plain"}
            addresses = _wait_for_names(client, names, timeout=120)
            reports = client.run(worker_settings, workers=list(addresses.values()))
            settings = {name: reports[a] for name, a in addresses.items()}
        finally:
            for process in started:
                _stop(process)

    plain = settings.pop("plain")
    # Nothing differs: names and addresses are not settings and not in the report, and no
    # worker has a GPU to be given.
    assert settings["hand"] == settings["0"], (settings["hand"], settings["0"])
    assert settings["job-0"] == settings["job-1"] == settings["0"], settings
    expected = {
        "tick-interval": 0.1,
        "profile-interval": 0.1,
        MALLOC_TRIM: None,
        "CUDA_VISIBLE_DEVICES": "",
        "template-directory": str(tmp_path / "dask-scratch-space" / "pcm-templates"),
        "preloads": ["dask_pcm.worker.preimport", "dask_pcm.deploy.preemption"],
        "preimport-modules": [
            "torch",
            "transformers",
            "transformers.modeling_utils",
            "transformers.models.auto.modeling_auto",
            "transformers.models.auto.tokenization_auto",
        ],
        "preemption-signals": ["SIGUSR2"],
        "gpu-per-worker": True,
        "nanny": True,
    }
    assert settings["0"] == expected
    # What distributed alone gives: the report is not blind to the setup.
    differ = {key for key in expected if plain[key] != expected[key]}
    assert differ == {
        "tick-interval", "profile-interval", MALLOC_TRIM, "template-directory", "preloads",
        "preemption-signals",
    }, plain  # fmt: skip
    assert plain[MALLOC_TRIM] == "65536"


def test_dask_pcm_worker_has_every_dask_worker_option_and_needs_its_nanny():
    from distributed.cli.dask_worker import main as dask_worker

    runner = CliRunner()
    result = runner.invoke(main, ["worker", "--help"])
    assert result.exit_code == 0, result.output
    theirs = {o for p in dask_worker.params for o in p.opts if o.startswith("--")}
    missing = {o for o in theirs - {"--version"} if o not in result.output}
    assert missing == set()
    assert worker_setup.PRELOAD in result.output and "dask-pcm worker tcp://" in result.output
    refused = runner.invoke(main, ["worker", "tcp://127.0.0.1:1", "--no-nanny"])
    assert refused.exit_code == 2 and "leave out --no-nanny" in refused.output
    out = subprocess.run(
        [sys.executable, "-m", "dask_pcm.cli.worker", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and "--nworkers" in out.stdout
    assert "RuntimeWarning" not in out.stderr


def test_the_setup_edits_only_the_nannys_copy_and_keeps_preload_argv_in_step(tmp_path):
    async def check() -> None:
        async with distributed.Scheduler(dashboard_address=":0") as scheduler:
            nanny = distributed.Nanny(
                scheduler.address,
                preload=["mine", preemption.PRELOAD],
                preload_argv=[["--x"], []],
                local_directory=str(tmp_path),
            )
            assert nanny.env[MALLOC_TRIM] == "65536"  # distributed's
            worker_setup.setup(nanny)
            worker_setup.setup(nanny)  # a second listing of the preload changes nothing more
            assert MALLOC_TRIM not in nanny.env and MALLOC_TRIM not in nanny.pre_spawn_env
            assert nanny.preload == ["mine", preemption.PRELOAD, worker_setup.PREIMPORT]
            assert nanny.preload_argv == [["--x"], [], []]
            get = nanny.config["distributed"]
            assert get["worker"]["profile"]["interval"] == "100ms"
            assert get["admin"]["tick"]["interval"] == "100ms"
            assert nanny.config["pcm"]["worker"]["template-directory"] == os.path.join(
                nanny.local_directory, "pcm-templates"
            )
            await nanny.close()

    asyncio.run(check())
    # The process-wide config is as it was.
    assert dask.config.get("distributed.worker.profile.interval") == "10ms"
    assert dask.config.get("pcm.worker.template-directory") is None
    with pytest.raises(TypeError, match="is a nanny preload"):
        worker_setup.setup(object())  # type: ignore[arg-type]
