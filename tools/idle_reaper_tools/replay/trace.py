"""Reading a trace: a CSV (or gzip) file streamed into per-machine series on the sweep's bucket grid.

Samples are bucketed to the sweep period, keeping the Maximum per bucket (what the sweep reads from
CloudWatch); a bucket with no sample is a hole (NaN), never a value. Every row is validated as it streams
past: a bad row raises TraceError naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import gzip
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TextIO

NAN = math.nan
REQUIRED_COLUMNS = ("timestamp", "instance_id", "cpu")
OPTIONAL_COLUMNS = ("gpu", "team", "instance_type", "network", "user", "owner", "kind")
# `kind`: what the machine is. "ec2" (the default) or "notebook", a SageMaker notebook instance (stopped with
# StopNotebookInstance; priced at its ml.* type's SageMaker price).
KINDS = ("ec2", "notebook")
# `user`: minutes since the last human input at that sample (the on-machine collector's
# idle_reaper_minutes_since_input); USER_NONE means "no human input seen".
USER_NONE = 10080.0
DEFAULT_TEAM = "default"


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, the line and the column."""

    def __init__(self, source: str, line: int | None, message: str, column: str | None = None) -> None:
        self.source = source
        self.line = line
        self.column = column
        where = f"{source}:{line}" if line is not None else source
        what = f" column {column!r}:" if column else ""
        super().__init__(f"{where}:{what} {message}")


@dataclass
class Series:
    """One machine's samples on the bucket grid: bucket i starts at (first_bucket + i) * period."""

    instance_id: str
    team: str
    instance_type: str
    first_bucket: int
    cpu: array[float]  # Maximum per bucket; NaN where the trace has no sample
    gpu: array[float]
    network: array[float]  # bytes per second, in + out
    # Minimum per bucket of the minutes since the last human input (CloudWatch's Minimum); NaN: unknown.
    # Empty when the trace has no `user` column.
    user: array[float] = field(default_factory=lambda: array("d"))
    owner: str = ""  # the `owner` column; "" when the trace gives none
    kind: str = "ec2"  # the `kind` column (KINDS)

    def user_at(self, i: int) -> float:
        return self.user[i] if self.user else NAN

    def __len__(self) -> int:
        return len(self.cpu)

    @property
    def has_gpu(self) -> bool:
        return any(v == v for v in self.gpu)


@dataclass
class Trace:
    source: str
    period_seconds: int
    series: list[Series]
    has_network: bool = False
    clamped: int = 0  # values above 100 read as 100 (clamp_utilization)
    skipped_duplicates: int = 0  # rows repeating the previous one of their instance (skip_duplicates)

    @property
    def notes(self) -> list[str]:
        notes = []
        if self.clamped:
            notes.append(f"{self.clamped:,} values above 100 read as 100")
        if self.skipped_duplicates:
            notes.append(f"{self.skipped_duplicates:,} repeated rows skipped")
        return notes


class _Builder:
    """Accumulates one instance's rows while the file streams past (rows are sorted per instance)."""

    __slots__ = (
        "cpu",
        "first",
        "gpu",
        "instance_type",
        "kind",
        "last_bucket",
        "last_line",
        "last_row",
        "last_ts",
        "net",
        "owner",
        "team",
        "user",
    )

    def __init__(self, bucket: int) -> None:
        self.first = bucket
        self.last_bucket = bucket - 1
        self.last_ts = -math.inf
        self.last_line = 0
        self.last_row: list[str] = []
        self.team: tuple[str, int] | None = None
        self.instance_type: tuple[str, int] | None = None
        self.cpu: array[float] = array("d")
        self.gpu: array[float] = array("d")
        self.net: array[float] = array("d")
        self.user: array[float] = array("d")
        self.owner: tuple[str, int] | None = None
        self.kind: tuple[str, int] | None = None


def _timestamp(text: str, source: str, line: int) -> float:
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise TraceError(source, line, f"not an ISO-8601 time: {text!r}", "timestamp") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)  # a trace without offsets is read as UTC, like CloudWatch exports
    return value.timestamp()


class _Clamp:
    """Counts values read as 100 under clamp_utilization; None where clamping is off."""

    def __init__(self) -> None:
        self.count = 0


