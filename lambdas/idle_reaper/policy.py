"""Policy and settings models: the single source of truth for defaults, validation and JSON Schema.

Admins write JSON into SSM (`{prefix}/settings`, `{prefix}/teams/{team}`). A team parameter is a partial
override of the default policy held in settings; fields it does not name come from there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar
from zoneinfo import ZoneInfo

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

# Instance families that carry NVIDIA GPUs. A machine of these families without GPU metrics is
# "unknown" under `missing_gpu_metrics: busy`: we cannot see what the GPU does, so we never call it idle.
# The largest GPU and accelerator families: a stopped one may not start again for hours or days
# (InsufficientInstanceCapacity), so by default their warning says so (TeamPolicy.scarce_families).
DEFAULT_SCARCE_FAMILIES: tuple[str, ...] = (
    "p4d",
    "p4de",
    "p5",
    "p5e",
    "p5en",
    "p6-b200",
    "p6-b300",
    "p6e-gb200",
    "trn1",
    "trn1n",
    "trn2",
)
_GPU_FAMILIES = "p2 p3 p3dn p4d p4de p5 p5e p5en p6 g3 g3s g4dn g5 g5g g6 g6e g6f gr6 g7 gr7"
DEFAULT_GPU_FAMILIES: tuple[str, ...] = tuple(_GPU_FAMILIES.split())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Day = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
DAYS: tuple[Day, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WEEK_MINUTES = 7 * 1440
_HHMM = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
# The fields a schedule may override: timing, thresholds, action and quiet hours. Who is told and how
# long a machine may be kept stay the same all week, so an answer means the same thing at any hour.
SCHEDULE_FIELDS = (
    "idle_minutes",
    "warn_minutes",
    "cpu_threshold_percent",
    "gpu_threshold_percent",
    "action",
    "quiet_hours",
)


def shown(value: object, limit: int = 60, quote: Callable[[Any], str] = repr) -> str:
    """A value quoted for an error message, cut short: a 4,000-character id must not become the message."""
    text = quote(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# What each identifier pattern means, for error messages; the pattern itself is in the JSON Schema.
_KINDS: dict[str, str] = {}


def _identifier(kind: str, pattern: str, max_length: int) -> StringConstraints:
    """Length first (a huge value fails fast, before any regex or file lookup), then the pattern."""
    _KINDS[pattern] = kind
    return StringConstraints(min_length=1, max_length=max_length, pattern=pattern)


def _check_zone(value: str) -> str:
    try:
        ZoneInfo(value)
    except Exception:  # ZoneInfoNotFoundError, ValueError, OSError (a directory, a name too long): all "unknown"
        raise ValueError(f"unknown IANA time zone {shown(value)} (e.g. 'Europe/Berlin', 'UTC')") from None
    return value


# Identifiers, each validated as its kind with a bounded length. Slack ids are upper-case letters and
# digits after a one-letter prefix, 9-11 characters today; 32 leaves room for Slack to grow them.
SlackUserId = Annotated[str, _identifier("a Slack user id (U... or W..., e.g. U0123ABCD)", r"^[UW][A-Z0-9]{2,31}$", 32)]
SlackMember = Annotated[
    str, _identifier("a Slack user id (U..., W...) or user group id (S...)", r"^[UWS][A-Z0-9]{2,31}$", 32)
]
SlackChannelId = Annotated[
    str, _identifier("a Slack channel id (C..., G... or D..., e.g. C0123ABCD)", r"^[CGD][A-Z0-9]{2,31}$", 32)
]
TimeZoneName = Annotated[
    str,
    _identifier("an IANA time zone name (e.g. Europe/Berlin)", r"^[A-Za-z][A-Za-z0-9_+/-]{0,63}$", 64),
    AfterValidator(_check_zone),
]
ClockTime = Annotated[str, _identifier("a time of day HH:MM (00:00-23:59)", _HHMM, 5)]
# EC2 tag keys: 1-128 Unicode letters, digits, spaces and _ . : / = + - @.
TagKey = Annotated[
    str,
    _identifier("an EC2 tag key (letters, digits, spaces, _ . : / = + - @)", r"^[\p{L}\p{Z}\p{N}_.:/=+\-@]+$", 128),
]
# CloudWatch: a namespace is 1-255 of A-Z a-z 0-9 . - _ / # : and space, not starting with a space or ':';
# a metric name is 1-255 printable characters.
MetricNamespace = Annotated[
    str, _identifier("a CloudWatch namespace (e.g. AWS/EC2, CWAgent)", r"^[0-9A-Za-z._/#-][0-9A-Za-z._/#: -]*$", 255)
]
MetricName = Annotated[str, _identifier("a CloudWatch metric name (printable characters)", r"^[^\x00-\x1f\x7f]+$", 255)]
SlashCommand = Annotated[str, _identifier("a slash command (e.g. /idle-reaper)", r"^/[a-z0-9_-]{1,31}$", 32)]
InstanceFamily = Annotated[str, _identifier("an EC2 instance family (e.g. g5, p4d)", r"^[a-z][a-z0-9-]{0,15}$", 16)]


def _minute_of_day(hhmm: str) -> int:
    hour, minute = hhmm.split(":")
    return int(hour) * 60 + int(minute)


def _week_time(minute: int) -> str:
    minute %= _WEEK_MINUTES
    return f"{DAYS[minute // 1440]} {minute % 1440 // 60:02d}:{minute % 60:02d}"


class Schedule(_Strict):
    """A weekly period in local wall-clock time during which some policy fields take other values."""

    name: str | None = Field(None, min_length=1, max_length=64, description="Shown in decisions and status.")
    days: tuple[Day, ...] = Field(
        min_length=1, description="Days on which the period starts; a period past midnight ends the next day."
    )
    start: ClockTime = Field("00:00", description="Local start time, HH:MM.")
    end: str = Field(
        "24:00",
        pattern=r"^(([01][0-9]|2[0-3]):[0-5][0-9]|24:00)$",
        description="Local end time, HH:MM, exclusive; 24:00 is midnight; earlier than start runs past midnight.",
    )
    timezone: TimeZoneName | None = Field(
        None, description="IANA time zone, e.g. Europe/Berlin. Default: the policy's timezone."
    )
    idle_minutes: int | None = Field(None, ge=15, le=1440)
    warn_minutes: int | None = Field(None, ge=0, le=1440)
    cpu_threshold_percent: float | None = Field(None, ge=0, le=100)
    gpu_threshold_percent: float | None = Field(None, ge=0, le=100)
    action: Literal["stop", "hibernate", "notify_only"] | None = None
    quiet_hours: bool | None = Field(
        None, description="true: nothing is posted to owners in this period (see the policy's quiet_hours)."
    )

    @field_validator("days", mode="before")
    @classmethod
    def _lower_days(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [v.lower() if isinstance(v, str) else v for v in value]
        return value

    @field_validator("days")
    @classmethod
    def _distinct_days(cls, value: tuple[Day, ...]) -> tuple[Day, ...]:
        if len(set(value)) != len(value):
            raise ValueError("a day is listed twice")
        return value

    @model_validator(mode="after")
    def _meaningful(self) -> Schedule:
        if self.start == self.end:
            raise ValueError("start and end are equal; a whole day is start 00:00, end 24:00")
        if not self.overrides():
            raise ValueError(f"overrides nothing; set at least one of {', '.join(SCHEDULE_FIELDS)}")
        return self

    def overrides(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SCHEDULE_FIELDS if getattr(self, name) is not None}

    def spans(self) -> list[tuple[int, int]]:
        """(start minute of the week from Monday 00:00, length in minutes), one per day."""
        start, end = _minute_of_day(self.start), _minute_of_day(self.end)
        length = (end - start) % 1440 or 1440
        return [(DAYS.index(day) * 1440 + start, length) for day in self.days]

    def covers(self, local: datetime) -> bool:
        """Whether a local wall-clock time falls in the period. Wall-clock, so on the night clocks go back
        the repeated hour counts twice, and a start inside the skipped hour begins when the clocks jump."""
        return self.covers_minute(local.weekday() * 1440 + local.hour * 60 + local.minute)

    def covers_minute(self, minute: int) -> bool:
        return any((minute - start) % _WEEK_MINUTES < length for start, length in self.spans())

    def label(self, index: int) -> str:
        return f"schedules[{index}]" + (f" {self.name!r}" if self.name else "")


def _segments(schedules: Sequence[Schedule]) -> list[tuple[int, list[int]]]:
    """The week cut wherever a schedule starts or ends: (first minute, indexes of the schedules in force)
    for each piece in which at least one is in force. Within a piece the set does not change."""
    cuts = {edge % _WEEK_MINUTES for s in schedules for start, length in s.spans() for edge in (start, start + length)}
    pieces = []
    for minute in sorted(cuts):
        active = [i for i, s in enumerate(schedules) if s.covers_minute(minute)]
        if active:
            pieces.append((minute, active))
    return pieces


def _located(title: str, problems: list[tuple[tuple[str | int, ...], str, Any]]) -> ValidationError:
    """A ValidationError whose problems carry their own paths, so cross-field checks name the field."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(type=PydanticCustomError("policy_rule", message), loc=loc, input=value)
            for loc, message, value in problems
        ],
    )


