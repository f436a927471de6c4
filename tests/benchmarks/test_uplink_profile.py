"""Where a broadcast's uplink time went, from its copies' chunk timelines
(``scale_out.py --hosts``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _scale_out_hosts as hosts


def test_an_uplink_is_busy_idle_for_want_of_chunks_or_idle_while_wanted():
    # a reads chunk 0 from the source in [0, 1); b has it from a in [1, 2), c from b in
    # [2, 3); d asks a for it only at 2.5, so a idled for half a second while d lacked it.
    timelines = {
        "a": [(0, "", 0.0, 1.0)],
        "b": [(0, "a", 1.0, 2.0)],
        "c": [(0, "b", 2.0, 3.0)],
        "d": [(0, "a", 2.5, 3.0)],
    }
    profile = hosts.uplink_profile(timelines, window=2)
    samples = 4 * 3.0  # four uplinks over three seconds
    expected = {
        "busy": (1.0 + 0.5 + 1.0) / samples,  # a to b, a to d, b to c
        "wanted": 0.5 / samples,  # a while d lacked chunk 0 and fetched nothing
        "nothing_wanted": 0.0,
        "holds_nothing": (1.0 + 2.0 + 3.0 + 3.0) / samples,
        "busy_while_source_reads": 0.0,  # nobody held anything before 1.0
        "source_end_s": 1.0,
        "span_s": 3.0,
    }
    for part, value in expected.items():
        assert profile[part] == pytest.approx(value, abs=0.01), part


def test_chunks_lacked_only_by_copies_with_full_windows_or_on_their_way_leave_it_idle():
    # c reads chunk 1 from the source all along: with a window of one it cannot ask for
    # chunk 0 until 2.5, when it has it from b.
    timelines = {
        "a": [(0, "", 0.0, 1.0)],
        "b": [(0, "a", 1.0, 2.0)],
        "c": [(1, "", 0.0, 3.0), (0, "b", 2.5, 3.0)],
    }
    profile = hosts.uplink_profile(timelines, window=1)
    samples = 3 * 3.0
    expected = {
        "busy": (1.0 + 0.5) / samples,  # a to b, b to c
        "wanted_by_full_copies": (0.5 + 0.5) / samples,  # a and b in [2, 2.5)
        "nothing_wanted": 0.5 / samples,  # a in [2.5, 3): c gets chunk 0 from b
        "holds_nothing": (1.0 + 2.0 + 3.0) / samples,
        "source_end_s": 3.0,
    }
    for part, value in expected.items():
        assert profile[part] == pytest.approx(value, abs=0.01), part


def test_the_summary_gives_each_part_of_the_uplinks_time_with_its_range():
    rows = []
    for rnd, busy in enumerate((0.7, 0.8, 0.9)):
        for mode in ("source", "p2p"):
            for n in (1, 2):
                row = {"round": rnd, "mode": mode, "n": n, "held_seconds": 4.0 * n,
                       "seconds": 4.1 * n, "held_cpu_share": 0.1}  # fmt: skip
                if mode == "p2p" and n == 2:
                    row["uplinks"] = {"busy": busy, "wanted": 0.0}
                rows.append(row)
        rows.append({"round": rnd, "mode": "single", "mbit_per_s": 22.9, "of_link": 0.95})
    summary = hosts.summarise(rows, [1, 2])
    parts = {e["metric"]: e for e in summary if e["metric"].startswith("uplinks_")}
    assert parts["uplinks_busy"]["median"] == 0.8
    assert (parts["uplinks_busy"]["low"], parts["uplinks_busy"]["high"]) == (0.7, 0.9)
    assert parts["uplinks_wanted"]["median"] == 0.0  # a share of 0 is a figure too


def test_downlinks_carry_chunks_at_their_fair_share_or_slower():
    # Chunks of 10 bytes on links of 10 bytes/s. b has chunk 0 from a in [1, 2): alone on
    # both links, at the cap. c has chunk 0 from a in [1, 3) while a also serves b in
    # [1, 2): a fair share of a's uplink is half the cap for [1, 2), then all of it, so
    # 1.5 s; it took 2 (a stretch of 4/3). d has chunk 0 from b in [3, 7): 4 times its 1 s.
    timelines = {
        "a": [(0, "", 0.0, 1.0)],
        "b": [(0, "a", 1.0, 2.0)],
        "c": [(0, "a", 1.0, 3.0)],
        "d": [(0, "b", 3.0, 7.0)],
    }
    profile = hosts.downlink_profile(timelines, sizes=[10], cap=10.0)
    # 4 downlinks over 7 s; receiving 1 + 2 + 4 of them; 30 bytes in those 7 s at 10 bytes/s.
    assert profile["busy"] == pytest.approx(7.0 / 28.0, abs=0.01)
    assert profile["rate_while_busy"] == pytest.approx(3.0 / 7.0, abs=0.01)
    stretches = sorted([1.0, 2.0 / 1.5, 4.0])
    assert profile["stretch"] == pytest.approx(stretches[1], abs=0.02)
    assert profile["stretch_p90"] == pytest.approx(stretches[1], abs=0.02)  # of 3: the 2nd
    assert hosts.downlink_profile({"a": [(0, "", 0.0, 1.0)]}, [10], 10.0) == {}
    # A file's small tail (chunk 1, 1 byte) is all request: left out of the stretch.
    timelines["d"].append((1, "a", 7.0, 8.0))
    timelines["a"].append((1, "", 0.0, 0.5))
    assert hosts.downlink_profile(timelines, sizes=[10, 1], cap=10.0)["stretch_p90"] < 2


def test_a_simulated_broadcast_moves_every_chunk_at_its_fair_share():
    # The simulation shares each link equally between its flows, as the downlink profile's
    # fair share has it: every full-size chunk takes that long, and no longer.
    row = hosts.simulated(4, 6_000_000, 0.5, 24.0)
    assert row["mode"] == "simulated" and row["held_seconds"] > 6e6 * 8 / 24e6
    assert row["downlinks"]["stretch"] == pytest.approx(1.0, abs=0.05)
    assert row["downlinks"]["stretch_p90"] == pytest.approx(1.0, abs=0.05)
    assert 0 < row["downlinks"]["rate_while_busy"] <= 1.0
    assert 0 < row["uplinks"]["busy"] < 1.0


def test_the_summary_sets_the_simulated_broadcast_beside_the_measured_one():
    rows = []
    for rnd in range(3):
        for mode in ("source", "p2p", "simulated"):
            for n in (1, 2):
                row = {"round": rnd, "mode": mode, "n": n, "held_seconds": (4.0 + rnd) * n}
                if mode != "simulated":
                    row.update(seconds=4.1 * n, held_cpu_share=0.1)
                if n == 2 and mode != "source":
                    row["downlinks"] = {"stretch": 1.0 if mode == "simulated" else 1.5 + rnd}
                rows.append(row)
        rows.append({"round": rnd, "mode": "single", "mbit_per_s": 22.9, "of_link": 0.95})
    summary = {(e["metric"], e["mode"]): e for e in hosts.summarise(rows, [1, 2])}
    assert summary[("held_over_n1", "simulated")]["median"] == pytest.approx(2.0)
    assert summary[("downlinks_stretch", "simulated")]["median"] == 1.0
    assert summary[("downlinks_stretch", "p2p")]["median"] == 2.5
    assert ("seconds", "simulated") not in summary  # nothing is built in a simulation
