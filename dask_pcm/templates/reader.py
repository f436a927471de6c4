"""Reading a template's source, through one object that tests and benchmarks can replace."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import dask.utils

from dask_pcm import config
from dask_pcm.templates.manifest import Manifest, read_chunk


class SourceReader:
    """Reads a template's chunks from its source (a local folder, or a hub snapshot).

    Every read of a source, by a template copy or a build at level ``agnostic``, goes
    through one of these (:func:`source_reader`), so that tests and
    benchmarks can put a simulated shared filesystem in its place
    (:class:`dask_pcm.testing.ThrottledReader`).
    """

    def read(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        """Chunk ``index`` of ``manifest``'s files under ``root``."""
        return read_chunk(root, manifest, index)

    async def aread(self, root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
        """:meth:`read` from the event loop (a template copy): in a thread here; a reader
        that models a link waits for it on the loop instead of holding a thread."""
        return await asyncio.to_thread(self.read, root, manifest, index)

    def account(self, nbytes: int) -> float:
        """A build read ``nbytes`` of the source itself; seconds waited for it (none here)."""
        return 0.0


def source_reader() -> Any:
    """How template sources are read on this host: a plain :class:`SourceReader`, or, when
    ``pcm.template.source-bandwidth`` sets a simulated shared filesystem (tests and
    benchmarks), a :class:`~dask_pcm.testing.ThrottledReader` sharing that many bytes per
    second among every reader of the host.
    """
    value = config.get("template.source-bandwidth")
    if value is None:
        return SourceReader()
    # Only tests and benchmarks get here: the test device is not imported otherwise.
    from dask_pcm.testing.throttle import SharedBandwidth, ThrottledReader

    link = SharedBandwidth(float(dask.utils.parse_bytes(value)), name="template-source")
    chunk = int(dask.utils.parse_bytes(config.get("template.chunk-size")))
    return ThrottledReader(link, chunk)