class TeamPolicy(_Strict):
    """How one team wants its idle machines treated."""

    # Where this policy came from when it is a default other than settings.default_policy (organization mode:
    # a member account's own default, organization.py default_for). Not a field: never stored, dumped or shown
    # in the schema; only said in explanations (default_source).
    _source: str | None = PrivateAttr(default=None)

    idle_minutes: int = Field(90, ge=15, le=1440, description="Quiet this long (minutes) means idle.")
    warn_minutes: int = Field(30, ge=0, le=1440, description="The owner is warned this many minutes before the stop.")
    cpu_threshold_percent: float = Field(5.0, ge=0, le=100, description="CPU at or above this is busy.")
    gpu_threshold_percent: float = Field(5.0, ge=0, le=100, description="Busiest GPU at or above is busy.")
    network_threshold_bytes_per_second: float | None = Field(
        None, ge=0, description="Optional: NetworkIn+NetworkOut at or above this is busy."
    )
    action: Literal["stop", "hibernate", "notify_only"] = Field(
        "stop", description="What happens to an idle standalone machine past its window."
    )
    missing_gpu_metrics: Literal["busy", "cpu_only"] = Field(
        "busy",
        description="A GPU machine without GPU metrics: 'busy' never reaps it, 'cpu_only' judges CPU alone.",
    )
    asg_action: Literal["unprotect", "terminate"] = Field(
        "unprotect", description="What happens to an idle Auto Scaling Group member past its window."
    )
    undelivered_warning_max_minutes: int = Field(
        240,
        ge=0,
        le=10080,
        description="A warning that could not be delivered holds the stop this long, then the stop proceeds.",
    )
    max_gap_minutes: int = Field(
        15,
        ge=5,
        le=60,
        description="Largest hole in the metrics (and lag at the end) that still counts as covered.",
    )
    human_active_minutes: int | None = Field(
        30,
        ge=0,
        le=1440,
        description="A person's input (SSH, Jupyter, VS Code; the on-machine collector's "
        "idle_reaper_minutes_since_input) within this many minutes of any moment of the window means busy. "
        "0 or null: ignore the signal. A machine without the collector is judged on CPU/GPU alone.",
    )
    adaptive_wait_max_minutes: int | None = Field(
        180,
        ge=0,
        le=1440,
        description="The most a machine's own past (its usage profile, or how its past quiet stretches ended) "
        "may delay its warning and stop. 0 or null: off, every machine waits idle_minutes.",
    )
    adaptive_earliest_warn_minutes: int | None = Field(
        None,
        ge=0,
        le=1440,
        description="Learned waiting: the soonest (minutes of quiet) a machine whose quiet stretches usually go "
        "on for hours may be warned. null: never sooner than idle_minutes - warn_minutes. The stop still "
        "needs the whole idle window.",
    )
    time_of_day_wait_percent: int | None = Field(
        45,
        ge=0,
        le=100,
        description="Time-of-day waiting: hold the warning (up to adaptive_wait_max_minutes) while the chance "
        "that this machine is used within time_of_day_horizon_minutes, estimated from when it was busy on its "
        "past days at this time of day, is this many percent or more. 0 or null: off (learned waiting from "
        "past quiet stretches only). A machine with fewer than 3 days of profile uses learned waiting.",
    )
    history_wait_percent: int | None = Field(
        None,
        ge=0,
        le=100,
        description="History waiting (docs/policy.md): warn once the chance of use soon is under this %. 0/null: off",
    )
    time_of_day_horizon_minutes: int = Field(
        90,
        ge=15,
        le=480,
        description="Time-of-day waiting: how far ahead 'used soon' looks.",
    )
    # Slack: who hears about a warning, who may answer it, and how long they may keep a machine.
    notify: Literal["owner", "channel", "both"] = Field(
        "both", description="Where warnings go: the owner's DMs, the team channel, or both."
    )
    slack_channel: SlackChannelId | None = Field(None, description="Team channel id for warnings (e.g. C0123ABCD).")
    members: tuple[SlackMember, ...] = Field(
        (),
        max_length=500,
        description="Slack user ids (U..., W...) or user group ids (S...) who may answer for any team machine.",
    )
    max_snooze_hours: int = Field(8, ge=1, le=72, description="Longest a single 'keep' may last.")
    max_snoozes_per_day: int = Field(3, ge=0, le=50, description="How many 'keep' answers a machine may get a day.")
    timezone: TimeZoneName = Field("UTC", description="The team's IANA time zone, for 'keep until tomorrow morning'.")
    morning: ClockTime = Field("09:00", description="When 'morning' starts.")
    # The weekly digest (docs/policy.md, "The weekly digest"): sent once per ISO week to the team channel at
    # the first hourly check after this local day and time, never during quiet hours.
    digest_day: Day = Field("mon", description="The team-local weekday of the weekly digest (mon ... sun).")
    digest_time: ClockTime = Field("09:00", description="The team-local time of the weekly digest, HH:MM.")
    # Admin controls: quiet hours, a hard cap on runtime, and weekly schedule overrides.
    quiet_hours: bool = Field(
        False,
        description="true: nothing is posted to owners (no warnings, no 'resolved' or 'stopped' notices); "
        "warnings are recorded and the stop still follows warn_minutes later. Usually set in a schedule.",
    )
    max_runtime_hours: int | None = Field(
        None,
        ge=1,
        le=8760,
        description="A machine up longer than this since its last start is warned and stopped even if kept "
        "(snoozed); never while busy or unknown, never when exempt.",
    )
    # Machines a stop cannot reach or does not save (core/kinds.py; docs/policy.md has the table).
    terminate_unstoppable_after_minutes: int | None = Field(
        None,
        ge=60,
        le=10080,
        description="One-time Spot instances and instance-store roots cannot be stopped, only terminated. "
        "null (the default): their owner is told once per idle stretch, with buttons to keep or terminate. "
        "A number: quiet this long (minutes, longer than idle_minutes), they are warned and terminated.",
    )
    reserved_capacity_action: Literal["notify", "stop"] = Field(
        "notify",
        description="A machine in an active capacity reservation or Capacity Block: a stop saves nothing. "
        "notify: the owner and the admins are told the reservation is idle; stop: it is stopped as usual "
        "(freeing the slot for someone else), never counted as savings.",
    )
    scarce_families: tuple[InstanceFamily, ...] = Field(
        DEFAULT_SCARCE_FAMILIES,
        max_length=200,
        description="Instance families whose capacity is hard to get back once stopped: their warning says so.",
    )
    scarce_action: Literal["stop", "notify_only"] = Field(
        "stop", description="For scarce_families: stop as usual, or only tell the owner (notify_only)."
    )
    scarce_idle_minutes: int | None = Field(
        None, ge=15, le=10080, description="For scarce_families: their own idle window (null: idle_minutes)."
    )
    # SageMaker real-time endpoints (core/endpoints.py; docs/policy.md, "SageMaker endpoints").
    endpoint_idle_minutes: int = Field(
        1440,
        ge=60,
        le=10080,
        description="A SageMaker endpoint with no invocation on any of its variants this long (minutes; "
        "AWS/SageMaker Invocations, Sum) is idle: warned warn_minutes before, then deleted (its endpoint "
        "configuration, model and tags kept, so Slack's 'Bring it back' recreates it).",
    )
    # SageMaker Studio apps (core/studio.py; docs/policy.md, "SageMaker Studio apps").
    studio_apps: Literal["report", "delete"] = Field(
        "report",
        description="Running Studio JupyterLab and Code Editor apps whose space carries the team and opt-in tags: "
        "report (the admins' daily note lists those Studio's own idle shutdown would leave running past idle_minutes) "
        "or delete (such an app idle past idle_minutes is warned, then deleted, its space and storage kept, so "
        "Slack's 'Start it again' recreates it).",
    )
    schedules: tuple[Schedule, ...] = Field(
        (),
        max_length=50,
        description="Weekly overrides in local time, in one time zone. Schedules in force at the same time "
        "apply together and must set different fields.",
    )

    @field_validator("digest_day", mode="before")
    @classmethod
    def _lower_day(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("schedules")
    @classmethod
    def _one_zone_no_conflict(cls, value: tuple[Schedule, ...], info: ValidationInfo) -> tuple[Schedule, ...]:
        # One zone per policy keeps "which schedules are in force together" a question of wall-clock time.
        team_zone = info.data.get("timezone", "UTC")
        problems: list[tuple[tuple[str | int, ...], str, Any]] = []
        first_zone = (value[0].timezone or team_zone) if value else team_zone
        for i, s in enumerate(value):
            zone = s.timezone or team_zone
            if zone != first_zone:
                problems.append(
                    ((i, "timezone"), f"{zone!r} differs from schedules[0]'s {first_zone!r}; use one time zone", zone)
                )
        # Overlapping schedules compose only when they set different fields: no precedence rules to learn.
        reported: set[tuple[int, int]] = set()
        for minute, active in _segments(value):
            for pos, i in enumerate(active):
                for j in active[:pos]:
                    shared = [f for f in SCHEDULE_FIELDS if f in value[i].overrides() and f in value[j].overrides()]
                    if shared and (j, i) not in reported:
                        reported.add((j, i))
                        problems.append(
                            (
                                (i,),
                                f"overlaps {value[j].label(j)} from {_week_time(minute)} and both set "
                                f"{', '.join(shared)}; schedules in force at the same time must set different fields",
                                list(value[i].days),
                            )
                        )
        if problems:
            raise _located("schedules", problems)
        return value

    @model_validator(mode="after")
    def _warn_before_stop(self) -> TeamPolicy:
        problems: list[tuple[tuple[str | int, ...], str, Any]] = []
        terminate_after = self.terminate_unstoppable_after_minutes
        if terminate_after is not None and terminate_after <= self.idle_minutes:
            problems.append(
                (
                    ("terminate_unstoppable_after_minutes",),
                    f"terminate_unstoppable_after_minutes ({terminate_after}) must be longer than idle_minutes "
                    f"({self.idle_minutes}): termination loses the machine's disks, so it waits longer than a stop",
                    terminate_after,
                )
            )
        if self.scarce_idle_minutes is not None and self.warn_minutes >= self.scarce_idle_minutes:
            problems.append(
                (
                    ("scarce_idle_minutes",),
                    f"warn_minutes ({self.warn_minutes}) must be shorter than scarce_idle_minutes "
                    f"({self.scarce_idle_minutes})",
                    self.scarce_idle_minutes,
                )
            )
        longest_warn = max([self.warn_minutes, *(s.warn_minutes or 0 for s in self.schedules)])
        if longest_warn >= self.endpoint_idle_minutes:
            problems.append(
                (
                    ("endpoint_idle_minutes",),
                    f"endpoint_idle_minutes ({self.endpoint_idle_minutes}) must be longer than warn_minutes "
                    f"({longest_warn}, the longest the policy or a schedule sets): an endpoint's owner is warned "
                    "warn_minutes before it is deleted",
                    self.endpoint_idle_minutes,
                )
            )
        if self.warn_minutes >= self.idle_minutes:
            problems.append(
                (
                    ("warn_minutes",),
                    f"warn_minutes ({self.warn_minutes}) must be shorter than idle_minutes ({self.idle_minutes})",
                    self.warn_minutes,
                )
            )
        # Every moment of the week must give a valid policy once schedules are merged in, so
        # effective_policy never has to fail at sweep time.
        reported: set[tuple[int, str]] = set()
        for minute, active in _segments(self.schedules):
            merged = {k: v for i in active for k, v in self.schedules[i].overrides().items()}
            warn = merged.get("warn_minutes", self.warn_minutes)
            idle = merged.get("idle_minutes", self.idle_minutes)
            setters = [
                (i, f) for i in active for f in ("warn_minutes", "idle_minutes") if f in self.schedules[i].overrides()
            ]
            if warn < idle or not setters or setters[-1] in reported:
                continue
            reported.add(setters[-1])
            index, field = setters[-1]
            others = [self.schedules[i].label(i) for i in active if i != index]
            during = f" (with {', '.join(others)} also in force)" if others else ""
            problems.append(
                (
                    ("schedules", index, field),
                    f"from {_week_time(minute)}{during} warn_minutes ({warn}) "
                    f"must be shorter than idle_minutes ({idle})",
                    merged[field],
                )
            )
        if problems:
            raise _located("TeamPolicy", problems)
        return self


class TagKeys(_Strict):
    team: TagKey = "Team"
    owner: TagKey = "Owner"
    exempt: TagKey = "idle-reaper:exempt"
    managed: TagKey | None = Field(
        "idle-reaper:managed",
        description="Opt-in tag: only machines carrying it with the value `true` are swept (and IAM lets the "
        "reaper act only on those). null sweeps every machine with the team tag; the stack's IAM must match.",
    )


class MetricSource(_Strict):
    namespace: MetricNamespace
    name: MetricName


class MetricSettings(_Strict):
    cpu: MetricSource = MetricSource(namespace="AWS/EC2", name="CPUUtilization")
    gpu: MetricSource = MetricSource(namespace="CWAgent", name="nvidia_smi_utilization_gpu")
    # A SageMaker notebook instance publishes no CPU metric: the stack's lifecycle configuration has the
    # CloudWatch agent publish this one, by InstanceId = the notebook instance's name.
    notebook_cpu: MetricSource = MetricSource(namespace="CWAgent", name="cpu_usage_active")
    # Nor network: the agent's `net` plugin, bytes of each interval on the notebook's interfaces (Sum per
    # period, as NetworkIn/NetworkOut), read for notebook instances of teams with a network threshold.
    notebook_network_in: MetricSource = MetricSource(namespace="CWAgent", name="net_bytes_recv")
    notebook_network_out: MetricSource = MetricSource(namespace="CWAgent", name="net_bytes_sent")
    # A SageMaker endpoint's requests, per EndpointName and VariantName (Sum per period). SageMaker publishes it for
    # the periods that had requests: a period without a datapoint counts as none only where the variant's instances
    # reported this heartbeat (SampleCount per period); without either, the endpoint is unknown (core/endpoints.py).
    endpoint_invocations: MetricSource = MetricSource(namespace="AWS/SageMaker", name="Invocations")
    endpoint_heartbeat: MetricSource = MetricSource(namespace="/aws/sagemaker/Endpoints", name="CPUUtilization")
    network_in: MetricSource = MetricSource(namespace="AWS/EC2", name="NetworkIn")
    network_out: MetricSource = MetricSource(namespace="AWS/EC2", name="NetworkOut")
    period_seconds: Literal[60, 300] = Field(
        300, description="Metric period: 300 for basic monitoring, 60 for detailed."
    )


class Settings(_Strict):
    """Account-wide settings (`{prefix}/settings`)."""

    dry_run: bool = Field(False, description="Run everything but the actions and notifications.")
    tags: TagKeys = TagKeys()
    metrics: MetricSettings = MetricSettings()
    default_policy: TeamPolicy = TeamPolicy()
    gpu_instance_families: tuple[InstanceFamily, ...] = Field(DEFAULT_GPU_FAMILIES, max_length=200)
    admins: tuple[SlackUserId, ...] = Field((), max_length=100, description="Slack user ids of idle-reaper admins.")
    admin_channel: SlackChannelId | None = Field(
        None, description="Slack channel id where admin alerts (invalid policies, failed sweeps, alarms) are posted."
    )
    slack_command: SlashCommand = Field("/idle-reaper", description="The slash command.")
    read_when_due: bool = Field(
        True,
        description="Read a machine only when its decision can change (busy machines about hourly); "
        "false reads every machine at every sweep. Warnings and stops are the same either way.",
    )
    sagemaker_endpoints: bool = Field(
        True,
        description="Also sweep SageMaker real-time endpoints that carry the team and opt-in tags: idle when no "
        "variant was invoked for the team's endpoint_idle_minutes, then deleted (configuration, model and tags "
        "kept). false lists none.",
    )
    sagemaker_notebooks: bool = Field(
        True,
        description="Also sweep SageMaker notebook instances that carry the team and opt-in tags (they need the "
        "stack's lifecycle configuration to publish CPU, GPU and activity; without it they are unknown, never "
        "stopped). false lists none.",
    )


class PolicyError(Exception):
    """A policy parameter that cannot be used; the message names the parameter and every bad field."""

    def __init__(self, parameter: str, problems: list[str]) -> None:
        self.parameter = parameter
        self.problems = problems
        super().__init__(f"{parameter}: " + "; ".join(problems))


def json_path(loc: tuple[str | int, ...]) -> str:
    """('schedules', 0, 'timezone') -> 'schedules[0].timezone'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


_QUOTING = ("policy_rule", "value_error")


def _describe(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        if item["type"] == "extra_forbidden":
            message = "unknown field (not in the schema: see `idle-reaper policy schema`)"
        else:
            message = item["msg"].removeprefix("Value error, ")
            if item["type"] == "string_pattern_mismatch" and item.get("ctx", {}).get("pattern") in _KINDS:
                message = f"not {_KINDS[item['ctx']['pattern']]}"
            # Our own rules already quote the values; pydantic's type and range messages do not.
            if isinstance(item.get("input"), str | int | float | bool) and item["type"] not in _QUOTING:
                message += f" (got {shown(item['input'], quote=json.dumps)})"
        problems.append(f"{json_path(item['loc'])}: {message}")
    return problems


# Bounds checked before parsing. SSM's largest parameter (advanced tier) is 8 KB; a policy is a few
# levels deep (settings > default_policy > schedules > [i] > days), so 10 levels is room to spare. Without
# them a depth bomb of nested arrays escapes as RecursionError and takes the whole sweep down.
MAX_PARAMETER_CHARS = 8192
MAX_NESTING = 10
_Model = TypeVar("_Model", bound=BaseModel)


def _nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { outside JSON strings (a cheap scan; the text is bounded)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _parse_object(parameter: str, text: str) -> dict[str, Any]:
    if len(text) > MAX_PARAMETER_CHARS:
        raise PolicyError(
            parameter,
            [f"too large: {len(text)} characters (at most {MAX_PARAMETER_CHARS}: SSM's Advanced tier holds no more)"],
        )
    if _nesting_depth(text) > MAX_NESTING:
        raise PolicyError(parameter, [f"nested too deeply (more than {MAX_NESTING} levels of [ and {{)"])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(parameter, [f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"]) from None
    if not isinstance(data, dict):
        raise PolicyError(parameter, [f"(top level): expected a JSON object, got {type(data).__name__}"])
    return data


def _validated(parameter: str, model: type[_Model], data: dict[str, Any]) -> _Model:
    """Any failure, not only a ValidationError, becomes a PolicyError naming the parameter: one bad
    parameter must put its team in safe mode, never take the sweep (or the CLI) down with a traceback."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(parameter, _describe(exc)) from None
    except Exception as exc:
        raise PolicyError(parameter, [f"cannot be validated ({type(exc).__name__}: {shown(str(exc), 200)})"]) from None


def parse_settings(parameter: str, text: str) -> Settings:
    return _validated(parameter, Settings, _parse_object(parameter, text))


def parse_team_policy(parameter: str, text: str, default: TeamPolicy) -> TeamPolicy:
    """A team parameter overrides fields of the default policy; the merged result is validated whole."""
    data = _parse_object(parameter, text)
    return _validated(parameter, TeamPolicy, {**default.model_dump(), **data})


DEFAULT_SOURCE = "settings.default_policy"


def with_source(policy: TeamPolicy, source: str) -> TeamPolicy:
    """A copy of `policy` that says it came from `source` when it serves as a default (default_source)."""
    labelled = policy.model_copy()
    labelled._source = source
    return labelled


def default_source(settings: Settings) -> str:
    """What an explanation names as the origin of the default policy in force: `settings.default_policy`, or
    the organization setting a member account's default came from (with_source)."""
    return settings.default_policy._source or DEFAULT_SOURCE


class TeamPolicyRef(_Strict):
    """A resolved policy together with where it came from, recorded with every decision."""

    team: str
    policy: TeamPolicy | None  # None: the stored policy is invalid; the team is in safe mode
    source: str  # the SSM parameter name, "settings.default_policy", or an account's default (default_source)
    version: int | None  # the SSM parameter version, None for the default
    error: str | None = None
    schedule: str | None = None  # the schedule override in force, e.g. "schedules[1] 'weekend'"

    @property
    def label(self) -> str:
        label = f"{self.source}@v{self.version}" if self.version is not None else self.source
        return f"{label} {self.schedule}" if self.schedule else label

    def at(self, now: datetime) -> TeamPolicyRef:
        """This policy as it applies at `now`: the overrides of the schedules in force merged in."""
        if self.policy is None:
            return self
        active = active_schedules(self.policy, now)
        if not active:
            return self
        label = " + ".join(s.label(i) for i, s in active)
        return self.model_copy(update={"policy": effective_policy(self.policy, now), "schedule": label})


def schedule_zone(policy: TeamPolicy, schedule: Schedule) -> ZoneInfo:
    return ZoneInfo(schedule.timezone or policy.timezone)


def active_schedules(policy: TeamPolicy, now: datetime) -> list[tuple[int, Schedule]]:
    """The schedules in force at `now`, judged by the local wall-clock time of their zone. Several may
    be, but validation made sure they set different fields. Pure: the clock is an argument."""
    return [
        (index, schedule)
        for index, schedule in enumerate(policy.schedules)
        if schedule.covers(now.astimezone(schedule_zone(policy, schedule)))
    ]


def effective_policy(policy: TeamPolicy, now: datetime) -> TeamPolicy:
    """The policy in force at `now`: `policy` itself when no schedule is in force, else a copy with the
    overrides and no schedules of its own (resolved; kept, they would be judged against the overridden
    values, e.g. a schedule's warn_minutes against another schedule's shorter idle_minutes). Validation already
    checked every moment of the week (warn < idle once merged), so the copy needs no re-validation."""
    overrides = {k: v for _, s in active_schedules(policy, now) for k, v in s.overrides().items()}
    return policy.model_copy(update={**overrides, "schedules": ()}) if overrides else policy


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema editors can validate a policy file with. Cross-field rules (warn_minutes shorter
    than idle_minutes, no field set twice at one moment) are beyond JSON Schema: `policy validate` checks them."""
    schema = model.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
