"""Provenance: what determines a batch run's results, recorded in its output folder.

A run's provenance is a JSON mapping (:func:`dask_pcm.batch.run_batch` builds it; callers add
keys of their own). On a resume every key is compared with the folder's, except:

- ``format``: the output folder's format; another one is refused as written by another
  version of dask_pcm;
- ``info``: informative only, never compared (how the user named a model, for messages);
- ``groups``: one entry per group (a parameter set of the run, such as a prompt template);
  groups present in both are compared one by one, and a run may add groups to a folder.

A context's files are named by their contents (:func:`dask_pcm.context.content_digest`, the
identity the template transport computes), so the same model under another path resumes and
a changed file (in any subfolder) does not; this module only records it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from dask_pcm.context import Context, template_manifest

#: Keys never compared, and the key compared group by group.
NOT_COMPARED = ("format", "info", "groups")


def context_record(context: Context) -> tuple[dict[str, Any], dict[str, str]]:
    """What provenance records of a context (its content digest and loader), and per file
    of its template the file's SHA-256 (for the message that names a changed file)."""
    manifest = template_manifest(context)
    if manifest is not None:
        digest: str | None = manifest.content
        files = {f.path: f.sha256 for f in manifest.files}
    else:
        digest = None if context.template is None else f"template:{context.template}"
        files = {}
    return {"digest": digest, "loader": loader_spec(context.loader)}, files


# What a function's digest follows (function_digest): values that name code by themselves.
_SIMPLE = (str, bytes, int, float, complex, bool, type(None))


def function_digest(fn: Any) -> dict[str, Any]:
    """A task function as provenance: its name and a digest of what it computes.

    The digest covers the function's code (its syntax tree: comments, docstrings, blank
    lines and where it sits in its file do not count; a changed line, literal or name
    does), its default values, what it closes over, and what its code reads from its
    module by name: other functions of the same module (followed the same way) and plain
    values (strings, numbers, and tuples, lists and dicts of them). Modules, classes and
    objects of other libraries count by name only: a new version of a library is not seen.
    Where the source cannot be read (a function made by ``exec``) its bytecode counts, which
    changes with the Python version. ``functools.partial`` counts its function and
    arguments; an object with ``__call__``, its class's method and its attributes.

    Example
    -------
    >>> function_digest(len)["name"]
    'builtins.len'
    """
    name = _name(fn) if hasattr(fn, "__qualname__") else _name(type(fn))
    digest = hashlib.sha256()
    _feed(digest, fn, set())
    return {"name": name, "code": digest.hexdigest()}


def _feed(digest: Any, value: Any, seen: set[int]) -> None:
    import functools
    import types

    if isinstance(value, _SIMPLE):
        digest.update(repr(value).encode())
    elif isinstance(value, tuple | list):
        digest.update(f"{type(value).__name__}[{len(value)}]".encode())
        for item in value:
            _feed(digest, item, seen)
    elif isinstance(value, dict):
        digest.update(f"dict[{len(value)}]".encode())
        for key in sorted(value, key=repr):
            _feed(digest, key, seen)
            _feed(digest, value[key], seen)
    elif isinstance(value, types.FunctionType):
        if id(value) in seen:  # recursion: named once
            digest.update(f"again:{value.__qualname__}".encode())
            return
        seen.add(id(value))
        digest.update(_code_text(value).encode())
        _feed(digest, value.__defaults__, seen)
        _feed(digest, value.__kwdefaults__, seen)
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                contents = None
            _feed(digest, contents, seen)
        for name in sorted(_global_names(value.__code__)):
            if name not in value.__globals__:
                continue
            used = value.__globals__[name]
            same_module = getattr(used, "__module__", None) == value.__module__
            if (isinstance(used, types.FunctionType) and same_module) or _plain(used):
                digest.update(f"global:{name}".encode())
                _feed(digest, used, seen)
    elif isinstance(value, functools.partial):
        digest.update(b"partial")
        _feed(digest, value.func, seen)
        _feed(digest, value.args, seen)
        _feed(digest, value.keywords, seen)
    elif isinstance(value, types.MethodType):
        _feed(digest, value.__func__, seen)
        _feed(digest, value.__self__, seen)
    elif isinstance(value, types.BuiltinFunctionType | types.ModuleType | type):
        digest.update(_name(value).encode())
    elif isinstance(vars(type(value)).get("__call__"), types.FunctionType):
        digest.update(f"object:{_name(type(value))}".encode())
        _feed(digest, type(value).__call__, seen)
        if dataclasses.is_dataclass(value):
            state = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        else:
            state = dict(getattr(value, "__dict__", {}))
        _feed(digest, {k: v for k, v in state.items() if _plain(v) or callable(v)}, seen)
    else:
        # An object of another kind: by its type (its repr may hold a memory address).
        digest.update(f"value:{type(value).__module__}.{type(value).__qualname__}".encode())


