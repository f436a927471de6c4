"""dask-jobqueue's own tests, with dask_pcm's SGECluster, HTCondorCluster and SLURMCluster in
place of dask-jobqueue's (plugin: ``tests/deploy/jobqueue_suite.py``).

Whatever dask-jobqueue promises its users (job scripts, configuration sections, real jobs
on Grid Engine and SLURM) must hold for dask_pcm's subclasses too. The tests come from the
installed dask-jobqueue wheel, copied to a temporary folder with the TLS key and certificate
its security tests read (the wheel leaves them out), and run in a pytest of their own.
Minutes in all, so marked ``soak``: CI runs them after the README's test command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dask_jobqueue
import pytest

from tests.conftest import require_batch_system

pytestmark = pytest.mark.soak

REPO = Path(__file__).resolve().parents[2]

# Tests that exercise no dask_pcm class and cannot pass on this machine, with the reason.
NOT_HERE = {
    # dask-jobqueue's MPI-style runner (dask_jobqueue.runner), which dask_pcm neither extends
    # nor uses; it gives its two local workers 10 s, which a loaded 2-core machine misses.
    "test_runner.py::test_runner",
    # Needs the address labels eth0:scheduler and eth0:worker of dask-jobqueue's Docker CI.
    # The failure path it reaches here (a cluster whose scheduler cannot start) is
    # tests/deploy/test_slurm.py::test_a_cluster_that_cannot_start_says_why.
    "test_slurm.py::test_different_interfaces_on_scheduler_and_workers",
}


def _suite(tmp_path: Path) -> Path:
    source = Path(dask_jobqueue.__file__).parent / "tests"
    suite = tmp_path / "dask_jobqueue_tests"
    shutil.copytree(source, suite, ignore=shutil.ignore_patterns("__pycache__"))
    # A self-signed key and certificate (its own CA), as the security tests expect beside them.
    key, certificate = str(suite / "key.pem"), str(suite / "ca.pem")
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    command += ["-subj", "/CN=localhost", "-keyout", key, "-out", certificate]
    subprocess.run(command, check=True, capture_output=True)
    return suite


def _run(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    suite = _suite(tmp_path)
    shared = tmp_path / "shared"  # where the security tests copy the key for the jobs
    shared.mkdir()
    env = {
        **os.environ,
        "CI_SHARED_SPACE": str(shared),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    deselect = [f"--deselect={suite.name}/{test}" for test in sorted(NOT_HERE)]
    command = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path)]
    command += ["-p", "tests.deploy.jobqueue_suite", "-p", "no:cacheprovider", "-q", "-rfE"]
    command += ["--timeout", "240", *deselect, *options, suite.name]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )


def _passes(result: subprocess.CompletedProcess[str], at_least: int) -> None:
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    passed = int(summary.split(" passed")[0].split()[-1]) if " passed" in summary else 0
    assert passed >= at_least, summary


def test_job_scripts_and_configuration_of_every_class(tmp_path: Path) -> None:
    """Without a batch system: every class's job script, header, configuration section and
    errors (dask-jobqueue 0.9.0: about 200 tests)."""
    _passes(_run(tmp_path), at_least=150)


@pytest.mark.sge
def test_real_jobs_on_grid_engine(tmp_path: Path) -> None:
    require_batch_system("qstat", "Grid Engine", "sudo bash ci/sge/setup.sh", "PCM_REQUIRE_SGE")
    _passes(_run(tmp_path, "-E", "sge"), at_least=5)


@pytest.mark.slurm
def test_real_jobs_on_slurm(tmp_path: Path) -> None:
    require_batch_system("sinfo", "SLURM", "sudo bash ci/slurm/setup.sh", "PCM_REQUIRE_SLURM")
    _passes(_run(tmp_path, "-E", "slurm"), at_least=5)
