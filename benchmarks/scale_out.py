"""Scale-out (the paper's RQ4 in small): N workers join at once; time until all are ready.

Two modes side by side, each N in one run: ``source`` (every worker copies the model's
template from the source) and ``p2p`` (workers copy it from peers that hold it and read the
source only for what no peer has). The source is a simulated shared filesystem
(:class:`dask_pcm.templates.throttle.SharedBandwidth`): one link for the whole host, set so
that one worker alone reads the model in about ``--load-seconds`` (5 s by default), shared by all
concurrent readers like one NFS server under load. Loads may run concurrently (one host
stands for N hosts), so the link and the peers, not a host lock, decide.

The N workers start first (``startup_s``); then the template is broadcast (a context at level
``partial``, ready on a worker once it holds the template: ``held_s``, from registration until
every worker holds it), then the model is built from each worker's copy (the same template at
level ``full``); ``ready_s`` is the two together. The build is kept out of the broadcast on
purpose: here N builds share 2 cores with the copies, on a cluster each has its own. A single copy between two workers, nothing else running, is compared with a
raw loopback socket copy of the same bytes measured in the same run.

``--hosts`` puts each worker in an emulated host of its own behind a link capped at ``--link``
Mbit/s (network namespaces, as root: ``benchmarks/_scale_out_hosts.py``), so that the links,
not this machine's two cores, bound the broadcast.

``--simulate`` instead runs the broadcast to up to 1,024 workers in simulated time
(:mod:`dask_pcm.testing.broadcast`: the real chunk directory, fetch and serve code on one
event loop; per-worker links and a source of ``--link`` and ``--source`` bytes per second;
a template of ``--template-gb``, by default SmolLM2-1.7B in bfloat16), and fits the time
until the last worker holds it against log2 N (p2p) and N (source).

Examples::

    python benchmarks/scale_out.py --quick
    python benchmarks/scale_out.py --json scale_out.json     # N = 1, 2, 4, 8
    python benchmarks/scale_out.py --simulate --json sim.json  # N = 1 ... 1024, simulated
    sudo python benchmarks/scale_out.py --hosts --json hosts.json  # emulated hosts, 24 Mbit/s
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import socket
import threading
import time
from pathlib import Path

import _harness as h
import _protocol as P
import dask
import psutil
from distributed import Client

import dask_pcm
from dask_pcm.scheduler import ContextScheduler
from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.throttle import SharedBandwidth
from dask_pcm.testing.broadcast import SOURCE_MODELS, simulate

COLUMNS = [
    ("n", "N", "d"),
    ("mode", "mode", "s"),
    ("startup_seconds", "startup_s", ".1f"),
    ("held_seconds", "held_s", ".2f"),
    ("held_cpu_floor_seconds", "held_cpu_s/cores", ".2f"),
    ("seconds", "ready_s", ".2f"),
    ("mean_fetch_seconds", "fetch_s", ".2f"),
    ("mean_load_seconds", "load_s", ".2f"),
    ("mb_from_source", "MB_source", ".0f"),
    ("mb_from_peers", "MB_peers", ".0f"),
]

SIM_COLUMNS = [
    ("n", "N", "d"),
    ("mode", "mode", "s"),
    ("seconds", "held_s", ".2f"),
    ("median_seconds", "median_s", ".2f"),
    ("source_gb", "GB_source", ".1f"),
    ("peer_gb", "GB_peers", ".1f"),
    ("max_upload_gb", "GB_busiest_peer", ".1f"),
    ("scheduler_seconds", "directory_s", ".2f"),
    ("real_seconds", "real_s", ".1f"),
]

TRANSFER_COLUMNS = [
    ("chunk_mib", "chunk_MiB", "d"),
    ("round", "round", "d"),
    ("mb_per_s", "copy_MB/s", ".0f"),
    ("verified_loopback_mb_per_s", "verified_MB/s", ".0f"),
    ("raw_loopback_mb_per_s", "raw_MB/s", ".0f"),
    ("of_verified_loopback", "copy/verified", ".2f"),
    ("peak_window", "window_max", "d"),
    ("peak_extra_rss_mb", "peak_extra_RSS_MB", ".0f"),
]


MODES = ("source", "p2p")


def loopback_rate(nbytes: int, block: int = 1 << 20, verify: bool = False) -> float:
    """Bytes per second of a plain socket copy of ``nbytes`` over loopback.

    The receiver reads into one reused buffer (no allocation per read: a fresh buffer per
    ``recv`` makes the first copy in a process up to 3x slower, as glibc maps and unmaps
    each one); with ``verify``, it also hashes what it reads (SHA-256), as a peer copy
    must: the ceiling of a verified copy when both ends share this machine's cores.
    """
    a, b = socket.socketpair()
    payload = bytes(block)

    def send() -> None:
        left = nbytes
        while left > 0:
            n = min(block, left)
            a.sendall(payload[:n])
            left -= n
        a.shutdown(socket.SHUT_WR)

    buffer = memoryview(bytearray(block))
    digest = hashlib.sha256()
    start = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    got = 0
    while n := b.recv_into(buffer):
        got += n
        if verify:
            digest.update(buffer[:n])
    sender.join()
    seconds = time.perf_counter() - start
    a.close()
    b.close()
    assert got == nbytes
    return nbytes / seconds


def scale_out(n: int, mode: str, model: str, bytes_per_second: float) -> dict:
    """N workers started, then the template broadcast (a context at level ``partial``, ready
    once the worker holds the template), then the model built from each worker's copy (the
    same template at level ``full``): seconds of each."""
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
        start = time.perf_counter()
        cluster.scale(n)
        client.wait_for_workers(n, timeout=300)
        startup = time.perf_counter() - start
        SharedBandwidth(bytes_per_second, name="template-source").reset()
        phases, cpu = {}, {}
        for level in ("partial", "full"):  # register returns once every worker is ready
            before = _cpu_seconds(client)
            start = time.perf_counter()
            dask_pcm.register(
                client, dask_pcm.causal_lm(model, name=level, device="cpu", level=level)
            )
            phases[level] = time.perf_counter() - start
            cpu[level] = _cpu_seconds(client) - before
            table = dask_pcm.status(client, [level])
            if len(table) != n or not (table["state"] == "ready").all():
                raise RuntimeError(f"not ready at {level}: {table[['worker', 'state', 'error']]}")
        table = dask_pcm.status(client, ["partial"])
        loads = dask_pcm.status(client, ["full"])
    fetched = table[table["bytes_from_peers"] > 0]
    return {
        "n": n,
        "mode": mode,
        "startup_seconds": startup,
        "held_seconds": phases["partial"],
        # CPU time of every process of the cluster during the broadcast, over the cores:
        # the least the broadcast could take on this host, whatever the protocol.
        "held_cpu_seconds": cpu["partial"],
        "held_cpu_floor_seconds": cpu["partial"] / (os.cpu_count() or 1),
        "seconds": phases["partial"] + phases["full"],
        "mean_fetch_seconds": float(table["fetch_seconds"].mean()),
        "mean_load_seconds": float(loads["load_seconds"].mean()),
        "mb_from_source": table["bytes_from_source"].sum() / 1e6,
        "mb_from_peers": table["bytes_from_peers"].sum() / 1e6,
        "peer_mb_per_s": (
            fetched["bytes_from_peers"].sum() / fetched["fetch_seconds"].sum() / 1e6
            if len(fetched)
            else None
        ),
    }


def _cpu_seconds(client: Client) -> float:
    """CPU seconds (user and system) used so far by this process (client, scheduler and
    nannies) and every worker process."""

    def used() -> float:
        times = psutil.Process().cpu_times()
        return times.user + times.system

    return used() + sum(client.run(used).values())


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
        "window": report.window,
        "peak_window": report.peak_window,
    }


def transfer_alone(model: str, chunk_mib: int, rounds: int = 5, seed: int = 0) -> list[dict]:
    """One worker copies the whole template from another, nothing else running, interleaved
    with a raw and a verified loopback socket copy of the same bytes.

    ``rounds`` rounds, each running the copy, the raw and the verified loopback once, in an
    order drawn from ``seed`` (:func:`_protocol.schedule`), so that a slow minute on this
    shared machine lands on all three alike; one row per round, with each one's rate and the
    copying worker's largest RSS growth (what the copy holds at once: the chunks in flight
    and those being written). The first round's copy is into pages the process has not
    touched yet, as a worker joining a cluster copies.
    """
    manifest, root = build_manifest(model, chunk_mib << 20)
    rows = {r: {"round": r, "chunk_mib": chunk_mib} for r in range(rounds)}
    with (
        dask_pcm.local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as client,
    ):
        client.register_plugin(ContextScheduler())
        holder, joiner = sorted(client.scheduler_info()["workers"])
        client.run(_hold, manifest.to_json(), str(root), workers=[holder])
        client.run(_announce, manifest.digest, manifest.nchunks, workers=[holder])
        dest = Path(client.run(lambda dask_worker=None: dask_worker.local_directory)[joiner])
        for rnd, variant in P.schedule(["copy", "raw", "verified"], rounds, seed):
            row = rows[rnd]
            if variant == "copy":
                run = client.run(
                    _fetch_sampled, manifest.to_json(), str(dest / f"copy-{rnd}"), workers=[joiner]
                )[joiner]
                assert run["bytes_from_peers"] == manifest.total_bytes, run
                row["mb_per_s"] = manifest.total_bytes / run["seconds"] / 1e6
                row["peak_extra_rss_mb"] = run["peak_extra_rss"] / 1e6
                row["window"], row["peak_window"] = run["window"], run["peak_window"]
            else:
                rate = loopback_rate(manifest.total_bytes, verify=variant == "verified")
                row[f"{variant}_loopback_mb_per_s"] = rate / 1e6
    out = [rows[r] for r in range(rounds)]
    for row in out:
        row["template_mb"] = manifest.total_bytes / 1e6
        row["of_verified_loopback"] = row["mb_per_s"] / row["verified_loopback_mb_per_s"]
        row["of_loopback"] = row["mb_per_s"] / row["raw_loopback_mb_per_s"]
    return out


def summarise_transfers(rows: list[dict]) -> list[dict]:
    """Per chunk size: the copy's, the raw and the verified loopback's rate, and the copy
    over the verified loopback paired by round, each a median and 95 % interval."""
    out = []
    for mib in sorted({r["chunk_mib"] for r in rows}):
        mine = sorted((r for r in rows if r["chunk_mib"] == mib), key=lambda r: r["round"])
        copy = [r["mb_per_s"] for r in mine]
        verified = [r["verified_loopback_mb_per_s"] for r in mine]
        raw = [r["raw_loopback_mb_per_s"] for r in mine]
        for metric, values in (
            ("copy_mb_per_s", copy),
            ("verified_loopback_mb_per_s", verified),
            ("raw_loopback_mb_per_s", raw),
        ):
            out.append({"metric": metric, "chunk_mib": mib, **P.interval(values)})
        ratio = P.ratio_interval(copy, verified)
        ratio["of_medians"] = P.interval(copy)["median"] / P.interval(verified)["median"]
        out.append({"metric": "copy_over_verified_loopback", "chunk_mib": mib, **ratio})
        out.append(
            {"metric": "copy_over_raw_loopback", "chunk_mib": mib, **P.ratio_interval(copy, raw)}
        )
    return out


def simulated(args: argparse.Namespace) -> None:
    """``--simulate``: the broadcast to up to 1,024 workers in simulated time (``source`` up
    to ``--source-up-to``: every reader shares the one source link, so each flow that starts
    or ends re-rates all N, and past a few hundred the simulation takes long to show what
    N * S / B says)."""
    top = 64 if args.quick else 1024
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [1 << k for k in range(11)]
    sizes = [n for n in sizes if n <= top or args.sizes]
    template = args.template_gb * 1e9
    args.chunk_mib = args.chunk_mib or 64
    print(
        f"simulated: template {args.template_gb:g} GB in chunks of {args.chunk_mib:g} MiB, "
        f"links {args.link / 1e9:g} GB/s per worker each way, source {args.source / 1e9:g} GB/s "
        f"({args.source_model}), latency {args.latency * 1e3:g} ms"
    )
    rows = []
    for n in sizes:
        for mode in MODES:
            if mode == "source" and n > args.source_up_to:
                continue
            r = simulate(
                n,
                mode,
                template_bytes=template,
                chunk_size=int(args.chunk_mib * (1 << 20)),
                link=args.link,
                source=args.source,
                latency=args.latency,
                source_model=args.source_model,
            )
            del r["timelines"], r["chunk_bytes"]  # per chunk: --hosts profiles them
            r.update(
                source_gb=r["source_bytes"] / 1e9,
                peer_gb=r["peer_bytes"] / 1e9,
                max_upload_gb=r["max_peer_upload_bytes"] / 1e9,
                link_bytes_per_second=args.link,
                source_bytes_per_second=args.source,
                chunk_mib=args.chunk_mib,
                latency=args.latency,
                source_model=args.source_model,
            )
            rows.append(r)
            print(
                f"  N={n} {mode}: {r['seconds']:.2f} s ({r['real_seconds']:.1f} s real)", flush=True
            )
    h.print_table(rows, SIM_COLUMNS)
    fits = fit(rows)
    by = {(r["n"], r["mode"]): r["seconds"] for r in rows}
    print(
        f"\np2p: {fits['p2p'][0]:.2f} + {fits['p2p'][1]:.3f} * log2(N) s; "
        f"source: {fits['source'][0]:.2f} + {fits['source'][1]:.3f} * N s"
    )
    big = max(n for n, mode in by if mode == "p2p")
    growth = {}
    for ref in (1, 8):
        if ref < big and (ref, "p2p") in by:
            growth[f"p2p_n{big}_over_n{ref}"] = by[(big, "p2p")] / by[(ref, "p2p")]
            print(f"p2p held at N={big} / N={ref}: {growth[f'p2p_n{big}_over_n{ref}']:.2f}")
    real = sum(r["real_seconds"] for r in rows)
    print(f"the simulation took {real:.0f} s real")
    for r in rows:
        r["fit_p2p"], r["fit_source"] = fits["p2p"], fits["source"]
    # Simulated time is deterministic (only the directory's real CPU charge moves): one run.
    summary = {"fits": fits, **growth, "real_seconds": real}
    h.write_json(args.json, rows, summary=summary, simulated=True)
    plot_simulated(args.json, rows, fits)


def fit(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Least-squares lines: p2p seconds against log2 N, source seconds against N."""
    out = {}
    for mode, x in (("p2p", math.log2), ("source", float)):
        pts = [(x(r["n"]), r["seconds"]) for r in rows if r["mode"] == mode]
        mx = sum(p[0] for p in pts) / len(pts)
        my = sum(p[1] for p in pts) / len(pts)
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
        out[mode] = (my - slope * mx, slope)
    return out


