"""Policy and settings models: the single source of truth for defaults, validation and JSON Schema.

Admins write JSON into SSM (`{prefix}/settings`, `{prefix}/teams/{team}`). A team parameter is a partial
override of the default policy held in settings; fields it does not name come from there.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Instance families that carry NVIDIA GPUs. A machine of these families without GPU metrics is
# "unknown" under `missing_gpu_metrics: busy`: we cannot see what the GPU does, so we never call it idle.
DEFAULT_GPU_FAMILIES = (
    "p2",
    "p3",
    "p3dn",
    "p4d",
    "p4de",
    "p5",
    "p5e",
    "p5en",
    "p6",
    "g3",
    "g3s",
    "g4dn",
    "g5",
    "g5g",
    "g6",
    "g6e",
    "g6f",
    "gr6",
    "g7",
    "gr7",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TeamPolicy(_Strict):
    """How one team wants its idle machines treated."""

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

    @model_validator(mode="after")
    def _warn_before_stop(self) -> TeamPolicy:
        if self.warn_minutes >= self.idle_minutes:
            raise ValueError(
                f"warn_minutes ({self.warn_minutes}) must be shorter than idle_minutes ({self.idle_minutes})"
            )
        return self


class TagKeys(_Strict):
    team: str = Field("Team", min_length=1, max_length=128)
    owner: str = Field("Owner", min_length=1, max_length=128)
    exempt: str = Field("idle-reaper:exempt", min_length=1, max_length=128)


class MetricSource(_Strict):
    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)


class MetricSettings(_Strict):
    cpu: MetricSource = MetricSource(namespace="AWS/EC2", name="CPUUtilization")
    gpu: MetricSource = MetricSource(namespace="CWAgent", name="nvidia_smi_utilization_gpu")
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
    gpu_instance_families: tuple[str, ...] = DEFAULT_GPU_FAMILIES
    admins: tuple[str, ...] = Field((), description="Slack user ids of idle-reaper admins.")


class PolicyError(Exception):
    """A policy parameter that cannot be used; the message names the parameter and every bad field."""

    def __init__(self, parameter: str, problems: list[str]) -> None:
        self.parameter = parameter
        self.problems = problems
        super().__init__(f"{parameter}: " + "; ".join(problems))


def _describe(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(top level)"
        problems.append(f"{path}: {item['msg']}")
    return problems


def _parse_object(parameter: str, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(parameter, [f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"]) from None
    if not isinstance(data, dict):
        raise PolicyError(parameter, [f"(top level): expected a JSON object, got {type(data).__name__}"])
    return data


def parse_settings(parameter: str, text: str) -> Settings:
    data = _parse_object(parameter, text)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(parameter, _describe(exc)) from None


def parse_team_policy(parameter: str, text: str, default: TeamPolicy) -> TeamPolicy:
    """A team parameter overrides fields of the default policy; the merged result is validated whole."""
    data = _parse_object(parameter, text)
    try:
        return TeamPolicy.model_validate({**default.model_dump(), **data})
    except ValidationError as exc:
        raise PolicyError(parameter, _describe(exc)) from None


class TeamPolicyRef(_Strict):
    """A resolved policy together with where it came from, recorded with every decision."""

    team: str
    policy: TeamPolicy | None  # None: the stored policy is invalid; the team is in safe mode
    source: str  # the SSM parameter name, or "settings.default_policy"
    version: int | None  # the SSM parameter version, None for the default
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.source}@v{self.version}" if self.version is not None else self.source
