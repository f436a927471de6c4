"""Scale-out (the paper's RQ4 in small): N workers join at once; time until all are ready.

Two modes side by side, each N in one run: ``source`` (every worker copies the model's
template from the source) and ``p2p`` (workers copy it from peers that hold it and read the
source only for what no peer has). The source is a simulated shared filesystem
(:class:`dask_pcm.testing.throttle.SharedBandwidth`): one link for the whole host, set so that one
worker alone reads the model in about ``--load-seconds`` (5 s by default), shared by all
concurrent readers like one NFS server under load. Loads may run concurrently (one host
stands for N hosts), so the link and the peers, not a host lock, decide.

Each row times from ``cluster.scale(N)`` (worker processes start, connect, fetch, load) until
every worker reports its context ready. The transfer rate between peers is compared with a raw
loopback socket copy of the same bytes on this machine.

Examples::

    python benchmarks/scale_out.py --quick
    python benchmarks/scale_out.py --json scale_out.json     # N = 1, 2, 4, 8
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from pathlib import Path

import _harness as h
import dask
from distributed import Client

import dask_pcm
from dask_pcm.scheduler import ContextScheduler
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.testing.throttle import SharedBandwidth

COLUMNS = [
    ("n", "N", "d"),
    ("mode", "mode", "s"),
    ("seconds", "ready_s", ".2f"),
    ("mean_fetch_seconds", "fetch_s", ".2f"),
    ("mean_load_seconds", "load_s", ".2f"),
    ("mb_from_source", "MB_source", ".0f"),
    ("mb_from_peers", "MB_peers", ".0f"),
]

TRANSFER_COLUMNS = [
    ("chunk_mib", "chunk_MiB", "d"),
    ("template_mb", "template_MB", ".0f"),
    ("mb_per_s", "MB/s", ".0f"),
    ("peak_extra_rss_mb", "peak_extra_RSS_MB", ".0f"),
]


def loopback_rate(nbytes: int, block: int = 1 << 20) -> float:
    """Bytes per second of a plain socket copy of ``nbytes`` over loopback."""
    a, b = socket.socketpair()
    payload = bytes(block)

    def send() -> None:
        left = nbytes
        while left > 0:
            n = min(block, left)
            a.sendall(payload[:n])
            left -= n
        a.shutdown(socket.SHUT_WR)

    start = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    got = 0
    while True:
        chunk = b.recv(block)
        if not chunk:
            break
        got += len(chunk)
    sender.join()
    seconds = time.perf_counter() - start
    a.close()
    b.close()
    assert got == nbytes
    return nbytes / seconds


def scale_out(n: int, mode: str, model: str, bytes_per_second: float) -> dict:
    settings = {
        "pcm.template.source-bandwidth": int(bytes_per_second),
        "pcm.template.peer-to-peer": mode == "p2p",
        "pcm.worker.load-concurrency": n,
    }
    with (
        dask.config.set(settings),
        dask_pcm.local_cluster(n_workers=0, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        dask_pcm.register(client, dask_pcm.causal_lm(model, name="llm", device="cpu"))
        SharedBandwidth(bytes_per_second, name="template-source").reset()
        start = time.perf_counter()
        cluster.scale(n)
        while True:
            table = dask_pcm.status(client, ["llm"])
            if (table["state"] == "failed").any():
                raise RuntimeError(f"a worker failed: {table['error'].dropna().tolist()}")
            if len(table) == n and (table["state"] == "ready").all():
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - start
    fetched = table[table["bytes_from_peers"] > 0]
    return {
        "n": n,
        "mode": mode,
        "seconds": seconds,
        "mean_fetch_seconds": float(table["fetch_seconds"].mean()),
        "mean_load_seconds": float(table["load_seconds"].mean()),
        "mb_from_source": table["bytes_from_source"].sum() / 1e6,
        "mb_from_peers": table["bytes_from_peers"].sum() / 1e6,
        "peer_mb_per_s": (
            fetched["bytes_from_peers"].sum() / fetched["fetch_seconds"].sum() / 1e6
            if len(fetched)
            else None
        ),
    }


def _hold(manifest_json: str, root: str, dask_worker=None) -> None:
    """Make this worker a holder of the whole template (what a ready worker is)."""
    from dask_pcm.templates.manifest import Manifest
    from dask_pcm.templates.serve import TemplateStore

    manifest = Manifest.from_json(manifest_json)
    TemplateStore.of(dask_worker).add(root, manifest)


async def _announce(digest: str, nchunks: int, dask_worker=None) -> None:
    await dask_worker.scheduler.pcm_chunk_have(
        digest=digest, worker=dask_worker.address, indexes=list(range(nchunks))
    )


async def _fetch_sampled(manifest_json: str, dest: str, dask_worker=None) -> dict:
    """Fetch the template from peers while sampling this process's RSS every 5 ms."""
    import shutil
    import threading

    import psutil

    from dask_pcm.templates.fetch import fetch
    from dask_pcm.templates.manifest import Manifest

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        path, report = await fetch(dask_worker, Manifest.from_json(manifest_json), dest, None)
    finally:
        stop.set()
        sampler.join()
    shutil.rmtree(path)
    return {
        "seconds": report.seconds,
        "bytes_from_peers": report.bytes_from_peers,
        "base_rss": base,
        "peak_extra_rss": peak[0] - base,
    }


