"""Contexts that are not LLMs: an encoder whose template has subfolders, copied from a peer,
and a context without files."""

from __future__ import annotations

from pathlib import Path

from distributed import get_worker

import dask_pcm
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.tree import tree_files
from dask_pcm.testing.encoders import MeanPoolingEncoder, build_tiny_encoder
from tests.conftest import cluster_client

TEXTS = ["Paris is the capital of France.", "Penguins are birds that cannot fly."]

# Loaders and tasks live at module level so that they pickle by reference.


def _embed(texts: list[str]) -> tuple[str, str, list[list[float]]]:
    encoder = dask_pcm.get_context("encoder")
    return get_worker().address, encoder.location, encoder.embed(texts)


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def test_an_encoder_with_subfolders_reaches_a_later_worker_from_its_peer(tmp_path):
    import torch

    encoder_dir = build_tiny_encoder(tmp_path / "tiny-encoder")
    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.template.chunk-size": "16 KiB",
    }
    with cluster_client(config=settings) as client:
        context = dask_pcm.Context("encoder", MeanPoolingEncoder(), template=encoder_dir)
        table = dask_pcm.register(client, context, level="full")
        (holder,) = table["worker"]
        manifest, _ = build_manifest(tree_files(encoder_dir))
        assert {"1_Pooling/config.json", "tokenizer/tokenizer.json", "README.md"} <= {
            f.path for f in manifest.files
        }
        client.cluster.scale(2)
        client.wait_for_workers(2, timeout=60)
        (joiner,) = set(client.scheduler_info()["workers"]) - {holder}
        # Registered again, unchanged: the scheduler answers once the joiner has it too
        # (a failure there raises, naming it); the holder keeps its copy.
        table = dask_pcm.register(client, context, level="full").set_index("worker")
        assert table.loc[holder, "loads"] == 1
        row = table.loc[joiner]
        assert row["state"] == "ready"

        total = manifest.total_bytes
        assert manifest.nchunks > len(manifest.files)  # copied chunk by chunk
        assert (row["bytes_from_peers"], row["bytes_from_source"]) == (total, 0)
        assert (row["template_digest"], row["template_bytes"]) == (manifest.digest, total)
        copy = Path(row["location"])
        assert copy != encoder_dir
        assert _files(copy) == _files(encoder_dir)  # subfolders included, byte for byte

        where, location, vectors = client.submit(
            dask_pcm.ContextTask(_embed, "encoder"), TEXTS, workers=[joiner], pure=False
        ).result()
        assert (where, location) == (joiner, str(copy))
        expected = MeanPoolingEncoder()(str(encoder_dir)).embed(TEXTS)
        assert len(vectors) == 2 and len(vectors[0]) == 32
        torch.testing.assert_close(torch.tensor(vectors), torch.tensor(expected))


CALLS: list[object] = []


def _fileless(location: str | None) -> dict[str, object]:
    CALLS.append(location)
    return {"location": location}


def _where(name: str) -> object:
    return dask_pcm.get_context(name)["location"]


def test_a_context_without_files_copies_nothing_and_its_loader_gets_none(tmp_path):
    assert dask_pcm.Context("nothing", _fileless).template is None
    assert dask_pcm.causal_lm().template == "embedded"  # the LLM helper's own default
    CALLS.clear()
    templates = tmp_path / "templates"
    settings = {
        "pcm.cache-directory": str(tmp_path / "cache"),
        "pcm.worker.template-directory": str(templates),
    }
    levels = ("full", "partial", "agnostic")
    with cluster_client(n_workers=2, config=settings) as client:
        for level in levels:
            dask_pcm.register(client, dask_pcm.Context(level, _fileless, level=level))
        for level in levels:
            futures = [client.submit(dask_pcm.ContextTask(_where, level), level, pure=False)]
            assert client.gather(futures) == [None]
        table = dask_pcm.status(client, list(levels))
        assert list(table["state"]) == ["ready"] * 6
        for column in ("template_bytes", "bytes_from_peers", "bytes_from_source"):
            assert table[column].sum() == 0, column
        assert not table["template_held"].any()
        assert table["template_digest"].isna().all() and table["template"].isna().all()
        loads = table.groupby("context")["loads"].sum()
        assert loads["full"] == 2  # built once per worker and kept
        assert loads["partial"] == 1 and loads["agnostic"] == 1  # built for the one task
    assert CALLS and all(c is None for c in CALLS)
    assert not templates.exists() or not any(templates.iterdir())
    assert not (tmp_path / "cache" / "manifests").exists()  # nothing hashed
