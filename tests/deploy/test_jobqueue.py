"""Batch-system clusters without a batch system: job scripts, HTCondor submit descriptions
checked by HTCondor's own parser, the job watchdog and its end to the wait for workers that
cannot come, adaptive scaling's keep rule, and the graceful retirement of a worker warned of
its preemption by a signal."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import dask
import distributed
import pytest
from distributed import Client
from distributed.utils import sync

import dask_pcm
from dask_pcm.deploy import jobqueue, jobwatch, preemption, worker_setup
from dask_pcm.deploy.jobqueue import batch_cluster, job_options, walltime_seconds
from dask_pcm.deploy.jobwatch import parse_queue
from dask_pcm.testing.tasks import noted_square
from tests.conftest import assert_handed_back, load_the_victim, wait_gone


def _script(kind: str, **kwargs) -> str:
    cls = {"sge": jobqueue.SGECluster, "htcondor": jobqueue.HTCondorCluster}.get(
        kind, jobqueue.SLURMCluster
    )
    options = job_options(kind, scheduler_options={"dashboard_address": ":0"}, **kwargs)
    with cls(watch_interval="1h", **options) as cluster:
        return cluster.job_script()


def test_sge_jobs_are_warned_before_preemption_and_retire_before_their_walltime():
    script = _script(
        "sge", cores=1, memory="4GB", walltime="01:00:00",
        job_extra_directives=["-l gpu=1"], job_script_prologue=["module load cuda"],
    )  # fmt: skip
    lines = script.splitlines()
    assert "#$ -l gpu=1" in lines and "#$ -notify" in lines  # the site's and dask_pcm's
    worker = next(i for i, line in enumerate(lines) if "distributed.cli.dask_worker" in line)
    # The job shell and the nanny ignore the warning; the worker process handles it.
    assert lines.index("trap '' USR2") < lines.index("module load cuda") < worker
    assert "--lifetime 3060s --lifetime-stagger 180s" in lines[worker]  # 85 % +- 5 % of 1 h
    # The worker setup gives the worker process the plugin that turns the warning into a
    # retirement (tests/deploy/test_worker_setup.py starts such a job's workers).
    assert f"--preload-nanny {worker_setup.PRELOAD}" in lines[worker]
    assert preemption.PRELOAD in worker_setup.WORKER_PRELOADS


def test_configured_lifetime_and_directives_are_kept():
    settings = {
        "jobqueue.sge.job-extra-directives": ["-notify", "-l h_vmem=8G"],
        "jobqueue.sge.worker-extra-args": ["--lifetime", "20m"],
        "jobqueue.sge.walltime": "00:30:00",
    }
    with dask.config.set(settings):
        options = job_options("sge", cores=1, memory="1GB")
    assert options["job_extra_directives"] == ["-notify", "-l h_vmem=8G"]  # no second -notify
    assert options["worker_extra_args"] == [
        "--lifetime",
        "20m",
        "--preload-nanny",
        worker_setup.PRELOAD,
    ]
    # The scheduler gets the contexts page in its dashboard.
    assert options["scheduler_options"] == {"preload": ["dask_pcm.scheduler.preload"]}
    again = job_options("sge", worker_extra_args=["--preload-nanny", worker_setup.PRELOAD])
    assert again["worker_extra_args"].count(worker_setup.PRELOAD) == 1
    with pytest.raises(ValueError, match="nanny=False: dask_pcm's worker setup runs in the nanny"):
        job_options("sge", nanny=False)
    with pytest.raises(ValueError, match="unknown batch system 'pbs'"):
        job_options("pbs")
    with pytest.raises(ValueError, match="walltime 'soon'"):
        job_options("sge", walltime="soon")
    assert walltime_seconds("1:30:00") == walltime_seconds("90m") == 5400


def test_batch_cluster_without_cores_or_memory_names_the_template(monkeypatch):
    monkeypatch.setitem(dask.config.config["jobqueue"]["sge"], "cores", None)
    monkeypatch.setitem(dask.config.config["jobqueue"]["sge"], "memory", None)
    with pytest.raises(ValueError, match=r"jobqueue-configs/sge.yaml"):
        batch_cluster("sge")


def test_htcondor_submit_description_passes_htcondors_parser(monkeypatch):
    monkeypatch.setenv("CONDOR_CONFIG", "/dev/null")
    htcondor2 = pytest.importorskip("htcondor2", reason="pip install htcondor (the test extra)")
    script = _script(
        "htcondor", cores=1, memory="8GB", disk="10GB",
        job_extra_directives={"request_gpus": "1"}, job_script_prologue=["export A=1"],
    )  # fmt: skip
    description = "\n".join(line for line in script.splitlines() if not line.startswith("#!"))
    submit = htcondor2.Submit(description)
    assert submit["request_gpus"] == "1"
    assert submit["kill_sig"] == "SIGUSR2"
    assert submit["want_graceful_removal"] == "true"
    # HTCondor's quoting ('' inside '...') gives the shell: trap '' USR2; export A=1; ...
    assert "-c 'trap '''' USR2; export A=1; " in submit["Arguments"]
    with pytest.raises(ValueError):
        htcondor2.Submit("request_gpus 1\nqueue")  # the parser is real: no "=" is an error


def test_slurm_jobs_pass_the_warning_to_the_worker_and_keep_a_given_signal():
    script = _script("slurm", cores=1, memory="4GB", walltime="01:00:00")
    lines = script.splitlines()
    assert "#SBATCH --signal=B:USR2@50" in lines and "#SBATCH --mem=4G" in lines
    worker = next(i for i, line in enumerate(lines) if "distributed.cli.dask_worker" in line)
    # The worker's processes ignore USR2 sent to the job; the shell hands it on to them.
    assert lines[worker].startswith("( trap '' USR2; exec ") and lines[worker].endswith(") &")
    assert "trap 'pcm_warn USR2' USR2" in lines and "trap 'pcm_warn TERM' TERM" in lines
    assert any("SLURM_RESTART_COUNT" in line for line in lines[:worker])
    assert "trap '' USR2" not in lines  # the SGE prologue's trap would leave the shell deaf
    given = _script("slurm", cores=1, memory="4GB", job_extra_directives=["--signal=B:USR1@90"])
    assert "#SBATCH --signal=B:USR1@90" in given and "B:USR2" not in given


def test_a_config_name_section_reaches_the_job_script():
    """``config_name=`` names the site's own section; its prologue and directives used to be
    replaced by the default section's (``jobqueue.<kind>``)."""
    own = {
        "cores": 1, "memory": "2GB", "job-script-prologue": ["module load cuda"],
        "job-extra-directives": ["-l gpu=1"], "worker-extra-args": ["--resources", "GPU=1"],
    }  # fmt: skip
    settings = {
        "jobqueue.gpu-sge": {**dask.config.get("jobqueue.sge"), **own},  # a complete section
        "jobqueue.sge.job-script-prologue": ["module load default"],
    }
    with dask.config.set(settings):
        script = _script("sge", config_name="gpu-sge")
    assert "module load cuda" in script and "module load default" not in script
    assert "#$ -l gpu=1" in script and "--resources GPU=1" in script


