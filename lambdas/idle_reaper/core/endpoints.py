"""SageMaker real-time endpoints: what a sweep knows of one, when it is idle, and what is kept to bring it back.

An endpoint is swept as a machine (core/signals.Machine) whose id is `endpoint:<name>` (an endpoint's name has no
colon, so it can never be an EC2 id or a notebook instance's name), whose instance type is its hardware
("ml.g5.2xlarge x2 + ml.m5.large": pricing.py prices the whole) and whose facts carry `EndpointFacts`. Its signal
is `AWS/SageMaker Invocations` (Sum) per EndpointName and VariantName: one track per variant, busy at one request,
idle when every variant's track covers the team's `endpoint_idle_minutes` with no request, unknown when a variant
has no datapoints. The action is DeleteEndpoint: the endpoint configuration, its models and the endpoint's tags
stay, and the record keeps what CreateEndpoint needs (`Restore`), so "Bring it back" recreates it as it was.

Pure: the adapter (aws/endpoints.py) reads ListEndpoints, DescribeEndpoint, DescribeEndpointConfig, DescribeModel,
ListTags and Application Auto Scaling's scalable targets, and hands their answers here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from idle_reaper.policy import TeamPolicy

Point = tuple[datetime, float]  # (period start, value), as core/signals.py's

ENDPOINT_PREFIX = "endpoint:"
IN_SERVICE = "InService"
FAILED = "Failed"  # SageMaker could not create (or update) it: it runs no instance, and FailureReason says why
# The metric's dimensions (https://docs.aws.amazon.com/sagemaker/latest/dg/monitoring-cloudwatch.html).
ENDPOINT_DIMENSION, VARIANT_DIMENSION = "EndpointName", "VariantName"
# SageMaker's own tag limit: 50 a resource, keys up to 128 characters, values up to 256
# (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_Tag.html): a Restore is at most about 20 KB.
TAGS_MAX = 50
# FailureReason as kept on the record and said in Slack: SageMaker's is up to 1,024 characters
# (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DescribeEndpoint.html).
FAILURE_CHARS = 1024
# Tags AWS keeps for itself: CreateEndpoint and CreateApp refuse a key that starts with aws:, so they are not restored.
_AWS_TAG = "aws:"


def passed_on(tags: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The tags an endpoint or a Studio app is recreated with: its own, not AWS's, at most SageMaker's 50."""
    return tuple((k, v) for k, v in tags if not k.startswith(_AWS_TAG))[:TAGS_MAX]


def endpoint_id(name: str) -> str:
    """The machine id of endpoint `name` (in the state table, Slack references and `status`)."""
    return ENDPOINT_PREFIX + name


def is_studio_id(machine_id: str) -> bool:
    return machine_id.startswith(STUDIO_PREFIX)


def is_endpoint_id(machine_id: str) -> bool:
    return machine_id.startswith(ENDPOINT_PREFIX)


def endpoint_name(machine_id: str) -> str:
    """The endpoint's name in its machine id; ValueError for an id no endpoint has."""
    if not is_endpoint_id(machine_id) or len(machine_id) == len(ENDPOINT_PREFIX):
        raise ValueError(f"not an endpoint's id: {machine_id!r}")
    return machine_id[len(ENDPOINT_PREFIX) :]


@dataclass(frozen=True)
class Words:
    """What messages call a machine's action: a stop, or for an endpoint or a Studio app its deletion."""

    noun: str = "machine"
    stopped: str = "stopped"
    stop_button: str = "Stop now"
    stop_title: str = "Stopped"
    start_button: str = "Start it again"
    keeps: str = ""  # what a deletion keeps ("" for a stop)
    recreating: str = ""  # what SageMaker does once the start button is pressed, and how long it takes
    back_title: str = "Being brought back"  # the message's title meanwhile

    @property
    def deletes(self) -> bool:
        return self.stopped == "deleted"


ENDPOINT_WORDS = Words(
    "endpoint",
    "deleted",
    "Delete now",
    "Deleted",
    "Bring it back",
    "its configuration, models and tags",
    "SageMaker is creating it from its endpoint configuration (usually 5 to 15 minutes)",
)
STUDIO_WORDS = Words(
    "Studio app",
    "deleted",
    "Delete now",
    "Deleted",
    "Start it again",
    "its space and the space's storage",
    "SageMaker is creating the app in its space, on the same instance type and image (usually 2 to 5 minutes)",
    "Being started again",
)
MACHINE_WORDS = Words()
# A SageMaker Studio app's machine id: studio:<domain id>:<space name>:<app type>:<app name> (core/studio.py).
STUDIO_PREFIX = "studio:"


