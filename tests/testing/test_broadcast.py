"""The simulated broadcast: its clock, its links, and what it shows of the real protocol."""

from __future__ import annotations

import asyncio
import time

import pytest

from dask_pcm.templates.manifest import build_manifest
from dask_pcm.templates.tree import tree_files
from dask_pcm.testing.broadcast import Network, VirtualClockLoop, simulate, synthetic_template

GB = 1e9


def run(coro):
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.shut()


def test_the_clock_jumps_over_sleeps_and_stands_still_for_threads():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        after_sleep = loop.time()
        await asyncio.to_thread(time.sleep, 0.2)  # real work: no simulated time passes
        return after_sleep, loop.time()

    start = time.perf_counter()
    after_sleep, after_thread = run(main())
    assert after_sleep == pytest.approx(3600)
    assert after_thread == after_sleep
    assert time.perf_counter() - start < 5


def test_flows_share_a_link_equally_and_speed_up_when_one_ends():
    async def main():
        net = Network({"a": 100.0, "b": 100.0, "c": 50.0}, latency=0.0)
        loop = asyncio.get_running_loop()
        ends = {}

        async def move(name, links, nbytes):
            await net.transfer(links, nbytes)
            ends[name] = loop.time()

        await asyncio.gather(
            move("short", ("a",), 100),  # 50 B/s while shared: ends at 2 s
            move("long", ("a",), 200),  # 50 B/s for 2 s, then 100 B/s: ends at 3 s
            move("narrow", ("b", "c"), 100),  # c is the bottleneck: 50 B/s, 2 s
        )
        return ends, net.moved

    ends, moved = run(main())
    assert ends == pytest.approx({"short": 2.0, "long": 3.0, "narrow": 2.0})
    assert moved == {"a": 300, "b": 100, "c": 100}


def test_every_worker_gets_every_byte_and_the_source_is_read_once():
    n, template = 12, 0.5 * GB
    p2p = simulate(n, "p2p", template_bytes=template)
    assert p2p["source_bytes"] == pytest.approx(p2p["template_bytes"])
    assert p2p["peer_bytes"] == pytest.approx((n - 1) * p2p["template_bytes"])
    # Nobody can hold it before its own 1 GB/s download link brought it all.
    assert p2p["first_seconds"] >= template / GB
    source = simulate(n, "source", template_bytes=template)
    assert source["source_bytes"] == pytest.approx(n * source["template_bytes"])
    assert source["peer_bytes"] == 0


def test_a_queued_source_serves_reads_in_turn_off_the_links():
    """``source_model="queued"``, as ``pcm.template.source-bandwidth`` serves reads (the
    source of ``scale_out.py --hosts``): a read does not cross its reader's download link,
    and reads at once take turns at the source's full rate."""
    slow_links = {"template_bytes": GB, "link": 0.5 * GB, "source": GB}
    shared = simulate(1, "source", **slow_links)
    queued = simulate(1, "source", source_model="queued", **slow_links)
    assert shared["seconds"] == pytest.approx(2.0, rel=0.05)  # bound by the reader's link
    assert queued["seconds"] == pytest.approx(1.0, rel=0.05)  # by the source alone
    assert queued["source_bytes"] == pytest.approx(queued["template_bytes"])
    four = simulate(4, "source", source_model="queued", **slow_links)
    assert four["seconds"] == pytest.approx(4.0, rel=0.05)
    assert four["source_bytes"] == pytest.approx(4 * four["template_bytes"])
    with pytest.raises(ValueError, match="source_model"):
        simulate(1, source_model="fair")


def test_from_the_source_alone_the_time_grows_linearly():
    one = simulate(1, "source", template_bytes=GB)["seconds"]
    four = simulate(4, "source", template_bytes=GB)["seconds"]
    assert four / one == pytest.approx(4, rel=0.02)


def test_peer_to_peer_the_time_grows_slowly_with_the_workers():
    """3.4 GB over 1 GB/s links: 32 workers hold it little later than 4 (rounds of polling
    and uploads queued on the first holders made it 34.7 s against 4.1 s at N=8)."""
    four = simulate(4, "p2p")["seconds"]
    many = simulate(32, "p2p")["seconds"]
    assert many / four < 1.5
    assert four < 2 * 3.4  # the source is read once, and the peers pass it on meanwhile