@pytest.mark.parametrize("kind", ["sge", "slurm", "htcondor"])
def test_a_cluster_that_cannot_start_says_why(kind):
    """A scheduler that cannot start (an interface the host lacks) gives distributed's
    message; closing the half-built cluster used to raise AttributeError ('_watch') over
    it (found by dask-jobqueue's own tests, tests/deploy/test_jobqueue_suite.py)."""
    disk = {"disk": "1GB"} if kind == "htcondor" else {}
    with pytest.raises(RuntimeError, match="not a valid network interface") as raised:
        batch_cluster(
            kind, **disk, cores=1, memory="1GB", scheduler_options={"interface": "nic-pcm-x"}
        )
    assert "_watch" not in str(raised.value)


def test_queue_listings_are_parsed():
    qstat = """job-ID  prior   name       user  state submit/start at     queue  slots ja-task-ID
-----------------------------------------------------------------------------------------
     17 0.55500 dask-worke root  r     11/30/2026 01:02:03 all.q@host  1
     18 0.00000 dask-worke root  qw    11/30/2026 01:02:04             1
"""
    assert parse_queue("sge", qstat) == {"17", "18"}
    assert parse_queue("htcondor", "42 0\n43 0\n") == {"42.0", "43.0"}
    assert parse_queue("sge", "") == set()
    # squeue -h -o %i: requeued (PENDING) and completing jobs are listed: not gone.
    assert parse_queue("slurm", "17\n18_2\n") == {"17", "18_2"}


