"""SIGTERM raised as an interrupt (``dask_pcm.interrupts``), and ``import dask_pcm`` leaving
the process's SIGINT handler alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from dask_pcm.interrupts import Terminated, exit_status, terminate_as_interrupt


def test_import_leaves_ctrl_c_to_python():
    """dask-jobqueue's runner module, imported by ``import dask_pcm`` before 7acc781, replaced
    the SIGINT handler with ``lambda *_: sys.exit()``: Ctrl-C exited 0, with no unwinding."""
    check = (
        "import signal, sys, dask_pcm, dask_pcm.deploy\n"
        "assert dask_pcm.deploy.KINDS\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGINT)\n"
        "assert 'dask_jobqueue' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM at its default for the test, whatever the test runner set."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_unwinds_like_ctrl_c_and_the_handler_is_restored(default_sigterm):
    unwound = []
    with pytest.raises(KeyboardInterrupt) as caught, terminate_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        finally:
            # A second SIGTERM while finished work is written must not cut it short.
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            unwound.append(True)
    assert isinstance(caught.value, Terminated) and caught.value.signum == signal.SIGTERM
    assert unwound == [True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert exit_status(caught.value) == 143 and exit_status(KeyboardInterrupt()) == 130


def test_a_handler_someone_set_nested_uses_and_threads_are_left_alone(default_sigterm):
    def theirs(signum, frame):
        pass

    signal.signal(signal.SIGTERM, theirs)
    with terminate_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is theirs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with terminate_as_interrupt():
        ours = signal.getsignal(signal.SIGTERM)
        with terminate_as_interrupt():  # run_fever inside the CLI's block
            assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGTERM) is ours
    seen = []

    def in_a_thread():
        with terminate_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL]
