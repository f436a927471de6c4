"""Model sources: where a causal language model's files come from, and which of them travel.

A *source* is what a user names as a model: ``"embedded"`` (the embedded SmolLM2; ``None``
means the same here, the causal LM's default), a local directory in Hugging Face layout, a
single ``.gguf`` file, or a hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"``.
:func:`resolve_source` turns it into local files, :func:`template_files` lists the files of the
model that make up its template, :func:`model_files` the same as the
:class:`~dask_pcm.templates.tree.TemplateFiles` that :class:`dask_pcm.CausalLM` hands to the
template transport. Other contexts' templates are any file tree
(:mod:`dask_pcm.templates.tree`): nothing here applies to them.

Only formats that cannot run code when loaded are accepted for a model: pickle checkpoints
(``*.bin``, ``*.pt``, ``*.pth``) are refused, because loading one executes whatever it
contains.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dask_pcm.exceptions import ModelSourceError
from dask_pcm.templates import embedded
from dask_pcm.templates.tree import TemplateFiles, check_links

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
"""The source string that means the embedded default model (also what ``None`` means)."""

SAFE_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.gguf",
    "*.tiktoken",
    "merges.txt",
    "vocab.*",
)
"""File name patterns a template may contain: none of them can execute code when loaded."""

PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Suffixes of pickle-based checkpoints, refused even where a safe pattern would match them."""

# Hub downloads leave out ``*.gguf``: repositories often ship many quantisations of one model
# (gigabytes each) beside the safetensors weights the loader actually uses.
_HUB_PATTERNS = [p for p in SAFE_PATTERNS if p != "*.gguf"]

# An ``owner/name`` repository id as the hub allows it; anything else is treated as a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

_PROBE_SECONDS = 3.0
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class ResolvedSource:
    """A source turned into local files.

    Parameters
    ----------
    kind
        ``"directory"`` (a local Hugging Face directory), ``"gguf"`` (one ``.gguf`` file) or
        ``"hub"`` (a snapshot of a hub repository in the local hub cache).
    path
        The local directory, or the ``.gguf`` file.
    origin
        What the user gave, for messages and folder names.
    """

    kind: str
    path: Path
    origin: str


def resolve_source(source: str | os.PathLike[str] | None) -> ResolvedSource:
    """Turn a model source into local files, or raise :class:`ModelSourceError`.

    Parameters
    ----------
    source
        ``None`` or ``"embedded"`` for the embedded SmolLM2-135M-Instruct (converted to
        safetensors once per machine), a local directory with a ``config.json``, a ``.gguf``
        file, or a hub id ``owner/name`` (taken from the local hub cache, else downloaded
        unless ``HF_HUB_OFFLINE`` is set).

    Returns
    -------
    ResolvedSource

    Example
    -------
    >>> resolve_source("/models/my-llama")  # doctest: +SKIP
    ResolvedSource(kind='directory', path=PosixPath('/models/my-llama'), origin='/models/my-llama')
    """
    if source is None or (isinstance(source, str) and source == EMBEDDED):
        return ResolvedSource("directory", embedded.embedded_model_dir(), EMBEDDED)

    origin = os.fspath(source)
    path = Path(origin).expanduser()
    if path.is_dir():
        _check_directory(path)
        return ResolvedSource("directory", path.resolve(), origin)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"model file '{path}' is not a supported format: give a .gguf file or a "
                "directory with config.json and *.safetensors weights"
            )
        return ResolvedSource("gguf", path.resolve(), origin)
    if isinstance(source, str) and _HUB_ID.match(source) and ".." not in source:
        return ResolvedSource("hub", _hub_snapshot(source), origin)
    raise ModelSourceError(
        f"model path '{origin}' does not exist: give an existing directory with config.json, "
        "a .gguf file, a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or "
        f"'{EMBEDDED}' for the embedded model"
    )


def template_files(resolved: ResolvedSource) -> list[Path]:
    """The files that make up a template, sorted.

    For a ``.gguf`` source that is the file itself; for a directory, its top-level files that
    match :data:`SAFE_PATTERNS` (``*.gguf`` excluded: the loader reads the safetensors weights).
    Hidden files are left out.

    Example
    -------
    >>> [p.name for p in template_files(resolve_source("/models/my-llama"))]  # doctest: +SKIP
    ['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    """
    if resolved.kind == "gguf":
        return [resolved.path]
    files = sorted(
        p
        for p in resolved.path.iterdir()
        if p.is_file() and _is_safe(p.name) and not p.name.lower().endswith(".gguf")
    )
    check_links(resolved.path, files, "model directory")
    return files


