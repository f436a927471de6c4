"""Workers from batch systems: Grid Engine, HTCondor and SLURM through dask-jobqueue.

:func:`batch_cluster` starts a dask-jobqueue cluster whose jobs suit context management on
shared, opportunistic GPU clusters. Site settings (queue, cores, memory, GPU request, scratch
directory, interface) come from dask-jobqueue's configuration as usual (``jobqueue.sge``,
``jobqueue.htcondor``, ``jobqueue.slurm``, or the section ``config_name=`` names;
``jobqueue-configs/`` in the repository has commented examples) or from keyword arguments.
dask_pcm adds what its workers need:

- the dask_pcm worker setup as the nanny preload of every job (``--preload-nanny
  dask_pcm.deploy.worker_setup``, :mod:`dask_pcm.deploy.worker_setup`): the worker settings
  of :func:`dask_pcm.local_cluster` and ``dask-pcm worker``, among them one GPU per worker
  process of those the job may see (also where the site binds no GPU to a job) and the
  preemption plugin (:mod:`dask_pcm.deploy.preemption`);
- a preemption warning: ``qsub -notify`` on Grid Engine, ``kill_sig = SIGUSR2`` with
  ``want_graceful_removal`` on HTCondor; the job script ignores ``SIGUSR2`` (``trap '' USR2``)
  so that only the worker process reacts to it, by retiring gracefully; on SLURM
  ``--signal=B:USR2@<drain + 30 s>`` and a job script whose shell passes USR2 and
  ``scancel``'s TERM on to the worker (:mod:`dask_pcm.deploy.slurm`), and no ``--mem``
  beside ``--mem-per-gpu``;
- the scheduler preload :mod:`dask_pcm.scheduler.preload` (the contexts page in the
  dashboard);
- ``--lifetime`` and ``--lifetime-stagger`` from the walltime when one is set and the worker
  arguments name no lifetime: workers retire before the batch system kills them;
- adaptive scaling (:class:`ContextAdaptive`) that never retires every worker holding a ready
  context while context tasks wait for it;
- a watchdog (:mod:`dask_pcm.deploy.jobwatch`) that notices jobs which left the queue while
  their worker is not connected (deleted, preempted, or dead before their worker ever
  connected, dask-jobqueue #643) and submits replacements, so that ``scale(n)`` keeps ``n``
  workers, not ``n`` job records;
- an end to waiting for workers that cannot come: a job whose submission command (``qsub``,
  ``condor_submit``, ``sbatch``) fails keeps the batch system's message (dask-jobqueue only logs it and
  submits nothing more), and ``cluster.raise_if_stuck()`` raises
  :class:`~dask_pcm.exceptions.BatchJobError` quoting it once no worker is connected, no job
  is left that could bring one, and that has lasted ``pcm.jobs.start-timeout`` (60 s):
  every submission rejected (a queue name with a typo, a resource the site does not
  offer), or ``max_failed_starts`` jobs in a row ended before their worker connected.
  :func:`dask_pcm.run_fever` calls it while it waits. Jobs waiting in the queue, however
  long, are not stuck.

Workers that join later build the registered contexts themselves, their templates copied
from peers that hold them (see :mod:`dask_pcm.templates.fetch`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import dask.config
import dask_jobqueue
from dask.utils import parse_timedelta
from distributed.deploy.adaptive import Adaptive

from dask_pcm import config
from dask_pcm.deploy import KINDS, with_preload, worker_setup
from dask_pcm.deploy.jobwatch import HTCondorJob, JobWatch, SGEJob
from dask_pcm.deploy.requeue import KeepsQueuedJobs
from dask_pcm.deploy.slurm import SIGNAL_SLACK, SLURMJob

logger = logging.getLogger(__name__)

PREEMPTION_TRAP = "trap '' USR2"


class ContextAdaptive(Adaptive):
    """:class:`distributed.deploy.Adaptive` that keeps a ready context while tasks wait.

    Of the workers distributed would retire, it keeps one holding a context when all the
    workers with that context ready would go and context tasks still wait for it
    (the scheduler plugin decides: ``pcm_keep_workers``).
    """

    async def workers_to_close(self, target: int) -> list[str]:
        names = await super().workers_to_close(target)
        if not names:
            return names
        try:
            keep = set(await self.scheduler.pcm_keep_workers(names=list(names)))
        except Exception as exc:  # no dask_pcm scheduler plugin: nothing registered yet
            logger.debug("pcm_keep_workers unavailable (%r); retiring as distributed chose", exc)
            return names
        if keep:
            logger.info("Adaptive scaling keeps %s: the only ready context for waiting tasks", keep)
        return [n for n in names if n not in keep]


class _ContextJobs(KeepsQueuedJobs, JobWatch):
    """Cluster mixin: adaptive scaling by :class:`ContextAdaptive`, the job watchdog, and
    jobs kept while the batch system holds them (:mod:`dask_pcm.deploy.requeue`)."""

    def adapt(self, *args: Any, Adaptive: type = ContextAdaptive, **kwargs: Any) -> Any:
        return super().adapt(*args, Adaptive=Adaptive, **kwargs)  # type: ignore[misc]


class SGECluster(_ContextJobs, dask_jobqueue.SGECluster):
    """:class:`dask_jobqueue.SGECluster` with dask_pcm's adaptive scaling and job watchdog."""

    kind = "sge"
    job_cls = SGEJob