def test_a_copy_alone_on_a_long_path_grows_its_window_and_fills_the_link():
    """100 ms each way at 1 GB/s: two 64 MiB chunks in flight leave the link idle for most
    of each round trip; the window grows to its cap and the copy takes less time."""
    long_path = {"template_bytes": GB, "latency": 0.1}
    fixed = simulate(1, "source", max_in_flight=2, **long_path)
    grown = simulate(1, "source", max_in_flight=4, **long_path)
    assert fixed["peak_windows"] == [2]
    assert grown["peak_windows"] == [4]
    assert grown["seconds"] < 0.9 * fixed["seconds"]
    # Memory held stays bounded: never more chunks received at once than the cap.
    assert grown["peak_in_flight"] <= 4


def test_on_a_slow_link_the_window_stays_small_and_the_link_full():
    """24 Mbit/s (3 MB/s), 1 MiB chunks: more chunks in flight would only queue."""
    slow = {"template_bytes": 0.05 * GB, "link": 3e6, "source": 3e6, "chunk_size": 1 << 20}
    result = simulate(1, "source", max_in_flight=8, **slow)
    assert max(result["peak_windows"]) <= 3  # probes one more, keeps none
    assert result["seconds"] == pytest.approx(0.05 * GB / 3e6, rel=0.02)


def test_copies_together_keep_their_windows_small():
    """In a broadcast, a chunk more for one copy is a share taken from another: the windows
    stay near their start, and the broadcast is no slower than with fixed windows."""
    fixed = simulate(8, "p2p", max_in_flight=2)
    adaptive = simulate(8, "p2p", max_in_flight=8)
    assert max(adaptive["peak_windows"]) <= 3
    # Without Window.shared, each copy's own rate grew its window: the broadcast was slower.
    assert adaptive["seconds"] <= 1.05 * fixed["seconds"]


def test_the_timelines_give_each_worker_every_chunk_once_no_faster_than_its_link():
    n, template, link = 4, 12e6, 3e6
    r = simulate(n, "p2p", template_bytes=template, chunk_size=512 << 10, link=link,
                 source=link, latency=0.002, source_model="queued", scale=1 << 10)  # fmt: skip
    assert sorted(r["timelines"]) == [f"sim://worker-{i}" for i in range(n)]
    assert sum(r["chunk_bytes"]) == pytest.approx(r["template_bytes"])
    from_source = 0
    for worker, timeline in r["timelines"].items():
        assert sorted(index for index, *_ in timeline) == list(range(r["chunks"])), worker
        for index, peer, asked, done in timeline:
            assert 0 <= asked < done <= r["seconds"] + 1e-9
            assert peer != worker
            if peer:  # over the holder's uplink and this downlink, after the request
                assert done - asked >= r["chunk_bytes"][index] / link
            else:
                from_source += 1
    assert from_source == r["chunks"]  # the source read once


def test_a_template_of_several_files_is_cut_as_its_manifest_and_copied_whole(tmp_path):
    # A real template's shape: small files (config, tokenizer) beside the weights.
    sizes, chunk, scale = [151, 715, 22_063, 3_000_000], 512 << 10, 1 << 10
    manifest, root = synthetic_template(tmp_path / "t", sizes, chunk, scale)
    built, _ = build_manifest(tree_files(root), chunk // scale)
    assert built.digest == manifest.digest  # cut as the manifest code cuts a folder
    assert [len(f.chunks) for f in manifest.files] == [1, 1, 1, 6]
    r = simulate(3, "p2p", template_bytes=sizes, chunk_size=chunk, link=3e6, source=3e6,
                 latency=0.002, source_model="queued", scale=scale)  # fmt: skip
    assert r["chunks"] == 9
    assert sorted(r["chunk_bytes"])[:3] == [scale, scale, 22 * scale]  # each scaled, rounded up
    for timeline in r["timelines"].values():
        assert sorted(index for index, *_ in timeline) == list(range(9))
    assert r["source_bytes"] == pytest.approx(r["template_bytes"])  # the source read once
