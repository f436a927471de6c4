"""A pytest plugin that runs dask-jobqueue's own tests against dask_pcm's cluster classes.

dask-jobqueue's wheel ships its tests (``dask_jobqueue.tests``) but not the ``conftest.py``
that gives them their fixtures and the ``-E <batch system>`` option. This plugin provides
those, written for dask_pcm, and puts :class:`dask_pcm.deploy.jobqueue.SGECluster`,
``HTCondorCluster`` and ``SLURMCluster`` where the tests import dask-jobqueue's: a job
script, a configuration section or a real job that dask-jobqueue's own tests expect to
work must work with dask_pcm's subclasses too. Used by ``tests/deploy/test_jobqueue_suite.py``::

    python -m pytest -p tests.deploy.jobqueue_suite --pyargs dask_jobqueue.tests [-E sge]

The tests marked ``asyncio`` run on a fresh event loop each (pytest-asyncio is not needed).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import os
from typing import Any

import dask
import dask_jobqueue
import dask_jobqueue.htcondor
import dask_jobqueue.local
import dask_jobqueue.sge
import dask_jobqueue.slurm
import distributed.utils_test
import pytest
from distributed.utils_test import loop, loop_in_thread  # noqa: F401 (fixtures the tests use)

from dask_pcm.deploy import jobqueue

# dask_pcm's classes where the tests look for dask-jobqueue's, before the test modules import.
SWAPPED = {
    "SGECluster": (dask_jobqueue.sge, jobqueue.SGECluster),
    "HTCondorCluster": (dask_jobqueue.htcondor, jobqueue.HTCondorCluster),
    "SLURMCluster": (dask_jobqueue.slurm, jobqueue.SLURMCluster),
}
if os.environ.get("PCM_JOBQUEUE_SUITE_UPSTREAM") == "1":  # the baseline: upstream's own classes
    SWAPPED = {name: (module, getattr(module, name)) for name, (module, _) in SWAPPED.items()}
for _name, (_module, _cls) in SWAPPED.items():
    setattr(dask_jobqueue, _name, _cls)
    setattr(_module, _name, _cls)

ENVIRONMENTS: dict[str | None, Any] = {
    None: dask_jobqueue.local.LocalCluster,
    "pbs": dask_jobqueue.PBSCluster,
    "moab": dask_jobqueue.MoabCluster,
    "slurm": SWAPPED["SLURMCluster"][1],
    "sge": SWAPPED["SGECluster"][1],
    "lsf": dask_jobqueue.LSFCluster,
    "oar": dask_jobqueue.OARCluster,
    "htcondor": SWAPPED["HTCondorCluster"][1],
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("-E", action="store", metavar="NAME", help="the batch system under test")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "env(NAME): runs only with -E NAME")
    config.addinivalue_line("markers", "asyncio: a coroutine test, run on its own event loop")
    # Upstream expects some real-job tests to fail on its CI (no shared home directory);
    # one host shares everything, so here they must pass: the marks are only registered.
    config.addinivalue_line("markers", "xfail_ci(dict): upstream CI only")
    config.addinivalue_line("markers", "xfail_env(dict): upstream CI only")


def _environments(item: pytest.Item) -> list[str]:
    names: list[str] = []
    for mark in item.iter_markers(name="env"):
        arg = mark.args[0]
        names += arg if isinstance(arg, list) else [arg]
    return names


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked for a batch system runs only under ``-E`` that system, and a test of a
    system's real jobs never runs without one (upstream's rule)."""
    chosen = item.config.getoption("-E")
    wanted = _environments(item)
    if (chosen is None and wanted) or (chosen is not None and chosen not in wanted):
        pytest.skip(f"needs -E in {wanted}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests to completion on a new event loop."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(pyfuncitem.obj(**kwargs))
    return True


@pytest.fixture
def cleanup() -> Any:
    """distributed's ``cleanup`` (pulled in by ``loop``) resets the configuration; keep
    dask-jobqueue's defaults in it."""
    dask_jobqueue.config.reconfigure()
    yield


def _reset_config() -> None:
    dask.config.config.clear()
    dask.config.config.update(copy.deepcopy(distributed.utils_test.original_config))
    dask_jobqueue.config.reconfigure()


distributed.utils_test.reset_config = _reset_config


def _with_disk(cls: Any) -> Any:
    if cls is SWAPPED["HTCondorCluster"][1]:  # HTCondor needs a disk request
        dask.config.set({"jobqueue.htcondor.disk": "1GB"})
    return cls


@pytest.fixture(
    params=[pytest.param(cls, marks=[pytest.mark.env(env)]) for env, cls in ENVIRONMENTS.items()]
)
def EnvSpecificCluster(request: pytest.FixtureRequest) -> Any:
    """The class of the batch system under ``-E`` (LocalCluster without one)."""
    return _with_disk(request.param)


@pytest.fixture(params=list(ENVIRONMENTS.values()))
def Cluster(request: pytest.FixtureRequest) -> Any:
    """Every cluster class in turn, for tests that need no real batch system."""
    return _with_disk(request.param)
