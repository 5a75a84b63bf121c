"""Reading a trace: bucketing, gzip, the opt-in allowances, and every kind of bad input (a clear error
naming the line and the column, exit 2, nothing on stdout)."""

from __future__ import annotations

import gzip
import io
import math
from pathlib import Path

import pytest
from replay_support import DATA, SAMPLE, T0, trace

from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import TraceError, parse_trace, read_trace
from testkit.generate_trace import generate


def test_samples_in_one_period_are_bucketed_to_their_maximum() -> None:
    # Off-grid samples at 00:01 (3 %) and 00:04 (7 %) fall in the 00:00 bucket: its Maximum, 7 %, is busy.
    t = trace(["2026-01-05T00:01:00Z,i-1,3", "2026-01-05T00:04:00Z,i-1,7", "2026-01-05T00:11:00Z,i-1,1"])
    [s] = t.series
    assert list(s.cpu) == [7.0, pytest.approx(float("nan"), nan_ok=True), 1.0]


def test_a_longer_period_takes_each_metrics_maximum_and_a_gap_stays_a_gap() -> None:
    # 10-minute buckets: 00:00 and 00:05 share one; nothing from 00:10 to 00:29; an empty gpu cell is
    # no GPU datapoint (NaN), not 0. Without a network column the network track is all NaN.
    text = (
        "Instance_ID,CPU,timestamp,gpu,team\n"  # any order, any case
        "i-1,3,2026-01-05T00:00:00Z,80,ml\n"
        "i-1,9,2026-01-05T00:05:00Z,,\n"
        "i-1,1,2026-01-05T00:30:00Z,0,\n"
    )
    t = parse_trace(io.StringIO(text), "t.csv", period_seconds=600)
    [s] = t.series
    nan = pytest.approx(math.nan, nan_ok=True)
    assert (list(s.cpu), list(s.gpu)) == ([9.0, nan, nan, 1.0], [80.0, nan, nan, 0.0])
    assert all(v != v for v in s.network) and not t.has_network
    assert (s.team, s.instance_type, s.first_bucket) == ("ml", "", int(T0.timestamp()) // 600)


def test_rows_of_different_instances_may_interleave_in_any_order() -> None:
    t = trace(["2026-01-05T00:05:00Z,i-1,1", "2026-01-05T00:00:00Z,i-2,1", "2026-01-05T00:10:00Z,i-1,1"])
    assert [len(s) for s in t.series] == [2, 1]


def test_gzip_is_detected_by_content_not_by_name(tmp_path: Path) -> None:
    plain = DATA / "replay-gpu-training.csv"
    packed = tmp_path / "trace.csv"  # gzip behind a plain name
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    unpacked = tmp_path / "trace.csv.gz"  # plain text behind a gzip name
    unpacked.write_bytes(plain.read_bytes())
    expected = read_trace(plain)
    for path in (packed, unpacked):
        [s] = read_trace(path).series
        [e] = expected.series
        assert (list(s.cpu), list(s.gpu), s.team, s.instance_type) == (
            list(e.cpu),
            list(e.gpu),
            e.team,
            e.instance_type,
        )
    assert (len(e), e.team, e.instance_type) == (48, "training", "g5.xlarge")


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the line (and the column), exit 2, nothing on stdout

HEADER = "timestamp,instance_id,cpu,gpu,network"
GOOD = "2026-01-05T00:00:00Z,i-1,1,2,300"


@pytest.mark.parametrize(
    ("rows", "line", "column", "words"),
    [
        (["timestamp,instance_id,gpu", "2026-01-05T00:00:00Z,i-1,2"], 1, None, "missing column(s) cpu"),
        ([HEADER, GOOD, "2026-01-05T00:05:00,i-1,1,2,3", "5 Jan 2026,i-1,1,2,3"], 4, "timestamp", "ISO-8601"),
        ([HEADER, GOOD, "2026-01-05T00:10:00Z,i-1,1,2,3", "2026-01-05T00:05:00Z,i-1,1,2,3"], 4, None, "not sorted"),
        ([HEADER, GOOD, "2026-01-05T00:00:00Z,i-1,3,2,300"], 3, None, "duplicate sample for i-1"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,100.5,2,3"], 3, "cpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,-1,3"], 3, "gpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,2,-3"], 3, "network", "0 or more"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,busy,2,3"], 3, "cpu", "not a number"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,nan,2,3"], 3, "cpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,2"], 3, None, "expected 5 fields"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,,1,2,3"], 3, "instance_id", "empty"),
        (
            ["timestamp,instance_id,cpu,team", "2026-01-05T00:00:00Z,i-1,1,ml", "2026-01-05T00:05:00Z,i-1,1,data"],
            3,
            "team",
            "was 'ml' at line 2",
        ),
    ],
)
def test_bad_input_names_the_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rows: list[str],
    line: int,
    column: str | None,
    words: str,
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:{line}:" in err
    assert words in err
    if column:
        assert f"column {column!r}" in err