class _FakeSGEJob(jobwatch.SGEJob):
    """An SGE job that is never submitted: qsub and qdel are not called."""

    submitted: list[str] = []

    async def _submit_job(self, script_filename: str) -> str:
        job_id = str(1000 + len(self.submitted))
        self.submitted.append(job_id)
        return f'Your job {job_id} ("dask-worker") has been submitted'

    @classmethod
    def _close_job(cls, job_id: str, cancel_command: str) -> None:
        pass


def test_watchdog_replaces_jobs_that_left_the_queue_and_gives_up_on_broken_ones(
    monkeypatch, tmp_path: Path
):
    queue: set[str] = set()
    monkeypatch.setattr(jobwatch, "queued_job_ids", lambda kind: set(queue))
    _FakeSGEJob.submitted = []
    logs = tmp_path / "logs"
    with (
        dask.config.set({"pcm.jobs.start-timeout": 0}),  # stuck at once, if ever
        jobqueue.SGECluster(
            job_cls=_FakeSGEJob, watch_interval="1h", cores=1, memory="1GB",
            log_directory=str(logs), scheduler_options={"dashboard_address": ":0"},
        ) as cluster,
    ):  # fmt: skip
        cluster.scale(2)
        deadline = time.monotonic() + 30
        while len(_FakeSGEJob.submitted) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        queue.update(_FakeSGEJob.submitted)
        assert sync(cluster.loop, cluster.check_jobs) == []  # queued: nothing to do
        cluster.raise_if_stuck()  # jobs waiting in the queue are never stuck

        # The newest job dies before its worker connected.
        newest = max(cluster.workers, key=lambda name: int(name.rsplit("-", 1)[1]))
        queue.discard(cluster.workers[newest].job_id)
        gone = sync(cluster.loop, cluster.check_jobs)
        assert gone == [newest] and cluster.failed_starts == 1
        while len(_FakeSGEJob.submitted) < 3:  # a replacement keeps scale(2)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(cluster.worker_spec) == 2
        # Under a name of its own: distributed drops the lost job's name a little later, and
        # a replacement of the same name was dropped with it and submitted again (two jobs
        # for one loss, seen in a SLURM soak: 29 jobs for 21 losses).
        assert gone[0] not in cluster.worker_spec

        cluster.raise_if_stuck()  # one failed start, and its replacement queued
        for job_id in range(1000, 1020):  # what Grid Engine keeps of each job's stderr
            (logs / f"dask-worker.e{job_id}").write_text(f"job {job_id}: dask-worker: not found\n")

        queue.clear()  # every job dies at start, again and again: stop after five in a row
        for _ in range(10):
            sync(cluster.loop, cluster.check_jobs)
            time.sleep(0.2)
        assert cluster.failed_starts >= cluster.max_failed_starts
        assert len(_FakeSGEJob.submitted) <= 2 + cluster.max_failed_starts
        with pytest.raises(dask_pcm.BatchJobError, match="batch jobs in a row left the queue") as e:
            cluster.raise_if_stuck()
        last = cluster._last_failed_start
        assert f"job {last}: dask-worker: not found" in str(e.value)
        assert e.value.output.endswith(f"job {last}: dask-worker: not found")
        assert "cluster.job_script()" in str(e.value) and str(logs) in str(e.value)


class _RequeuedJob(jobwatch.SGEJob):
    """An SGE job that is never submitted, whose closes (``qdel``) are counted."""

    submitted: list[str] = []
    closed: list[str] = []

    async def _submit_job(self, script_filename: str) -> str:
        job_id = str(2000 + len(self.submitted))
        self.submitted.append(job_id)
        return f'Your job {job_id} ("dask-worker") has been submitted'

    @classmethod
    async def _close_job(cls, job_id: str, cancel_command: str) -> None:
        cls.closed.append(job_id)


