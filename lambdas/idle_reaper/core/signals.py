"""Busy, idle or unknown: what a machine's datapoints say, and the human-activity signal.

Pure: no boto3, no Slack, no clock. Missing or partial data is "unknown", never "idle"."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from idle_reaper.core.endpoints import Variant, requests_per_period, track_label, words_for
from idle_reaper.core.kinds import InstanceFacts, family_of
from idle_reaper.core.records import machine_key
from idle_reaper.core.time_of_day import UsageMarks, epoch_day, epoch_hours
from idle_reaper.policy import TeamPolicy

Signal = Literal["busy", "idle", "unknown"]


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Machine:
    instance_id: str
    instance_type: str
    team: str
    launch_time: datetime
    name: str | None = None
    owner: str | None = None
    exempt_tag: str | None = None  # raw value of the exemption tag, if present
    asg_name: str | None = None
    asg_protected: bool = False
    hibernation_configured: bool = False
    facts: InstanceFacts = field(default_factory=InstanceFacts)  # what DescribeInstances says of its kind
    # Organization mode: the member account and region it runs in (None: the hub's own account).
    account: str | None = None
    region: str | None = None

    @property
    def key(self) -> str:
        """Its key in the state table and Slack references (records.machine_key)."""
        return machine_key(self.instance_id, self.account, self.region)

    @property
    def where(self) -> str:
        """ ", account A in R" for a member account's machine, for explanations; "" for the hub's."""
        return f", account {self.account} in {self.region}" if self.account else ""

    @property
    def family(self) -> str:
        return family_of(self.instance_type)

    @property
    def is_notebook(self) -> bool:
        """A SageMaker notebook instance (its id is its name), not an EC2 instance."""
        return self.facts.notebook_status is not None

    @property
    def is_endpoint(self) -> bool:
        """A SageMaker real-time endpoint (its id is endpoint:<name>; core/endpoints.py)."""
        return self.facts.endpoint is not None

    @property
    def is_studio_app(self) -> bool:
        """A SageMaker Studio app (its id is studio:<domain>:<space>:<type>:<name>; core/studio.py)."""
        return self.facts.studio is not None

    @property
    def deleted_by_stop(self) -> bool:
        """Its action is a deletion (an endpoint, a Studio app), and starting it again recreates it."""
        return self.is_endpoint or self.is_studio_app


Point = tuple[datetime, float]  # (period start, value)


@dataclass(frozen=True)
class Signals:
    """Datapoints fetched for one machine, sorted by time. `complete` is False when CloudWatch
    answered PartialData we could not finish, or a query errored: such a machine is unknown."""

    cpu: Sequence[Point] = ()
    gpu: Sequence[Point] = ()
    network_in: Sequence[Point] = ()
    network_out: Sequence[Point] = ()
    complete: bool = True
    # CWAgent idle_reaper_minutes_since_input (Minimum): minutes since a person's last input, 0-10080
    # (HUMAN_NONE = none seen). No points: the collector is not running, no information either way.
    user: Sequence[Point] = ()
    # A SageMaker endpoint's AWS/SageMaker Invocations (Sum per period), per variant: (variant name, points); and
    # the periods its instances reported (the heartbeat metric's SampleCount), per variant (core/endpoints.py).
    invocations: Sequence[tuple[str, Sequence[Point]]] = ()
    reported: Sequence[tuple[str, Sequence[Point]]] = ()


@dataclass(frozen=True)
class Assessment:
    signal: Signal
    reason: str
    quiet_since: datetime | None = None  # start of the covered, below-threshold run that ends now
    max_cpu: float | None = None
    max_gpu: float | None = None
    max_network: float | None = None  # bytes per second
    uses_gpu: bool = False
    # End of the newest activity or data hole in the fetched data (None: none seen). A warning given
    # before this belongs to an earlier quiet stretch and no longer counts.
    interrupted_at: datetime | None = None
    observed_until: datetime | None = None  # end of the newest datapoint every track has
    quiet_summary: str = ""  # what the quiet stretch looked like, for warnings ("why it counts as idle")
    # The human-activity signal: a person active within human_active_minutes, none, no usable data,
    # or "off" (the policy ignores it).
    human_signal: Literal["active", "quiet", "missing", "off"] = "off"
    human_last_input: datetime | None = None  # the newest person's input the collector reported
    # For the machine's usage profile (core/time_of_day.py): what the datapoints fetched say. Frozen: one
    # default serves all.
    usage: UsageMarks = UsageMarks()  # noqa: RUF009
    # A series the machine is judged on that has no datapoint at all in the fetched range (say, a GPU
    # machine without the agent): unknown until it reports, and no warning before it has reported quiet
    # for a warning point (core/reading.py reads such a machine less often).
    missing_series: bool = False

    @property
    def why_quiet(self) -> str:
        return self.quiet_summary or self.reason

    def quiet_minutes(self, now: datetime) -> float:
        """Observed quiet only: up to the end of the newest datapoint, never the unreported tail."""
        if self.quiet_since is None:
            return 0.0
        until = min(now, self.observed_until or now)
        return max(0.0, (until - self.quiet_since).total_seconds() / 60)


# ---------------------------------------------------------------------------------------------
# Signal assessment


@dataclass(frozen=True)
class _Track:
    label: str
    threshold: float
    points: Sequence[Point]
    unit: str = "%"


def _coverage(
    points: Sequence[Point], period: timedelta, max_gap: timedelta, now: datetime
) -> tuple[datetime, bool] | None:
    """Earliest time from which `points` cover [t, now] with no hole longer than max_gap, and whether
    that coverage starts after a real hole (True) or only where the fetched data begins (False).
    None when there are no points or the newest one is already too old (the data stopped)."""
    if not points:
        return None
    last_start = points[-1][0]
    if now - (last_start + period) > max_gap:
        return None
    since = last_start
    for (earlier, _), (later, _) in zip(reversed(points[:-1]), reversed(points[1:]), strict=True):
        if later - (earlier + period) > max_gap:
            return since, True
        since = earlier
    # Before the first point we know nothing; allow a leading hole of max_gap like any other.
    return since - max_gap, False


def _fmt(value: float, unit: str) -> str:
    if unit == "requests":
        return f"{value:,.0f} request{'' if value == 1 else 's'}"
    if unit == "B/s":
        return f"{value:,.0f} B/s"
    return f"{value:.1f}%"


def _below(label: str, value: float, threshold: float, unit: str) -> str:
    """'max CPU 4.96% < 5.0%': enough digits that a value just under the threshold never reads as equal; an
    endpoint's 'no invocations of variant AllTraffic' (below its threshold of one request means none)."""
    if unit == "requests":
        return f"no {label}"
    shown = _fmt(value, unit)
    if unit == "%" and shown == _fmt(threshold, unit):
        shown = f"{value:.3f}".rstrip("0") + "%"
    return f"max {label} {shown} < {_fmt(threshold, unit)}"


