"""The ``pcm`` configuration namespace, read through :mod:`dask.config`.

Defaults live in ``pcm.yaml`` beside this module. Override them like any Dask setting: in
``~/.config/dask/pcm.yaml``, with ``dask.config.set({"pcm.worker.load-concurrency": 2})`` or
with environment variables such as ``DASK_PCM__WORKER__LOAD_CONCURRENCY=2``. Every key is
described in ``pcm-schema.yaml``; a ``pcm.*`` key that is none of them (a typo in a user's
config file or environment) is reported once, when this module loads, with the closest key.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterator, Mapping
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
    """Seconds a cluster may go without a worker while none can come
    (``pcm.jobs.start-timeout``)."""
    value = get("jobs.start-timeout")
    return None if value is None else _seconds(value)


def _leaves(tree: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for key, value in tree.items():
        path = f"{prefix}.{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path)
        else:
            yield path


def _known_keys() -> set[str]:
    """Every ``pcm.*`` leaf key of ``pcm.yaml``, and the deprecated ``pcm.fever.<batch key>``
    aliases that :func:`batch` still reads."""
    keys = set(_leaves(_DEFAULTS["pcm"], "pcm"))
    return keys | {f"pcm.fever.{key}" for key in _DEFAULTS["pcm"]["batch"]}


def _environment_variable(key: str) -> str | None:
    """The ``DASK_*`` variable that Dask read ``key`` from, if one did."""
    for name in os.environ:
        if name.startswith("DASK_") and name[5:].lower().replace("__", ".") == key:
            return name
    return None


def unknown_keys(configuration: Mapping[str, Any] | None = None) -> list[tuple[str, str | None]]:
    """``(key, closest known key or None)`` for every ``pcm.*`` key of ``configuration``
    (by default Dask's, as loaded from config files and the environment) that is no setting.

    Dask reads ``_`` and ``-`` in a key alike (``DASK_PCM__BATCH__FLUSH_INTERVAL`` sets
    ``pcm.batch.flush-interval``), and so does this check; a section that is unknown has each
    key under it reported.

    Examples
    --------
    >>> unknown_keys({"pcm": {"batch": {"flush_intervl": "10s"}}})
    [('pcm.batch.flush_intervl', 'pcm.batch.flush-interval')]
    """
    if configuration is None:
        configuration = dask.config.config
    section = configuration.get("pcm")
    if not isinstance(section, Mapping):
        return []
    known = _known_keys()
    sections = {key.rsplit(".", 1)[0] for key in known}
    found = []
    for key in _leaves(section, "pcm"):
        canonical = key.replace("_", "-")
        if canonical in known or canonical in sections:
            continue  # a setting, or a section set to an empty mapping
        close = difflib.get_close_matches(canonical, sorted(known), n=1)
        found.append((key, close[0] if close else None))
    return found


def warn_unknown_keys(configuration: Mapping[str, Any] | None = None) -> None:
    """Warn (``UserWarning``) about each key :func:`unknown_keys` finds, naming the closest
    setting. Called once, when dask_pcm's configuration loads."""
    for key, close in unknown_keys(configuration):
        variable = _environment_variable(key) if configuration is None else None
        where = f" (environment variable {variable})" if variable else ""
        hint = f"did you mean {close}?" if close else f"the settings are in {_DEFAULTS_FILE}"
        warnings.warn(
            f"{key}{where} is not a dask_pcm setting and is ignored: {hint}",
            UserWarning,
            stacklevel=2,
        )


warn_unknown_keys()