def words_for(key: str) -> Words:
    """The words for the machine a machine id or key (records.machine_key: account/region/id) names."""
    machine_id = key.rsplit("/", 1)[-1]
    if is_studio_id(machine_id):
        return STUDIO_WORDS
    return ENDPOINT_WORDS if is_endpoint_id(machine_id) else MACHINE_WORDS


@dataclass(frozen=True)
class Variant:
    """One production variant as DescribeEndpoint and its endpoint configuration say."""

    name: str
    instance_type: str | None  # None: a serverless variant (no instances to pay for by the hour)
    instances: int  # CurrentInstanceCount (DesiredInstanceCount while it has none yet)
    model: str | None = None  # the configuration's ModelName (None: none, or the configuration is gone)
    components: bool = False  # the variant hosts inference components (its configuration names no model)
    # The fewest instances it may scale to: ManagedInstanceScaling's MinInstanceCount, or an Application Auto
    # Scaling target's MinCapacity, the lower (None: neither is set).
    min_instances: int | None = None


@dataclass(frozen=True)
class EndpointFacts:
    """What a sweep knows of one endpoint. Part of its Machine: an endpoint that changed (status, variants, tags)
    since it was listed counts as changed (`Fleet.still_as_listed`)."""

    name: str
    status: str  # EndpointStatus: InService, Creating, Updating, SystemUpdating, RollingBack, ...
    config: str  # EndpointConfigName
    variants: tuple[Variant, ...]
    # What CreateEndpoint would need and is gone: "endpoint configuration C", "model M" (empty: it can be recreated).
    missing: tuple[str, ...] = ()
    tags: tuple[tuple[str, str], ...] = ()  # every tag of the endpoint, sorted
    # Its configuration has AsyncInferenceConfig: SageMaker publishes no Invocations for an asynchronous endpoint
    # (https://docs.aws.amazon.com/sagemaker/latest/dg/async-inference-monitor.html), so it is never idle.
    asynchronous: bool = False

    @property
    def hardware(self) -> str:
        """Its instance type as a machine's: "ml.g5.2xlarge x2 + ml.m5.large" ("serverless" for a variant with
        none). pricing.hourly_price prices it whole: each variant's type times its count."""
        parts = []
        for v in self.variants:
            if v.instance_type is None:
                parts.append("serverless")
            else:
                parts.append(v.instance_type + (f" x{v.instances}" if v.instances != 1 else ""))
        return " + ".join(parts) or "serverless"

    @property
    def saves_nothing(self) -> str:
        """Why deleting it saves nothing, in words ("" when it saves its instances' price)."""
        serverless = [v.name for v in self.variants if v.instance_type is None]
        if serverless:
            return f"serverless variant {', '.join(serverless)}: billed per request, so an idle one costs nothing"
        components = [v.name for v in self.variants if v.components]
        if components:
            return (
                f"variant {', '.join(components)} hosts inference components, which can scale to zero copies and which "
                "CreateEndpoint would not bring back"
            )
        to_zero = [v.name for v in self.variants if v.min_instances == 0]
        if to_zero:
            return f"variant {', '.join(to_zero)} scales to zero instances on its own (its minimum is 0)"
        return ""

    @property
    def restorable(self) -> bool:
        return not self.missing

    def restore(self) -> Restore:
        return Restore(self.config, passed_on(self.tags))


@dataclass(frozen=True)
class Restore:
    """What CreateEndpoint needs to bring a deleted endpoint back as it was, kept on its record
    (MachineRecord.endpoint): its configuration's name and its tags. `pending_by`: who asked to bring it back,
    until a sweep sees it InService (or Failed) and says so in its message. `failed`: why SageMaker could not
    create it the last time someone brought it back (its FailureReason), until someone tries again."""

    config: str
    tags: tuple[tuple[str, str], ...] = ()
    pending_by: str | None = None
    pending_since: str | None = None  # ISO-8601 UTC
    failed: str | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {"config": self.config, "tags": [list(t) for t in self.tags]}
        if self.pending_by:
            data.update(pending_by=self.pending_by, pending_since=self.pending_since)
        if self.failed:
            data.update(failed=self.failed)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def brought_back_by(self, user: str, now: datetime) -> Restore:
        """As kept once `user` asked to bring it back at `now` (a failure before is moot: they try again)."""
        return Restore(self.config, self.tags, user, now.isoformat())

    def failed_with(self, why: str) -> Restore:
        """As kept once the sweep found the endpoint brought back Failed: told, not pending, and why."""
        return Restore(self.config, self.tags, failed=(why or "SageMaker gave no reason")[:FAILURE_CHARS])

    @classmethod
    def parse(cls, raw: str | None) -> Restore | None:
        """None for nothing kept, or for text this never wrote (a corrupt item must never fail a sweep)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            tags = tuple((str(k), str(v)) for k, v in data.get("tags", []))
            config = data["config"]
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not isinstance(config, str) or not config:
            return None
        failed = data.get("failed") or None
        return cls(
            config,
            tags,
            data.get("pending_by") or None,
            data.get("pending_since") or None,
            str(failed) if failed else None,
        )

    def tag_list(self) -> list[dict[str, str]]:
        """As CreateEndpoint's Tags."""
        return [{"Key": k, "Value": v} for k, v in self.tags]

    def recreate_command(self, name: str) -> str:
        """How a person recreates it by hand (its record lasts 30 days after its last write)."""
        return f"aws sagemaker create-endpoint --endpoint-name {name} --endpoint-config-name {self.config}"


