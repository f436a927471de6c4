"""SIGTERM handled like Ctrl-C, so that ``kill PID`` keeps a run's finished work.

Python turns SIGINT into :class:`KeyboardInterrupt`, which unwinds through every ``finally``
and ``with`` block: an output folder writes its open segment, a cluster closes. SIGTERM (a
batch system's walltime, ``docker stop``, systemd, ``kill PID``) by default ends the
process on the spot, as ``kill -9`` would, and whatever was finished but not yet written is
lost. Inside :func:`terminate_as_interrupt`, SIGTERM raises :class:`Terminated`, a
``KeyboardInterrupt``, so the same code paths run for both.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM (or another terminating signal) received inside :func:`terminate_as_interrupt`.

    A :class:`KeyboardInterrupt`, so that every ``except KeyboardInterrupt`` and ``finally``
    treats it as Ctrl-C.

    Parameters
    ----------
    signum
        The signal received.

    Example
    -------
    >>> try:
    ...     raise Terminated(signal.SIGTERM)
    ... except KeyboardInterrupt as exc:
    ...     print(interrupt_signal(exc).name)
    SIGTERM
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signal.Signals(signum)

    def __str__(self) -> str:
        return f"received {self.signum.name}"


def interrupt_signal(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal behind ``exc``: its own for :class:`Terminated`, else SIGINT."""
    return exc.signum if isinstance(exc, Terminated) else signal.SIGINT


def exit_status(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for a process ended by the signal behind ``exc``: 128 plus
    its number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(interrupt_signal(exc))


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread.

    Only where it is safe to take the signal over: in the main thread (only it can set
    handlers), and only while SIGTERM's handler is the default. A handler someone else set
    (an application's, a server's) is left alone, and so are nested uses, which makes
    wrapping both a library call and the command that makes it harmless. The previous
    handler is restored on leaving. A second SIGTERM while the first unwinds is ignored,
    with a warning, so that it cannot cut short the writing of finished work (SIGKILL still
    ends the process).

    Example
    -------
    >>> with terminate_as_interrupt():                      # doctest: +SKIP
    ...     result = run_fever(output="preds.parquet")      # kill PID: the output is flushed
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:
            logger.warning("%s again: still writing what finished", signal.Signals(signum).name)
            return
        received.append(signum)
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
