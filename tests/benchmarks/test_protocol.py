"""The benchmarks' timing protocol (benchmarks/_protocol.py): rounds in random order, the
intervals its figures are quoted with, and the stamp on every JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _protocol as P


def test_every_round_runs_every_variant_once_in_a_seeded_order():
    names = ["ideal", "agnostic", "partial", "full"]
    order = P.schedule(names, 3, seed=7)
    assert len(order) == 12
    for r in range(3):
        assert sorted(v for rnd, v in order if rnd == r) == sorted(names)
    assert order == P.schedule(names, 3, seed=7)  # the same seed, the same schedule
    rounds = [[v for rnd, v in order if rnd == r] for r in range(3)]
    many = [P.schedule(names, 1, seed=s) for s in range(20)]
    assert len({tuple(v for _, v in o) for o in many}) > 1  # orders do change
    assert rounds[0] == [v for _, v in P.schedule(names, 1, seed=7)]
    with pytest.raises(ValueError, match="repeat"):
        P.schedule(["full", "full"], 1)


def test_the_interval_is_a_t_interval_on_a_log_scale():
    values = [10.0, 12.0, 11.0]
    got = P.interval(values)
    logs = [math.log(v) for v in values]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert got["runs"] == 3 and got["median"] == 11.0
    assert got["low"] == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)))
    assert got["high"] == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)))
    one = P.interval([2.5])
    assert one["low"] == one["high"] == one["median"] == 2.5 and P.clears(one) is None
    with pytest.raises(ValueError, match="positive"):
        P.interval([1.0, 0.0])


def test_ratios_pair_by_round_and_say_whether_they_clear_the_noise():
    # A slow second round hits both variants: per-round ratios cancel it.
    full, agnostic = [10.0, 20.0, 11.0], [30.0, 61.0, 32.0]
    ratio = P.ratio_interval(agnostic, full)
    assert ratio["median"] == pytest.approx(3.0, rel=0.05)
    assert P.clears(ratio) is True
    assert P.clears(P.ratio_interval([10.0, 12.0, 9.0], [11.0, 10.0, 10.0])) is False
    with pytest.raises(ValueError, match="pair them"):
        P.ratio_interval([1.0], [1.0, 2.0])
    rows = [
        {"round": 1, "level": "full", "s": 20.0},
        {"round": 0, "level": "full", "s": 10.0},
        {"round": 0, "level": "agnostic", "s": 30.0},
        {"round": 1, "level": "agnostic", "s": 61.0},
    ]
    assert P.by_variant(rows, "level", "s") == {"full": [10.0, 20.0], "agnostic": [30.0, 61.0]}


def test_the_json_carries_what_the_figures_were_measured_on(tmp_path):
    path = tmp_path / "levels.json"
    P.write_json(path, [{"level": "full", "round": 0}], reps=3, summary=[], seed=5)
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    assert len(meta["commit"]) == 40 and isinstance(meta["dirty"], bool)
    assert meta["cores"] >= 1 and meta["cpu"]
    assert len(meta["load_average_before"]) == 3
    assert {"python", "dask", "distributed", "torch", "transformers"} <= set(meta["versions"])
    assert meta["repetitions"] == 3 and meta["seed"] == 5 and meta["date"].endswith("Z")
    assert doc["rows"] == [{"level": "full", "round": 0}] and doc["summary"] == []


def test_the_json_says_which_claims_were_scored(tmp_path, monkeypatch, capsys):
    import _harness as h

    lines = [
        {"id": i, "claim": f"Claim {i}.", "label": "SUPPORTS", "evidence": []} for i in range(4)
    ]
    data = tmp_path / "dev.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len(h.load_claims(data, 3)) == 3
    recorded = P.meta(1)["data"]
    assert recorded["source"] == "dev.jsonl" and recorded["claims"] == 3
    assert recorded["sha256"] == h.file_sha256(data) and len(recorded["sha256"]) == 64
    # Without the dev set beside the checkout, the demo claims: said, and recorded.
    monkeypatch.setattr(h, "DEFAULT_DATA", tmp_path / "missing.jsonl")
    assert len(h.load_claims(None, 5)) == 5
    assert P.meta(1)["data"] == {"source": "built-in demo claims", "claims": 5}
    assert "built-in demo claims" in capsys.readouterr().out


def test_repetitions_default_to_three_and_one_when_quick():
    assert P.repetitions(False) == 3 and P.repetitions(True) == 1
    assert P.repetitions(True, 2) == 2
    with pytest.raises(ValueError, match="1 or more"):
        P.repetitions(False, 0)


def test_peers_flags_only_a_variant_that_beats_the_ideal_on_the_same_work():
    import peers

    seconds = {"ideal": [10.0, 11.0, 10.5], "dask_pcm": [8.0, 8.5, 8.2],
               "dask_pcm-prefix": [4.0, 4.2, 4.1]}  # fmt: skip
    rows = [
        {"round": r, "variant": v, "seconds": s[r], "end_to_end_seconds": s[r] + 5}
        for v, s in seconds.items()
        for r in range(3)
    ]
    flags = {
        s["variant"]: s["measurement_error"]
        for s in peers.summarise(rows, list(seconds))
        if s["metric"] == "efficiency"
    }
    # dask_pcm running the same passes faster than bare processes is an error of measurement;
    # prefix reuse runs fewer tokens, so beating the ideal is its point.
    assert flags == {"dask_pcm": True, "dask_pcm-prefix": False}


def test_first_answer_summary_keeps_a_figure_that_was_zero_in_some_run():
    # The quick smoke run on a warm cache copies nothing: the copy figure is 0 s there.
    import first_answer

    nan = float("nan")
    rows = []
    for copy in (0.0, 0.4):
        row = dict.fromkeys(first_answer.FIGURES, nan)
        row.update(variant="batch", copy_seconds=copy, seconds=5.0 + copy)
        rows.append(row)
    out = {r["figure"]: r for r in first_answer.summary(rows) if r["variant"] == "batch"}
    assert out["copy_seconds"]["min"] == 0.0 and out["copy_seconds"]["median"] == 0.2
    assert "low" not in out["copy_seconds"]  # no log interval through a zero
    assert out["seconds"]["low"] < 5.2 < out["seconds"]["high"]