def kept_restore(previous: str | None, facts: EndpointFacts) -> str:
    """The record's Restore as this sweep sees the endpoint: its configuration and tags now, and a bring-back still
    waiting to be told (its pending_by) carried over."""
    before = Restore.parse(previous)
    now = facts.restore()
    if before is not None and before.pending_by:
        now = Restore(now.config, now.tags, before.pending_by, before.pending_since)
    return now.to_json()


def variants_of(
    endpoint: Mapping[str, Any], config: Mapping[str, Any] | None, min_capacity: Mapping[str, int]
) -> tuple[Variant, ...]:
    """The variants of one DescribeEndpoint answer, joined with its DescribeEndpointConfig answer (None: gone) and
    Application Auto Scaling's MinCapacity by variant name."""
    configured = {v.get("VariantName"): v for v in (config or {}).get("ProductionVariants", [])}
    found = []
    for item in endpoint.get("ProductionVariants") or configured.values():
        name = str(item.get("VariantName"))
        conf = configured.get(name, {})
        serverless = item.get("CurrentServerlessConfig") or conf.get("ServerlessConfig")
        count = item.get("CurrentInstanceCount")
        if count is None:
            count = item.get("DesiredInstanceCount", conf.get("InitialInstanceCount", 0))
        managed = (conf.get("ManagedInstanceScaling") or {}).get("MinInstanceCount")
        lows = [int(x) for x in (managed, min_capacity.get(name)) if x is not None]
        found.append(
            Variant(
                name=name,
                # DescribeEndpoint does not say the type: without its configuration, it is not known (nor its price).
                instance_type=None if serverless else (conf.get("InstanceType") or "unknown"),
                instances=int(count or 0),
                model=conf.get("ModelName") or None,
                components=config is not None and not conf.get("ModelName"),
                min_instances=min(lows) if lows else None,
            )
        )
    return tuple(sorted(found, key=lambda v: v.name))


def endpoint_policy(policy: TeamPolicy) -> TeamPolicy:
    """The team's policy as an endpoint gets it: the window is endpoint_idle_minutes, and nothing that reads a
    machine's insides applies (no network threshold, no person at the keyboard, no learned or time-of-day wait, no
    runtime cap: an endpoint is meant to run for long; no scarce family's own window). Not validated again: every
    value comes from a validated policy, and endpoint_idle_minutes is longer than any warn_minutes."""
    return policy.model_copy(
        update={
            "idle_minutes": policy.endpoint_idle_minutes,
            "network_threshold_bytes_per_second": None,
            "human_active_minutes": None,
            "adaptive_wait_max_minutes": None,
            "time_of_day_wait_percent": None,
            "max_runtime_hours": None,
            "scarce_idle_minutes": None,
        }
    )


def requests_per_period(invocations: Sequence[Point], reported: Sequence[Point]) -> list[Point]:
    """A variant's requests in each period it is known about, oldest first: Invocations' Sum where SageMaker
    published one, and 0 where it published none but the variant's instances reported (the heartbeat metric): an
    endpoint in service publishes Invocations only for periods with requests, so a period without a datapoint is
    "no request" only if the endpoint is seen running then. Periods with neither stay holes (unknown, never idle)."""
    found = {t: 0.0 for t, _ in reported}
    found.update((t, float(v)) for t, v in invocations)
    return sorted(found.items())


def track_label(variant: str) -> str:
    """A variant's track, as reasons and warnings say it."""
    return f"invocations of variant {variant}"


def describe_missing(missing: Sequence[str]) -> str:
    return " and ".join(missing)
