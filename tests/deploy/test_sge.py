"""On a real Son of Grid Engine (``sudo bash ci/sge/setup.sh`` starts one on this machine):
a FEVER run while worker jobs are preempted, a worker warned by ``qdel`` (``-notify``), and
jobs that ``qsub`` rejects, which end a run with qsub's message instead of a wait for ever.

Without Grid Engine these tests skip, unless ``PCM_REQUIRE_SGE=1`` (as in CI), where its
absence is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import dask_pcm
from dask_pcm.apps.fever import demo_claims
from dask_pcm.apps.fever.prompts import BUILTIN_TEMPLATES
from dask_pcm.apps.fever.run import CONTEXT, run_fever
from dask_pcm.testing.tasks import noted_square
from tests.conftest import (
    assert_handed_back,
    fever_cli_on_jobs,
    job_of,
    load_the_victim,
    one_host_batch_cluster,
    require_batch_system,
    wait_for,
)

pytestmark = [pytest.mark.sge, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def grid_engine() -> None:
    require_batch_system(
        "qstat", "Grid Engine", "; `sudo bash ci/sge/setup.sh` starts one", "PCM_REQUIRE_SGE"
    )


def _sge_cluster(tmp_path: Path, workers: int, **kwargs):
    return one_host_batch_cluster("sge", tmp_path, workers, memory="4GB", **kwargs)


class Preemptor(threading.Thread):
    """Preempts a worker job every ``period`` seconds: ``qdel`` (a warned, graceful exit)
    three times, then SIGKILL of the worker and its nanny (a vanished node); only a worker
    whose context is ready while another worker's is too, so a peer always holds the
    template. Records every status row it sees."""

    def __init__(self, cluster, client: Client, period: float, times: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.client, self.period, self.times = cluster, client, period, times
        self.done: list[tuple[str, str]] = []
        self.rows: dict[str, dict] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _ready(self) -> list[str]:
        table = dask_pcm.status(self.client, [CONTEXT])
        for row in table.to_dict("records"):
            self.rows[row["worker"]] = row
        return sorted(table.loc[table["state"] == "ready", "worker"])

    def run(self) -> None:
        try:
            while not self.stop.wait(self.period) and len(self.done) < self.times:
                while len(ready := self._ready()) < 2:
                    if self.stop.wait(0.2):
                        return
                victim = ready[len(self.done) % 2]
                if len(self.done) < 3:  # three qdels first, then a vanished node
                    subprocess.run(["qdel", job_of(self.cluster, self.client, victim)], check=True)
                    self.done.append(("qdel", victim))
                else:
                    pid = self.client.run(os.getpid, workers=[victim])[victim]
                    nanny = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
                    os.kill(pid, signal.SIGKILL)
                    os.kill(nanny, signal.SIGKILL)
                    self.done.append(("SIGKILL", victim))
            while not self.stop.wait(0.5):
                self._ready()
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.soak
def test_fever_run_completes_exactly_once_while_workers_are_preempted(tmp_path):
    # The demo claims three times over: a replacement takes several seconds (the watchdog
    # sees the job gone, a job starts, the template comes from a peer, the model loads), and
    # the run must outlast four.
    data = tmp_path / "claims.jsonl"
    with open(data, "w") as f:
        for copy in range(3):
            for c in demo_claims():
                record = {"id": copy * 100 + int(c.id), "label": c.label, "claim": c.claim}
                f.write(json.dumps(record) + "\n")
    with (
        # Each job its own local disk, as on nodes of their own: workers sharing a folder
        # share one template copy per host (the worker setup), and a replacement would
        # find the copy there instead of fetching it from a peer.
        _sge_cluster(tmp_path, workers=2, local_directory=f"{tmp_path}/scratch/$JOB_ID") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        first = set(client.scheduler_info()["workers"])
        dask_pcm.register(client, dask_pcm.causal_lm(name=CONTEXT))  # the embedded SmolLM2
        preemptor = Preemptor(cluster, client, period=5, times=4)
        preemptor.start()
        try:
            result = run_fever(
                data,
                cluster=client,
                num_templates=len(BUILTIN_TEMPLATES),
                claims_per_task=4,
                output=tmp_path / "preds.parquet",
                progress=False,
            )
        finally:
            preemptor.stop.set()
            preemptor.join(30)
        assert preemptor.error is None, preemptor.error
        assert [kind for kind, _ in preemptor.done[:3]] == ["qdel"] * 3, preemptor.done
        # Every preempted job is replaced, though the run may end first: the last kill can
        # come in its final seconds, before the watchdog's next look.
        wait_for(
            lambda: cluster.replaced_jobs >= len(preemptor.done),
            60,
            f"the watchdog to replace all {len(preemptor.done)} preempted jobs",
        )

    expected = 3 * len(demo_claims()) * len(BUILTIN_TEMPLATES)
    pred = result.predictions
    assert len(pred) == expected  # every (claim, template) present...
    assert not pred.duplicated(["claim_id", "template"]).any()  # ...exactly once
    joiners = [
        row
        for worker, row in preemptor.rows.items()
        if worker not in first and row["template_held"]
    ]
    assert joiners, "no replacement got as far as holding the template"
    for row in joiners:  # a peer always held it: none read the source
        assert row["bytes_from_source"] == 0, row
        assert row["bytes_from_peers"] == row["template_bytes"], row


def test_qdel_warns_the_worker_which_hands_its_work_back(tmp_path, tiny_model_dir):
    log = tmp_path / "runs"

    with _sge_cluster(tmp_path, workers=2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        dask_pcm.register(client, dask_pcm.causal_lm(tiny_model_dir, name="tiny", device="cpu"))
        victim, other, held, queued = load_the_victim(client, noted_square, log)
        job = job_of(cluster, client, victim)
        start = time.monotonic()
        subprocess.run(["qdel", job], check=True)
        wait_for(
            lambda: victim not in client.scheduler_info()["workers"], 60, "the warned worker to go"
        )
        # It left on the warning, well before Grid Engine's kill (the queue's notify time).
        notify = subprocess.run(
            ["qconf", "-sq", "all.q"], capture_output=True, text=True, check=True
        ).stdout
        notify_s = next(
            sum(int(p) * 60**i for i, p in enumerate(reversed(line.split()[1].split(":"))))
            for line in notify.splitlines()
            if line.startswith("notify")
        )
        assert time.monotonic() - start < notify_s
        assert_handed_back(client, held, queued, other, log)


def test_cli_runs_fever_on_grid_engine_jobs(tmp_path, tiny_model_dir):
    """``dask-pcm fever --cluster sge``: worker jobs from dask-jobqueue's configuration."""
    fever_cli_on_jobs("sge", tmp_path, tiny_model_dir)
    # The run deleted its jobs when it ended (they may still be leaving: state "dr").
    jobs = subprocess.run(["qstat"], capture_output=True, text=True).stdout.splitlines()[2:]
    assert all("d" in line.split()[4] for line in jobs), jobs


