"""A context's status record, sent to the scheduler plugin whenever it changes.

Reports travel over the worker's batched stream, the same ordered channel that carries
"task finished" messages, so the scheduler never sees a task finish before the load that
preceded it. Changes made in any thread are coalesced into one report sent from the event
loop; a report made while the worker is not yet connected (a joining worker whose context
loads fast) is resent once it is. Each report names the registration of the plugin that
made it, when it has one (see :mod:`dask_pcm.scheduler.registration`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_pcm.protocol import STATE_OP

if TYPE_CHECKING:
    from distributed import Worker

_RESEND_SECONDS = 0.5


class Reporter:
    """Reports the record that ``snapshot`` returns (a context on ``worker``), tagged with
    ``registration``."""

    def __init__(
        self,
        worker: Worker,
        snapshot: Callable[[], dict[str, Any]],
        registration: str | None = None,
    ) -> None:
        self.worker = worker
        self.snapshot = snapshot
        self.registration = registration
        self.lock = threading.Lock()  # guards the versions below
        self._version = 0
        self._sent_version = -1
        self._scheduled = False

    def changed(self) -> None:
        """The record changed: report it soon (from any thread)."""
        with self.lock:
            self._version += 1
            if self._scheduled:
                return
            self._scheduled = True
        # A closed loop means the worker is going away: nothing to report to.
        with contextlib.suppress(RuntimeError):
            self.worker.loop.add_callback(self.send)

    def flush(self) -> None:
        """Report now (on the event loop), e.g. as the worker closes."""
        with self.lock:
            self._version += 1
        self.send()

    def send(self) -> None:
        """Send the latest record over the batched stream; retry until connected."""
        with self.lock:
            self._scheduled = False
            if self._sent_version == self._version:
                return
            version = self._version
        stream = getattr(self.worker, "batched_stream", None)
        comm = getattr(stream, "comm", None)
        if stream is None or comm is None or comm.closed():
            if self.worker.status.name in ("closing", "closed", "failed"):
                return
            with self.lock:
                if self._scheduled:
                    return
                self._scheduled = True
            self.worker.loop.call_later(_RESEND_SECONDS, self.send)
            return
        report = self.snapshot()
        message = {"op": STATE_OP, "seq": time.monotonic_ns(), **report}
        if self.registration is not None:
            message["registration"] = self.registration
        stream.send(message)
        with self.lock:
            self._sent_version = max(self._sent_version, version)