class HTCondorCluster(_ContextJobs, dask_jobqueue.HTCondorCluster):
    """:class:`dask_jobqueue.HTCondorCluster` with dask_pcm's adaptive scaling and watchdog."""

    kind = "htcondor"
    job_cls = HTCondorJob


class SLURMCluster(_ContextJobs, dask_jobqueue.SLURMCluster):
    """:class:`dask_jobqueue.SLURMCluster` with dask_pcm's adaptive scaling and watchdog, and
    a job script that passes SLURM's warnings on to the worker (:mod:`dask_pcm.deploy.slurm`)."""

    kind = "slurm"
    job_cls = SLURMJob


def _with_parent_docs(cls: type) -> type:
    """``cls`` with the documentation of the dask-jobqueue class it extends appended: what
    ``help()`` and dask-jobqueue's own tests read (``cores``, ``memory``, ...)."""
    parent = next(c for c in cls.__mro__ if c.__module__.startswith("dask_jobqueue."))
    cls.__doc__ = f"{cls.__doc__}\n\n{parent.__doc__ or ''}"
    return cls


for _cls in (SGECluster, HTCondorCluster, SLURMCluster):
    _with_parent_docs(_cls)


def job_options(kind: str, **kwargs: Any) -> dict[str, Any]:
    """dask-jobqueue keyword arguments for ``kind``, with what dask_pcm's workers need.

    Keyword arguments win over dask-jobqueue's configuration (``jobqueue.<kind>.*``), which
    is read here for the lists that dask_pcm extends rather than replaces.
    """
    kind = _check_kind(kind)

    section = kwargs.get("config_name") or kind  # a site's own section, if named

    def setting(key: str) -> Any:
        if key in kwargs:
            return kwargs[key]
        return dask.config.get(f"jobqueue.{section}.{key.replace('_', '-')}", None)

    out = dict(kwargs)
    prologue = list(setting("job_script_prologue") or [])
    if PREEMPTION_TRAP not in prologue and kind != "slurm":  # SLURM's script traps it itself
        prologue.insert(0, PREEMPTION_TRAP)
    out["job_script_prologue"] = prologue

    extra = setting("job_extra_directives")
    if kind == "sge":
        directives = list(extra or [])
        if not any(d.strip() == "-notify" for d in directives):
            directives.append("-notify")
        out["job_extra_directives"] = directives
    elif kind == "slurm":
        out.update(slurm_directives(list(extra or []), list(setting("job_directives_skip") or [])))
    else:
        submit = dict(extra or {})
        submit.setdefault("kill_sig", "SIGUSR2")
        submit.setdefault("want_graceful_removal", "true")
        out["job_extra_directives"] = submit

    if setting("nanny") is False:
        raise ValueError(
            f"nanny=False: dask_pcm's worker setup runs in the nanny ({worker_setup.PRELOAD}); "
            "leave jobqueue's nanny on"
        )
    args = list(setting("worker_extra_args") or [])
    if worker_setup.PRELOAD not in args:
        # What every dask_pcm worker gets, from the one module that says it (its GPU, the
        # preemption plugin, the environment and settings of its worker process).
        args += ["--preload-nanny", worker_setup.PRELOAD]
    walltime = setting("walltime")
    if walltime and not any(a.startswith("--lifetime") for a in args):
        seconds = walltime_seconds(walltime)
        # Retire between 80 % and 90 % of the walltime: before the kill, not all at once.
        args += [
            "--lifetime",
            f"{int(seconds * 0.85)}s",
            "--lifetime-stagger",
            f"{int(seconds * 0.05)}s",
        ]
    out["worker_extra_args"] = args

    # The contexts page in the dashboard ("More..."), and /pcm/status from the start.
    scheduler_options = dict(setting("scheduler_options") or {})
    scheduler_options["preload"] = with_preload(scheduler_options.get("preload"))
    out["scheduler_options"] = scheduler_options
    return out