def plot_simulated(path: Path | None, rows: list[dict], fits: dict) -> None:
    """Seconds until the last worker holds the template against N (log scales), with fits."""
    if path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ns = sorted({r["n"] for r in rows})
    for mode, shape, line in (
        ("source", "s", lambda n: fits["source"][0] + fits["source"][1] * n),
        ("p2p", "o", lambda n: fits["p2p"][0] + fits["p2p"][1] * math.log2(n)),
    ):
        pts = sorted((r["n"], r["seconds"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], shape, label=mode)
        ax.plot(ns, [line(n) for n in ns], "--", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N workers joining at once")
    ax.set_ylabel("s until the last holds the template")
    ax.set_title("Simulated broadcast (dashed: source a+bN, p2p a+b log2 N)", fontsize=10)
    ax.legend()
    h.save_figure(fig, path)


def main() -> None:
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        help="comma-separated N (default 1,2,4,8; --quick 2; "
        "--simulate 1,2,...,1024, --quick to 64)",
    )
    p.add_argument(
        "--load-seconds", type=float, default=5.0, help="one source read alone (default 5 s)"
    )
    p.add_argument(
        "--transfer-only",
        action="store_true",
        help="only the copy between two workers alone: rate and memory held, per chunk size",
    )
    p.add_argument(
        "--transfer-rounds",
        type=int,
        default=5,
        help="rounds of the copy alone, each with a raw and a verified loopback (default 5)",
    )
    p.add_argument("--simulate", action="store_true", help="the broadcast in simulated time")
    p.add_argument("--template-gb", type=float, default=3.4, help="--simulate: template size")
    p.add_argument(
        "--source-up-to",
        type=int,
        default=256,
        help="--simulate: the largest N simulated in mode source (default 256)",
    )
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="--simulate: chunk size (64); --hosts: 0.5")  # fmt: skip
    p.add_argument(
        "--link",
        type=float,
        help="--simulate: B/s per worker link (default 1e9); --hosts: Mbit/s each way per "
        "host (default 24)",
    )
    p.add_argument(
        "--hosts",
        action="store_true",
        help="each worker in an emulated host behind a capped link (root; ci/hosts/setup.sh)",
    )
    p.add_argument("--source", type=float, default=1e9, help="--simulate: B/s of the source")
    p.add_argument(
        "--source-model",
        choices=SOURCE_MODELS,
        default="shared",
        help="--simulate: reads at once share the source over their readers' links (default), "
        "or take turns off the links, as --hosts' source does",
    )
    p.add_argument(
        "--latency", type=float, default=0.0002, help="--simulate: one-way seconds (0.0002)"
    )
    args = p.parse_args()
    if args.hosts:
        import _scale_out_hosts

        _scale_out_hosts.run(args)
        return
    if args.simulate:
        if args.link is None:
            args.link = 1e9
        simulated(args)
        return
    sizes = [int(s) for s in (args.sizes or ("2" if args.quick else "1,2,4,8")).split(",")]
    model = h.model_path(args)
    manifest, _ = build_manifest(model)
    rate = manifest.total_bytes / args.load_seconds
    print(
        f"template {manifest.total_bytes / 1e6:.0f} MB in {manifest.nchunks} chunks; "
        f"simulated shared FS {rate / 1e6:.0f} MB/s for the whole host"
    )
    reps = P.repetitions(args.quick, args.repetitions)
    rows: list[dict] = []
    with h._worker_environ():
        # The baselines in the same rounds as the copies they are compared with.
        transfers = [
            row
            for mib in ((64,) if args.quick else (16, 64))
            for row in transfer_alone(model, mib, max(2, args.transfer_rounds), args.seed)
        ]
        variants = [] if args.transfer_only else [f"{m}@{n}" for n in sizes for m in MODES]
        for rnd, variant in P.schedule(variants, reps, args.seed):
            mode, _, n_text = variant.partition("@")
            rows.append({"round": rnd, **scale_out(int(n_text), mode, model, rate)})
            r = rows[-1]
            print(
                f"  round {rnd} N={r['n']} {mode}: held {r['held_seconds']:.2f} s, "
                f"ready {r['seconds']:.2f} s",
                flush=True,
            )
    rows.sort(key=lambda r: (r["round"], r["n"], r["mode"]))
    if rows:
        h.print_table(rows, [("round", "round", "d"), *COLUMNS])
    print(
        "\none worker copying the template from another, nothing else running, each round "
        "with a loopback socket copy of the same bytes (raw, and with SHA-256 of what is "
        "received: verified):"
    )
    h.print_table(transfers, TRANSFER_COLUMNS)
    transfer_summary = summarise_transfers(transfers)
    for entry in transfer_summary:
        print(
            f"  chunks of {entry['chunk_mib']} MiB, {entry['metric'].replace('_', ' ')}: "
            f"{P.format_interval(entry, '.2f' if 'over' in entry['metric'] else '.0f')}"
            + (f" (median over median {entry['of_medians']:.2f})" if "of_medians" in entry else "")
        )
    for mib in sorted({t["chunk_mib"] for t in transfers}):
        held = max(t["peak_extra_rss_mb"] for t in transfers if t["chunk_mib"] == mib)
        print(f"  chunks of {mib} MiB: memory held at most {held / (mib * 1.048576):.1f} chunks")
    summary = summarise(rows)
    for entry in summary:
        if entry["metric"] != "seconds":
            print(
                f"  {entry['metric'].replace('_', ' ')} at N={entry['n']}: {P.format_interval(entry)}"
            )
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary={
            "intervals": summary,
            "transfer_alone": transfers,
            "transfer_intervals": transfer_summary,
        },
        seed=args.seed,
        source_mb_per_s=rate / 1e6,
        template_mb=manifest.total_bytes / 1e6,
    )
    plot(args.json, summary)


