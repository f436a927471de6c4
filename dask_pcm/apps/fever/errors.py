"""The FEVER application's own error."""

from __future__ import annotations

from dask_pcm.exceptions import PCMError


class FeverFormatError(PCMError, ValueError):
    """Malformed FEVER input: claims or templates that cannot be read.

    The message names the file and, where there is one, the 1-based line or template number,
    as in ``paper_dev.jsonl:3: unknown label 'MAYBE'``.
    """
