"""Context templates as verifiable chunks: the format peers exchange model files in.

A template (the files a context is built from: any directory, subfolders included, or one
file; :mod:`dask_pcm.templates.tree`) is cut into chunks of ``pcm.template.chunk-size`` bytes
(64 MiB by default), file by file; the :class:`Manifest` lists every file under its relative
path with its size and the SHA-256 of each of its chunks, and a digest of the whole (the hash
of the manifest's canonical JSON: chunk size, relative paths, sizes, chunk digests) names the
template: two workers hold the same template exactly when their digests match.

Everything here streams: hashing reads a file in 1 MiB pieces, a chunk is read or written on
its own, so memory stays bounded by one chunk whatever the model's size. Which files are
listed is decided before (:func:`dask_pcm.templates.tree.list_template`): every file of the
tree, or for a causal LM the model's selection (safetensors, GGUF, JSON and text tokenizer
files; never pickle checkpoints). A manifest names files by relative paths of plain
components, checked wherever one is read or written, so a worker never writes outside its copy.

Building a manifest hashes every byte of the template once; the result is cached under
``<pcm.cache-directory>/manifests``, keyed by the files' paths, sizes and modification times
and the chunk size, so the next build of an unchanged template only stats its files.

Example
-------
>>> manifest, root = build_manifest("/scratch/models/SmolLM2-1.7B-Instruct")  # doctest: +SKIP
>>> manifest.nchunks, manifest.total_bytes, manifest.digest[:12]           # doctest: +SKIP
(55, 3422777952, '5f0c2d9a81be')
>>> from dask_pcm.templates.tree import tree_files
>>> manifest, root = build_manifest(tree_files("/models/encoder"))         # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.utils

from dask_pcm import config
from dask_pcm.exceptions import ChunkError
from dask_pcm.templates.sources import model_files
from dask_pcm.templates.tree import TemplateFiles, check_distinct, check_file_name

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "ChunkError",
    "ChunkRef",
    "FileEntry",
    "Manifest",
    "TemplateWriter",
    "build_manifest",
    "chunk_size",
    "map_chunk",
    "read_chunk",
    "verify_chunk",
    "verify_copy",
]

FORMAT = "dask-pcm-template/1"
MANIFEST_NAME = ".dask-pcm-manifest.json"
_PIECE = 1 << 20  # hashing and copying read this much at a time
# Part of the manifest cache's key: a manifest cached before the cache held ``entry`` and
# each file's whole SHA-256 must be built again (its digest comes out the same).
_CACHE_LAYOUT = 3
# Manifests built in this process, by the cache key (paths, sizes, modification times).
_BUILT: dict[str, Manifest] = {}


@dataclass(frozen=True)
class FileEntry:
    """One file of a template: its path relative to the root (POSIX), size, chunk digests
    and the SHA-256 of the whole file (``""`` in a manifest written before it was kept)."""

    path: str
    size: int
    chunks: tuple[str, ...]
    sha256: str = ""


@dataclass(frozen=True)
class ChunkRef:
    """Where chunk ``index`` of a template lies: a byte range of one file."""

    index: int
    path: str
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The files of a template, their chunks' SHA-256 digests and the digest of it all.

    ``entry`` is where a copy's loader is pointed: ``""`` for the copy's folder, or the
    file of a single-file template. It says how to read the files, not what they are, so
    it is left out of the digest (a folder holding one file and that file are one copy).

    ``digest`` names a copy as it is cut into chunks (it changes with ``chunk_size``);
    :attr:`content` names the files whatever the chunk size: both come from the one pass
    over the bytes that builds the manifest.
    """

    chunk_size: int
    files: tuple[FileEntry, ...]
    digest: str
    entry: str = ""

    @property
    def nchunks(self) -> int:
        return sum(len(f.chunks) for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def content(self) -> str:
        """SHA-256 of the files' paths, sizes and whole-file digests: what the template is,
        whatever path names it and whatever ``pcm.template.chunk-size`` cuts it into (the
        identity a batch run's provenance records)."""
        missing = [f.path for f in self.files if not f.sha256]
        if missing:
            raise ChunkError(
                f"manifest has no whole-file digest of {missing[0]!r} (written by an older "
                "dask_pcm): build it again"
            )
        canonical = json.dumps([[f.path, f.size, f.sha256] for f in self.files])
        return hashlib.sha256(canonical.encode()).hexdigest()

    def chunk(self, index: int) -> ChunkRef:
        """The file range of chunk ``index`` (chunks are numbered across files, in order)."""
        if not 0 <= index < self.nchunks:
            raise ChunkError(f"chunk {index} out of range: template has {self.nchunks} chunks")
        local = index  # the chunk's number within its file
        for entry in self.files:
            if local < len(entry.chunks):
                offset = local * self.chunk_size
                length = min(self.chunk_size, entry.size - offset)
                return ChunkRef(index, entry.path, offset, length, entry.chunks[local])
            local -= len(entry.chunks)
        raise AssertionError("unreachable")  # pragma: no cover

    def chunks(self) -> Iterator[ChunkRef]:
        for index in range(self.nchunks):
            yield self.chunk(index)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "format": FORMAT,
            "chunk_size": self.chunk_size,
            "files": [
                {"path": f.path, "size": f.size, "chunks": list(f.chunks), "sha256": f.sha256}
                for f in self.files
            ],
            "digest": self.digest,
        }
        if self.entry:
            data["entry"] = self.entry
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """The manifest in ``data``, checked: format, file names, digest.

        A manifest travels to every worker, which writes the files it names: a path that is
        not relative or has a component that is not a plain name (``..``, a hidden name) is
        refused before anything is written, as are two entries for one path.
        """
        if data.get("format") != FORMAT:
            raise ChunkError(f"not a {FORMAT} manifest: format {data.get('format')!r}")
        files = tuple(
            FileEntry(
                check_file_name(f["path"]),
                int(f["size"]),
                tuple(f["chunks"]),
                str(f.get("sha256", "")),
            )
            for f in data["files"]
        )
        check_distinct(files)
        entry = str(data.get("entry", ""))
        if entry and entry not in {f.path for f in files}:
            raise ChunkError(f"manifest entry {entry!r} is not one of its files")
        manifest = cls(int(data["chunk_size"]), files, str(data["digest"]), entry)
        expected = _digest(manifest.chunk_size, files)
        if manifest.digest != expected:
            raise ChunkError(
                f"manifest digest {manifest.digest[:12]}... does not match its contents "
                f"({expected[:12]}...)"
            )
        return manifest

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls.from_dict(json.loads(text))