def _combine_network(inbound: Sequence[Point], outbound: Sequence[Point], period: timedelta) -> list[Point]:
    """NetworkIn + NetworkOut (Sum per period, bytes) as bytes per second; only periods with both."""
    out_by_time = dict(outbound)
    seconds = period.total_seconds()
    return [(t, (v + out_by_time[t]) / seconds) for t, v in inbound if t in out_by_time]


# Every EC2 family starting p<digit>, g<digit> or gr<digit> carries GPUs (p6-b200, g4ad, ...): a family
# AWS adds next year must count as a GPU machine before anyone updates a list.
_GPU_FAMILY = re.compile(r"^(p|g|gr)\d")


def is_gpu_type(instance_type: str, gpu_families: Iterable[str]) -> bool:
    family = family_of(instance_type)  # ml.p3.2xlarge (a SageMaker notebook) is a p3
    return family in set(gpu_families) or bool(_GPU_FAMILY.match(family))


# General purpose, compute, memory, storage and burstable families (m7i, c6gn, r8g, x2idn, z1d, i4i, d3en,
# t3, a1): none has an NVIDIA GPU, so none can publish nvidia-smi's metric. Accelerated families never
# match (inf2, trn1, dl1, f2, vt1: a letter after the first; g and p are not in the set).
_NO_GPU_FAMILY = re.compile(r"^(a|c|d|i|m|r|t|x|z)\d")