def test_a_job_that_dies_before_its_worker_connects_is_replaced(tmp_path):
    """dask-jobqueue #643: the first job exits at once; the watchdog submits another."""
    marker = tmp_path / "first-job-died"
    with (
        dask_pcm.batch_cluster(
            "sge",
            workers=1,
            cores=1,
            memory="2GB",
            processes=1,
            interface="lo",
            log_directory=str(tmp_path / "logs"),
            watch_interval="1s",
            scheduler_options={"dashboard_address": ":0"},
            # The first job to start leaves a mark and dies before starting its worker.
            job_script_prologue=[f"[ -e {marker} ] || {{ touch {marker}; exit 1; }}"],
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(1, timeout=120)
        assert marker.exists()
        # The count of failed starts is reset at the watchdog's next look (every 1 s here).
        wait_for(lambda: cluster.failed_starts == 0, 10, "the watchdog to see the worker")
        assert cluster.replaced_jobs >= 1
        assert len(cluster.worker_spec) == 1


def _stuck_error(cluster) -> dask_pcm.BatchJobError | None:
    try:
        cluster.raise_if_stuck()
    except dask_pcm.BatchJobError as exc:
        return exc
    return None


QSUB_SAID = 'Unable to run job: Job was rejected because job requests unknown queue "nosuch.q"'


def test_a_job_qsub_rejects_ends_the_wait_with_qsubs_message(tmp_path):
    """A queue name with a typo: qsub fails once, and dask-jobqueue only logs it."""
    with (
        dask.config.set({"pcm.jobs.start-timeout": "2s"}),
        _sge_cluster(tmp_path, workers=1, queue="nosuch.q") as cluster,
    ):
        start = time.monotonic()
        error = wait_for(lambda: _stuck_error(cluster), 30, "raise_if_stuck to raise")
        waited = time.monotonic() - start
    assert 2 <= waited < 8, waited  # the start timeout, plus at most a watch interval or so
    assert QSUB_SAID in error.output
    message = str(error)
    assert QSUB_SAID in message and "`qsub <job script>` said" in message
    assert "cluster.job_script()" in message and str(tmp_path / "logs") in message


def test_a_job_waiting_in_the_queue_is_not_stuck(tmp_path):
    """A held job (``qsub -h``) waits in the queue as a job on a busy cluster does."""
    with (
        dask.config.set({"pcm.jobs.start-timeout": "1s"}),
        _sge_cluster(tmp_path, workers=1, job_extra_directives=["-h"]) as cluster,
    ):
        job_id = wait_for(
            lambda: next((job.job_id for job in cluster.workers.values() if job.job_id), None),
            30,
            "the job to be submitted",
        )
        end = time.monotonic() + 5  # five start timeouts
        while time.monotonic() < end:
            cluster.raise_if_stuck()
            time.sleep(0.2)
        queue = subprocess.run(["qstat"], capture_output=True, text=True, check=True).stdout
        state = next(line.split()[4] for line in queue.splitlines() if line.split()[:1] == [job_id])
        assert state == "hqw", queue  # held and waiting all along
        assert not cluster.scheduler_info["workers"] and cluster.failed_starts == 0


@pytest.mark.timeout(60)
def test_run_fever_on_jobs_qsub_rejects_raises_instead_of_waiting(tmp_path, tiny_model_dir):
    with (
        dask.config.set({"pcm.jobs.start-timeout": "3s"}),
        _sge_cluster(tmp_path, workers=1, queue="nosuch.q") as cluster,
    ):
        start = time.monotonic()
        with pytest.raises(dask_pcm.BatchJobError, match="unknown queue") as error:
            dask_pcm.run_fever(
                cluster=cluster, model=tiny_model_dir, limit=6, num_templates=1, progress=False
            )
        waited = time.monotonic() - start
    assert waited < 45, waited
    assert QSUB_SAID in error.value.output
