"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

from dask_pcm.testing import build_tiny_llama, write_llama_gguf


@contextlib.contextmanager
def cluster_client(
    n_workers: int = 1,
    processes: bool = False,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[Client]:
    """A local cluster and its client (``client.cluster`` is the cluster), all closed on
    leaving the block, ``config`` (``dask.config.set``) held for as long.

    ``processes=False``: a :class:`distributed.LocalCluster` in this process;
    ``processes=True``: :func:`dask_pcm.local_cluster` (worker processes with dask_pcm's
    nanny, as a user's run starts them). One thread per worker and a dashboard on a free
    port unless ``kwargs`` say otherwise; the other ``kwargs`` go to the cluster
    (``security`` to the client too). For a fixture of wider scope than a test; a test
    takes :func:`make_cluster`.
    """
    import dask_pcm

    with contextlib.ExitStack() as stack:
        if config:
            stack.enter_context(dask.config.set(dict(config)))
        kwargs.setdefault("dashboard_address", ":0")
        kwargs.setdefault("threads_per_worker", 1)
        if processes:
            cluster = dask_pcm.local_cluster(n_workers=n_workers, **kwargs)
        else:
            cluster = LocalCluster(n_workers=n_workers, processes=False, **kwargs)
        stack.enter_context(cluster)
        yield stack.enter_context(Client(cluster, security=kwargs.get("security")))


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Client]]:
    """A factory of local clusters for one test: ``make_cluster(n_workers=1,
    processes=False, config=None, **kwargs)`` returns a client of a new cluster
    (:func:`cluster_client`); every cluster made is closed at teardown, the last made
    first, and its ``config`` then restored."""
    with contextlib.ExitStack() as stack:

        def make(*args: Any, **kwargs: Any) -> Client:
            return stack.enter_context(cluster_client(*args, **kwargs))

        yield make


@pytest.fixture
def inproc_cluster(make_cluster: Callable[..., Client]) -> tuple[LocalCluster, Client]:
    """A 2-worker, 1-thread-each LocalCluster in this process, and its client."""
    client = make_cluster(n_workers=2)
    return client.cluster, client


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model with its tokenizer (built offline in about a second)."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gguf_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model written as a float32 llama GGUF file, as llama.cpp's converter lays it out."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_llama_gguf(tiny_model_dir, path)
    return path


def require_batch_system(command: str, what: str, hint: str, require_env: str) -> None:
    """Skip the calling module unless ``command`` answers (a batch system is here); with
    ``require_env`` set in the environment (as in CI) its absence is a failure instead."""
    problem = None
    if shutil.which(command) is None:
        problem = f"{command} is not on PATH"
    else:
        probe = subprocess.run([command], capture_output=True, text=True, timeout=60)
        if probe.returncode:
            problem = f"{command} failed: {probe.stderr.strip()}"
    if problem:
        message = f"no {what} here ({problem}){hint}"
        if os.environ.get(require_env):
            pytest.fail(message)
        pytest.skip(message)


def wait_until_started(log: Path, first: int, seconds: float = 60) -> None:
    """Wait until a task numbered ``first`` or more has written its number to ``log`` (the
    tasks of the preemption tests note their start there): a worker is running one."""
    deadline = time.monotonic() + seconds
    while not (log.exists() and any(int(x) >= first for x in log.read_text().split())):
        assert time.monotonic() < deadline, f"no task numbered {first} or more started"
        time.sleep(0.02)


def load_the_victim(client: Client, runs: Any, log: Path) -> tuple[str, str, list, list]:
    """The preemption scenario every backend's test plays: on the first worker (the victim)
    two results held and ten tasks queued (``runs(log, x)`` notes ``x``), one of them running.
    Returns ``victim, other, held, queued``."""
    victim, other = sorted(client.scheduler_info()["workers"])
    held = [client.submit(runs, str(log), i, workers=[victim], pure=False) for i in range(2)]
    client.gather(held)
    queued = [
        client.submit(runs, str(log), i, workers=[victim], allow_other_workers=True, pure=False)
        for i in range(10, 20)
    ]  # fmt: skip
    wait_until_started(log, 10)
    return victim, other, held, queued


