"""SLURM jobs whose worker hears the preemption warning, and a requeue-aware queue listing.

SLURM signals a batch job differently from Grid Engine (measured on SLURM 22.05; see the
README's SLURM section):

- ``--signal=USR2@N`` without ``B:`` reaches job *steps* only, never a batch script's worker;
  ``--signal=B:USR2@N`` reaches the batch shell alone. Time limits and ``--signal`` are
  checked every 30 s, so the warning comes up to 30 s late: dask_pcm asks for
  ``pcm.worker.preemption-drain`` + 30 s.
- ``scancel`` (and preemption with ``PreemptMode=CANCEL``) sends SIGTERM to every process of
  the job at once, then SIGKILL after ``KillWait`` (or the partition's ``GraceTime``).

So the job script (:data:`SCRIPT`) starts the worker in the background with USR2 ignored
(the nanny and its worker process inherit that) and traps USR2 and TERM in the shell, which
passes USR2 on to the nanny and its worker process: the worker's preemption plugin
(:mod:`dask_pcm.deploy.preemption`) then retires it gracefully, handing its work back, as on
Grid Engine, before SLURM's kill. That needs the warning to come first: a time limit with
``--signal``, a preemption where the site sets ``SlurmctldParameters=preempt_send_user_signal``
and a ``GraceTime``, or ``scancel -b --signal=USR2``. A plain ``scancel`` TERMs the nanny too,
which closes its worker within 10 s: the running tasks are lost and run again elsewhere (no
result is lost, as after a kill). The shell waits for the worker either way and exits with
its status. A requeued job (``--requeue``, ``scontrol requeue``) runs the script again from
the top: the worker joins again under the same name and rebuilds its contexts from peers;
the script logs ``SLURM_RESTART_COUNT``. squeue still lists a requeued or completing job
under its id, so the watchdog does not replace it.
"""

from __future__ import annotations

import dask_jobqueue

from dask_pcm.deploy.jobwatch import RecordsSubmission

#: Seconds SLURM may be late with a ``--signal`` warning (its periodic check).
SIGNAL_SLACK = 30

#: The job script: dask-jobqueue's pieces, the worker started so that the shell can pass the
#: preemption warning (USR2 from ``--signal=B:``, or TERM from ``scancel``) on to it.
SCRIPT = """
%(shebang)s

%(job_header)s
%(job_script_prologue)s
echo "dask_pcm: SLURM job ${SLURM_JOB_ID:-?} on $(hostname), restart ${SLURM_RESTART_COUNT:-0}" >&2
# The worker's processes ignore USR2 sent to the whole job; the shell hands SLURM's warning
# (USR2 from --signal=B:, or scancel's TERM) to them as USR2: the worker retires gracefully.
( trap '' USR2; exec %(worker_command)s ) &
pcm_worker=$!
pcm_warn() {
    trap '' USR2 TERM
    echo "dask_pcm: $1 received; asking the worker to hand its work back" >&2
    kill -USR2 "$pcm_worker" 2>/dev/null
    pkill -USR2 -P "$pcm_worker" 2>/dev/null
}
trap 'pcm_warn USR2' USR2
trap 'pcm_warn TERM' TERM
while kill -0 "$pcm_worker" 2>/dev/null; do wait "$pcm_worker"; pcm_status=$?; done
exit "${pcm_status:-0}"
""".lstrip()


class SLURMJob(RecordsSubmission, dask_jobqueue.slurm.SLURMJob):
    """:class:`dask_jobqueue.slurm.SLURMJob` whose worker hears SLURM's warnings
    (:data:`SCRIPT`), and that keeps why ``sbatch`` failed."""

    _script_template = SCRIPT