def transfer_alone(model: str, chunk_mib: int, rounds: int = 2) -> dict:
    """One worker copies the whole template from another, nothing else running.

    Returns the best rate of ``rounds`` copies and the largest RSS growth of the copying
    worker during any of them (what the copy holds at once: the chunks in flight).
    """
    manifest, root = build_manifest(model, chunk_mib << 20)
    with (
        dask_pcm.local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as client,
    ):
        client.register_plugin(ContextScheduler())
        holder, joiner = sorted(client.scheduler_info()["workers"])
        client.run(_hold, manifest.to_json(), str(root), workers=[holder])
        client.run(_announce, manifest.digest, manifest.nchunks, workers=[holder])
        dest = Path(client.run(lambda dask_worker=None: dask_worker.local_directory)[joiner])
        runs = [
            client.run(
                _fetch_sampled, manifest.to_json(), str(dest / f"copy-{i}"), workers=[joiner]
            )[joiner]
            for i in range(rounds)
        ]
    assert all(r["bytes_from_peers"] == manifest.total_bytes for r in runs), runs
    return {
        "chunk_mib": chunk_mib,
        "template_mb": manifest.total_bytes / 1e6,
        "mb_per_s": manifest.total_bytes / min(r["seconds"] for r in runs) / 1e6,
        "peak_extra_rss_mb": max(r["peak_extra_rss"] for r in runs) / 1e6,
    }


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", help="comma-separated N (default 1,2,4,8; --quick 2)")
    p.add_argument(
        "--load-seconds", type=float, default=5.0, help="one source read alone (default 5 s)"
    )
    p.add_argument(
        "--transfer-only",
        action="store_true",
        help="only the copy between two workers alone: rate and memory held, per chunk size",
    )
    args = p.parse_args()
    sizes = [int(s) for s in (args.sizes or ("2" if args.quick else "1,2,4,8")).split(",")]
    model = h.model_path(args)
    manifest, _ = build_manifest(model)
    rate = manifest.total_bytes / args.load_seconds
    print(
        f"template {manifest.total_bytes / 1e6:.0f} MB in {manifest.nchunks} chunks; "
        f"simulated shared FS {rate / 1e6:.0f} MB/s for the whole host"
    )
    rows: list[dict] = []
    with h._worker_environ():
        transfers = [transfer_alone(model, mib) for mib in ((64,) if args.quick else (16, 64))]
        for n in [] if args.transfer_only else sizes:
            for mode in ("source", "p2p"):
                rows.append(scale_out(n, mode, model, rate))
                print(f"  N={n} {mode}: {rows[-1]['seconds']:.2f} s", flush=True)
    if rows:
        h.print_table(rows, COLUMNS)
    loop = loopback_rate(manifest.total_bytes)
    print("\none worker copying the template from another, nothing else running:")
    h.print_table(transfers, TRANSFER_COLUMNS)
    for t in transfers:
        print(
            f"chunks of {t['chunk_mib']} MiB: {t['mb_per_s'] / (loop / 1e6):.2f} of loopback; "
            f"memory held {t['peak_extra_rss_mb'] / (t['chunk_mib'] * 1.048576):.1f} chunks, "
            f"{t['peak_extra_rss_mb'] / t['template_mb']:.2f} of the template"
        )
    peer_rates = [r["peer_mb_per_s"] for r in rows if r["peer_mb_per_s"]]
    print(
        f"\nraw loopback socket copy of {manifest.total_bytes / 1e6:.0f} MB: {loop / 1e6:.0f} MB/s"
    )
    if peer_rates:
        best = max(peer_rates)
        print(
            f"peer-to-peer transfer during the scale-out (fetch, verify, write): best {best:.0f} MB/s, "
            f"{best / (loop / 1e6):.2f} of loopback"
        )
    for n in sorted({r["n"] for r in rows}):
        src = next(r for r in rows if r["n"] == n and r["mode"] == "source")
        p2p = next(r for r in rows if r["n"] == n and r["mode"] == "p2p")
        print(f"N={n}: source/p2p time {src['seconds'] / p2p['seconds']:.2f}")
    run = uuid.uuid4().hex[:8]  # one id for the rows of one invocation
    for r in rows:
        r["loopback_mb_per_s"] = loop / 1e6
        r["transfer_alone"] = transfers
        r["run"] = run
    h.write_json(args.json, rows or [{"transfer_alone": transfers}])
    plot(args.json, rows)


def plot(path: Path | None, rows: list[dict]) -> None:
    """Seconds until every joining worker is ready, per N and mode (the PNG beside ``path``)."""
    if rows:
        h.plot_bars(
            path,
            rows,
            "n",
            "seconds",
            group="mode",
            title="N workers joining at once, template from the source or peer to peer",
            ylabel="s until all ready (lower is better)",
        )


if __name__ == "__main__":
    main()
