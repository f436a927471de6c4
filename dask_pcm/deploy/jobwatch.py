"""The job watchdog of batch clusters: jobs that go, and jobs that never come.

Every ``watch_interval`` :class:`JobWatch` compares the batch queue (``qstat``,
``condor_q``, ``squeue``) with the connected workers:

- a job that left the queue while its worker is not connected (deleted, preempted, or dead
  before its worker ever connected, dask-jobqueue #643) is replaced, so that ``scale(n)``
  keeps ``n`` workers, not ``n`` job records; after ``max_failed_starts`` jobs in a row that
  ended before their worker connected (a broken job script), no more are submitted;
- a job whose submission command failed keeps the batch system's message
  (:class:`RecordsSubmission`): dask-jobqueue raises it from ``Job.start`` and
  distributed's ``SpecCluster`` only logs it, then submits nothing more for that job.

When no worker is connected and no job is left that could bring one (every submission
rejected, or the watchdog gave up), the watchdog notes since when; past
``pcm.jobs.start-timeout`` :meth:`JobWatch.raise_if_stuck` raises
:class:`~dask_pcm.exceptions.BatchJobError` with that message. Jobs waiting in the queue
never count, however long they wait.
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask_jobqueue
from dask.utils import parse_timedelta
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_pcm import config
from dask_pcm.deploy import KINDS
from dask_pcm.exceptions import BatchJobError

logger = logging.getLogger(__name__)

SYSTEMS = {"sge": "Grid Engine", "htcondor": "HTCondor", "slurm": "SLURM"}


class RecordsSubmission:
    """Job mixin: a job whose submission command fails keeps the batch system's message.

    dask-jobqueue raises it from ``Job.start`` with the command's output, and distributed's
    ``SpecCluster`` only logs it: the job stays in ``cluster.workers``, never submitted
    again, and nothing else says why no worker comes. The watchdog reads ``submit_error``.
    """

    submit_error: str | None = None
    if TYPE_CHECKING:  # provided by dask_jobqueue.Job
        name: str
        job_id: str | None
        status: Status

    async def start(self) -> None:
        try:
            await super().start()  # type: ignore[misc]
        except Exception as exc:
            if self.job_id is None:  # the submission itself failed
                self.submit_error = command_output(exc)
                logger.error("Submitting batch job %s failed: %s", self.name, self.submit_error)
            # Not "created": closing the cluster asserts that its jobs ended one way or another.
            self.status = Status.failed
            raise


class SGEJob(RecordsSubmission, dask_jobqueue.sge.SGEJob):
    """:class:`dask_jobqueue.sge.SGEJob` that keeps why ``qsub`` failed."""


class HTCondorJob(RecordsSubmission, dask_jobqueue.htcondor.HTCondorJob):
    """:class:`dask_jobqueue.htcondor.HTCondorJob` that keeps why ``condor_submit`` failed."""


def command_output(exc: BaseException) -> str:
    """What a failed command printed (stderr first), from dask-jobqueue's error message."""
    text = str(exc).strip()
    match = re.search(r"\nstdout:\n(.*)\nstderr:\n(.*)\Z", text, re.S)
    if match is None:
        return text  # not a failed command (say, qsub's output without a job id): all of it
    printed = [part.strip() for part in (match.group(2), match.group(1)) if part.strip()]
    return "\n".join(printed) or text