def _value(text: str, column: str, high: float, source: str, line: int, clamp: _Clamp | None = None) -> float:
    """A metric cell; empty means no datapoint for this metric in this sample."""
    if not text or text.isspace():
        return NAN
    try:
        v = float(text)
    except ValueError:
        raise TraceError(source, line, f"not a number: {text!r}", column) from None
    if not 0.0 <= v <= high:  # also rejects nan
        if clamp is not None and v > high and v != math.inf:
            clamp.count += 1
            return high
        if high == 100.0:
            hint = "" if v < 0 or v != v else " (--clamp-utilization reads values above 100 as 100)"
            raise TraceError(source, line, f"{text.strip()!r} is outside 0-100{hint}", column)
        if high == USER_NONE:
            raise TraceError(source, line, f"{text.strip()!r} is not minutes from 0 to {USER_NONE:.0f}", column)
        raise TraceError(source, line, f"{text.strip()!r} is not a rate of 0 or more bytes per second", column)
    return v


def _label(
    builder: _Builder,
    slot: Literal["team", "instance_type", "owner", "kind"],
    value: str,
    iid: str,
    source: str,
    line: int,
) -> None:
    """Team and instance type may be given on any row, but must not change within an instance."""
    known: tuple[str, int] | None = getattr(builder, slot)
    if known is None:
        setattr(builder, slot, (value, line))
    elif known[0] != value:
        raise TraceError(source, line, f"{iid} was {known[0]!r} at line {known[1]}, now {value!r}", slot)