def test_a_lost_workers_job_is_kept_while_queued(monkeypatch):
    """distributed closes a lost worker's job after the lost-worker timeout (0.2 s here);
    a requeued job, still in the queue, is kept until its worker rejoins under its name, and
    a job that left the queue is replaced by the watchdog (tests/deploy/test_slurm.py
    requeues a real SLURM job)."""
    queue: set[str] = set()
    monkeypatch.setattr(jobwatch, "queued_job_ids", lambda kind: set(queue))
    _RequeuedJob.submitted, _RequeuedJob.closed = [], []

    async def worker(name: str) -> distributed.Worker:
        return await distributed.Worker(cluster.scheduler_address, name=name, nthreads=1)

    def lose(w: distributed.Worker) -> None:
        sync(cluster.loop, w.close)
        deadline = time.monotonic() + 30
        while w.address in cluster.scheduler_info["workers"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1)  # five lost-worker timeouts

    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "0.2s"}),
        jobqueue.SGECluster(
            job_cls=_RequeuedJob, watch_interval="1h", cores=1, memory="1GB",
            scheduler_options={"dashboard_address": ":0"},
        ) as cluster,
    ):  # fmt: skip
        cluster.scale(1)
        deadline = time.monotonic() + 30
        while not _RequeuedJob.submitted:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        queue.update(_RequeuedJob.submitted)
        (name,) = cluster.workers
        lose(sync(cluster.loop, worker, name))
        assert name in cluster.workers and _RequeuedJob.closed == []  # kept: still queued
        assert sync(cluster.loop, cluster.check_jobs) == []
        lose(sync(cluster.loop, worker, name))  # requeued, rejoined, lost again
        assert cluster.replaced_jobs == 0 and len(_RequeuedJob.submitted) == 1
        queue.clear()  # the job left the queue: the watchdog replaces it
        assert sync(cluster.loop, cluster.check_jobs) == [name]
        while len(_RequeuedJob.submitted) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cluster.replaced_jobs == 1 and name not in cluster.workers
    assert dask.config.get("distributed.deploy.lost-worker-timeout") == "15s"


class _RejectedJob(jobwatch.SGEJob):
    """An SGE job whose submission command fails as qsub does for a queue that is not there
    (the real command line and error path of dask-jobqueue, without Grid Engine)."""

    submit_command = "sh -c 'echo Unable to run job: unknown queue nosuch.q >&2; exit 1'"


def test_rejected_submissions_end_the_wait_after_the_start_timeout():
    with (
        dask.config.set({"pcm.jobs.start-timeout": "1s"}),
        jobqueue.SGECluster(
            job_cls=_RejectedJob, watch_interval="0.1s", cores=1, memory="1GB",
            scheduler_options={"dashboard_address": ":0"},
        ) as cluster,
    ):  # fmt: skip
        cluster.raise_if_stuck()  # nothing asked for: nothing stuck
        cluster.scale(2)
        start = time.monotonic()
        while cluster._stuck is None:  # both submissions failed, the watchdog has seen it
            assert time.monotonic() - start < 10, "the watchdog never noticed"
            time.sleep(0.02)
        cluster.raise_if_stuck()  # not yet: under the start timeout
        while True:
            try:
                cluster.raise_if_stuck()
            except dask_pcm.BatchJobError as exc:
                error = exc
                break
            time.sleep(0.05)
        waited = time.monotonic() - start
        assert 1 <= waited < 3, waited
        assert error.output == "Unable to run job: unknown queue nosuch.q"
        message = str(error)
        assert "Grid Engine rejected 2 job submission(s)" in message
        assert "`sh -c 'echo Unable" in message  # the submit command
        assert "cluster.job_script()" in message and "log_directory=None" in message
        assert all(job.job_id is None for job in cluster.workers.values())  # none submitted
        with dask.config.set({"pcm.jobs.start-timeout": None}):
            cluster.raise_if_stuck()  # null: wait for ever