class JobWatch:
    """Cluster mixin for dask-jobqueue clusters: the job watchdog and :meth:`raise_if_stuck`.

    The cluster class sets ``kind`` (``"sge"`` or ``"htcondor"``) and a ``job_cls`` derived
    from :class:`RecordsSubmission`, as :class:`dask_pcm.deploy.jobqueue.SGECluster` does.
    """

    kind: str = ""
    if TYPE_CHECKING:  # provided by dask_jobqueue.JobQueueCluster
        loop: Any
        workers: dict[str, Any]
        worker_spec: dict[str, Any]
        scheduler_info: dict[str, Any]
        scale: Any
        _correct_state: Any
        _i: int

    #: Consecutive jobs that left the queue without their worker ever connecting, after
    #: which no more replacements are submitted (a broken job script would loop forever).
    max_failed_starts = 5

    def __init__(self, *args: Any, watch_interval: str | float = "10s", **kwargs: Any) -> None:
        self._retired: set[str] = set()  # names of jobs that left: never given again
        self._watch: PeriodicCallback | None = None  # a cluster that fails to start closes
        super().__init__(*args, **kwargs)
        self._ever_connected: set[str] = set()
        self.failed_starts = 0
        self.replaced_jobs = 0
        self._last_failed_start: str | None = None
        # (since when, message, the batch system's output): written by the watchdog only,
        # read by raise_if_stuck from any thread.
        self._stuck: tuple[float, str, str] | None = None
        interval = parse_timedelta(watch_interval) * 1000
        self._watch = PeriodicCallback(self._watch_jobs, interval)
        self.loop.add_callback(self._watch.start)

    async def _close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        await super()._close()  # type: ignore[misc]

    # -- the watchdog ----------------------------------------------------------------------
    def _connected(self) -> set[str]:
        names = {str(w.get("name")) for w in self.scheduler_info.get("workers", {}).values()}
        # A job of several processes runs workers named "<job name>-<i>".
        return {
            job
            for job in self.workers
            if job in names or any(n.startswith(f"{job}-") for n in names)
        }

    async def _watch_jobs(self) -> None:
        try:
            await self.check_jobs()
        except Exception:  # a watchdog must not die of one bad poll
            logger.exception("dask_pcm job watchdog failed; trying again next period")

    async def check_jobs(self) -> list[str]:
        """Replace jobs that left the queue while their worker is not connected, and note
        whether any worker can still come (see :meth:`raise_if_stuck`).

        Returns the names of the jobs dropped. Runs every ``watch_interval``.
        """
        connected = self._connected()
        gone = await self._replace_gone(connected)
        self._note_stuck(connected)
        return gone

    async def _replace_gone(self, connected: set[str]) -> list[str]:
        workers = self.workers
        self._ever_connected |= connected
        if connected:
            self.failed_starts = 0
        suspects = {
            name: job.job_id
            for name, job in workers.items()
            if name not in connected and getattr(job, "job_id", None)
        }
        queued = await asyncio.to_thread(queued_job_ids, self.kind) if suspects else set()
        if queued is None:
            return []
        gone = [name for name, job_id in suspects.items() if not in_queue(job_id, queued)]
        if not gone:
            await self._reopen_lost()
            return []
        jobs_before = len(self.worker_spec)
        for name in gone:
            self._retired.add(name)  # never a replacement's name: see new_worker_spec
            started = name in self._ever_connected
            self._ever_connected.discard(name)
            self.worker_spec.pop(name, None)
            workers.pop(name, None)
            if not started:
                self.failed_starts += 1
                self._last_failed_start = suspects[name]
            logger.warning(
                "Batch job %s (%s) left the queue %s; %s",
                suspects[name],
                name,
                "after its worker left" if started else "before its worker ever connected",
                "submitting a replacement"
                if self.failed_starts < self.max_failed_starts
                else "not replacing it",
            )
        if self.failed_starts >= self.max_failed_starts:
            logger.error(
                "%d batch jobs in a row ended before their worker connected: not submitting "
                "more. Read the jobs' output (log_directory=%r) and the job script "
                "(cluster.job_script()).",
                self.failed_starts,
                getattr(self, "_job_kwargs", {}).get("log_directory"),
            )
            return gone
        self.replaced_jobs += len(gone)
        if getattr(self, "_adaptive", None) is None:
            self.scale(jobs=jobs_before)
        # Adaptive scaling sees the smaller plan at its next step and asks for more.
        return gone

    def new_worker_spec(self) -> dict[str, Any]:
        """The next worker spec, under a name no job of this cluster had: a replacement under
        the name of the job it replaces was dropped again when distributed, seconds later,
        removed the old worker of that name as lost, and reopened: two jobs for one loss."""
        spec: dict[str, Any] = super().new_worker_spec()  # type: ignore[misc]
        while next(iter(spec)) in self._retired:
            self._i += 1
            spec = super().new_worker_spec()  # type: ignore[misc]
        return spec

    # -- a cluster that cannot get a worker ----------------------------------------------
    def raise_if_stuck(self) -> None:
        """Raise :class:`~dask_pcm.exceptions.BatchJobError` if no worker can come.

        That is: no worker is connected, no job is left that could bring one (every
        submission was rejected, or ``max_failed_starts`` jobs in a row ended before their
        worker connected and no more are submitted), and so for ``pcm.jobs.start-timeout``.
        Jobs waiting in the queue are never stuck, however long they wait.

        Cheap and safe from any thread (e.g. once a second while waiting for results): it
        reads what the watchdog noted at its last look, every ``watch_interval``, and runs
        no command. :func:`dask_pcm.run_fever` calls it while it waits.

        Examples
        --------
        >>> cluster = dask_pcm.batch_cluster("sge", queue="nosuch.q", workers=1)  # doctest: +SKIP
        >>> cluster.raise_if_stuck()  # a minute later                              # doctest: +SKIP
        Traceback (most recent call last):
        dask_pcm.exceptions.BatchJobError: No worker can start: ... `qsub <job script>` said:
            Unable to run job: Job was rejected because job requests unknown queue "nosuch.q"
            Exiting.
        ...
        """
        stuck = self._stuck
        if stuck is None or self.scheduler_info.get("workers"):
            return
        since, message, output = stuck
        timeout = config.job_start_timeout()
        waited = time.monotonic() - since
        if timeout is None or waited < timeout:
            return
        raise BatchJobError(
            f"{message}\n(No worker for {waited:.0f} s; pcm.jobs.start-timeout is {timeout:g} s.)",
            output,
        )

    def _note_stuck(self, connected: set[str]) -> None:
        jobs = list(self.workers.values())
        rejected = [job for job in jobs if getattr(job, "submit_error", None)]
        gave_up = self.failed_starts >= self.max_failed_starts
        if connected or len(rejected) < len(jobs) or not (rejected or gave_up):
            self._stuck = None  # a worker is here, a job may still bring one, or none asked
        elif self._stuck is None:
            self._stuck = (time.monotonic(), *self._why_stuck(rejected))

    def _why_stuck(self, rejected: list[Any]) -> tuple[str, str]:
        log_directory = getattr(self, "_job_kwargs", {}).get("log_directory")
        look = (
            f"Read the job script (cluster.job_script()) and the jobs' output "
            f"(log_directory={log_directory!r})."
        )
        if rejected:
            job = rejected[-1]
            output = job.submit_error
            return (
                f"No worker can start: {SYSTEMS[self.kind]} rejected {len(rejected)} job "
                f"submission(s) and no worker is connected. "
                f"`{job.submit_command} <job script>` said:\n{_indent(output)}\n"
                f"Check the job's settings (batch_cluster's arguments or the jobqueue.{self.kind} "
                f"configuration). {look}",
                output,
            )
        job_id = self._last_failed_start
        output = job_output(log_directory, job_id) if job_id else ""
        said = f" Its output:\n{_indent(output)}\n" if output else " "
        return (
            f"No worker can start: {self.failed_starts} batch jobs in a row left the queue "
            f"before their worker connected (the last: job {job_id}), and no more are "
            f"submitted.{said}{look}",
            output,
        )

    async def _reopen_lost(self) -> None:
        """Submit jobs for specs whose job distributed dropped as lost.

        Without :class:`~dask_pcm.deploy.requeue.KeepsQueuedJobs`, distributed drops a
        worker that left for good from ``cluster.workers`` after
        ``distributed.deploy.lost-worker-timeout``, but its spec stays and nothing reopens
        it unless something scales: a fixed-size cluster would shrink with every preemption.
        """
        if getattr(self, "_adaptive", None) is not None:
            return  # adaptive scaling reopens them at its next step
        lost = set(self.worker_spec) - set(self.workers)
        if not lost:
            return
        logger.warning("Submitting %d job(s) for workers that left: %s", len(lost), sorted(lost))
        self.replaced_jobs += len(lost)
        await self._correct_state()