def has_no_gpu(instance_type: str, gpu_families: Iterable[str]) -> bool:
    """A type that certainly has no NVIDIA GPU: its GPU metric is not read (a query billed for a series that
    cannot exist). Anything unsure (a family the pattern does not know, or the settings' GPU families) is read."""
    family = family_of(instance_type)
    return bool(_NO_GPU_FAMILY.match(family)) and not is_gpu_type(instance_type, gpu_families)


HUMAN_NONE = 10080.0  # the collector's "no human input seen" (a week, in minutes)


def last_human_input(points: Sequence[Point], now: datetime) -> tuple[datetime | None, int]:
    """The latest human input the user track shows (datapoint time - minutes since input), and how many
    datapoints were garbage and ignored: negative, over HUMAN_NONE, NaN, or an input time in the future
    (a skewed clock). HUMAN_NONE means no input seen: a valid point that names no input.

    The sweep reads the collector's one-minute values as a Minimum over its period, timed at the period's
    end (aws/metrics.py, _human_point): the input it places is never earlier than the truth, at most a
    period later (timed at the period's start, a value sampled late in it would place the input up to a
    period early, making the machine look idle sooner)."""
    latest: datetime | None = None
    bad = 0
    for t, minutes in points:
        if not 0.0 <= minutes <= HUMAN_NONE:  # also NaN
            bad += 1
            continue
        if minutes == HUMAN_NONE:
            continue
        at = t - timedelta(minutes=minutes)
        if at > now or t > now:
            bad += 1
            continue
        latest = at if latest is None or at > latest else latest
    return latest, bad


def _tracks(
    machine: Machine,
    signals: Signals,
    policy: TeamPolicy,
    period: timedelta,
    gpu_families: Iterable[str],
    notes: list[str],
) -> list[_Track] | Assessment:
    """The series a machine is judged on (CPU, GPU, network; an endpoint's invocations of each variant), or at
    once "unknown" for a GPU machine without GPU metrics when the policy never treats such a machine as idle."""
    if machine.facts.endpoint is not None and machine.facts.endpoint.asynchronous:
        why = "an asynchronous endpoint: SageMaker publishes no Invocations for it, so whether it is used is unknown"
        return Assessment("unknown", why, missing_series=True)
    if machine.facts.endpoint is not None:
        return _endpoint_tracks(machine.facts.endpoint.variants, signals)
    tracks = [_Track("CPU", policy.cpu_threshold_percent, sorted(signals.cpu))]
    if signals.gpu:
        tracks.append(_Track("GPU", policy.gpu_threshold_percent, sorted(signals.gpu)))
    elif is_gpu_type(machine.instance_type, gpu_families):
        if policy.missing_gpu_metrics == "busy":
            return Assessment(
                "unknown",
                f"GPU instance {machine.instance_type} reports no GPU metrics; "
                "policy missing_gpu_metrics=busy never treats it as idle",
                uses_gpu=True,
                missing_series=True,
            )
        notes.append("no GPU metrics, judged on CPU alone (missing_gpu_metrics=cpu_only)")
    if policy.network_threshold_bytes_per_second is not None:
        network = sorted(_combine_network(signals.network_in, signals.network_out, period))
        tracks.append(_Track("network", policy.network_threshold_bytes_per_second, network, "B/s"))
    return tracks


