"""A template as a tree of files: which files travel, under which names, and the safety rules.

A template is what a context's loader builds from: any directory (subfolders included) or a
single file. :func:`tree_files` lists every file of it; :func:`list_template` asks the
context's loader first, since a loader may know better which files it reads
(:class:`dask_pcm.CausalLM` keeps a model's Hugging Face selection, see
:func:`dask_pcm.templates.sources.model_files`).

A template is copied to workers and served to peers, so the names it travels under must not
let a worker write outside its copy, and its files must not carry something from elsewhere
on the machine:

- names are relative POSIX paths of plain components: no ``..``, no absolute path, no
  backslash, no empty or hidden (leading-dot) component (:func:`path_problem`);
- hidden files and folders are left out of a listing (``.git``, caches);
- a symbolic link is followed only where it stays inside the template (or a Hugging Face
  cache, whose snapshots link each file to ``../../blobs/<hash>``) (:func:`check_links`).

What the files hold is the loader's business: a generic template carries every file, pickle
files included (only the causal LM's selection refuses them, because it loads the model).

Example
-------
>>> files = tree_files("/models/all-MiniLM-L6-v2")                  # doctest: +SKIP
>>> files.names[:3]                                                 # doctest: +SKIP
('1_Pooling/config.json', 'config.json', 'model.safetensors')
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dask_pcm.exceptions import ChunkError, ModelSourceError


@dataclass(frozen=True)
class TemplateFiles:
    """The files of a template, as they travel.

    Parameters
    ----------
    root
        The folder the names are relative to (a single-file template's parent folder).
    names
        Relative POSIX paths of the files, sorted; each is checked by :func:`path_problem`.
    entry
        What the loader is pointed at inside a copy: ``""`` for the copy's folder itself,
        or the file's name for a single-file template.
    """

    root: Path
    names: tuple[str, ...]
    entry: str = ""

    def paths(self) -> list[Path]:
        """The files on this machine."""
        return [self.root / name for name in self.names]


def path_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a file of a template, or None if it can.

    A name is a relative POSIX path whose components are plain names: not empty, not
    ``.`` or ``..``, without a leading dot, a backslash or a NUL byte.

    Example
    -------
    >>> path_problem("1_Pooling/config.json") is None
    True
    >>> path_problem("1_Pooling/../../etc/passwd")
    "'..' component"
    """
    text = str(name)
    if not text:
        return "empty name"
    if "\\" in text or "\0" in text:
        return "backslash or NUL byte"
    if text.startswith("/") or os.path.isabs(text):
        return "absolute path"
    for part in text.split("/"):
        if part == "..":
            return "'..' component"
        if not part or part == ".":
            return "empty or '.' component"
        if part.startswith("."):
            return "hidden component"
    return None


def check_file_name(name: Any) -> str:
    """``name`` if it is a path a manifest may list, else raise :class:`ChunkError`.

    A relative POSIX path of plain names (``1_Pooling/config.json``): a ``..`` component,
    an absolute path, a backslash, an empty or hidden component or a NUL byte could make a
    worker write outside its copy (:func:`path_problem`).
    """
    text = str(name)
    problem = path_problem(text)
    if problem:
        raise ChunkError(
            f"manifest lists {text!r} ({problem}): template files must be relative paths of "
            "plain names (no '..', absolute paths, backslashes or leading dots)"
        )
    return text


def check_distinct(files: Sequence[Any]) -> None:
    """Refuse a path listed twice in a manifest's ``files``, or listed both as a file and as
    a folder of another (:class:`ChunkError`)."""
    paths = {f.path for f in files}
    if len(paths) != len(files):
        raise ChunkError("manifest lists a file twice")
    for path in paths:
        parts = path.split("/")
        for n in range(1, len(parts)):
            folder = "/".join(parts[:n])
            if folder in paths:
                raise ChunkError(f"manifest lists {folder!r} both as a file and as a folder")


def check_links(root: Path, files: Iterable[Path], what: str) -> None:
    """Refuse files of the template at ``root`` that are symbolic links leading outside it.

    Links are followed only where they stay inside ``root``, or inside a Hugging Face cache
    (the repository folder of a snapshot, or the hub cache): a template is copied to workers
    and served to peers, and must not carry a file from anywhere else on the machine.
    ``what`` names the template in the message (``"model directory"``, ``"template"``).
    """
    links = [p for p in files if _through_link(root, p)]
    if not links:
        return
    roots = [root.resolve()]
    if root.parent.name == "snapshots":  # a snapshot inside a hub cache's repo folder
        roots.append(root.parent.parent.resolve())
    try:
        from huggingface_hub import constants

        roots.append(Path(constants.HF_HUB_CACHE).expanduser().resolve())
    except ImportError:  # pragma: no cover - installed with transformers
        pass
    for link in links:
        target = link.resolve()
        if not any(target.is_relative_to(r) for r in roots):
            name = link.relative_to(root).as_posix()
            raise ModelSourceError(
                f"{what} '{root}': '{name}' is a symbolic link to '{target}', outside the "
                f"{what} and the Hugging Face cache; copy the file into the {what} "
                "(links are followed only inside it)"
            )


def _through_link(root: Path, path: Path) -> bool:
    """Whether ``path`` or a folder between ``root`` and it is a symbolic link."""
    while path != root and path != path.parent:
        if path.is_symlink():
            return True
        path = path.parent
    return False


def tree_files(template: str | os.PathLike[str]) -> TemplateFiles:
    """Every file of the template at ``template``: a directory (recursively) or one file.

    Hidden files and folders are left out; links are checked (:func:`check_links`); names
    are checked (:func:`path_problem`).

    Raises
    ------
    ModelSourceError
        The path does not exist, holds no files, or has a file that may not travel (the
        message names it).

    Example
    -------
    >>> tree_files("/data/index.faiss")                                  # doctest: +SKIP
    TemplateFiles(root=PosixPath('/data'), names=('index.faiss',), entry='index.faiss')
    """
    origin = os.fspath(template)
    path = Path(origin).expanduser()
    if path.is_file():
        check_links(path.parent, [path], "template")
        problem = path_problem(path.name)
        if problem:
            raise ModelSourceError(f"template file '{path}' cannot travel: {problem}")
        return TemplateFiles(path.parent, (path.name,), path.name)
    if not path.is_dir():
        raise ModelSourceError(
            f"template '{origin}' does not exist: give an existing directory or file "
            "(or template=None for a context without files)"
        )
    root = path
    names: list[str] = []
    seen: set[Path] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        here = Path(folder)
        real = here.resolve()
        if real in seen:  # a link back to a folder already listed
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        check_links(root, [here / d for d in dirs], "template")
        for name in files:
            if name.startswith("."):
                continue
            file = here / name
            if not file.is_file():  # a dangling link, a socket...
                continue
            relative = file.relative_to(root).as_posix()
            problem = path_problem(relative)
            if problem:
                raise ModelSourceError(
                    f"template '{root}': file '{relative}' cannot travel ({problem}); rename it"
                )
            names.append(relative)
    if not names:
        raise ModelSourceError(
            f"template directory '{root}' holds no files (hidden ones are left out): "
            "use template=None for a context without files"
        )
    names.sort()
    check_links(root, [root / n for n in names], "template")
    return TemplateFiles(root, tuple(names))


def list_template(template: str | os.PathLike[str], loader: Any = None) -> TemplateFiles:
    """The files of ``template`` that travel for a context built by ``loader``.

    A loader with a ``list_files(template)`` method chooses (:class:`dask_pcm.CausalLM`
    keeps a model's Hugging Face selection and resolves hub ids and ``"embedded"``); for
    any other, the whole tree (:func:`tree_files`).

    Example
    -------
    >>> list_template("/models/encoder", my_loader).names               # doctest: +SKIP
    ('1_Pooling/config.json', 'config.json', 'model.safetensors', 'tokenizer/tokenizer.json')
    """
    choose = getattr(loader, "list_files", None)
    if choose is not None:
        files = choose(template)
        if not isinstance(files, TemplateFiles):
            raise TypeError(
                f"{type(loader).__name__}.list_files returned {type(files).__name__}, "
                "expected TemplateFiles"
            )
        return files
    return tree_files(template)