def chunk_size() -> int:
    """Bytes per chunk (``pcm.template.chunk-size``)."""
    size = int(dask.utils.parse_bytes(config.get("template.chunk-size")))
    if size < 1:
        raise ValueError(f"pcm.template.chunk-size must be positive, got {size}")
    return size


def _digest(size: int, files: tuple[FileEntry, ...]) -> str:
    canonical = json.dumps(
        [size, [[f.path, f.size, list(f.chunks)] for f in files]], separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _hash_file(path: Path, size: int) -> tuple[tuple[str, ...], str]:
    """SHA-256 of each ``size``-byte chunk of ``path`` (the last one may be shorter), and of
    the whole file, in one read."""
    digests = []
    whole = hashlib.sha256()
    with path.open("rb") as f:
        while True:
            h = hashlib.sha256()
            n = 0
            while n < size:
                piece = f.read(min(_PIECE, size - n))
                if not piece:
                    break
                h.update(piece)
                whole.update(piece)
                n += len(piece)
            if n == 0:
                break
            digests.append(h.hexdigest())
            if n < size:
                break
    return tuple(digests), whole.hexdigest()


def build_manifest(
    source: TemplateFiles | str | os.PathLike[str] | None, size: int | None = None
) -> tuple[Manifest, Path]:
    """The manifest of a template and the folder its file paths are relative to.

    Parameters
    ----------
    source
        The template's files (:class:`~dask_pcm.templates.tree.TemplateFiles`, from
        :func:`~dask_pcm.templates.tree.list_template` or
        :func:`~dask_pcm.templates.tree.tree_files`: any tree),
        or a model source as :func:`dask_pcm.templates.sources.resolve_source` takes it (a
        model directory, a ``.gguf`` file, a hub id in the local cache, ``None`` or
        ``"embedded"``), whose model selection is listed
        (:func:`dask_pcm.templates.sources.model_files`).
    size
        Bytes per chunk; ``None`` for ``pcm.template.chunk-size``.

    Raises
    ------
    ModelSourceError
        The source cannot be resolved or holds no template files.
    """
    began = time.perf_counter()
    size = size or chunk_size()
    listed = source if isinstance(source, TemplateFiles) else model_files(source)
    root = listed.root
    stats = [(name, (root / name).stat()) for name in listed.names]
    stamps = [[n, s.st_size, s.st_mtime_ns] for n, s in stats]
    layout = [_CACHE_LAYOUT, str(root.resolve()), size, listed.entry, stamps]
    key = hashlib.sha256(json.dumps(layout).encode()).hexdigest()
    if key in _BUILT:  # this process listed the same files already (one run, many uses)
        return _BUILT[key], root
    cache = config.cache_directory() / "manifests" / f"{key}.json"
    if cache.is_file():
        try:
            cached = Manifest.from_json(cache.read_text())
            logger.info("Manifest of %s cached: %.2f s", root, time.perf_counter() - began)
            _BUILT[key] = cached
            return cached, root
        except (ChunkError, ValueError, KeyError):
            pass  # rebuilt below
    files = tuple(FileEntry(name, st.st_size, *_hash_file(root / name, size)) for name, st in stats)
    manifest = Manifest(size, files, _digest(size, files), listed.entry)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, cache)
    _BUILT[key] = manifest
    logger.info("Manifest of %s hashed: %.2f s", root, time.perf_counter() - began)
    return manifest, root