def parse_trace(
    lines: Iterable[str],
    source: str,
    period_seconds: int = 300,
    *,
    clamp_utilization: bool = False,
    skip_duplicates: bool = False,
) -> Trace:
    """Stream a CSV trace into per-machine bucket series. Raises TraceError naming the line.

    Two opt-in allowances for real exports, both off by default (then such rows are errors):
    clamp_utilization reads CPU and GPU values above 100 as 100 (Bitbrains measures against provisioned
    capacity and overshoots a little); skip_duplicates drops a row identical to the previous row of its
    instance (a repeated export line). A duplicate timestamp with different values is always an error."""
    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(source, 1, "empty file: expected a header with timestamp, instance_id, cpu") from None
    except csv.Error as exc:
        raise TraceError(source, 1, f"not CSV: {exc}") from None
    names = [h.strip().lower() for h in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TraceError(
            source,
            1,
            f"missing column(s) {', '.join(missing)}; the header has: {', '.join(names) or '(nothing)'} "
            f"(required: {', '.join(REQUIRED_COLUMNS)}; optional: {', '.join(OPTIONAL_COLUMNS)})",
        )
    repeated = sorted({n for n in names if n and names.count(n) > 1})
    if repeated:
        raise TraceError(source, 1, f"repeated column(s) {', '.join(repeated)}")
    col = {n: i for i, n in enumerate(names)}
    i_ts, i_id, i_cpu = col["timestamp"], col["instance_id"], col["cpu"]
    i_gpu, i_net = col.get("gpu"), col.get("network")
    i_team, i_type = col.get("team"), col.get("instance_type")
    i_user, i_owner, i_kind = col.get("user"), col.get("owner"), col.get("kind")
    width = len(names)

    ts_cache: dict[str, float] = {}  # a fleet's rows share their timestamps: parse each once
    builders: dict[str, _Builder] = {}
    clamp = _Clamp() if clamp_utilization else None
    skipped = 0
    line = 1
    try:
        for row in reader:
            line = reader.line_num
            if len(row) != width:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue  # a blank line
                raise TraceError(source, line, f"expected {width} fields like the header, got {len(row)}")
            ts_text = row[i_ts]
            ts = ts_cache.get(ts_text)
            if ts is None:
                if len(ts_cache) > 100_000:
                    ts_cache.clear()
                ts = ts_cache[ts_text] = _timestamp(ts_text, source, line)
            iid = row[i_id].strip()
            if not iid:
                raise TraceError(source, line, "empty", "instance_id")
            bucket = int(ts // period_seconds)
            b = builders.get(iid)
            if b is None:
                b = builders[iid] = _Builder(bucket)
            elif ts <= b.last_ts:
                if ts == b.last_ts:
                    if skip_duplicates and row == b.last_row:
                        skipped += 1
                        continue
                    hint = "" if row != b.last_row else " (--skip-duplicates drops identical repeats)"
                    raise TraceError(
                        source, line, f"duplicate sample for {iid} at {ts_text} (also at line {b.last_line}){hint}"
                    )
                raise TraceError(
                    source,
                    line,
                    f"rows are not sorted by time for {iid}: {ts_text} comes after line {b.last_line}, which is later",
                )
            b.last_ts, b.last_line, b.last_row = ts, line, row
            cpu = _value(row[i_cpu], "cpu", 100.0, source, line, clamp)
            gpu = NAN if i_gpu is None else _value(row[i_gpu], "gpu", 100.0, source, line, clamp)
            net = NAN if i_net is None else _value(row[i_net], "network", math.inf, source, line)
            user = NAN if i_user is None else _value(row[i_user], "user", USER_NONE, source, line)
            if i_owner is not None and (owner := row[i_owner].strip()):
                _label(b, "owner", owner, iid, source, line)
            if i_kind is not None and (kind := row[i_kind].strip().lower()):
                if kind not in KINDS:
                    raise TraceError(source, line, f"{kind!r} is not one of {', '.join(KINDS)}", "kind")
                _label(b, "kind", kind, iid, source, line)
            if i_team is not None and (team := row[i_team].strip()):
                _label(b, "team", team, iid, source, line)
            if i_type is not None and (itype := row[i_type].strip()):
                _label(b, "instance_type", itype, iid, source, line)

            if bucket == b.last_bucket:  # several samples in one period: keep the Maximum
                if cpu > b.cpu[-1] or b.cpu[-1] != b.cpu[-1]:
                    b.cpu[-1] = cpu
                if gpu > b.gpu[-1] or b.gpu[-1] != b.gpu[-1]:
                    b.gpu[-1] = gpu
                if net > b.net[-1] or b.net[-1] != b.net[-1]:
                    b.net[-1] = net
                if user < b.user[-1] or b.user[-1] != b.user[-1]:  # the Minimum: the latest input
                    b.user[-1] = user
                continue
            hole = bucket - b.last_bucket - 1
            if hole:  # a gap stays a gap: NaN, never a value
                padding = [NAN] * hole
                b.cpu.extend(padding)
                b.gpu.extend(padding)
                b.net.extend(padding)
                b.user.extend(padding)
            b.cpu.append(cpu)
            b.gpu.append(gpu)
            b.net.append(net)
            b.user.append(user)
            b.last_bucket = bucket
    except csv.Error as exc:
        raise TraceError(source, line, f"not valid CSV: {exc}") from None
    if not builders:
        raise TraceError(source, None, "no samples after the header")
    series = [
        Series(
            instance_id=iid,
            team=b.team[0] if b.team else DEFAULT_TEAM,
            instance_type=b.instance_type[0] if b.instance_type else "",
            first_bucket=b.first,
            cpu=b.cpu,
            gpu=b.gpu,
            network=b.net,
            user=b.user if i_user is not None else array("d"),
            owner=b.owner[0] if b.owner else "",
            kind=b.kind[0] if b.kind else "ec2",
        )
        for iid, b in builders.items()
    ]
    return Trace(
        source=source,
        period_seconds=period_seconds,
        series=series,
        has_network=i_net is not None,
        clamped=clamp.count if clamp else 0,
        skipped_duplicates=skipped,
    )


def read_trace(
    path: str | Path, period_minutes: int = 5, *, clamp_utilization: bool = False, skip_duplicates: bool = False
) -> Trace:
    """A .csv or gzip-compressed .csv(.gz) trace file (detected by content, not by name)."""
    source = str(path)
    try:
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        stream: TextIO = (
            gzip.open(path, "rt", encoding="utf-8-sig", newline="")  # noqa: SIM115 (closed by the with below)
            if gzipped
            else open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115
        )
    except OSError as exc:
        raise TraceError(source, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        with stream:
            return parse_trace(
                stream,
                source,
                period_minutes * 60,
                clamp_utilization=clamp_utilization,
                skip_duplicates=skip_duplicates,
            )
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(source, None, f"cannot read: {exc}") from None