def summarise(rows: list[dict]) -> list[dict]:
    """Per N: held and ready seconds per mode, source / p2p (held), and p2p held at N over
    N=1 (the broadcast's growth), each a median and 95 % interval over rounds."""
    out: list[dict] = []
    key = {(r["mode"], r["n"], r["round"]): r for r in rows}
    sizes = sorted({r["n"] for r in rows})
    rounds = sorted({r["round"] for r in rows})

    def series(mode: str, n: int, field: str) -> list[float]:
        return [key[(mode, n, rnd)][field] for rnd in rounds]

    for n in sizes:
        for mode in MODES:
            for field, what in (("held_seconds", "held"), ("seconds", "ready")):
                out.append(
                    {"metric": "seconds", "what": what, "n": n, "mode": mode,
                     **P.interval(series(mode, n, field))}
                )  # fmt: skip
        held = P.ratio_interval(
            series("source", n, "held_seconds"), series("p2p", n, "held_seconds")
        )
        out.append({"metric": "source_over_p2p_held", "n": n, **held})
        behind = P.ratio_interval(
            series("p2p", n, "held_seconds"), series("source", n, "held_seconds")
        )
        out.append({"metric": "p2p_over_source_held", "n": n, **behind})
        if 1 in sizes and n > 1:
            growth = P.ratio_interval(
                series("p2p", n, "held_seconds"), series("p2p", 1, "held_seconds")
            )
            out.append({"metric": "p2p_held_over_n1", "n": n, **growth})
    return out


def plot(path: Path | None, summary: list[dict]) -> None:
    """Median seconds until every worker holds the template, per N and mode (the PNG beside
    ``path``)."""
    held = [e for e in summary if e["metric"] == "seconds" and e["what"] == "held"]
    if held:
        h.plot_bars(
            path,
            held,
            "n",
            "median",
            group="mode",
            title="N workers, template from the source or peer to peer",
            ylabel="s until all hold it (lower is better)",
        )


if __name__ == "__main__":
    main()
