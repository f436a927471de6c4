"""``scale_out.py --hosts``: the broadcast between emulated hosts, bound by their links.

Each worker runs in a host of its own (:mod:`dask_pcm.testing.hosts`: a network namespace
on a private bridge, its link capped at ``--link`` Mbit/s each way by a token-bucket shaper,
its own lock and template folders); the scheduler and client run on the bridge. The source is
the simulated shared filesystem (``pcm.template.source-bandwidth``), one for all hosts, at the
rate of one link: a file server behind a link like the hosts'. Its reads do not cross the
emulated links (it stands for storage the hosts reach by another path).

Per round, each variant in random order: ``single`` (a host copies the whole template from
one that holds it, nothing else running: the copy's rate against the cap), and ``source`` and
``p2p`` at N = 1, 2, 4, 8 hosts joining at once. ``held_s``: from registering a context at
level ``partial`` until every worker holds the template; ``ready_s``: plus the same template
at level ``full`` (each worker builds the model from its copy). The CPU seconds of every
process during the broadcast, over the cores, show how far the cores were from binding it.
Where its uplinks' time went in a p2p broadcast (:func:`uplink_profile`, from every copy's
chunk timeline), and how fully its downlinks carried the chunks between peers
(:func:`downlink_profile`), are in the JSON's rows (``uplinks``, ``downlinks``) and summary.
The same p2p broadcasts are simulated once per round (mode ``simulated``, :func:`simulated`):
the same plan and copy code on exactly fair links, against which the emulated links' own
losses show.

The template defaults to a random Llama of 12 MB (hidden size 256, 4 layers) and the link
to 24 Mbit/s: a copy takes about 4 s, and the N=8 broadcast moves 90 MB, a fraction of a
CPU-second. The embedded 538 MB model at the same 4 s per copy would need 1 Gbit/s links and
the 2 cores would bind again (issue 33: 17 CPU-s in a 9.8 s broadcast on loopback).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h
import _protocol as P
import psutil
from distributed import Client

import dask_pcm
from dask_pcm import config as pcm_config
from dask_pcm.templates.manifest import build_manifest

DEFAULT_LINK = 24.0  # Mbit/s
# Chunks of 512 KiB: 28 of the 12 MB template (its files are cut apart). A chunk's way from
# the source through N hosts costs about log2(N) chunk times over a link, so the tail
# shrinks with the chunk; but every chunk costs directory round trips to the scheduler,
# which a loaded 2-core machine makes slow (256 KiB under load: p2p at N=1 took 6.9 s where
# the source alone took 3.9 s).
CHUNK_MIB = 0.5
MODES = ("source", "p2p")
# The p2p broadcast is also simulated at each N, once per round (``simulated``): the same
# directory and copy code, the template's files cut into chunks as its manifest cuts them
# (its small files chunks of their own), links and source, on links
# shared exactly fairly (dask_pcm.testing.broadcast), with a one-way delay of the emulated
# links' order under load (docs/hosts.md). What the emulation loses beyond it, the
# transport loses, not the plan.
SIM_LATENCY = 0.002

COLUMNS = [
    ("n", "N", "d"),
    ("mode", "mode", "s"),
    ("startup_seconds", "startup_s", ".1f"),
    ("held_seconds", "held_s", ".2f"),
    ("held_cpu_share", "CPU_share", ".2f"),
    ("seconds", "ready_s", ".2f"),
    ("mb_from_source", "MB_source", ".1f"),
    ("mb_from_peers", "MB_peers", ".1f"),
]


def small_model() -> str:
    """The default template: a 12 MB random Llama, built once in ``pcm.cache-directory``."""
    from dask_pcm import config

    folder = Path(config.cache_directory()) / "bench-small-llama"
    return str(dask_pcm.build_tiny_llama(folder, hidden_size=256, num_layers=4, num_heads=4))


def _cpu_seconds(client: Client) -> float:
    """CPU seconds so far of this process (scheduler, client) and every worker process."""

    def used() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system

    return used() + sum(client.run(used).values())


def _register(client: Client, model: str, level: str) -> float:
    start = time.perf_counter()
    dask_pcm.register(client, dask_pcm.causal_lm(model, name=level, device="cpu", level=level))
    seconds = time.perf_counter() - start
    table = dask_pcm.status(client, [level])
    if not (table["state"] == "ready").all():
        raise RuntimeError(f"not ready at {level}: {table[['worker', 'state', 'error']]}")
    return seconds


def _network(n: int, link: float, mode: str, chunk_mib: float) -> Any:
    from dask_pcm.testing.hosts import HostNetwork

    rate = link * 1e6 / 8
    settings = {
        "pcm.template.chunk-size": int(chunk_mib * (1 << 20)),
        "pcm.template.source-bandwidth": int(rate),
        "pcm.template.peer-to-peer": mode != "source",
    }
    return HostNetwork(hosts=n, link=link, settings=settings), settings


def _environ() -> dict[str, str]:
    """Workers import this folder's modules (the warm-up), from wherever this runs."""
    paths = [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _workers(net: Any, client: Client, address: str, hosts: list, model: str) -> float:
    """Start a worker in each of ``hosts`` and warm it up (:func:`_harness.warm_up`: torch,
    transformers and dask_pcm's worker code imported, the model built once and dropped);
    seconds. Timed from here, a broadcast is the copy, not N processes' first imports at once
    on 2 cores (a cost per process, not per context; every benchmark here leaves it out)."""
    start = time.perf_counter()
    for host in hosts:
        host.start_worker(address, env=_environ())
    client.wait_for_workers(len(net.hosts), timeout=300)
    names = {host.name for host in hosts}
    mine = [
        a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["name"] in names
    ]
    client.run(h.warm_up, model, workers=mine)
    return time.perf_counter() - start


def _timelines(dask_worker: Any) -> list[tuple[int, str, float, float]]:
    """On a worker: the chunk timeline of the template copy it made (one template here)."""
    store = dask_worker.extensions.get("dask-pcm-templates")
    reports = list(store.reports.values()) if store is not None else []
    return [tuple(t) for report in reports for t in report.timeline]


# Steps of the uplink profile, seconds (a 512 KiB chunk takes 175 ms on a 24 Mbit/s link).
PROFILE_STEP = 0.005
IDLE = ("holds_nothing", "nothing_wanted", "wanted_by_full_copies", "wanted")


def uplink_profile(
    timelines: dict[str, list[tuple[int, str, float, float]]], window: int = 2
) -> dict[str, float]:
    """Where the uplinks' time went in one broadcast, from each worker's chunk timeline
    (``FetchReport.timeline``: chunk, the peer it came from or "" for the source, asked,
    bytes in; wall clock).

    Sampled every :data:`PROFILE_STEP` from the first request to the last chunk in, over
    every worker's uplink: ``busy`` (uploading at least one chunk), or idle because it
    ``holds_nothing``; ``nothing_wanted`` (every other worker holds, or is fetching from
    someone, each chunk it holds); ``wanted_by_full_copies`` (some worker lacks one of its
    chunks and is not fetching it, but already has ``window`` chunks on the way); or
    ``wanted`` (such a worker had a free slot: the copy and the directory missed it). Also
    ``busy_while_source_reads`` (the busy share until the last chunk came out of the source),
    ``source_end_s`` and ``span_s``. Shares of the uplinks' time."""
    held: dict[str, dict[int, float]] = {}
    fetching: dict[str, list[tuple[int, float, float]]] = {}
    uploads: dict[str, list[tuple[float, float]]] = {w: [] for w in timelines}
    for worker, timeline in timelines.items():
        held[worker] = {index: end for index, _, _, end in timeline}
        fetching[worker] = [(index, start, end) for index, _, start, end in timeline]
        for _, peer, start, end in timeline:
            if peer:
                uploads.setdefault(peer, []).append((start, end))
    events = [t for timeline in timelines.values() for _, _, a, b in timeline for t in (a, b)]
    source = [end for timeline in timelines.values() for _, peer, _, end in timeline if not peer]
    if not events:
        return {}
    first, last = min(events), max(events)
    source_end = max(source, default=first)
    counts = dict.fromkeys(("busy", *IDLE), 0)
    busy_reading = samples_reading = 0
    workers = sorted(timelines)
    t = first
    while t < last:
        # Per worker: chunks on the way to it now, and their number.
        on_way = {w: {i for i, a, b in fetching[w] if a <= t < b} for w in workers}
        for holder in workers:
            busy = any(a <= t < b for a, b in uploads.get(holder, ()))
            if t < source_end:
                samples_reading += 1
                busy_reading += busy
            if busy:
                counts["busy"] += 1
                continue
            mine = {i for i, end in held[holder].items() if end <= t}
            if not mine:
                counts["holds_nothing"] += 1
                continue
            state = "nothing_wanted"
            for other in workers:
                if other == holder:
                    continue
                lacking = {i for i in mine if held[other].get(i, math.inf) > t} - on_way[other]
                if lacking:
                    state = "wanted" if len(on_way[other]) < window else "wanted_by_full_copies"
                    if state == "wanted":
                        break
            counts[state] += 1
        t += PROFILE_STEP
    total = sum(counts.values())
    out = {k: v / total for k, v in counts.items()}
    out["busy_while_source_reads"] = busy_reading / samples_reading if samples_reading else 0.0
    out["source_end_s"] = source_end - first
    out["span_s"] = last - first
    return out


def downlink_profile(
    timelines: dict[str, list[tuple[int, str, float, float]]], sizes: list[int], cap: float
) -> dict[str, float]:
    """How well the downlinks carried what peers sent in one broadcast, from each worker's
    chunk timeline (as :func:`uplink_profile`); ``sizes``: each chunk's bytes; ``cap``: a
    link's bytes per second.

    ``busy``: the share of the downlinks' time with at least one chunk on its way from a
    peer (sampled every :data:`PROFILE_STEP`); ``rate_while_busy``: the bytes from peers over
    the busy time at the cap (1: a receiving downlink always full); ``stretch`` and
    ``stretch_p90``: a peer chunk's time, from asking to its last byte, over its time at a
    fair share of the links (its bytes at the cap, times the most chunks its holder's
    uplink or its downlink carried at once, on average over its time), the median and the
    90th percentile over the chunks of at least half the largest chunk's size (1: as fast as
    the links shared fairly allow; more: the request, the holder and the transport's own
    ways; a file's small tail would be all request)."""
    transfers = [
        (worker, peer, index, start, end)
        for worker, timeline in timelines.items()
        for index, peer, start, end in timeline
        if peer and end > start
    ]
    if not transfers:
        return {}
    ups: dict[str, list[tuple[float, float]]] = {}
    downs: dict[str, list[tuple[float, float]]] = {}
    for worker, peer, _, start, end in transfers:
        ups.setdefault(peer, []).append((start, end))
        downs.setdefault(worker, []).append((start, end))

    def on(intervals: list[tuple[float, float]], t: float) -> int:
        return sum(1 for a, b in intervals if a <= t < b)

    events = [t for timeline in timelines.values() for _, _, a, b in timeline for t in (a, b)]
    first, last = min(events), max(events)
    busy = samples = 0
    t = first
    while t < last:
        for worker in timelines:
            samples += 1
            busy += on(downs.get(worker, []), t) > 0
        t += PROFILE_STEP
    stretches = []
    for worker, peer, index, start, end in transfers:
        if 2 * sizes[index] < max(sizes):
            continue
        shared, steps = 0, 0
        t = start
        while t < end:
            shared += max(on(ups[peer], t), on(downs[worker], t))
            steps += 1
            t += PROFILE_STEP
        fair = sizes[index] / cap * max(1.0, shared / max(steps, 1))
        stretches.append((end - start) / fair)
    stretches.sort()
    received = sum(sizes[index] for _, _, index, _, _ in transfers)
    busy_seconds = busy * PROFILE_STEP
    return {
        "busy": busy / samples if samples else 0.0,
        "rate_while_busy": received / cap / busy_seconds if busy_seconds else 0.0,
        "stretch": statistics.median(stretches) if stretches else math.nan,
        "stretch_p90": stretches[int(0.9 * (len(stretches) - 1))] if stretches else math.nan,
    }


def broadcast(n: int, mode: str, model: str, link: float, chunk_mib: float) -> dict[str, Any]:
    """N hosts joining at once: the template broadcast, then the model built on each."""
    import dask

    net, settings = _network(n, link, mode, chunk_mib)
    with (
        net,
        dask.config.set(settings),
        dask_pcm.local_cluster(n_workers=0, host=net.address, dashboard_address=":0") as cl,
        Client(cl) as client,
    ):
        startup = _workers(net, client, cl.scheduler_address, net.hosts, model)
        net.reset_source()
        before = _cpu_seconds(client)
        held = _register(client, model, "partial")
        cpu = _cpu_seconds(client) - before
        timelines = client.run(_timelines) if mode == "p2p" and n > 1 else {}
        ready = held + _register(client, model, "full")
        table = dask_pcm.status(client, ["partial"])
    uplinks = (
        uplink_profile(timelines, int(pcm_config.get("template.in-flight"))) if timelines else {}
    )
    downlinks = {}
    if timelines:
        manifest, _ = build_manifest(model, int(chunk_mib * (1 << 20)))
        sizes = [manifest.chunk(i).length for i in range(manifest.nchunks)]
        downlinks = downlink_profile(timelines, sizes, link * 1e6 / 8)
    return {
        "n": n,
        "mode": mode,
        "startup_seconds": startup,
        "held_seconds": held,
        "held_cpu_seconds": cpu,
        # The share of the machine's cores the broadcast used: far below 1, the links bound it.
        "held_cpu_share": cpu / held / (os.cpu_count() or 1),
        "seconds": ready,
        "mean_fetch_seconds": float(table["fetch_seconds"].mean()),
        "mb_from_source": table["bytes_from_source"].sum() / 1e6,
        "mb_from_peers": table["bytes_from_peers"].sum() / 1e6,
        **({"uplinks": uplinks} if uplinks else {}),
        **({"downlinks": downlinks} if downlinks else {}),
    }


def single(model: str, link: float, chunk_mib: float) -> dict[str, Any]:
    """One host copies the whole template from another that holds it, nothing else running."""
    import dask

    net, settings = _network(1, link, "p2p", chunk_mib)
    with (
        net,
        dask.config.set(settings),
        dask_pcm.local_cluster(n_workers=0, host=net.address, dashboard_address=":0") as cl,
        Client(cl) as client,
    ):
        _workers(net, client, cl.scheduler_address, net.hosts, model)
        _register(client, model, "partial")
        joiner = net.add_host(link=link)
        # It copies the registered template as soon as it joins: torch imported before that
        # (a preload), not beside the copy being measured.
        joiner.start_worker(cl.scheduler_address, env=_environ(), args=["--preload", "torch"])
        deadline = time.monotonic() + 600
        while True:
            table = dask_pcm.status(client, ["partial"])
            if len(table) == 2 and (table["state"] == "ready").all():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the joiner never got ready: {table[['worker', 'state']]}")
            time.sleep(0.1)
    row = table[table["bytes_from_peers"] > 0].iloc[0]
    rate = row["bytes_from_peers"] / row["fetch_seconds"]
    return {
        "mode": "single",
        "fetch_seconds": float(row["fetch_seconds"]),
        "mb_from_peers": row["bytes_from_peers"] / 1e6,
        "mbit_per_s": rate * 8 / 1e6,
        "of_link": rate * 8 / 1e6 / link,
    }


def simulated(
    n: int, file_bytes: int | Sequence[int], chunk_mib: float, link: float
) -> dict[str, Any]:
    """The p2p broadcast to ``n`` hosts of a template of ``file_bytes`` (each file's size,
    cut into chunks as its manifest cuts it) in :func:`dask_pcm.testing.broadcast.simulate`, on
    ``link`` Mbit/s links, the source at one link's rate serving reads in turn (as
    ``pcm.template.source-bandwidth`` does here): held seconds, and the uplink and downlink
    profiles of its chunk timelines (simulated seconds)."""
    from dask_pcm.testing.broadcast import simulate

    rate = link * 1e6 / 8
    r = simulate(
        n,
        "p2p",
        template_bytes=file_bytes,
        chunk_size=int(chunk_mib * (1 << 20)),
        link=rate,
        source=rate,
        latency=SIM_LATENCY,
        source_model="queued",
        scale=1 << 10,  # 512 KiB chunks of 512 bytes on disk
    )
    row: dict[str, Any] = {"n": n, "mode": "simulated", "held_seconds": r["seconds"]}
    if n > 1:  # chunks passed between peers to profile
        row["uplinks"] = uplink_profile(r["timelines"], int(pcm_config.get("template.in-flight")))
        row["downlinks"] = downlink_profile(r["timelines"], r["chunk_bytes"], rate)
    return row


def run(args: argparse.Namespace) -> None:
    """``--hosts``: every variant in rounds, the summary, the JSON and its plot."""
    from dask_pcm.testing import hosts

    reason = hosts.unavailable()
    if reason:
        message = f"--hosts needs emulated hosts: {reason}"
        if os.environ.get("PCM_REQUIRE_HOSTS"):
            raise SystemExit(message)
        print(f"skipped: {message}")
        return
    link = args.link if args.link is not None else DEFAULT_LINK
    sizes = [int(s) for s in (args.sizes or ("2" if args.quick else "1,2,4,8")).split(",")]
    model = h.model_path(args) if args.model else small_model()
    chunk_mib = args.chunk_mib or CHUNK_MIB
    manifest, _ = build_manifest(model, int(chunk_mib * (1 << 20)))
    print(
        f"template {manifest.total_bytes / 1e6:.1f} MB in {manifest.nchunks} chunks; links "
        f"{link:g} Mbit/s each way; source {link / 8:g} MB/s shared by all hosts "
        f"(one copy alone: {manifest.total_bytes * 8 / link / 1e6:.1f} s)"
    )
    reps = P.repetitions(args.quick, args.repetitions)
    variants = ["single"] + [f"{m}@{n}" for n in sizes for m in MODES]
    rows: list[dict[str, Any]] = []
    load = []
    for rnd, variant in P.schedule(variants, reps, args.seed):
        mode, _, n = variant.partition("@")
        load.append(os.getloadavg()[0])
        r = (
            single(model, link, chunk_mib)
            if mode == "single"
            else broadcast(int(n), mode, model, link, chunk_mib)
        )
        rows.append({"round": rnd, **r})
        print(f"  round {rnd} {variant}: " + (
            f"{r['mbit_per_s']:.1f} Mbit/s ({r['of_link']:.2f} of the link)" if mode == "single"
            else f"held {r['held_seconds']:.2f} s, ready {r['seconds']:.2f} s, "
                 f"CPU share {r['held_cpu_share']:.2f}"
        ), flush=True)  # fmt: skip
    file_sizes = [f.size for f in manifest.files]
    for rnd in range(reps):  # in one process, seconds of CPU: not interleaved
        rows += [{"round": rnd, **simulated(n, file_sizes, chunk_mib, link)}
                 for n in sizes]  # fmt: skip
    rows.sort(key=lambda r: (r["round"], r.get("n", 0), r["mode"]))
    for r in rows:
        if r["mode"] == "simulated":
            print(f"  round {r['round']} simulated@{r['n']}: held {r['held_seconds']:.2f} s")
    scaled = [r for r in rows if r["mode"] in MODES]
    h.print_table(scaled, [("round", "round", "d"), *COLUMNS])
    summary = summarise(rows, sizes)
    for entry in summary:
        print(f"  {entry['metric']} {entry.get('mode', '')} N={entry.get('n', '')}: "
              f"{P.format_interval(entry)}")  # fmt: skip
    h.write_json(
        args.json,
        rows,
        reps=reps,
        summary=summary,
        seed=args.seed,
        link_mbit_per_s=link,
        template_mb=manifest.total_bytes / 1e6,
        chunk=f"{chunk_mib:g} MiB",
        in_flight=pcm_config.get("template.in-flight"),
        max_uploads=pcm_config.get("template.max-uploads"),
        simulated_latency_s=SIM_LATENCY,
        load_average_during=[round(x, 2) for x in load],
    )
    held = [e for e in summary if e["metric"] == "held_seconds"]
    h.plot_bars(args.json, held, "n", "median", group="mode", ylabel="s until all hold it",
                title=f"Emulated hosts, {link:g} Mbit/s links: source alone or peer to peer")  # fmt: skip


def summarise(rows: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Medians and 95 % intervals over rounds: held and ready seconds per N and mode, p2p held
    at N over N=1, source held at N over N=1, the CPU share, where the uplinks' time went
    (``uplinks_<part>``: :func:`uplink_profile`) and how the downlinks carried it
    (``downlinks_<part>``: :func:`downlink_profile`; the median and the range, as shares may
    be 0), and the single copy's rate."""
    out: list[dict[str, Any]] = []
    rounds = sorted({r["round"] for r in rows})
    key = {(r["mode"], r.get("n"), r["round"]): r for r in rows}

    def series(mode: str, n: int | None, field: str) -> list[float]:
        return [key[(mode, n, rnd)][field] for rnd in rounds]

    simulated = any(r["mode"] == "simulated" for r in rows)
    for n in sizes:
        for mode in (*MODES, "simulated") if simulated else MODES:
            fields = ("held_seconds",) if mode == "simulated" else (
                "held_seconds", "seconds", "held_cpu_share")  # fmt: skip
            for field in fields:
                out.append({"metric": field, "n": n, "mode": mode,
                            **P.interval(series(mode, n, field))})  # fmt: skip
            if n > 1 and 1 in sizes:
                growth = P.ratio_interval(
                    series(mode, n, "held_seconds"), series(mode, 1, "held_seconds")
                )
                out.append({"metric": "held_over_n1", "n": n, "mode": mode, **growth})
    # Where the uplinks' time went in the p2p broadcasts, and how the downlinks carried it.
    # (The simulated broadcast's too, in JSON from 2026-12-07 on.)
    for n, side, mode in itertools.product(sizes, ("uplinks", "downlinks"), ("p2p", "simulated")):
        profiles = [key.get((mode, n, rnd), {}).get(side) for rnd in rounds]
        if n > 1 and all(profiles):
            for part in profiles[0]:
                # Shares, some of them 0: the median and the range over the rounds.
                values = [profile[part] for profile in profiles]
                out.append({"metric": f"{side}_{part}", "n": n, "mode": mode,
                            "runs": len(values), "median": statistics.median(values),
                            "low": min(values), "high": max(values)})  # fmt: skip
    for field in ("mbit_per_s", "of_link"):
        out.append({"metric": field, "mode": "single", **P.interval(series("single", None, field))})
    return out
