"""Helpers for testing dask_pcm and code built on it: small offline models (a Llama, a
sentence encoder whose template has subfolders, with its loader), a chunk planner without a
scheduler, and, re-exported from :mod:`dask_pcm.templates`, the source rate limit that models
a shared filesystem (:class:`SharedBandwidth`, :class:`ThrottledReader`).

No production module imports this package (``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

from dask_pcm.templates.reader import ThrottledReader
from dask_pcm.templates.throttle import SharedBandwidth
from dask_pcm.testing.encoders import (
    MeanPoolingEncoder,
    build_tiny_encoder,
    build_tiny_sentence_transformer,
)
from dask_pcm.testing.models import build_tiny_llama, write_llama_gguf
from dask_pcm.testing.planners import StaticPeers

__all__ = [
    "MeanPoolingEncoder",
    "SharedBandwidth",
    "StaticPeers",
    "ThrottledReader",
    "build_tiny_encoder",
    "build_tiny_llama",
    "build_tiny_sentence_transformer",
    "write_llama_gguf",
]
