"""Reading, checking and sampling FEVER claims."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from dask_pcm.apps.fever import (
    LABELS,
    Claim,
    ClaimSet,
    demo_claims,
    load_claims,
    sample_claims,
    write_demo,
)
from dask_pcm.apps.fever.errors import FeverFormatError
from dask_pcm.exceptions import PCMError

FEVER_DEV = Path(__file__).parents[4] / "shared/data/fever/paper_dev.jsonl"


def line(id_: object = 1, label: object = "SUPPORTS", claim: object = "Snow is white.", **extra):
    return json.dumps({"id": id_, "label": label, "claim": claim, **extra})


def write(path: Path, *lines: str, newline: str = "\n", bom: bool = False) -> Path:
    text = newline.join(lines) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


GOOD = (
    line(1, "SUPPORTS", "Snow is white."),
    line(2, "REFUTES", "Snow is green."),
    line(3, "NOT ENOUGH INFO", "Snow fell on Elm Street in 1901."),
)


def test_loads_fever_lines_and_ignores_other_fields(tmp_path):
    path = write(tmp_path / "dev.jsonl", line(7, verifiable="VERIFIABLE", evidence=[[1, 2]]))
    claims = load_claims(path)
    assert claims.claims == [Claim(7, "Snow is white.", "SUPPORTS")]
    assert claims.path == str(path)
    assert claims.skipped == 0
    assert len(claims) == 1


@pytest.mark.parametrize(
    "newline, bom", [("\n", False), ("\r\n", False), ("\n", True), ("\r\n", True)]
)
def test_untidy_but_valid_files(tmp_path, newline, bom):
    lines = ["", "   ", GOOD[0], "\t", GOOD[1], "", GOOD[2], "  "]
    claims = load_claims(write(tmp_path / "dev.jsonl", *lines, newline=newline, bom=bom))
    assert [c.id for c in claims] == [1, 2, 3]
    assert claims.label_counts() == dict.fromkeys(LABELS, 1)


def test_bom_on_a_file_starting_with_a_claim(tmp_path):
    claims = load_claims(write(tmp_path / "dev.jsonl", *GOOD, bom=True))
    assert claims.claims[0] == Claim(1, "Snow is white.", "SUPPORTS")


def test_non_ascii_text_and_string_ids(tmp_path):
    text = "Zoë Kravitz starred in a film shot in Łódź — 東京 too."
    path = tmp_path / "dev.jsonl"
    path.write_text(
        json.dumps({"id": "a-1", "label": "REFUTES", "claim": text}, ensure_ascii=False)
        + "\n"
        + line(1)
        + "\n",
        encoding="utf-8",
    )
    claims = load_claims(path)
    assert claims.claims[0] == Claim("a-1", text, "REFUTES")
    assert claims.claims[1].id == 1


def test_missing_final_newline(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_text("\n".join(GOOD), encoding="utf-8")
    assert len(load_claims(path)) == 3


MALFORMED = [
    ("{not json", r"invalid JSON"),
    ("[1, 2, 3]", r"expected a JSON object, got list"),
    ('"a string"', r"expected a JSON object, got str"),
    (json.dumps({"id": 9, "claim": "x"}), r"missing field\(s\) 'label'"),
    (json.dumps({"label": "SUPPORTS", "claim": "x"}), r"missing field\(s\) 'id'"),
    (json.dumps({"id": 9, "label": "SUPPORTS"}), r"missing field\(s\) 'claim'"),
    (line(9, label="MAYBE"), r"unknown label 'MAYBE'; expected one of 'SUPPORTS', 'REFUTES', "),
    (line(9, label="supports"), r"unknown label 'supports'"),
    (line(9, claim=""), r"empty claim"),
    (line(9, claim="   \t"), r"empty claim"),
    (line(9, claim=42), r"claim must be a string, not int"),
    (line(9, claim=None), r"claim must be a string, not NoneType"),
    (line(None), r"id must be an integer or a string"),
    (line(True), r"id must be an integer or a string"),
    (line(1), r"duplicate id 1 \(first seen on line 1\)"),
    # json.dumps writes the JSON escape "\ud800": a lone surrogate, which UTF-8 cannot encode.
    (
        line(9, claim="abc \ud800 def"),
        r"claim is not valid Unicode \(lone surrogate \\ud800 at char",
    ),
    (line("a-\udc80"), r"id is not valid Unicode \(lone surrogate \\udc80 at character 3\)"),
]


@pytest.mark.parametrize("bad, message", MALFORMED)
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = write(tmp_path / "paper_dev.jsonl", GOOD[0], "", bad, GOOD[1])
    with pytest.raises(FeverFormatError, match=rf"^{re.escape(str(path))}:3: {message}"):
        load_claims(path)


def test_message_uses_the_path_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "paper_dev.jsonl", GOOD[0], GOOD[1], "{oops")
    with pytest.raises(FeverFormatError, match=r"^paper_dev.jsonl:3: invalid JSON"):
        load_claims("paper_dev.jsonl")


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_bytes(GOOD[0].encode() + b"\n" + b'{"id": 2, "claim": "\xff"}\n')
    with pytest.raises(FeverFormatError, match=r"dev.jsonl:2: not valid UTF-8"):
        load_claims(path)


def test_a_lone_surrogate_is_a_malformed_line_and_skipped(tmp_path):
    """It used to load, and fail late in the run ('utf-8' codec can't encode) with no line."""
    path = tmp_path / "dev.jsonl"
    path.write_bytes(
        b'{"id": 1, "label": "SUPPORTS", "claim": "abc \\ud800 def"}\n'
        b'{"id": 2, "label": "REFUTES", "claim": "a pair \\ud83d\\ude00 is fine"}\n'
    )
    with pytest.raises(FeverFormatError, match=r"dev.jsonl:1: claim is not valid Unicode"):
        load_claims(path)
    claims = load_claims(path, errors="skip")
    assert claims.skipped == 1
    assert claims.claims == [Claim(2, "a pair \U0001f600 is fine", "REFUTES")]


def test_a_lone_surrogate_in_a_template_file_names_the_file_and_template(tmp_path):
    """The template loader shares the check: such a template used to load, then fail late."""
    from dask_pcm.apps.fever.prompts import read_templates

    path = tmp_path / "mine.json"
    path.write_text('[{"name": "ok", "text": "{claim}"}, {"name": "x", "text": "\\udc80 {claim}"}]')
    with pytest.raises(FeverFormatError, match=r"mine.json: template 2: text is not valid Unicode"):
        read_templates(path)


def test_fever_format_error_is_a_value_error():
    assert issubclass(FeverFormatError, PCMError)
    assert issubclass(FeverFormatError, ValueError)


@pytest.mark.parametrize("content", ["", "\n\n  \n", "\ufeff", "\ufeff\r\n\r\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content.encode("utf-8"))
    with pytest.raises(FeverFormatError, match=rf"^{re.escape(str(path))}: no claims"):
        load_claims(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(FeverFormatError, match=re.escape(str(path))):
        load_claims(path)


def test_skip_mode_counts_and_warns(tmp_path, caplog):
    path = write(
        tmp_path / "dev.jsonl",
        GOOD[0],
        "{bad",
        line(5, label="MAYBE"),
        GOOD[1],
        line(1, claim="again"),
        line(6, claim=""),
        GOOD[2],
    )
    with caplog.at_level(logging.WARNING, logger="dask_pcm.apps.fever.data"):
        claims = load_claims(path, errors="skip")
    assert [c.id for c in claims] == [1, 2, 3]
    assert claims.skipped == 4
    [record] = caplog.records
    message = record.getMessage()
    assert "Skipped 4 malformed line(s)" in message
    assert "dev.jsonl:2: invalid JSON" in message
    assert "dev.jsonl:3: unknown label" in message
    assert "(and 1 more)" in message


def test_skip_mode_with_nothing_left_is_an_error(tmp_path):
    path = write(tmp_path / "dev.jsonl", "{bad", "[]")
    with pytest.raises(FeverFormatError, match=r"no claims left after skipping 2"):
        load_claims(path, errors="skip")


def test_skip_mode_on_a_clean_file_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        claims = load_claims(write(tmp_path / "dev.jsonl", *GOOD), errors="skip")
    assert claims.skipped == 0
    assert not caplog.records


def test_bad_arguments(tmp_path):
    path = write(tmp_path / "dev.jsonl", *GOOD)
    with pytest.raises(ValueError, match="errors must be 'raise' or 'skip'"):
        load_claims(path, errors="ignore")  # type: ignore[arg-type]
    for limit in (0, -3):
        with pytest.raises(ValueError, match="limit must be a positive"):
            load_claims(path, limit=limit)


def make_set(counts: dict[str, int]) -> ClaimSet:
    claims = []
    for label, n in counts.items():
        claims += [Claim(f"{label}-{i}", f"claim {label} {i}", label) for i in range(n)]
    # Interleave the labels, as real files do, so that file order is worth checking.
    claims.sort(key=lambda c: (int(str(c.id).rsplit("-", 1)[1]), c.label))
    return ClaimSet(claims, "made.jsonl", 0)


@pytest.mark.parametrize(
    "counts, limit, expected",
    [
        ({"SUPPORTS": 10, "REFUTES": 10, "NOT ENOUGH INFO": 10}, 6, (2, 2, 2)),
        ({"SUPPORTS": 10, "REFUTES": 10, "NOT ENOUGH INFO": 10}, 7, (3, 2, 2)),
        ({"SUPPORTS": 10, "REFUTES": 10, "NOT ENOUGH INFO": 10}, 8, (3, 3, 2)),
        ({"SUPPORTS": 60, "REFUTES": 30, "NOT ENOUGH INFO": 10}, 10, (6, 3, 1)),
        ({"SUPPORTS": 50, "REFUTES": 30, "NOT ENOUGH INFO": 20}, 9, (4, 3, 2)),
        ({"SUPPORTS": 97, "REFUTES": 2, "NOT ENOUGH INFO": 1}, 5, (3, 1, 1)),
        ({"SUPPORTS": 97, "REFUTES": 2, "NOT ENOUGH INFO": 1}, 2, (2, 0, 0)),
        ({"SUPPORTS": 20, "REFUTES": 0, "NOT ENOUGH INFO": 5}, 5, (4, 0, 1)),
    ],
)
def test_stratified_sample_sizes(counts, limit, expected):
    sample = sample_claims(make_set(counts), limit, seed=0)
    assert len(sample) == limit
    assert tuple(sample.label_counts().values()) == expected


def test_sample_is_deterministic_in_file_order_and_seeded():
    claims = make_set({"SUPPORTS": 40, "REFUTES": 40, "NOT ENOUGH INFO": 40})
    first = sample_claims(claims, 12, seed=1)
    assert first == sample_claims(claims, 12, seed=1)
    positions = [claims.claims.index(c) for c in first]
    assert positions == sorted(positions)
    assert len({c.id for c in first}) == 12
    others = [sample_claims(claims, 12, seed=s).claims for s in range(2, 6)]
    assert any(other != first.claims for other in others)


def test_limit_through_load_claims(tmp_path):
    path = write_demo(tmp_path / "demo.jsonl")
    sample = load_claims(path, limit=9, seed=3)
    assert sample.label_counts() == dict.fromkeys(LABELS, 3)
    assert sample == load_claims(path, limit=9, seed=3)
    assert load_claims(path, limit=30).claims == demo_claims().claims
    assert load_claims(path, limit=1000).claims == demo_claims().claims


def test_demo_claims():
    claims = demo_claims()
    assert len(claims) == 30
    assert [c.id for c in claims] == list(range(1, 31))
    assert claims.label_counts() == dict.fromkeys(LABELS, 10)
    assert len({c.claim for c in claims}) == 30
    assert claims.path is None


def test_demo_round_trips_through_a_file(tmp_path):
    path = write_demo(tmp_path / "demo.jsonl")
    loaded = load_claims(path)
    assert loaded.claims == demo_claims().claims
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"id", "verifiable", "label", "claim", "evidence"}


def test_to_frame():
    frame = demo_claims().to_frame()
    assert list(frame.columns) == ["id", "claim", "label"]
    assert len(frame) == 30
    assert frame["label"].value_counts().to_dict() == dict.fromkeys(LABELS, 10)
    assert list(ClaimSet([], None, 0).to_frame().columns) == ["id", "claim", "label"]


@pytest.mark.skipif(
    not FEVER_DEV.exists(),
    reason="the FEVER dev set is not beside this checkout (../shared/data/fever/paper_dev.jsonl); the package must not bundle it",
)
def test_real_fever_dev_set():
    claims = load_claims(FEVER_DEV)
    assert len(claims) == 9999
    assert claims.skipped == 0
    assert claims.label_counts() == dict.fromkeys(LABELS, 3333)
    sample = load_claims(FEVER_DEV, limit=300, seed=0)
    assert sample.label_counts() == dict.fromkeys(LABELS, 100)