def _endpoint_tracks(variants: Sequence[Variant], signals: Signals) -> list[_Track] | Assessment:
    """One track per variant the endpoint has, its requests each period it is known to have had them or none
    (core/endpoints.requests_per_period): a request is busy. A variant with no datapoint of either metric leaves the
    endpoint unknown; so does an endpoint with no variant."""
    if not variants:
        return Assessment("unknown", "the endpoint lists no production variant", missing_series=True)
    calls, reported = dict(signals.invocations), dict(signals.reported)
    tracks = []
    for v in variants:
        points = requests_per_period(calls.get(v.name, ()), reported.get(v.name, ()))
        if not points:
            why = (
                f"no metrics from variant {v.name}: SageMaker published neither its Invocations nor its instances' "
                "heartbeat in the window"
            )
            return Assessment("unknown", why, missing_series=True)
        tracks.append(_Track(track_label(v.name), 1.0, points, "requests"))
    return tracks


HumanSignal = Literal["active", "quiet", "missing", "off"]


def _human_activity(
    user: Sequence[Point],
    policy: TeamPolicy,
    now: datetime,
    period: timedelta,
    window_start: datetime,
    notes: list[str],
) -> tuple[HumanSignal, datetime | None, datetime | None]:
    """A person at the keyboard is active from their last input for human_active_minutes, like a busy
    bucket: (the signal, the last input, the end of the newest human activity)."""
    if not policy.human_active_minutes:
        return "off", None, None
    last_input, bad = last_human_input(user, now)
    if bad:
        notes.append(f"ignored {bad} unusable human-activity value{'s' if bad > 1 else ''}")
    if len(user) == bad:  # said on the Assessment (status shows it), not in every reason
        return "missing", None, None
    if last_input is None:
        return "quiet", None, None
    human_until = min(now, last_input + timedelta(minutes=policy.human_active_minutes))
    return ("active" if human_until > window_start else "quiet"), last_input, human_until


def _usage(
    tracks: Sequence[_Track], highs: list[Point], user: Sequence[Point], now: datetime, period: timedelta
) -> UsageMarks:
    """What the usage profile learns from the datapoints fetched: the UTC hours of the busy ones (`highs`:
    a track at or above its threshold; or a person's input within the datapoint's own period, as the
    replay's truth counts it, marked at the input's own time) and the UTC day of the newest datapoint."""
    busy = [t for t, _ in highs]
    if user:
        period_minutes = period.total_seconds() / 60
        busy.extend(t - timedelta(minutes=v) for t, v in user if 0 <= v < period_minutes and t <= now)
    newest = max([track.points[-1][0] for track in tracks if track.points], default=None)
    return UsageMarks(epoch_hours(busy) if busy else (), None if newest is None else epoch_day(newest))


def _noun(machine: Machine) -> str:
    """What the reasons call it: "machine", or an endpoint's or a Studio app's own noun (never "machine")."""
    return words_for(machine.instance_id).noun