def read_chunk(root: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
    """Chunk ``index`` read from the template files under ``root``."""
    ref = manifest.chunk(index)
    with open(Path(root) / ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
    return data


def map_chunk(root: str | os.PathLike[str], manifest: Manifest, index: int) -> Any:
    """Chunk ``index`` as a read-only 1-d ``uint8`` NumPy array over the file, mapped.

    What :mod:`~dask_pcm.templates.serve` sends: the socket copies straight from the page
    cache, where reading into a buffer first costs one more copy (the kernel's) and, for a
    fresh buffer, its page faults. distributed sends an array as its own frame and hands the
    peer an array over the buffer it read into (a ``bytes`` frame is copied once more on
    arrival). The mapping lives as long as the array (until the comm has sent it). A chunk
    past the end of a short file comes back short, as from :func:`read_chunk` (the peer's
    check refuses it); the files themselves must not be truncated while served (templates
    are written once and never changed).
    """
    import mmap

    import numpy as np  # distributed's comm buffers, pandas and torch need it anyway

    ref = manifest.chunk(index)
    with open(Path(root) / ref.path, "rb") as f:
        length = max(0, min(ref.length, os.fstat(f.fileno()).st_size - ref.offset))
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        start = ref.offset - ref.offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(
            f.fileno(),
            ref.offset - start + length,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ,
            offset=start,
        )
    return np.frombuffer(mapped, dtype=np.uint8, count=length, offset=ref.offset - start)


def verify_chunk(manifest: Manifest, index: int, data: bytes | memoryview) -> None:
    """Raise :class:`ChunkError` unless ``data`` is chunk ``index`` of ``manifest``."""
    ref = manifest.chunk(index)
    if len(data) != ref.length:
        raise ChunkError(
            f"chunk {index} ({ref.path} at {ref.offset}): {len(data)} bytes, expected {ref.length}"
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != ref.sha256:
        raise ChunkError(
            f"chunk {index} ({ref.path} at {ref.offset}): SHA-256 {actual[:12]}... does not "
            f"match the manifest's {ref.sha256[:12]}..."
        )


def verify_copy(root: str | os.PathLike[str], manifest: Manifest) -> list[int]:
    """Indexes of the chunks of the copy at ``root`` that do not match ``manifest``.

    Reads the copy chunk by chunk (memory bounded by one chunk); a missing or short file
    counts all its chunks as bad.
    """
    bad = []
    for ref in manifest.chunks():
        try:
            verify_chunk(manifest, ref.index, read_chunk(root, manifest, ref.index))
        except (OSError, ChunkError):
            bad.append(ref.index)
    return bad


class TemplateWriter:
    """Assemble a template from verified chunks, in any order, into ``dest``.

    Files are created at their full size (in their subfolders) in a hidden staging folder
    beside ``dest``; each
    chunk is verified and written at its offset; :meth:`finish` writes the manifest and moves
    the folder into place in one rename, so ``dest`` either holds the whole template or
    nothing.
    """

    def __init__(self, manifest: Manifest, dest: str | os.PathLike[str]) -> None:
        self.manifest = manifest
        self.dest = Path(dest)
        self.staging = self.dest.with_name(f".{self.dest.name}.{os.getpid()}.partial")
        self.staging.mkdir(parents=True, exist_ok=True)
        # Checked again here (from_dict checks names too): a Manifest built in code, or a
        # staging folder reached through a link, must not let a write land elsewhere.
        inside = self.staging.resolve()
        self._paths: dict[str, Path] = {}
        check_distinct(manifest.files)
        for entry in manifest.files:
            path = (inside / check_file_name(entry.path)).resolve()
            if path == inside or not path.is_relative_to(inside):
                raise ChunkError(
                    f"manifest file {entry.path!r} resolves to {path}, outside the copy "
                    f"being assembled in {inside}"
                )
            self._paths[entry.path] = path
        for entry in manifest.files:
            path = self._paths[entry.path]
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.resolve().is_relative_to(inside):  # a folder swapped for a link
                raise ChunkError(f"manifest file {entry.path!r} resolves outside {inside}")
            with open(path, "ab") as f:
                f.truncate(entry.size)
        self.missing = set(range(manifest.nchunks))

    def write(self, index: int, data: bytes | memoryview) -> None:
        """Verify chunk ``index`` and write it; raises :class:`ChunkError` if it is wrong."""
        verify_chunk(self.manifest, index, data)
        ref = self.manifest.chunk(index)
        with open(self._paths[ref.path], "r+b") as f:
            f.seek(ref.offset)
            f.write(data)
        self.missing.discard(index)

    def finish(self) -> Path:
        """Move the complete template into place; raises if chunks are missing."""
        if self.missing:
            raise ChunkError(
                f"{len(self.missing)} of {self.manifest.nchunks} chunks still missing, "
                f"e.g. {sorted(self.missing)[:5]}"
            )
        (self.staging / MANIFEST_NAME).write_text(self.manifest.to_json())
        if self.dest.exists():
            shutil.rmtree(self.staging)  # another process completed it first
        else:
            os.replace(self.staging, self.dest)
        return self.dest

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