def model_files(source: str | os.PathLike[str] | None) -> TemplateFiles:
    """The template of the model ``source``: :func:`template_files` of :func:`resolve_source`.

    What :class:`dask_pcm.CausalLM` lists for the template transport (its ``list_files``):
    a directory's names are its file names (the model's selection is flat), a ``.gguf``
    template is the file, which the loader is then pointed at.

    Example
    -------
    >>> model_files("/models/my-llama").names  # doctest: +SKIP
    ('config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json')
    """
    resolved = resolve_source(source)
    paths = template_files(resolved)
    if resolved.kind == "gguf":
        return TemplateFiles(resolved.path.parent, (resolved.path.name,), resolved.path.name)
    return TemplateFiles(resolved.path, tuple(p.name for p in paths))


def _is_safe(name: str) -> bool:
    lowered = name.lower()
    if name.startswith(".") or lowered.endswith(PICKLE_SUFFIXES):
        return False
    return any(fnmatch.fnmatchcase(lowered, pattern) for pattern in SAFE_PATTERNS)


def _check_directory(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model directory '{path}' has no config.json: give a directory in Hugging Face "
            "layout (config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    names = [p.name.lower() for p in path.iterdir() if p.is_file()]
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    if not has_safetensors and any(n.endswith(PICKLE_SUFFIXES) for n in names):
        raise ModelSourceError(
            f"model directory '{path}' holds only pickle checkpoints (*.bin/*.pt/*.pth), which "
            "can run arbitrary code when loaded and are refused: convert them once with "
            "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` (which writes "
            "safetensors) and pass NEW_DIR"
        )


def _local_copy_hint(repo_id: str) -> str:
    return (
        f"download it on a machine with network access with `hf download {repo_id} "
        "--local-dir DIR` and pass that directory as the model"
    )


def _hub_snapshot(repo_id: str) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, local_files_only=True, allow_patterns=_HUB_PATTERNS
        )
    except LocalEntryNotFoundError:
        folder = None
    if folder is None:
        if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
            raise ModelSourceError(
                f"hub model '{repo_id}' is not in the local hub cache and HF_HUB_OFFLINE is set: "
                + _local_copy_hint(repo_id)
            )
        # The hub client sets no overall timeout on its first request, so without network
        # (a black-holed route, a proxy that never answers) it can wait for minutes: ask once
        # with a bounded wait first.
        problem = _hub_problem(f"{constants.ENDPOINT}/api/models/{repo_id}", _PROBE_SECONDS)
        if problem is not None:
            raise ModelSourceError(
                f"hub model '{repo_id}' could not be reached ({problem}) and is not in the local "
                "hub cache: " + _local_copy_hint(repo_id)
            )
        try:
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=_PROBE_SECONDS
            )
        except RepositoryNotFoundError as exc:
            raise ModelSourceError(
                f"hub model '{repo_id}' was not found on {constants.ENDPOINT} (a private or gated "
                f"repository needs a token): {_local_copy_hint(repo_id)}"
            ) from exc
        except Exception as exc:
            raise ModelSourceError(
                f"hub model '{repo_id}' could not be downloaded ({type(exc).__name__}: {exc}): "
                + _local_copy_hint(repo_id)
            ) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"hub model '{repo_id}' (snapshot '{path}') has no config.json: only repositories in "
            "Hugging Face layout are downloaded; for a GGUF-only repository download the one "
            ".gguf file you want and pass its path"
        )
    if not any(p.name.endswith(".safetensors") for p in path.iterdir()):
        raise ModelSourceError(
            f"hub model '{repo_id}' (snapshot '{path}') has no *.safetensors weights; pickle "
            "checkpoints are never downloaded because loading them can run arbitrary code"
        )
    return path


def _hub_problem(url: str, timeout: float) -> str | None:
    """Why ``url`` gave no HTTP answer within ``timeout`` seconds in all, or None if it did.

    Any HTTP status counts as an answer (a missing repository is reported by the download).
    Proxies from the environment are used, as the hub client uses them. Name resolution cannot
    be given a timeout, so the request runs in a daemon thread abandoned when time is up.
    """
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout):
                outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)
        except urllib.error.URLError as exc:
            outcome.append(f"{url}: {exc.reason}")
        except Exception as exc:  # timeouts, resets, TLS errors
            outcome.append(f"{url}: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=attempt, name="dask-pcm-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer from {url} within {timeout:g} s"
    proxy = urllib.request.getproxies().get(url.split(":", 1)[0])
    return None if outcome[0] is None else outcome[0] + (f" through proxy {proxy}" if proxy else "")
