"""Scale-out (the paper's RQ4 in small): N workers join at once; time until all are ready.

Two modes side by side, each N in one run: ``source`` (every worker copies the model's
template from the source) and ``p2p`` (workers copy it from peers that hold it and read the
source only for what no peer has). The source is a simulated shared filesystem
(:class:`dask_pcm.throttle.SharedBandwidth`): one link for the whole host, set so that one
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

import _harness as h
import dask
from distributed import Client

import dask_pcm
from dask_pcm.chunks import build_manifest
from dask_pcm.throttle import SharedBandwidth

COLUMNS = [
    ("n", "N", "d"),
    ("mode", "mode", "s"),
    ("seconds", "ready_s", ".2f"),
    ("mean_fetch_seconds", "fetch_s", ".2f"),
    ("mean_load_seconds", "load_s", ".2f"),
    ("mb_from_source", "MB_source", ".0f"),
    ("mb_from_peers", "MB_peers", ".0f"),
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


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", help="comma-separated N (default 1,2,4,8; --quick 1,2)")
    p.add_argument(
        "--load-seconds", type=float, default=5.0, help="one source read alone (default 5 s)"
    )
    args = p.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    model = h.model_path(args)
    manifest, _ = build_manifest(model)
    rate = manifest.total_bytes / args.load_seconds
    print(
        f"template {manifest.total_bytes / 1e6:.0f} MB in {manifest.nchunks} chunks; "
        f"simulated shared FS {rate / 1e6:.0f} MB/s for the whole host"
    )
    rows = []
    with h._worker_environ():
        for n in sizes:
            for mode in ("source", "p2p"):
                rows.append(scale_out(n, mode, model, rate))
                print(f"  N={n} {mode}: {rows[-1]['seconds']:.2f} s", flush=True)
    h.print_table(rows, COLUMNS)
    loop = loopback_rate(manifest.total_bytes)
    peer_rates = [r["peer_mb_per_s"] for r in rows if r["peer_mb_per_s"]]
    print(
        f"\nraw loopback socket copy of {manifest.total_bytes / 1e6:.0f} MB: {loop / 1e6:.0f} MB/s"
    )
    if peer_rates:
        best = max(peer_rates)
        print(
            f"peer-to-peer transfer (fetch incl. verify and write): best {best:.0f} MB/s, "
            f"{best / (loop / 1e6):.2f} of loopback"
        )
    for n in sizes:
        src = next(r for r in rows if r["n"] == n and r["mode"] == "source")
        p2p = next(r for r in rows if r["n"] == n and r["mode"] == "p2p")
        print(f"N={n}: source/p2p time {src['seconds'] / p2p['seconds']:.2f}")
    for r in rows:
        r["loopback_mb_per_s"] = loop / 1e6
        r["run"] = uuid.uuid4().hex[:8]
    h.write_json(args.json, rows)


if __name__ == "__main__":
    main()
