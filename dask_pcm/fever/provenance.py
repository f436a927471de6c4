"""What differs between the provenance recorded in an output folder and a run's own: the
message of :class:`~dask_pcm.exceptions.OutputFolderError` when a run would mix its rows with
another's (see :mod:`dask_pcm.fever.store`)."""

from __future__ import annotations

import json
from typing import Any

# What must match for a folder to be resumed (``templates`` is compared per template).
COMPARED = ("model_digest", "loader", "method", "claims_per_task", "claims")


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the provenance of the folder (``old``) and of this run."""
    if old.get("format") != new["format"]:
        return [
            f"it was written by another version of dask_pcm (format {old.get('format')!r}, "
            f"this one writes {new['format']!r})"
        ]
    out = []
    for key in COMPARED:
        if old.get(key) != new.get(key):
            detail = f"{key} differs (folder: {_short(old.get(key))}, now: {_short(new.get(key))})"
            if key == "model_digest":
                detail += (
                    f" - model files changed: {old.get('model')!r} then, {new.get('model')!r} now"
                )
            out.append(detail)
    before = old.get("templates", {})
    for name, spec in new["templates"].items():
        if name in before and before[name] != spec:
            fields = sorted(k for k in spec if before[name].get(k) != spec[k])
            out.append(f"template {name!r} changed ({', '.join(fields)})")
    return out