@pytest.mark.parametrize(
    ("header", "words"),
    [
        ("timestamp,instance_id,cpu,cpu", "repeated column(s) cpu"),
        ("time,instance_id,cpu", "the header has: time, instance_id, cpu"),
    ],
)
def test_a_bad_header_is_line_1(header: str, words: str) -> None:
    with pytest.raises(TraceError, match=r"^t\.csv:1: ") as caught:
        parse_trace(io.StringIO(header + "\n2026-01-05T00:00:00Z,i-1,1,1\n"), "t.csv")
    assert words in str(caught.value) and caught.value.line == 1


@pytest.mark.parametrize("content", [b"", b"timestamp,instance_id,cpu\n"])
def test_empty_trace_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    path = tmp_path / "empty.csv"
    path.write_bytes(content)
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(path) in err


def test_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope.csv")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot read" in err


def test_a_truncated_gzip_is_an_error_not_a_short_trace(tmp_path: Path) -> None:
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(gzip.compress((DATA / "replay-gpu-training.csv").read_bytes())[:-12])
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(path)


def test_real_export_quirks_are_opt_in() -> None:
    # Bitbrains-style: a value just over 100 and a repeated row. Errors by default, with a hint.
    rows = ["2026-01-05T00:00:00Z,i-1,104.2", "2026-01-05T00:00:00Z,i-1,104.2", "2026-01-05T00:05:00Z,i-1,1"]
    text = "timestamp,instance_id,cpu\n" + "\n".join(rows) + "\n"
    with pytest.raises(TraceError, match="--clamp-utilization"):
        parse_trace(io.StringIO(text), "t.csv")
    with pytest.raises(TraceError, match=r"t.csv:3: .*--skip-duplicates"):
        parse_trace(io.StringIO(text), "t.csv", clamp_utilization=True)
    t = parse_trace(io.StringIO(text), "t.csv", clamp_utilization=True, skip_duplicates=True)
    assert (t.clamped, t.skipped_duplicates, list(t.series[0].cpu)) == (1, 1, [100.0, 1.0])
    assert t.notes == ["1 values above 100 read as 100", "1 repeated rows skipped"]
    conflicting = text.replace("104.2\n2026-01-05T00:00:00Z,i-1,104.2", "104.2\n2026-01-05T00:00:00Z,i-1,3")
    with pytest.raises(TraceError, match="duplicate"):
        parse_trace(io.StringIO(conflicting), "t.csv", clamp_utilization=True, skip_duplicates=True)


# ---------------------------------------------------------------------------------------------
# The generator and the shipped sample


def test_generator_is_seeded_and_the_sample_is_small(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv.gz", tmp_path / "b.csv.gz"
    assert generate(a, 6, 1, seed=5) == generate(b, 6, 1, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert SAMPLE.stat().st_size < 3_000_000
    with gzip.open(SAMPLE, "rt") as f:
        assert f.readline().strip() == "timestamp,instance_id,cpu,gpu,team,instance_type"