def wait_gone(client: Client, worker: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while worker in client.scheduler_info()["workers"]:
        assert time.monotonic() < deadline, f"{worker} did not leave"
        time.sleep(0.1)


def assert_handed_back(client: Client, held: list, queued: list, other: str, log: Path) -> None:
    """The warned victim handed its results and queued tasks to ``other``: nothing lost,
    nothing recomputed, every task run once."""
    assert client.gather(held) == [0, 1]  # moved to the other worker, not recomputed
    assert client.gather(queued) == [i * i for i in range(10, 20)]
    assert client.who_has(held)[held[0].key] == (other,)
    assert sorted(int(x) for x in log.read_text().split()) == [0, 1, *range(10, 20)]


def run_in_threads(work: Callable[[], Any], count: int) -> list[BaseException]:
    """Run ``work`` in ``count`` threads that start together; what they raised."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def one_host_batch_cluster(kind: str, tmp_path: Path, workers: int, **kwargs: Any) -> Any:
    """A ``dask_pcm.batch_cluster`` of ``kind`` on this host's one-host batch system (ci/sge,
    ci/slurm): one core and one worker per job, on loopback, logs and scratch in
    ``tmp_path``, a watchdog every second; the jobs are told where the converted model is
    (batch jobs start with a fresh environment)."""
    import dask_pcm

    cache = dask_pcm.config.cache_directory()
    options: dict[str, Any] = {
        "workers": workers,
        "cores": 1,
        "processes": 1,
        "interface": "lo",
        "log_directory": str(tmp_path / "logs"),
        "local_directory": str(tmp_path / "scratch"),
        "watch_interval": "1s",
        "scheduler_options": {"dashboard_address": ":0"},
        "job_script_prologue": [f"export DASK_PCM__CACHE_DIRECTORY={cache}"],
    }
    return dask_pcm.batch_cluster(kind, **{**options, **kwargs})


def fever_cli_on_jobs(kind: str, tmp_path: Path, model: Path) -> dict[str, Any]:
    """``dask-pcm fever --cluster <kind> --workers 2`` on this host's one-host batch system,
    worker jobs from dask-jobqueue's configuration (environment); the run's report, after
    checking it computed its 6 units once on at most two workers."""
    import json

    section = f"DASK_JOBQUEUE__{kind.upper()}__"
    env = dict(os.environ)
    env.update({f"{section}CORES": "1", f"{section}MEMORY": "2GB", f"{section}INTERFACE": "lo",
                f"{section}LOG_DIRECTORY": str(tmp_path / "logs")})  # fmt: skip
    out = tmp_path / "run.json"
    cmd = ["dask-pcm", "fever", "--cluster", kind, "--workers", "2", "--model", str(model)]
    cmd += ["--num-templates", "2", "--claims-per-task", "10", "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())["report"]
    assert report["units"] == {"total": 6, "computed": 6, "reused": 0, "failed": 0, "unfinished": 0}
    assert 1 <= len(report["workers"]) <= 2
    assert sum(w["tasks"] for w in report["workers"]) == 6
    return report


def job_of(cluster: Any, client: Client, address: str) -> str:
    """The batch job id of the worker at ``address``."""
    name = client.scheduler_info()["workers"][address]["name"]
    return str(cluster.workers[name].job_id)


def wait_for(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll ``condition`` until it is true (and return it), failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {seconds:.0f} s waiting for {what}"
        time.sleep(0.2)
    return value


class StderrReader:
    """Everything a process writes on standard error (``stderr=subprocess.PIPE``), read as
    it comes, and the count of units its progress bar shows (tqdm rewrites its line with
    carriage returns, never a newline)."""

    PROGRESS = re.compile(r"units:.*?\| *(\d+)/(\d+) \[")

    def __init__(self, process: subprocess.Popen) -> None:
        assert process.stderr is not None
        self._pipe = process.stderr
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while chunk := os.read(self._pipe.fileno(), 65536):
            self._chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def units_done(self) -> int:
        found = self.PROGRESS.findall(self.text())
        return int(found[-1][0]) if found else 0

    def finish(self) -> str:
        """All of it, once the process has closed its end."""
        self._thread.join(timeout=30)
        return self.text()


def group_gone(pgid: int, seconds: float) -> bool:
    """Whether every process of the group ``pgid`` has exited within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def signal_after_units(run: Any, stderr: Any, signum: int, units: int = 5) -> tuple[int, str]:
    """Send ``signum`` to the process ``run`` (its own process only, as ``kill PID`` does)
    once its progress bar (``stderr``, a :class:`StderrReader`) shows ``units`` finished;
    wait for it and for its process group to be gone (a signalled run closes the cluster it
    started). Returns the units seen at the signal and its stderr. Kills the group if not."""
    try:
        deadline = time.monotonic() + 120
        while stderr.units_done() < units:
            assert run.poll() is None, stderr.finish()[-2000:]
            assert time.monotonic() < deadline, "no units finished"
            time.sleep(0.02)
        run.send_signal(signum)
        seen = stderr.units_done()
        run.wait(timeout=120)
        text = stderr.finish()
        assert group_gone(run.pid, 30), "worker processes outlived the run"
    finally:
        if run.poll() is None or not group_gone(run.pid, 0.1):
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return seen, text
