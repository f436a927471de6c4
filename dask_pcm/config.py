"""The ``pcm`` configuration namespace, read through :mod:`dask.config`.

Defaults live in ``pcm.yaml`` beside this module. Override them like any Dask setting: in
``~/.config/dask/pcm.yaml``, with ``dask.config.set({"pcm.worker.load-concurrency": 2})`` or
with environment variables such as ``DASK_PCM__WORKER__LOAD_CONCURRENCY=2``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import dask.config
import yaml

_DEFAULTS_FILE = Path(__file__).with_name("pcm.yaml")

with _DEFAULTS_FILE.open() as _f:
    _DEFAULTS: dict[str, Any] = yaml.safe_load(_f)

dask.config.update_defaults(_DEFAULTS)

LEVELS = ("full", "partial", "agnostic")


def get(key: str) -> Any:
    """``pcm.<key>`` from :mod:`dask.config`; its default is in ``pcm.yaml``, nowhere else.

    Raises ``KeyError`` for a key ``pcm.yaml`` does not define (a typo in the code).
    """
    return dask.config.get(f"pcm.{key}")


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
    return check_level(get("default-level"))


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
    return _seconds(value)


def context_memory_limit() -> int | None:
    """Bytes the resident contexts of one worker may hold (``pcm.worker.context-memory-limit``)."""
    value = get("worker.context-memory-limit")
    if value is None:
        return None
    return int(dask.utils.parse_bytes(value))


def _seconds(value: Any) -> float:
    return float(dask.utils.parse_timedelta(value, default="s"))


def prefix_cache_bytes() -> int:
    """``pcm.worker.prefix-cache`` in bytes; 0 when off."""
    value = get("worker.prefix-cache")
    return 0 if not value else int(dask.utils.parse_bytes(value))


def batch(key: str) -> Any:
    """``pcm.batch.<key>``; a value the user set under the old name ``pcm.fever.<key>`` wins,
    with a ``FutureWarning`` (those settings moved when the batch layer left the FEVER app)."""
    old = dask.config.get(f"pcm.fever.{key}", None)
    if old is not None:
        warnings.warn(f"pcm.fever.{key} is now pcm.batch.{key}", FutureWarning, stacklevel=3)
        return old
    return get(f"batch.{key}")


def batch_seconds(key: str) -> float | None:
    """``pcm.batch.<key>`` in seconds (``None`` when unset)."""
    value = batch(key)
    return None if value is None else _seconds(value)


def release_timeout() -> float:
    """``pcm.worker.release-timeout`` in seconds."""
    return _seconds(get("worker.release-timeout"))


def peer_connect_timeout() -> float:
    """Seconds to connect to a peer for a chunk (``pcm.template.peer-connect-timeout``)."""
    return _seconds(get("template.peer-connect-timeout"))


def peer_deadline(nbytes: int) -> float:
    """Seconds a peer may take to deliver a chunk of ``nbytes``, connecting included.

    The connect timeout plus the time the chunk takes at ``pcm.template.peer-min-bandwidth``
    (bytes per second; ``"8 MiB"`` and ``"8 MiB/s"`` both read as 8 MiB per second).
    """
    text = str(get("template.peer-min-bandwidth")).strip()
    text = text[:-2].strip() if text.lower().endswith("/s") else text
    rate = float(dask.utils.parse_bytes(text))
    if rate <= 0:
        raise ValueError(f"pcm.template.peer-min-bandwidth must be positive, got {text!r}")
    return peer_connect_timeout() + nbytes / rate


def fetch_timeout() -> float | None:
    """Seconds one template copy may take in all (``pcm.template.fetch-timeout``), or None."""
    value = get("template.fetch-timeout")
    return None if value is None else _seconds(value)


def job_start_timeout() -> float | None:
    """Seconds a batch cluster may fail to start any worker (``pcm.jobs.start-timeout``)."""
    value = get("jobs.start-timeout")
    return None if value is None else _seconds(value)