def slurm_directives(extra: list[str], skip: list[str]) -> dict[str, Any]:
    """SLURM's ``job_extra_directives`` and ``job_directives_skip`` with what dask_pcm adds:
    the preemption warning to the batch shell (``--signal=B:USR2@<drain + 30 s>``, unless a
    ``--signal`` is given), and no ``--mem`` beside ``--mem-per-gpu`` or ``--mem-per-cpu``
    (SLURM refuses both; dask-jobqueue always writes ``--mem``)."""
    if not any(d.strip().startswith("--signal") for d in extra):
        drain = parse_timedelta(config.get("worker.preemption-drain"))
        extra.append(f"--signal=B:USR2@{int(drain) + SIGNAL_SLACK}")
    if any(d.strip().startswith(("--mem-per-gpu", "--mem-per-cpu")) for d in extra):
        skip = [*skip, "--mem="] if "--mem=" not in skip else skip
    return {"job_extra_directives": extra, "job_directives_skip": skip}


def walltime_seconds(walltime: str | int | float) -> float:
    """``"HH:MM:SS"``, ``"MM:SS"``, seconds, or a Dask time string (``"2h"``) in seconds."""
    if isinstance(walltime, (int, float)):
        return float(walltime)
    text = str(walltime).strip()
    if re.fullmatch(r"\d+(:\d{1,2}){1,2}", text):
        seconds = 0.0
        for part in text.split(":"):
            seconds = seconds * 60 + int(part)
        return seconds
    try:
        return float(parse_timedelta(text))
    except (ValueError, KeyError):
        raise ValueError(
            f"walltime {walltime!r}: expected HH:MM:SS or a duration such as '2h'"
        ) from None


def _check_kind(kind: str) -> str:
    kind = str(kind).lower()
    if kind not in KINDS:
        raise ValueError(f"unknown batch system {kind!r}: one of {', '.join(KINDS)}")
    return kind


def batch_cluster(
    kind: str = "sge",
    *,
    workers: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    watch_interval: str | float = "10s",
    **kwargs: Any,
) -> SGECluster | HTCondorCluster | SLURMCluster:
    """Start a Grid Engine, HTCondor or SLURM cluster for context work (see the module doc).

    Parameters
    ----------
    kind : {"sge", "htcondor", "slurm"}
    workers : int, optional
        Keep this many worker jobs (``cluster.scale(workers)``), replacing those that go.
    minimum, maximum : int, optional
        Scale adaptively between these (:class:`ContextAdaptive`); wins over ``workers``.
    watch_interval : str or float
        How often the watchdog compares the batch queue with the connected workers.
    **kwargs
        dask-jobqueue arguments (``cores``, ``memory``, ``queue``, ``walltime``,
        ``job_extra_directives``, ``local_directory``, ...); defaults from the
        ``jobqueue.<kind>`` configuration.

    Examples
    --------
    >>> cluster = dask_pcm.batch_cluster("sge", minimum=1, maximum=8)   # doctest: +SKIP
    >>> dask_pcm.run_fever(cluster=cluster, limit=1000)                   # doctest: +SKIP
    """
    kind = _check_kind(kind)
    options = job_options(kind, **kwargs)
    classes: dict[str, type[SGECluster] | type[HTCondorCluster] | type[SLURMCluster]] = {
        "sge": SGECluster,
        "htcondor": HTCondorCluster,
        "slurm": SLURMCluster,
    }
    cls = classes[kind]
    try:
        cluster = cls(watch_interval=watch_interval, **options)
    except ValueError as exc:
        if "must specify how" in str(exc):  # dask-jobqueue: no cores or no memory
            raise ValueError(
                f"{exc}\nSet them in the jobqueue.{kind} configuration (see the repository's "
                f"jobqueue-configs/{kind}.yaml) or pass cores=..., memory=..."
            ) from exc
        raise
    if minimum is not None or maximum is not None:
        cluster.adapt(minimum=minimum or 0, maximum=maximum if maximum is not None else minimum)
    elif workers:
        cluster.scale(workers)
    return cluster
