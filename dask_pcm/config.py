"""The ``pcm`` configuration namespace, read through :mod:`dask.config`.

Defaults live in ``pcm.yaml`` beside this module. Override them like any Dask setting: in
``~/.config/dask/pcm.yaml``, with ``dask.config.set({"pcm.worker.load-concurrency": 2})`` or
with environment variables such as ``DASK_PCM__WORKER__LOAD_CONCURRENCY=2``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dask.config
import yaml

_DEFAULTS_FILE = Path(__file__).with_name("pcm.yaml")

with _DEFAULTS_FILE.open() as _f:
    _DEFAULTS: dict[str, Any] = yaml.safe_load(_f)

dask.config.update_defaults(_DEFAULTS)

LEVELS = ("full", "partial", "agnostic")


def get(key: str, default: Any = None) -> Any:
    """Return ``pcm.<key>`` from :mod:`dask.config`, or ``default`` when it is unset/None."""
    value = dask.config.get(f"pcm.{key}", default=None)
    return default if value is None else value


def cache_directory() -> Path:
    """The per-machine cache folder (``pcm.cache-directory``), created if missing."""
    configured = get("cache-directory")
    if configured:
        path = Path(os.path.expandvars(str(configured))).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "dask-pcm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_level() -> str:
    """The level used when a registration names none (``pcm.default-level``)."""
    return check_level(get("default-level", "full"))


def check_level(level: str) -> str:
    """Return ``level`` if it is a known context level, else raise ``ValueError``."""
    if level not in LEVELS:
        raise ValueError(f"unknown context level {level!r}: use one of {', '.join(LEVELS)}")
    return level


def ready_timeout() -> float | None:
    """Seconds a context task waits for its context (``pcm.worker.ready-timeout``)."""
    value = get("worker.ready-timeout")
    if value is None:
        return None
    return float(dask.utils.parse_timedelta(value, default="s"))


def context_memory_limit() -> int | None:
    """Bytes the resident contexts of one worker may hold (``pcm.worker.context-memory-limit``)."""
    value = get("worker.context-memory-limit")
    if value is None:
        return None
    return int(dask.utils.parse_bytes(value))


def source_bandwidth() -> Any:
    """The simulated shared filesystem, if ``pcm.template.source-bandwidth`` sets one.

    Returns a :class:`~dask_pcm.throttle.SharedBandwidth` of that many bytes per second for
    every source read of a template on this host, or ``None``.
    """
    value = get("template.source-bandwidth")
    if value is None:
        return None
    from dask_pcm.throttle import SharedBandwidth

    return SharedBandwidth(float(dask.utils.parse_bytes(value)), name="template-source")