def _name(value: Any) -> str:
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
    return f"{getattr(value, '__module__', None) or '?'}.{qualname}"


def _plain(value: Any) -> bool:
    """Whether ``value`` is a plain value (see :func:`function_digest`)."""
    if isinstance(value, _SIMPLE):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _global_names(code: Any) -> set[str]:
    """Names the code (nested functions and comprehensions included) may read globally."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _code_text(fn: Any) -> str:
    """The function's syntax tree without docstrings or positions; its bytecode where no
    source can be read or parsed (a lambda inside a longer expression, say)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        tree = None
    node = (
        next(
            (
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == fn.__name__
            ),
            None,
        )
        if tree is not None
        else None
    )
    if node is None:
        return _bytecode(fn.__code__)
    for each in ast.walk(node):
        body = getattr(each, "body", None)
        if (
            isinstance(each, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            each.body = body[1:] or [ast.Pass()]
    node.decorator_list = []
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _bytecode(code: Any) -> str:
    parts = [code.co_code.hex(), repr(code.co_names)]
    for const in code.co_consts:
        parts.append(_bytecode(const) if hasattr(const, "co_code") else repr(const))
    return "|".join(parts)


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


def differences(
    old: dict[str, Any], new: dict[str, Any], accepted: Sequence[str] = ()
) -> list[str]:
    """What differs between the provenance of the folder (``old``) and of this run, one
    phrase per difference, naming the key (and the entry, for mappings); keys in
    ``accepted`` are not compared."""
    if old.get("format") != new["format"]:
        return [
            f"it was written by another version of dask_pcm (format {old.get('format')!r}, "
            f"this one writes {new['format']!r})"
        ]
    out = []
    for key in sorted((set(old) | set(new)) - set(NOT_COMPARED) - set(accepted)):
        before, now = old.get(key), new.get(key)
        if before == now:
            continue
        if key == "function" and isinstance(before, dict) and isinstance(now, dict):
            out.append(_function_differs(before, now))
        elif key == "contexts" and isinstance(before, dict) and isinstance(now, dict):
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
    """Per context: changed files (naming them, with the paths that named the template then
    and now) or loader."""
    out = []
    paths = (old_info.get("contexts", {}), new_info.get("contexts", {}))
    files = (old_info.get("files", {}), new_info.get("files", {}))
    for name in sorted(set(before) | set(now)):
        then, current = before.get(name), now.get(name)
        if then == current:
            continue
        if isinstance(then, dict) and isinstance(current, dict):
            if then.get("digest") != current.get("digest"):
                which = _files_differ(files[0].get(name) or {}, files[1].get(name) or {})
                out.append(
                    f"context {name!r}: its files changed ({which}content digest "
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


def _files_differ(before: dict[str, str], now: dict[str, str]) -> str:
    """The files of a template that changed, came or went, as a phrase ending in '; '."""
    if not before or not now:
        return ""  # a folder written before files were recorded, or a template by name
    phrases = []
    for what, names in (
        ("changed", [n for n in sorted(now) if n in before and before[n] != now[n]]),
        ("added", [n for n in sorted(now) if n not in before]),
        ("removed", [n for n in sorted(before) if n not in now]),
    ):
        if names:
            shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
            phrases.append(f"{what}: {shown}")
    return "; ".join(phrases) + "; " if phrases else ""


def _function_differs(before: dict[str, Any], now: dict[str, Any]) -> str:
    if before.get("name") != now.get("name"):
        return _differs("function", before.get("name"), now.get("name"))
    return (
        f"function {now.get('name')!r} changed: its code, defaults or what it reads differ "
        f"(code digest {str(before.get('code'))[:12]}... then, {str(now.get('code'))[:12]}... "
        "now), so the folder's results came from other code (if the change cannot change a "
        "result, accept_changes=['function'] keeps them)"
    )


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the groups of ``old`` kept: their rows are still in the folder."""
    return {**new, "groups": {**old.get("groups", {}), **new.get("groups", {})}}


def _differs(what: str, before: Any, now: Any) -> str:
    return f"{what} differs (folder: {_short(before)}, now: {_short(now)})"
