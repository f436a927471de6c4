"""Provenance: what determines a batch run's results, recorded in its output folder.

A run's provenance is a JSON mapping (:func:`dask_pcm.batch.run_batch` builds it; callers add
keys of their own). On a resume every key is compared with the folder's, except:

- ``format``: the output folder's format; another one is refused as written by another
  version of dask_pcm;
- ``info``: informative only, never compared (how the user named a model, for messages);
- ``groups``: one entry per group (a parameter set of the run, such as a prompt template);
  groups present in both are compared one by one, and a run may add groups to a folder.

:func:`content_digest` names a context's files by their contents, so the same model under
another path resumes and changed files do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.sources import resolve_source

#: Keys never compared, and the key compared group by group.
NOT_COMPARED = ("format", "info", "groups")

# Provenance hashes files in chunks of this size whatever pcm.template.chunk-size is, so
# that a digest recorded in an output folder does not change with that setting.
_PROVENANCE_CHUNK = 64 * 2**20


def content_digest(template: str | os.PathLike[str] | None) -> str | None:
    """The content digest of a context's template: what it is, whatever path names it.

    For a local directory (subfolders included), a file or the embedded model, the SHA-256 of
    its files (:func:`dask_pcm.templates.manifest.build_manifest`, cached by path, size and
    modification time); for a hub id, ``hub:<id>@<revision>`` of the local snapshot; ``None``
    for a context without files.

    Raises
    ------
    ModelSourceError
        The template cannot be found (the message names the path).

    Example
    -------
    >>> content_digest("/scratch/models/SmolLM2-1.7B-Instruct")  # doctest: +SKIP
    '3f5c...'
    """
    if template is None:
        return None
    resolved = resolve_source(template)
    if resolved.kind == "hub":
        return f"hub:{resolved.origin}@{resolved.path.name}"
    return build_manifest(template, _PROVENANCE_CHUNK)[0].digest


def rows_digest(rows: Any) -> str:
    """SHA-256 of rows (dicts, in order) as canonical JSON lines: the input's identity."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def loader_spec(loader: Any) -> dict[str, Any]:
    """A loader as provenance: its class and options (a dataclass's fields; a function's
    qualified name; else its repr, unless that names a memory address, which changes with
    every process and would refuse every resume)."""
    options: Any = repr(loader)
    if dataclasses.is_dataclass(loader) and not isinstance(loader, type):
        options = json.loads(json.dumps(dataclasses.asdict(loader), default=repr))
    elif hasattr(loader, "__qualname__"):  # a function or a class
        options = f"{getattr(loader, '__module__', '?')}.{loader.__qualname__}"
    elif re.search(r" at 0x[0-9a-f]+", options):
        options = None
    return {"class": type(loader).__qualname__, "options": options}


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the provenance of the folder (``old``) and of this run, one
    phrase per difference, naming the key (and the entry, for mappings)."""
    if old.get("format") != new["format"]:
        return [
            f"it was written by another version of dask_pcm (format {old.get('format')!r}, "
            f"this one writes {new['format']!r})"
        ]
    out = []
    for key in sorted((set(old) | set(new)) - set(NOT_COMPARED)):
        before, now = old.get(key), new.get(key)
        if before == now:
            continue
        if key == "contexts" and isinstance(before, dict) and isinstance(now, dict):
            out.extend(_contexts_differ(before, now, old.get("info", {}), new.get("info", {})))
        elif isinstance(before, dict) and isinstance(now, dict):
            for entry in sorted(set(before) | set(now), key=str):
                if before.get(entry) != now.get(entry):
                    out.append(_differs(f"{key} {entry!r}", before.get(entry), now.get(entry)))
        else:
            out.append(_differs(key, before, now))
    groups = old.get("groups", {})
    word = new.get("info", {}).get("group", "group")  # what the caller calls a group
    for name, spec in new.get("groups", {}).items():
        if name in groups and groups[name] != spec:
            if isinstance(spec, dict) and isinstance(groups[name], dict):
                fields = sorted(k for k in spec if groups[name].get(k) != spec[k])
                out.append(f"{word} {name!r} changed ({', '.join(fields)})")
            else:
                out.append(_differs(f"{word} {name!r}", groups[name], spec))
    return out


def _contexts_differ(
    before: dict[str, Any], now: dict[str, Any], old_info: Any, new_info: Any
) -> list[str]:
    """Per context: changed files (with the paths that named them then and now) or loader."""
    out = []
    paths = (old_info.get("contexts", {}), new_info.get("contexts", {}))
    for name in sorted(set(before) | set(now)):
        then, current = before.get(name), now.get(name)
        if then == current:
            continue
        if isinstance(then, dict) and isinstance(current, dict):
            if then.get("digest") != current.get("digest"):
                out.append(
                    f"context {name!r}: its files changed (content digest "
                    f"{str(then.get('digest'))[:12]}... then, {str(current.get('digest'))[:12]}... "
                    f"now; {paths[0].get(name)!r} then, {paths[1].get(name)!r} now)"
                )
            if then.get("loader") != current.get("loader"):
                out.append(
                    _differs(f"context {name!r} loader", then.get("loader"), current.get("loader"))
                )
        else:
            out.append(_differs(f"context {name!r}", then, current))
    return out


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the groups of ``old`` kept: their rows are still in the folder."""
    return {**new, "groups": {**old.get("groups", {}), **new.get("groups", {})}}


def _differs(what: str, before: Any, now: Any) -> str:
    return f"{what} differs (folder: {_short(before)}, now: {_short(now)})"
