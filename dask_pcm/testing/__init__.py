"""Helpers for testing dask_pcm and code built on it: small offline models (a Llama, a
sentence encoder whose template has subfolders, with its loader), a simulated
shared filesystem, a chunk planner without a scheduler.

Nothing in the library's normal path imports this package; ``pcm.template.source-bandwidth``
(a benchmark and test setting) is what brings :class:`ThrottledReader` in.
"""

from __future__ import annotations

from dask_pcm.testing.encoders import MeanPoolingEncoder, build_tiny_encoder
from dask_pcm.testing.models import build_tiny_llama, write_llama_gguf
from dask_pcm.testing.planners import StaticPeers
from dask_pcm.testing.throttle import SharedBandwidth, ThrottledReader

__all__ = [
    "MeanPoolingEncoder",
    "SharedBandwidth",
    "StaticPeers",
    "ThrottledReader",
    "build_tiny_encoder",
    "build_tiny_llama",
    "write_llama_gguf",
]
