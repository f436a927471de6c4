"""Every exception dask_pcm raises, in one place.

All derive from :class:`PCMError`, so ``except dask_pcm.PCMError`` catches any of them.
Messages name the thing that is wrong: the model path, the context, the worker address.
"""

from __future__ import annotations


class PCMError(Exception):
    """Base class of every dask_pcm error."""


class ModelSourceError(PCMError, ValueError):
    """A model or template source cannot be used: missing path, unknown format, hub offline."""


class ContextLoadError(PCMError, RuntimeError):
    """A context's loader failed on one or more workers.

    ``failures`` maps each worker address to the loader's message on that worker.
    """

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})

    def __reduce__(self):  # keep ``failures`` when the error travels between processes
        return (type(self), (self.args[0], self.failures))


class ContextNotFoundError(PCMError, KeyError):
    """A task asked for a context that is not registered on the worker it runs on."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class ContextTimeoutError(PCMError, TimeoutError):
    """A context did not become ready on a worker within the configured time."""


class TransitionError(PCMError, RuntimeError):
    """A context was asked to change state in a way its state machine does not allow (a bug
    in dask_pcm, or a report from a worker plugin that was replaced). The message names the
    context, the worker and the transition."""


class ChunkError(PCMError):
    """A template chunk or manifest is wrong: a chunk that does not match its SHA-256 or size,
    an index out of range, or a manifest whose digest or file names are invalid."""


class TemplateFetchError(PCMError):
    """A worker could not assemble a context's template: no peer delivered, the source could
    not be read, or the copy ran past ``pcm.template.fetch-timeout``. The message names each
    peer and what it did."""


class OutputFolderError(PCMError, ValueError):
    """A ``run_fever`` output folder cannot be used: in use by another run, holding another
    run's predictions, or not writable. The message names the folder and what to do."""


class DeviceMemoryError(PCMError, MemoryError):
    """Even one prompt per forward pass does not fit in the device's memory (batches are
    halved on an out-of-memory error first)."""


class NoWorkerError(PCMError, RuntimeError):
    """A cluster that dask_pcm started has no worker and none can come, for longer than
    ``pcm.jobs.start-timeout``: a local cluster started with no worker and nothing to scale
    it, or whose nannies closed because their workers could not start again. The message
    names the scheduler's address and the closed nannies."""


class BatchJobError(NoWorkerError):
    """A batch cluster cannot get a worker: its job submissions are rejected, or its jobs keep
    ending before their worker connects, for longer than ``pcm.jobs.start-timeout``. The
    message quotes the batch system's own output and names the submit command, the jobs' log
    directory and ``cluster.job_script()``; ``output`` holds that output alone."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output

    def __reduce__(self):  # keep ``output`` when the error travels between processes
        return (type(self), (self.args[0], self.output))


class ClusterLostError(PCMError, ConnectionError):
    """The client lost its scheduler in the middle of a run (the scheduler died, or the network
    to it dropped). The message names the scheduler's address; a run with an output folder
    keeps what it finished and resumes when run again."""


class PromptTooLongError(PCMError, ValueError):
    """A prompt cannot fit the model: more tokens than its context holds, or more memory for
    one forward pass than the worker's budget. The message names the template, and the claim
    with its file and line where known."""


class BatchInputError(PCMError, ValueError):
    """The input of a batch run cannot be used: an unreadable file (naming it, and the line
    for JSON lines), a row without the id column, or an id seen twice (naming both rows)."""


class UnitError(PCMError, RuntimeError):
    """A unit of a batch run failed (``on_error="raise"``): its function raised, or it ran
    past the timeout. The message names the unit, the worker and the original exception,
    whose traceback follows."""


def __getattr__(name: str) -> object:
    # FeverFormatError moved to the FEVER application (dask_pcm.apps.fever.errors).
    from dask_pcm import _moved

    return _moved.moved_attribute(__name__, name)