def assess(
    machine: Machine,
    signals: Signals,
    policy: TeamPolicy,
    *,
    now: datetime,
    period: timedelta,
    gpu_families: Iterable[str],
) -> Assessment:
    """Busy if any datapoint in the window is at or above a threshold; idle if the whole window is
    covered and every datapoint is below every threshold; unknown otherwise."""
    window = timedelta(minutes=policy.idle_minutes)
    window_start = now - window
    # A hole may be at most half the window: a window must hold real datapoints to be called idle.
    max_gap = timedelta(minutes=min(policy.max_gap_minutes, policy.idle_minutes // 2))

    if not signals.complete:
        return Assessment("unknown", f"CloudWatch did not return complete metrics for this {_noun(machine)}")

    notes: list[str] = []
    tracks = _tracks(machine, signals, policy, period, gpu_families, notes)
    if isinstance(tracks, Assessment):
        return tracks
    uses_gpu = bool(signals.gpu) or is_gpu_type(machine.instance_type, gpu_families)

    def in_window(points: Sequence[Point]) -> list[Point]:
        return [(t, v) for t, v in points if t + period > window_start and t <= now]

    maxima: dict[str, float | None] = {}
    all_highs: list[Point] = []  # every busy datapoint fetched, for the usage profile
    latest_high: tuple[datetime, _Track, float] | None = None
    human, last_input, human_until = _human_activity(signals.user, policy, now, period, window_start, notes)
    interrupted_at: datetime | None = human_until  # end of the newest activity or data hole seen
    for track in tracks:
        windowed = in_window(track.points)
        maxima[track.label] = max((v for _, v in windowed), default=None)
        highs = [(t, v) for t, v in track.points if v >= track.threshold and t <= now]
        all_highs += highs
        if highs:
            t_high, v_high = highs[-1]
            interrupted_at = max(interrupted_at or t_high, t_high + period)
            if t_high + period > window_start and (latest_high is None or t_high > latest_high[0]):
                latest_high = (t_high, track, v_high)

    def result(signal: Signal, reason: str, since: datetime | None, *, missing: bool = False) -> Assessment:
        if notes:
            reason = f"{reason} ({'; '.join(notes)})"
        summary = ""
        if since is not None:
            parts = []
            for track in tracks:
                peak = max((v for t, v in track.points if t >= since), default=0.0)
                parts.append(_below(track.label, peak, track.threshold, track.unit))
            summary = f"quiet since {since:%H:%M} UTC: {', '.join(parts)}"
            if notes:
                summary += f" ({'; '.join(notes)})"
        return Assessment(
            signal,
            reason,
            since,
            max_cpu=maxima.get("CPU"),
            max_gpu=maxima.get("GPU"),
            max_network=maxima.get("network"),
            uses_gpu=uses_gpu,
            interrupted_at=interrupted_at,
            observed_until=observed_until,
            quiet_summary=summary,
            human_signal=human,
            human_last_input=last_input,
            usage=_usage(tracks, all_highs, signals.user, now, period),
            missing_series=missing,
        )

    observed_until = (
        min(track.points[-1][0] for track in tracks) + period if all(track.points for track in tracks) else None
    )
    coverage = [_coverage(track.points, period, max_gap, now) for track in tracks]
    covered = [c[0] if c else None for c in coverage]
    for c in coverage:
        if c and c[1]:
            interrupted_at = max(interrupted_at or c[0], c[0])
    quiet: datetime | None = None
    if all(c is not None for c in covered):
        quiet_since = max([machine.launch_time, *(c for c in covered if c is not None)])
        if interrupted_at is not None:
            quiet_since = max(quiet_since, interrupted_at)
        # Quiet must be observed: every track has a point at or after the start of the quiet run.
        newest = min(track.points[-1][0] for track in tracks)
        quiet = quiet_since if quiet_since <= newest else None

    if human == "active" and last_input and human_until and (latest_high is None or human_until >= latest_high[0]):
        return result(
            "busy",
            f"a person was active at {last_input:%H:%M} UTC, within human_active_minutes "
            f"({policy.human_active_minutes}) of the {policy.idle_minutes}-min window",
            quiet,
        )
    if latest_high is not None:
        t_high, track, value = latest_high
        return result(
            "busy",
            f"{track.label} {_fmt(value, track.unit)} at {t_high:%H:%M} UTC is at or above "
            f"{_fmt(track.threshold, track.unit)} within the {policy.idle_minutes}-min window",
            quiet,
        )
    if machine.launch_time > window_start:
        age = (now - machine.launch_time).total_seconds() / 60
        return result(
            "unknown", f"started {age:.0f} min ago, less than one idle window ({policy.idle_minutes} min)", None
        )
    for track, since in zip(tracks, covered, strict=True):
        if since is None:
            if not track.points:
                return result("unknown", f"no {track.label} datapoints", None, missing=True)
            last = track.points[-1][0] + period
            return result(
                "unknown", f"no {track.label} data since {last:%H:%M} UTC (gap over {policy.max_gap_minutes} min)", None
            )
        if since > window_start:
            return result(
                "unknown",
                f"{track.label} data has a gap over {policy.max_gap_minutes} min "
                f"before {since + max_gap:%H:%M} UTC; the window is not covered",
                quiet,
            )
    for track in tracks:
        if maxima[track.label] is None:
            return result("unknown", f"no {track.label} datapoints inside the {policy.idle_minutes}-min window", quiet)
    below = ", ".join(_below(track.label, maxima[track.label] or 0.0, track.threshold, track.unit) for track in tracks)
    return result("idle", f"quiet for the whole {policy.idle_minutes}-min window: {below}", quiet)


# ---------------------------------------------------------------------------------------------
# Exemption


def parse_exemption(value: str | None, now: datetime) -> tuple[bool, str]:
    """`true`, or an ISO-8601 time until which the machine is exempt. A value we cannot read is
    treated as exempt: a typo must make the reaper do less, never more."""
    if value is None:
        return False, ""
    text = value.strip()
    if text.lower() == "true":
        return True, "tagged exempt"
    if text.lower() == "false":
        return False, ""
    try:
        until = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return True, f"exemption tag value {value!r} is not 'true' or an ISO time; treated as exempt"
    if until.tzinfo is None:
        until = until.replace(tzinfo=now.tzinfo)
    if until > now:
        return True, f"exempt until {until.isoformat()}"
    return False, f"exemption expired at {until.isoformat()}"


# ---------------------------------------------------------------------------------------------
# The human-activity signal as `status` shows it


def human_signal_note(assessment: Assessment | None) -> str:
    """What a record keeps of the human-activity signal (MachineRecord.human_signal): "" when the policy
    ignores it or the machine was not judged, "missing" when the collector sent nothing usable, else
    "active" or "quiet" and the newest human input seen, to the minute."""
    if assessment is None or assessment.human_signal == "off":
        return ""
    if assessment.human_signal == "missing":
        return "missing"
    last = assessment.human_last_input
    return assessment.human_signal + (f" {last:%Y-%m-%dT%H:%MZ}" if last else "")


def describe_human_signal(note: str) -> str:
    """A record's human_signal in words ("person active 12:03 UTC", "no collector"); "" when
    there is nothing to say. A value it cannot read (a corrupted item) says nothing rather than fail."""
    kind, _, at = note.partition(" ")
    when = ""
    with contextlib.suppress(ValueError):
        when = f"{datetime.fromisoformat(at.replace('Z', '+00:00')):%H:%M} UTC" if at else ""
    if kind == "missing":
        return "no collector (no activity data: judged on CPU/GPU alone)"
    if kind == "active":
        return f"person active {when}".rstrip()
    if kind == "quiet":
        return f"no person active (last input {when})" if when else "no person active"
    return ""


def idle_hours(signals: Signals, policy: TeamPolicy, lo: datetime, hi: datetime, *, gpu: bool) -> float | None:
    """Hours of [lo, hi) an exempt machine sat idle by its team's thresholds: the clock hours with CPU data
    (and, for a GPU type, GPU data) in which every point stayed under them. An hour without data is not idle
    (unknown, never idle); None when the window holds no data at all or the read was incomplete."""
    if not signals.complete:
        return None
    hours: dict[datetime, list[bool]] = {}  # hour -> [seen CPU, seen GPU, busy]

    def mark(points: Sequence[tuple[datetime, float]], slot: int, threshold: float) -> None:
        for at, value in points:
            if lo <= at < hi:
                marks = hours.setdefault(at.replace(minute=0, second=0, microsecond=0), [False, False, False])
                marks[slot] = True
                marks[2] = marks[2] or value >= threshold

    mark(signals.cpu, 0, policy.cpu_threshold_percent)
    if gpu:
        mark(signals.gpu, 1, policy.gpu_threshold_percent)
    if not hours or (gpu and not any(marks[1] for marks in hours.values())):
        return None  # nothing read, or a GPU type whose GPU was never seen: unknown, never idle
    return float(sum(1 for cpu, seen_gpu, busy in hours.values() if cpu and (seen_gpu or not gpu) and not busy))