def job_output(log_directory: str | None, job_id: str, lines: int = 20) -> str:
    """The last ``lines`` of each of a job's output files in ``log_directory``, if any.

    Grid Engine writes ``<job name>.e<id>`` and ``.o<id>``; dask-jobqueue's HTCondor jobs
    ``worker-<id>.err`` and ``.out``.
    """
    if not log_directory:
        return ""
    own = re.compile(rf"(^|\D){re.escape(job_id)}(\D|$)")
    try:
        files = sorted(p for p in Path(log_directory).iterdir() if own.search(p.name))
    except OSError:
        return ""
    parts = []
    for path in files:
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"==> {path} <==\n{tail}")
    return "\n".join(parts)


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def queued_job_ids(kind: str) -> set[str] | None:
    """Ids of this user's jobs the batch system still lists (pending, running, ending).

    ``None`` when the query fails (the watchdog then waits for the next period rather than
    replacing jobs it cannot see).
    """
    if kind == "sge":
        cmd = ["qstat", "-u", getpass.getuser()]
    elif kind == "htcondor":
        cmd = ["condor_q", "-af", "ClusterId", "ProcId"]
    elif kind == "slurm":
        cmd = ["squeue", "-h", "-u", getpass.getuser(), "-o", "%i"]
    else:
        raise ValueError(f"unknown batch system {kind!r}; one of {KINDS}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("Could not list batch jobs with %s: %r", " ".join(cmd), exc)
        return None
    return parse_queue(kind, out)


def parse_queue(kind: str, text: str) -> set[str]:
    """Job ids in the output of ``qstat`` (SGE), ``condor_q -af ClusterId ProcId`` or
    ``squeue -h -o %i`` (SLURM)."""
    ids = set()
    for line in text.splitlines():
        fields = line.split()
        if kind == "sge" and fields and fields[0].isdigit():
            ids.add(fields[0])
        elif kind == "htcondor" and len(fields) == 2 and all(f.isdigit() for f in fields):
            ids.add(f"{fields[0]}.{fields[1]}")
        elif kind == "slurm" and fields and fields[0][:1].isdigit():
            ids.add(fields[0])  # requeued and completing jobs too: they are not gone
    return ids


def in_queue(job_id: str, queued: set[str]) -> bool:
    """Whether ``job_id`` (or its cluster id, ``123`` of ``123.0``) is among ``queued``."""
    return job_id in queued or job_id.split(".")[0] in queued