def test_adaptive_keeps_the_last_ready_worker_of_a_context_tasks_wait_for():
    from dask_pcm.protocol import LOADING, READY
    from dask_pcm.scheduler.adaptive import by_name, keep_workers
    from dask_pcm.scheduler.state import ContextStates

    states = ContextStates()
    states.declare("llm", "full", ["tcp://a", "tcp://b", "tcp://c"])
    for worker, state in [("tcp://a", READY), ("tcp://b", READY), ("tcp://c", LOADING)]:
        states.report(worker, "llm", state, seq=1, info={})
    workers = {a: SimpleNamespace(name=n) for a, n in [("tcp://a", "wa"), ("tcp://b", "wb")]}
    assert by_name(workers, ["wa", "wb", "nobody"]) == {"tcp://a", "tcp://b"}
    everyone = {"tcp://a", "tcp://b", "tcp://c"}
    assert keep_workers(states, {"llm"}, everyone) == {"tcp://a"}  # one ready worker stays
    assert keep_workers(states, {"llm"}, {"tcp://a", "tcp://c"}) == set()  # b stays anyway
    assert keep_workers(states, set(), everyone) == set()  # nothing waits: all may go


def test_a_worker_warned_of_preemption_hands_its_work_back(tiny_model_dir, tmp_path: Path):
    log = tmp_path / "runs"
    with (
        dask.config.set({"pcm.cache-directory": str(tmp_path / "cache")}),
        # The worker preload the batch clusters give their jobs.
        dask_pcm.local_cluster(
            n_workers=2, dashboard_address=":0", preload=[preemption.PRELOAD]
        ) as cluster,
        Client(cluster) as client,
    ):
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
        victim, other, held, queued = load_the_victim(client, noted_square, log)
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGUSR2)  # while the victim runs one of them
        wait_gone(client, victim, 60)
        assert_handed_back(client, held, queued, other, log)


TEMPLATES = Path(__file__).parents[2] / "jobqueue-configs"


@pytest.mark.parametrize("kind", ["sge", "htcondor", "slurm"])
def test_jobqueue_templates_give_gpu_jobs_with_a_preemption_warning(kind, monkeypatch):
    """The commented templates in jobqueue-configs/ are valid dask config and give jobs
    that request a GPU, keep the template cache on local scratch and warn before a kill."""
    import yaml

    config = yaml.safe_load((TEMPLATES / f"{kind}.yaml").read_text())
    # The worker settings (no MALLOC_TRIM_THRESHOLD_, the profiler...) come from the worker
    # setup, which every job's nanny runs, not from a copy in the template.
    assert set(config) == {"jobqueue"}
    flat = {f"jobqueue.{kind}.{key}": value for key, value in config["jobqueue"][kind].items()}
    with dask.config.set(flat):
        script = _script(kind)
    assert f"--preload-nanny {worker_setup.PRELOAD}" in script
    assert "export DASK_PCM__WORKER__TEMPLATE_DIRECTORY=" in script
    assert "--nthreads 1 " in script  # one task at a time per GPU
    if kind == "slurm":
        assert "#SBATCH --gres=gpu:1" in script and "#SBATCH --mem-per-gpu=32G" in script
        assert "#SBATCH --mem=" not in script  # SLURM refuses it beside --mem-per-gpu
        assert "#SBATCH --signal=B:USR2@50" in script  # 20 s drain + 30 s of SLURM's lateness
        assert "#SBATCH -t 04:00:00" in script and "#SBATCH --cpus-per-task=4" in script
        assert "--lifetime 12240s --lifetime-stagger 720s" in script
    elif kind == "sge":
        assert "trap '' USR2" in script
        assert "#$ -l gpu=1" in script and "#$ -notify" in script
        assert "#$ -l h_rt=04:00:00" in script
        assert "--lifetime 12240s --lifetime-stagger 720s" in script
    else:
        monkeypatch.setenv("CONDOR_CONFIG", "/dev/null")
        htcondor2 = pytest.importorskip("htcondor2", reason="pip install htcondor (test extra)")
        body = "\n".join(line for line in script.splitlines() if not line.startswith("#!"))
        submit = htcondor2.Submit(body)
        assert submit["request_gpus"] == "1"
        assert submit["kill_sig"] == "SIGUSR2"
        assert submit["job_max_vacate_time"] == "60"
        assert submit["request_cpus"] == "4"
        assert submit["should_transfer_files"] == "YES"
        assert (
            "-c 'trap '''' USR2; export DASK_PCM__WORKER__TEMPLATE_DIRECTORY="
            in submit["Arguments"]
        )
