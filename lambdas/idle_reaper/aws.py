"""Thin AWS adapters: fetch facts for the core and carry out its actions, in as few calls as possible.

Every client comes from boto3's normal resolution, so AWS_ENDPOINT_URL points it at a local emulator.
Retries use botocore's adaptive mode (bounded, with backoff on throttling and 5xx, and a client-side rate
limiter that slows a client down once AWS throttles it), so concurrent calls stay inside the API quotas.
Independent calls run concurrently on small bounded thread pools (boto3 clients are thread-safe).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from idle_reaper.core import GroupCapacity, Machine, MachineRecord, Point, Signals, State
from idle_reaper.machine_kinds import InstanceFacts, Lookups, Reservation, SpotRequest
from idle_reaper.policy import (
    MetricSettings,
    PolicyError,
    Settings,
    TagKeys,
    TeamPolicyRef,
    parse_settings,
    parse_team_policy,
)

DEFAULT_TABLE = "idle-reaper-state"
DEFAULT_PREFIX = "/idle-reaper"
METRIC_QUERIES_PER_CALL = 500  # GetMetricData's limit
ASG_INSTANCES_PER_CALL = 50  # DescribeAutoScalingInstances and SetInstanceProtection limit
ASG_GROUPS_PER_CALL = 50  # DescribeAutoScalingGroups: names per call without MaxRecords
FILTER_VALUES = 200  # values in one DescribeInstances filter
STOP_BATCH = 200  # StopInstances documents no limit; smaller batches fail smaller
SPOT_REQUEST_FILTER_VALUES = 200  # request ids in one DescribeSpotInstanceRequests filter
RESERVATIONS_PER_CALL = 100  # capacity reservation ids in one DescribeCapacityReservations call
DATAPOINTS_PER_CALL = 100_800  # GetMetricData returns at most this many before paging
# The on-machine activity collector's metric (agent/README.md), by InstanceId alone. Minimum: a hostile
# local user's high values cannot hide a real low one (see the threat model there).
HUMAN_METRIC_NAMESPACE = "CWAgent"
HUMAN_METRIC_NAME = "idle_reaper_minutes_since_input"
# Errors about the call, not about one machine: splitting the batch would only multiply them.
CALL_WIDE_ERRORS = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
    }
)
DDB_BATCH_GET = 100
# Threads per kind of call. GetMetricData allows 50 transactions/s per account and region: 20 threads at
# ~0.6 s a call stay near 33/s. DynamoDB on-demand absorbs 32 threads of small writes (a new table starts
# at 4,000 writes/s). EC2 and Auto Scaling calls run on 8 threads per kind of action (at 0.2-0.3 s a call,
# 25-40 calls/s); the adaptive retry mode slows a client down when a bucket runs dry (docs/deploying.md).
METRIC_WORKERS = 20
# GetMetricData's default quota, transactions per second per account and region (adjustable), and what one
# call takes in-region: how many calls the shards of one sweep may make at once together.
GET_METRIC_DATA_TPS = 50
GET_METRIC_DATA_SECONDS = 0.6
DDB_WORKERS = 32
ACTION_WORKERS = 8
OWNER_INDEX = "owner-index"  # the state table's GSI on owner_slack_id (the Slack status and keep commands)
AUDIT_TTL_DAYS = 90
CLAIM_TTL_DAYS = 30  # an admin alert for a policy still broken after this long is sent again
RECORD_TTL = timedelta(days=30)  # a machine's record expires this long after its last write (machine gone)
# How long a sweep's claim on a machine lasts: longer than a sweep Lambda may run (15 min at most), so a
# live sweep never loses its claim, and a crashed sweep's claim blocks that machine for one lease at most.
SWEEP_LEASE = timedelta(minutes=15)

_RETRIES = Config(
    retries={"mode": "adaptive", "max_attempts": 5},
    connect_timeout=5,
    read_timeout=30,
    max_pool_connections=DDB_WORKERS,
)


def client(service: str, region: str | None = None) -> Any:
    return boto3.client(service, region_name=region, config=_RETRIES)  # type: ignore[call-overload]


def table_name() -> str:
    return os.environ.get("IDLE_REAPER_TABLE", DEFAULT_TABLE)


def ssm_prefix() -> str:
    return os.environ.get("IDLE_REAPER_SSM_PREFIX", DEFAULT_PREFIX).rstrip("/")


def error_code(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "ClientError"))
    return type(exc).__name__


AwsError = (ClientError, BotoCoreError)


def _wall_clock() -> datetime:
    return datetime.now(UTC)


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


Item = TypeVar("Item")
Result = TypeVar("Result")


def _on_threads(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> list[Result]:
    if len(items) <= 1 or workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="idle-reaper") as pool:
        return list(pool.map(fn, items))


class Concurrency:
    """Where independent calls run: on a bounded thread pool. The latency-model benchmark swaps in a
    runner that schedules the same tasks on virtual lanes (testkit/fake_aws.py LatencyModel)."""

    runner: Callable[[Callable[[Any], Any], Sequence[Any], int], list[Any]] = staticmethod(_on_threads)


def run_concurrently(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> list[Result]:
    """`fn` over `items` on at most `workers` threads, results in order. `fn` handles its own errors."""
    return Concurrency.runner(fn, items, workers)


# ---------------------------------------------------------------------------------------------
# Policies (SSM)


class PolicyStore:
    """Reads `{prefix}/settings` and every `{prefix}/teams/*` in as few calls as possible."""

    def __init__(self, ssm: Any, prefix: str) -> None:
        self.ssm = ssm
        self.prefix = prefix

    @property
    def settings_name(self) -> str:
        return f"{self.prefix}/settings"

    def team_name(self, team: str) -> str:
        return f"{self.prefix}/teams/{team}"

    def load_settings(self) -> tuple[Settings, int | None]:
        """Raises PolicyError when the parameter is invalid; defaults when it does not exist."""
        try:
            param = self.ssm.get_parameter(Name=self.settings_name)["Parameter"]
        except ClientError as exc:
            if error_code(exc) == "ParameterNotFound":
                return Settings(), None
            raise
        return parse_settings(self.settings_name, param["Value"]), int(param["Version"])

    def load_teams(self, settings: Settings) -> dict[str, TeamPolicyRef]:
        refs: dict[str, TeamPolicyRef] = {}
        for param in self.stored_teams():
            team = param.name.rsplit("/", 1)[-1]
            # One team's bad parameter puts that team alone in safe mode; the rest of the fleet is swept.
            # parse_team_policy turns every failure into a PolicyError; the catch-all is a second net.
            try:
                policy = parse_team_policy(param.name, param.value, settings.default_policy)
                refs[team] = TeamPolicyRef(team=team, policy=policy, source=param.name, version=param.version)
            except Exception as exc:
                error = exc if isinstance(exc, PolicyError) else PolicyError(param.name, [f"{type(exc).__name__}"])
                refs[team] = TeamPolicyRef(
                    team=team, policy=None, source=param.name, version=param.version, error=str(error)
                )
        return refs

    # Plain boto3 rather than Powertools parameters: their providers return the value alone, and the
    # version is what decisions record and `policy put` compares. A sweep reads afresh each run (one
    # GetParameter plus one GetParametersByPath per 10 teams), so a change applies at the next sweep.

    def stored_teams(self) -> list[StoredParameter]:
        """Every team parameter with its version, 10 per call (GetParametersByPath's maximum)."""
        found: list[StoredParameter] = []
        pages = self.ssm.get_paginator("get_parameters_by_path").paginate(
            Path=f"{self.prefix}/teams/", Recursive=False, PaginationConfig={"PageSize": 10}
        )
        for page in pages:
            found += [StoredParameter.of(param) for param in page["Parameters"]]
        return found

    def read(self, name: str) -> StoredParameter | None:
        """One parameter with its version and last change; None when it does not exist."""
        try:
            return StoredParameter.of(self.ssm.get_parameter(Name=name)["Parameter"])
        except ClientError as exc:
            if error_code(exc) == "ParameterNotFound":
                return None
            raise

    def put(self, name: str, value: str, overwrite: bool = True) -> int:
        out = self.ssm.put_parameter(Name=name, Value=value, Type="String", Overwrite=overwrite)
        return int(out["Version"])

    def put_if_version(self, name: str, value: str, expected: int | None) -> int:
        """Write `value` only if the parameter is still at version `expected` (None: does not exist).

        SSM has no compare-and-swap. Creation is exact (Overwrite=False fails if someone created it
        first). An update re-reads the version right before PutParameter; a write landing between that
        read and ours (milliseconds) is not prevented, but it is detected afterwards: the new version is
        then not expected + 1 and LostUpdate says which versions were overwritten."""
        current = self.read(name)
        found = current.version if current else None
        if found != expected:
            raise VersionConflict(name, expected, found)
        try:
            version = self.put(name, value, overwrite=expected is not None)
        except ClientError as exc:
            if error_code(exc) == "ParameterAlreadyExists":
                raise VersionConflict(name, expected, None) from None
            raise
        if expected is not None and version != expected + 1:
            raise LostUpdate(name, expected, version)
        return version


@dataclass(frozen=True)
class StoredParameter:
    name: str
    value: str
    version: int
    last_modified: datetime | None

    @classmethod
    def of(cls, param: Mapping[str, Any]) -> StoredParameter:
        modified = param.get("LastModifiedDate")
        return cls(
            name=param["Name"],
            value=param["Value"],
            version=int(param["Version"]),
            last_modified=modified.astimezone(UTC) if isinstance(modified, datetime) else None,
        )


class VersionConflict(Exception):
    """The parameter changed since it was read: nothing was written."""

    def __init__(self, name: str, expected: int | None, found: int | None) -> None:
        self.name, self.expected, self.found = name, expected, found
        was = f"v{expected}" if expected is not None else "absent"
        now = f"v{found}" if found is not None else "created by someone else" if expected is None else "absent"
        super().__init__(f"{name} changed since it was read (was {was}, now {now}); nothing was written")


class LostUpdate(Exception):
    """Our write landed, but another write slipped in between the version check and it."""

    def __init__(self, name: str, expected: int, written: int) -> None:
        self.name, self.expected, self.written = name, expected, written
        others = ", ".join(f"v{v}" for v in range(expected + 1, written))
        super().__init__(
            f"{name} is now v{written} (ours), but {others} was written by someone else between our check and "
            f"our write and is now overwritten; review it with `aws ssm get-parameter-history --name {name}`"
        )


def policy_for(team: str, refs: Mapping[str, TeamPolicyRef], settings: Settings) -> TeamPolicyRef:
    return refs.get(team) or TeamPolicyRef(
        team=team, policy=settings.default_policy, source="settings.default_policy", version=None
    )


# ---------------------------------------------------------------------------------------------
# Fleet (EC2 + Auto Scaling)


@dataclass(frozen=True)
class ActionOutcome:
    instance_id: str
    error: str | None = None  # None: done


class Fleet:
    def __init__(self, ec2: Any, autoscaling: Any) -> None:
        self.ec2 = ec2
        self.autoscaling = autoscaling

    def discover(self, tags: TagKeys) -> list[Machine]:
        """Running machines carrying the team tag (and the opt-in tag, when one is set), joined with their
        ASG membership and protection."""
        return self._describe(tags, [])

    def still_as_listed(self, machines: Sequence[Machine], tags: TagKeys) -> set[str]:
        """Those of `machines` that are still as discovery described them: running, same launch, same group
        and protection. A sweep that listed its machines before another sweep (or a person) acted on them
        must not act again on what it saw then."""
        current = {m.instance_id: m for m in self.describe_ids([m.instance_id for m in machines], tags)}
        return {m.instance_id for m in machines if current.get(m.instance_id) == m}

    def describe_ids(self, instance_ids: Sequence[str], tags: TagKeys) -> list[Machine]:
        """Those of the given machines that discovery would list now (running, tagged), described afresh:
        200 ids a DescribeInstances call, the calls concurrently, then their groups in one go. A shard
        worker's discovery."""

        def describe(batch: Sequence[str]) -> tuple[list[Machine], dict[str, str]]:
            return self._list(tags, [{"Name": "instance-id", "Values": list(batch)}])

        machines: list[Machine] = []
        asg_tagged: dict[str, str] = {}
        batches = list(_chunks(sorted(set(instance_ids)), FILTER_VALUES))
        for found, tagged in run_concurrently(describe, batches, ACTION_WORKERS):
            machines += found
            asg_tagged.update(tagged)
        return self._with_membership(machines, asg_tagged)

    def _describe(self, tags: TagKeys, only: list[dict[str, Any]]) -> list[Machine]:
        return self._with_membership(*self._list(tags, only))

    def _list(self, tags: TagKeys, only: list[dict[str, Any]]) -> tuple[list[Machine], dict[str, str]]:
        """The machines DescribeInstances lists, and the group each member's tag names (instance id -> group)."""
        machines: list[Machine] = []
        asg_tagged: dict[str, str] = {}
        filters = [
            {"Name": "instance-state-name", "Values": ["running"]},
            {"Name": "tag-key", "Values": [tags.team]},
            *only,
        ]
        if tags.managed:
            # The reaper's own opt-in: a cost-allocation `Team` tag alone never makes a machine reapable.
            filters.append({"Name": f"tag:{tags.managed}", "Values": ["true"]})
        for page in self.ec2.get_paginator("describe_instances").paginate(
            Filters=filters, PaginationConfig={"PageSize": 1000}
        ):
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    tag = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                    if not tag.get(tags.team, "").strip():
                        continue  # an empty team tag names no team (and IAM lets us act only on "?*")
                    machines.append(
                        Machine(
                            instance_id=inst["InstanceId"],
                            instance_type=inst["InstanceType"],
                            team=tag[tags.team],
                            launch_time=inst["LaunchTime"].astimezone(UTC),
                            name=tag.get("Name"),
                            owner=tag.get(tags.owner),
                            exempt_tag=tag.get(tags.exempt),
                            hibernation_configured=bool(inst.get("HibernationOptions", {}).get("Configured")),
                            facts=InstanceFacts.of(inst, tag),
                        )
                    )
                    # Only members carry this AWS-managed tag: ask the ASG API about their groups alone.
                    if tag.get("aws:autoscaling:groupName"):
                        asg_tagged[inst["InstanceId"]] = tag["aws:autoscaling:groupName"]
        return machines, asg_tagged

    def _with_membership(self, machines: list[Machine], asg_tagged: Mapping[str, str]) -> list[Machine]:
        membership = self._membership(asg_tagged)
        return [
            replace(m, asg_name=membership[m.instance_id][0], asg_protected=membership[m.instance_id][1])
            if m.instance_id in membership
            else m
            for m in machines
        ]

    def _membership(self, asg_tagged: Mapping[str, str]) -> dict[str, tuple[str, bool]]:
        """Group and scale-in protection of the tagged members, from DescribeAutoScalingGroups on the groups
        their tags name (50 groups a call, each with every member), not 50 instances a call. A tagged
        machine its group does not list (detached) stays standalone, as DescribeAutoScalingInstances said."""
        wanted = set(asg_tagged)

        def describe(names: Sequence[str]) -> dict[str, tuple[str, bool]]:
            found: dict[str, tuple[str, bool]] = {}
            pages = self.autoscaling.get_paginator("describe_auto_scaling_groups").paginate(
                AutoScalingGroupNames=list(names)
            )
            for page in pages:
                for group in page["AutoScalingGroups"]:
                    for item in group.get("Instances", []):
                        if item["InstanceId"] in wanted:
                            found[item["InstanceId"]] = (
                                group["AutoScalingGroupName"],
                                bool(item["ProtectedFromScaleIn"]),
                            )
            return found

        membership: dict[str, tuple[str, bool]] = {}
        batches = list(_chunks(sorted(set(asg_tagged.values())), ASG_GROUPS_PER_CALL))
        for found in run_concurrently(describe, batches, ACTION_WORKERS):
            membership.update(found)
        return membership

    def group_capacity(self, names: Iterable[str]) -> dict[str, GroupCapacity]:
        result: dict[str, GroupCapacity] = {}
        for batch in _chunks(sorted(set(names)), ASG_GROUPS_PER_CALL):
            for page in self.autoscaling.get_paginator("describe_auto_scaling_groups").paginate(
                AutoScalingGroupNames=list(batch)
            ):
                for g in page["AutoScalingGroups"]:
                    result[g["AutoScalingGroupName"]] = GroupCapacity(
                        g["AutoScalingGroupName"], int(g["MinSize"]), int(g["DesiredCapacity"])
                    )
        return result

    def stop(self, instance_ids: Sequence[str], *, hibernate: bool) -> list[ActionOutcome]:
        """StopInstances in batches that bisect on failure, so one bad machine does not block the rest.
        A machine that cannot hibernate falls back to a plain stop alone: the batch bisects down to it
        first, so the others still hibernate (and keep their notebook kernels)."""

        def call(ids: Sequence[str]) -> None:
            try:
                self.ec2.stop_instances(InstanceIds=list(ids), Hibernate=hibernate)
            except ClientError as exc:
                if hibernate and len(ids) == 1 and error_code(exc) == "UnsupportedHibernationConfiguration":
                    self.ec2.stop_instances(InstanceIds=list(ids), Hibernate=False)
                else:
                    raise

        return _batched(instance_ids, STOP_BATCH, call)

    def terminate(self, instance_ids: Sequence[str]) -> list[ActionOutcome]:
        """TerminateInstances in batches that bisect on failure: only ever for machines EC2 cannot stop, on a
        team's opt-in (terminate_unstoppable_after_minutes) or their owner's confirmed click."""

        def call(ids: Sequence[str]) -> None:
            self.ec2.terminate_instances(InstanceIds=list(ids))

        return _batched(instance_ids, STOP_BATCH, call)

    def kind_lookups(self, machines: Sequence[Machine]) -> Lookups:
        """What says what kind each machine is beyond DescribeInstances: the Spot requests of its Spot machines
        (DescribeSpotInstanceRequests filtered by request id, 200 a call) and the capacity reservations machines
        run in (DescribeCapacityReservations, 100 ids a call), each asked only when a listed machine needs it,
        the calls concurrently. A call that fails marks its ids failed: those machines are unknown (never
        stopped) this sweep, and the next sweep asks again."""
        spot_ids = sorted({m.facts.spot_request_id or "" for m in machines if m.facts.needs_spot_request})
        reservation_ids = sorted({m.facts.reservation_id or "" for m in machines if m.facts.reservation_id})

        def spot(batch: Sequence[str]) -> Lookups:
            found: dict[str, SpotRequest] = {}
            try:
                pages = self.ec2.get_paginator("describe_spot_instance_requests").paginate(
                    Filters=[{"Name": "spot-instance-request-id", "Values": list(batch)}]
                )
                for page in pages:
                    for item in page["SpotInstanceRequests"]:
                        request = SpotRequest.of(item)
                        found[request.request_id] = request
            except AwsError as exc:
                return Lookups(failed={i: error_code(exc) for i in batch})
            return Lookups(spot_requests=found)

        def reservations(batch: Sequence[str]) -> Lookups:
            try:
                out = self.ec2.describe_capacity_reservations(CapacityReservationIds=list(batch))
            except AwsError as exc:
                # One id EC2 no longer knows fails the call: split until it stands alone (then: not billing).
                if error_code(exc) == "InvalidCapacityReservationId.NotFound":
                    if len(batch) == 1:
                        return Lookups()
                    half = len(batch) // 2
                    return _merged([reservations(batch[:half]), reservations(batch[half:])])
                return Lookups(failed={i: error_code(exc) for i in batch})
            found = [Reservation.of(item) for item in out.get("CapacityReservations", [])]
            return Lookups(reservations={r.reservation_id: r for r in found})

        tasks: list[Callable[[], Lookups]] = [
            *(lambda b=b: spot(b) for b in _chunks(spot_ids, SPOT_REQUEST_FILTER_VALUES)),
            *(lambda b=b: reservations(b) for b in _chunks(reservation_ids, RESERVATIONS_PER_CALL)),
        ]
        return _merged(run_concurrently(lambda task: task(), tasks, ACTION_WORKERS))

    def start(self, instance_id: str) -> ActionOutcome:
        try:
            self.ec2.start_instances(InstanceIds=[instance_id])
        except AwsError as exc:
            return ActionOutcome(instance_id, f"{error_code(exc)}: {exc}")
        return ActionOutcome(instance_id)

    def set_protection(self, group: str, instance_ids: Sequence[str], *, protected: bool) -> list[ActionOutcome]:
        def call(ids: Sequence[str]) -> None:
            self.autoscaling.set_instance_protection(
                AutoScalingGroupName=group, InstanceIds=list(ids), ProtectedFromScaleIn=protected
            )

        return _batched(instance_ids, ASG_INSTANCES_PER_CALL, call)

    def terminate_in_group(self, instance_id: str) -> ActionOutcome:
        try:
            self.autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=True
            )
        except AwsError as exc:
            return ActionOutcome(instance_id, f"{error_code(exc)}: {exc}")
        return ActionOutcome(instance_id)

    def terminate_in_groups(self, instance_ids: Sequence[str]) -> list[ActionOutcome]:
        """TerminateInstanceInAutoScalingGroup takes one instance: the calls run concurrently instead."""
        return run_concurrently(self.terminate_in_group, list(instance_ids), ACTION_WORKERS)


def _merged(parts: Iterable[Lookups]) -> Lookups:
    spot: dict[str, SpotRequest] = {}
    reserved: dict[str, Reservation] = {}
    failed: dict[str, str] = {}
    for part in parts:
        spot.update(part.spot_requests)
        reserved.update(part.reservations)
        failed.update(part.failed)
    return Lookups(spot, reserved, failed)


def _batched(ids: Sequence[str], size: int, call: Callable[[Sequence[str]], None]) -> list[ActionOutcome]:
    """Batches of `size` run concurrently; each bisects on failure on its own."""
    outcomes: list[ActionOutcome] = []
    for done in run_concurrently(lambda batch: _bisect(batch, call), list(_chunks(ids, size)), ACTION_WORKERS):
        outcomes += done
    return outcomes


def _bisect(ids: Sequence[str], call: Callable[[Sequence[str]], None]) -> list[ActionOutcome]:
    if not ids:
        return []
    try:
        call(ids)
    except AwsError as exc:
        if len(ids) == 1 or error_code(exc) in CALL_WIDE_ERRORS or not isinstance(exc, ClientError):
            return [ActionOutcome(i, f"{error_code(exc)}: {exc}") for i in ids]
        half = len(ids) // 2
        halves = run_concurrently(lambda part: _bisect(part, call), [ids[:half], ids[half:]], 2)
        return halves[0] + halves[1]
    return [ActionOutcome(i) for i in ids]


# ---------------------------------------------------------------------------------------------
# Signals (CloudWatch GetMetricData)


# Maximum of utilization (the busiest moment), Sum of bytes, Minimum of minutes since a person's input.
_STATISTIC = {"network_in": "Sum", "network_out": "Sum", "user": "Minimum"}


@dataclass(frozen=True)
class MetricFetchStats:
    calls: int = 0
    queries: int = 0
    failed_calls: int = 0


class MetricsReader:
    """Packs every machine's CPU, GPU, human-activity (and network) queries into as few GetMetricData calls
    as possible. Every query names one dimension, the machine's own InstanceId: datapoints published for
    any other dimension set (another InstanceId, extra StatsD tags) are never read for this machine."""

    def __init__(self, cloudwatch: Any, workers: int = METRIC_WORKERS) -> None:
        self.cloudwatch = cloudwatch
        self.workers = workers  # GetMetricData calls at once (fewer when shards of one sweep share the quota)
        self.stats = MetricFetchStats()
        self._stats_lock = threading.Lock()  # batches run on several threads

    def _count(self, calls: int = 0, queries: int = 0, failed_calls: int = 0) -> None:
        with self._stats_lock:
            s = self.stats
            self.stats = MetricFetchStats(s.calls + calls, s.queries + queries, s.failed_calls + failed_calls)

    def fetch(
        self,
        instance_ids: Sequence[str],
        metrics: MetricSettings,
        *,
        start: datetime,
        end: datetime,
        network: bool = False,
        human: bool = True,
    ) -> dict[str, Signals]:
        period = metrics.period_seconds
        start = datetime.fromtimestamp(int(start.timestamp()) // period * period, tz=UTC)
        kinds: list[tuple[str, str, str]] = [
            ("cpu", metrics.cpu.namespace, metrics.cpu.name),
            ("gpu", metrics.gpu.namespace, metrics.gpu.name),
        ]
        if human:  # only for policies that read it (human_active_minutes): each query is billed
            kinds.append(("user", HUMAN_METRIC_NAMESPACE, HUMAN_METRIC_NAME))
        if network:
            kinds += [
                ("network_in", metrics.network_in.namespace, metrics.network_in.name),
                ("network_out", metrics.network_out.namespace, metrics.network_out.name),
            ]
        queries: list[dict[str, Any]] = []
        owner: dict[str, tuple[str, str]] = {}
        for index, instance_id in enumerate(instance_ids):
            for kind, namespace, name in kinds:
                query_id = f"{kind[0]}{kind[-1]}{index}"  # e.g. "cu12": unique, starts with a letter
                owner[query_id] = (instance_id, kind)
                stat = _STATISTIC.get(kind, "Maximum")
                queries.append(
                    {
                        "Id": query_id,
                        "MetricStat": {
                            "Metric": {
                                "Namespace": namespace,
                                "MetricName": name,
                                "Dimensions": [{"Name": "InstanceId", "Value": instance_id}],
                            },
                            "Period": period,
                            "Stat": stat,
                        },
                        "ReturnData": True,
                    }
                )
        points: dict[tuple[str, str], list[Point]] = {}
        incomplete: set[str] = set()
        # A long window returns many points per query; keep one call under GetMetricData's datapoint
        # limit so no batch needs a second (re-billed) NextToken page.
        points_per_query = int((end - start).total_seconds()) // period + 1
        per_call = max(1, min(METRIC_QUERIES_PER_CALL, DATAPOINTS_PER_CALL // points_per_query))

        def read(batch: Sequence[dict[str, Any]]) -> None:
            # Each batch fills its own keys of `points`; the set and dict updates are atomic under the GIL.
            try:
                self._fetch_batch(batch, start, end, owner, points, incomplete)
            except AwsError:
                # A batch we could not read: those machines are unknown, the rest go on.
                incomplete.update(owner[q["Id"]][0] for q in batch)
                self._count(failed_calls=1)

        run_concurrently(read, list(_chunks(queries, per_call)), self.workers)
        result: dict[str, Signals] = {}
        for instance_id in instance_ids:
            series = {kind: sorted(points.get((instance_id, kind), [])) for kind, _, _ in kinds}
            result[instance_id] = Signals(
                cpu=series["cpu"],
                gpu=series["gpu"],
                network_in=series.get("network_in", []),
                network_out=series.get("network_out", []),
                complete=instance_id not in incomplete,
                user=series.get("user", []),
            )
        return result

    def _fetch_batch(
        self,
        batch: Sequence[dict[str, Any]],
        start: datetime,
        end: datetime,
        owner: Mapping[str, tuple[str, str]],
        points: dict[tuple[str, str], list[Point]],
        incomplete: set[str],
    ) -> None:
        status: dict[str, str] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "MetricDataQueries": list(batch),
                "StartTime": start,
                "EndTime": end,
                "ScanBy": "TimestampAscending",
            }
            if token:
                kwargs["NextToken"] = token
            response = self.cloudwatch.get_metric_data(**kwargs)
            self._count(calls=1, queries=len(batch))
            for res in response["MetricDataResults"]:
                key = owner[res["Id"]]
                points.setdefault(key, []).extend(
                    (ts.astimezone(UTC), float(v)) for ts, v in zip(res["Timestamps"], res["Values"], strict=True)
                )
                status[res["Id"]] = res.get("StatusCode", "Complete")
            token = response.get("NextToken")
            if not token:
                break
        for query_id, code in status.items():
            if code != "Complete":  # PartialData left after the last page, InternalError, Forbidden
                incomplete.add(owner[query_id][0])
        for q in batch:
            if q["Id"] not in status:
                incomplete.add(owner[q["Id"]][0])


# ---------------------------------------------------------------------------------------------
# Lifecycle state (DynamoDB) and its in-memory twin


@dataclass(frozen=True)
class AuditEntry:
    instance_id: str
    at: datetime
    entry: Mapping[str, Any]


def _audit_item(a: AuditEntry) -> dict[str, Any]:
    return {
        "pk": f"machine#{a.instance_id}",
        "sk": f"audit#{a.at.isoformat()}#{a.entry.get('action', '')}",
        "expires_at": int((a.at + timedelta(days=AUDIT_TTL_DAYS)).timestamp()),
        "entry": json.dumps(a.entry, default=str, sort_keys=True),
    }


class StateStore(Protocol):
    """The state table. A sweep that posts or acts on a machine first claims it: the claim rides on the
    conditional write of the machine's record, so claiming costs no extra call, and every later write by
    another sweep fails until the claim is released or its lease (SWEEP_LEASE, on the store's clock) ends."""

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]: ...

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        """Write `record` if the stored version is record.version - 1 (or absent for version 1).
        False when another writer got there first.

        With `holder` (a sweep's id) the write also needs that no other sweep holds a live claim on the
        machine; `hold=True` leaves `holder`'s claim on it for SWEEP_LEASE, `hold=False` releases it.
        Without a holder (a person's answer) the write also needs that no sweep holds a live claim: a sweep
        that claimed the machine may be stopping it right now, and a "keep" recorded in that moment would
        be a promise the machine breaks. The person is asked to try again. Every write sets the TTL."""
        ...

    def claim_of(self, instance_id: str) -> tuple[str, datetime] | None:
        """The sweep holding a live claim on the machine, and until when; None when free."""
        ...

    def audit(self, instance_id: str, at: datetime, entry: Mapping[str, Any]) -> None: ...

    def audit_many(self, entries: Sequence[AuditEntry]) -> list[str]:
        """Write audit items concurrently; the instance ids whose item could not be written."""
        ...

    def all_records(self) -> list[MachineRecord]: ...

    def put_lookup(self, key: str, value: str, expires: datetime) -> None: ...

    def get_lookup(self, key: str, now: datetime) -> str | None: ...

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        """put_lookup only if the value is still `expected` (None: absent or expired), for read-modify-write
        of a value several sweeps (or shards of one) update at once; False when someone wrote it first."""
        ...

    def claim_once(self, key: str, at: datetime) -> bool:
        """True for the first caller ever to claim `key` (a conditional write), False for every later one."""
        ...

    def release_claim(self, key: str) -> None: ...

    def records_of_owner(self, slack_user_id: str) -> list[MachineRecord]:
        """The machines whose owner is this Slack user (the table's owner-index; never a scan)."""
        ...


_DATE_FIELDS = {
    "idle_since",
    "warned_at",
    "warning_delivered_at",
    "snoozed_until",
    "last_action_at",
    "updated_at",
    "observed_at",
    "stop_not_before",
    "warning_post_started_at",
    "quiet_stop_at",
    "action_refused_at",
}


def record_to_item(record: MachineRecord) -> dict[str, Any]:
    item: dict[str, Any] = {"pk": f"machine#{record.instance_id}", "sk": "state"}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None:
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, State):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        item[f.name] = value
    return item


def item_to_record(item: Mapping[str, Any]) -> MachineRecord:
    values: dict[str, Any] = {}
    for f in fields(MachineRecord):
        if f.name not in item:
            continue
        value = item[f.name]
        if f.name in _DATE_FIELDS:
            value = datetime.fromisoformat(value)
        elif f.name == "state":
            value = State(value)
        elif f.name in ("version", "snoozes_today"):
            value = int(value)
        elif f.name == "messages":
            value = tuple(value)
        values[f.name] = value
    return MachineRecord(**values)


class DynamoStateStore:
    def __init__(self, dynamodb: Any, table: str, clock: Callable[[], datetime] | None = None) -> None:
        from boto3.dynamodb.types import TypeDeserializer, TypeSerializer

        self.dynamodb = dynamodb
        self.table = table
        # Wall time, not the sweep's (possibly simulated) clock: leases and TTLs are about real processes.
        self.clock = clock or _wall_clock
        self._ser = TypeSerializer()
        self._de = TypeDeserializer()

    def _wire(self, item: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self._ser.serialize(v) for k, v in item.items()}

    def _plain(self, item: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self._de.deserialize(v) for k, v in item.items()}

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        def get(batch: Sequence[str]) -> list[MachineRecord]:
            found: list[MachineRecord] = []
            request = {self.table: {"Keys": [self._wire({"pk": f"machine#{i}", "sk": "state"}) for i in batch]}}
            while request:
                out = self.dynamodb.batch_get_item(RequestItems=request)
                found += [item_to_record(self._plain(raw)) for raw in out["Responses"].get(self.table, [])]
                request = out.get("UnprocessedKeys") or {}
            return found

        batches = list(_chunks(sorted(set(instance_ids)), DDB_BATCH_GET))
        return {r.instance_id: r for found in run_concurrently(get, batches, DDB_WORKERS) for r in found}

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        now = self.clock()
        item = {**record_to_item(record), "expires_at": int((now + RECORD_TTL).timestamp())}
        condition = "(attribute_not_exists(pk) OR version = :previous)"
        values: dict[str, Any] = {":previous": record.version - 1}
        # Free, lapsed, or (for a sweep) ours. claim_until is epoch seconds: DynamoDB compares numbers.
        values[":now"] = int(now.timestamp())
        if holder is not None:
            condition += " AND (attribute_not_exists(claim_until) OR claim_until <= :now OR claim_owner = :holder)"
            values[":holder"] = holder
            if hold:
                item.update(claim_owner=holder, claim_until=int((now + SWEEP_LEASE).timestamp()))
        else:
            condition += " AND (attribute_not_exists(claim_until) OR claim_until <= :now)"
        return self._put_if(item, condition, values)

    def _put_if(self, item: dict[str, Any], condition: str, values: dict[str, Any], **names: str) -> bool:
        """A conditional PutItem: False when the condition does not hold (someone wrote first)."""
        try:
            self.dynamodb.put_item(
                TableName=self.table,
                Item=self._wire(item),
                ConditionExpression=condition,
                ExpressionAttributeValues=self._wire(values),
                **({"ExpressionAttributeNames": {f"#{k}": v for k, v in names.items()}} if names else {}),
            )
        except ClientError as exc:
            if error_code(exc) == "ConditionalCheckFailedException":
                return False
            raise
        return True

    def claim_of(self, instance_id: str) -> tuple[str, datetime] | None:
        """The sweep holding a live claim on the machine, and until when; None when free."""
        out = self.dynamodb.get_item(
            TableName=self.table, Key=self._wire({"pk": f"machine#{instance_id}", "sk": "state"}), ConsistentRead=True
        )
        item = self._plain(out.get("Item", {}))
        if "claim_until" not in item:
            return None
        until = datetime.fromtimestamp(int(item["claim_until"]), tz=UTC)
        return (str(item["claim_owner"]), until) if until > self.clock() else None

    def audit(self, instance_id: str, at: datetime, entry: Mapping[str, Any]) -> None:
        self.dynamodb.put_item(TableName=self.table, Item=self._wire(_audit_item(AuditEntry(instance_id, at, entry))))

    def audit_many(self, entries: Sequence[AuditEntry]) -> list[str]:
        """PutItem per entry, concurrently. Not BatchWriteItem: it can delete any item, and IAM cannot
        tell its puts from its deletes, so the sweep is not granted it (tests/infra/test_iam.py)."""

        def write(a: AuditEntry) -> str | None:
            try:
                self.audit(a.instance_id, a.at, a.entry)
            except AwsError:
                return a.instance_id
            return None

        return [i for i in run_concurrently(write, list(entries), DDB_WORKERS) if i is not None]

    def all_records(self) -> list[MachineRecord]:
        records = []
        for page in self.dynamodb.get_paginator("scan").paginate(
            TableName=self.table,
            FilterExpression="sk = :state",
            ExpressionAttributeValues=self._wire({":state": "state"}),
        ):
            records += [item_to_record(self._plain(raw)) for raw in page["Items"]]
        return records

    def put_lookup(self, key: str, value: str, expires: datetime) -> None:
        """A small keyed value with a TTL: Slack button references, owner email -> Slack id."""
        item = {"pk": f"lookup#{key}", "sk": "lookup", "value": value, "expires_at": int(expires.timestamp())}
        self.dynamodb.put_item(TableName=self.table, Item=self._wire(item))

    def get_lookup(self, key: str, now: datetime) -> str | None:
        out = self.dynamodb.get_item(
            TableName=self.table, Key=self._wire({"pk": f"lookup#{key}", "sk": "lookup"}), ConsistentRead=True
        )
        item = self._plain(out.get("Item", {}))
        # DynamoDB's TTL deletes lazily: an expired item may still be read.
        if not item or int(item["expires_at"]) <= now.timestamp():
            return None
        return str(item["value"])

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        item = {"pk": f"lookup#{key}", "sk": "lookup", "value": value, "expires_at": int(expires.timestamp())}
        values: dict[str, Any] = {":now": int(now.timestamp())}
        if expected is None:
            condition = "attribute_not_exists(pk) OR expires_at <= :now"
        else:
            condition, values[":expected"] = "#value = :expected AND expires_at > :now", expected
        return self._put_if(item, condition, values, **({"value": "value"} if expected is not None else {}))

    def claim_once(self, key: str, at: datetime) -> bool:
        # Expires after CLAIM_TTL_DAYS, so something left broken that long is claimed (and alerted) again.
        item = {
            "pk": f"once#{key}",
            "sk": "once",
            "claimed_at": at.isoformat(),
            "expires_at": int((at + timedelta(days=CLAIM_TTL_DAYS)).timestamp()),
        }
        try:
            self.dynamodb.put_item(
                TableName=self.table, Item=self._wire(item), ConditionExpression="attribute_not_exists(pk)"
            )
        except ClientError as exc:
            if error_code(exc) == "ConditionalCheckFailedException":
                return False
            raise
        return True

    def release_claim(self, key: str) -> None:
        self.dynamodb.delete_item(TableName=self.table, Key=self._wire({"pk": f"once#{key}", "sk": "once"}))

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        out = self.dynamodb.query(
            TableName=self.table,
            KeyConditionExpression="pk = :pk AND begins_with(sk, :audit)",
            ExpressionAttributeValues=self._wire({":pk": f"machine#{instance_id}", ":audit": "audit#"}),
        )
        return [json.loads(self._plain(raw)["entry"]) for raw in out["Items"]]

    def records_of_owner(self, slack_user_id: str) -> list[MachineRecord]:
        records = []
        for page in self.dynamodb.get_paginator("query").paginate(
            TableName=self.table,
            IndexName=OWNER_INDEX,
            KeyConditionExpression="owner_slack_id = :owner",
            ExpressionAttributeValues=self._wire({":owner": slack_user_id}),
        ):
            records += [item_to_record(self._plain(raw)) for raw in page["Items"] if raw["sk"]["S"] == "state"]
        return records


class InMemoryStateStore:
    """The state table's twin for replay, benchmarks and unit tests: same conditional semantics."""

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self.records: dict[str, MachineRecord] = {}
        self.audits: list[tuple[str, datetime, dict[str, Any]]] = []
        self.lookups: dict[str, tuple[str, datetime]] = {}
        self.claims: dict[str, datetime] = {}
        self.leases: dict[str, tuple[str, datetime]] = {}  # instance id -> (sweep holding it, until)
        self.expires: dict[str, datetime] = {}  # instance id -> when its record's TTL ends
        self.clock = clock or _wall_clock
        self._lock = threading.RLock()  # a sweep saves from several threads; check-and-set must be atomic

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        return {i: self.records[i] for i in instance_ids if i in self.records}

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        with self._lock:
            return self._save(record, holder, hold=hold)

    def _save(self, record: MachineRecord, holder: str | None, *, hold: bool) -> bool:
        now, instance_id = self.clock(), record.instance_id
        stored = self.records.get(instance_id)
        if stored is not None and stored.version != record.version - 1:
            return False
        claim = self.claim_of(instance_id)
        if claim is not None and claim[0] != holder:  # a person (holder None) never writes over a live claim
            return False
        self.records[instance_id] = record
        self.expires[instance_id] = now + RECORD_TTL
        if holder is not None and hold:
            self.leases[instance_id] = (holder, now + SWEEP_LEASE)
        else:
            self.leases.pop(instance_id, None)
        return True

    def claim_of(self, instance_id: str) -> tuple[str, datetime] | None:
        lease = self.leases.get(instance_id)
        return lease if lease is not None and lease[1] > self.clock() else None

    def audit(self, instance_id: str, at: datetime, entry: Mapping[str, Any]) -> None:
        self.audits.append((instance_id, at, dict(entry)))

    def audit_many(self, entries: Sequence[AuditEntry]) -> list[str]:
        for a in entries:
            self.audit(a.instance_id, a.at, a.entry)
        return []

    def all_records(self) -> list[MachineRecord]:
        return list(self.records.values())

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        return [entry for i, _, entry in self.audits if i == instance_id]

    def put_lookup(self, key: str, value: str, expires: datetime) -> None:
        self.lookups[key] = (value, expires)

    def get_lookup(self, key: str, now: datetime) -> str | None:
        return self._live_lookup(key, now)

    def _live_lookup(self, key: str, now: datetime) -> str | None:
        # Not get_lookup: a subclass that counts calls would count this internal read as a request.
        value, expires = self.lookups.get(key, ("", now))
        return value if expires > now else None

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        with self._lock:  # shards swept on threads share this store: check-and-set must be atomic
            if self._live_lookup(key, now) != expected:
                return False
            self.lookups[key] = (value, expires)
            return True

    def claim_once(self, key: str, at: datetime) -> bool:
        with self._lock:
            if key in self.claims:
                return False
            self.claims[key] = at
            return True

    def release_claim(self, key: str) -> None:
        self.claims.pop(key, None)

    def records_of_owner(self, slack_user_id: str) -> list[MachineRecord]:
        return [r for r in self.records.values() if r.owner_slack_id == slack_user_id]


def create_table(dynamodb: Any, table: str) -> bool:
    """For `idle-reaper init` and local use; the CDK stack creates the table in AWS. True if created."""
    try:
        dynamodb.create_table(
            TableName=table,
            AttributeDefinitions=[
                {"AttributeName": "pk", "AttributeType": "S"},
                {"AttributeName": "sk", "AttributeType": "S"},
                {"AttributeName": "owner_slack_id", "AttributeType": "S"},
            ],
            KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
            GlobalSecondaryIndexes=[
                {
                    "IndexName": OWNER_INDEX,
                    "KeySchema": [{"AttributeName": "owner_slack_id", "KeyType": "HASH"}],
                    "Projection": {"ProjectionType": "ALL"},
                }
            ],
            BillingMode="PAY_PER_REQUEST",
        )
    except ClientError as exc:
        if error_code(exc) == "ResourceInUseException":
            return False
        raise
    dynamodb.get_waiter("table_exists").wait(TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 30})
    return True


# ---------------------------------------------------------------------------------------------
# Regions no stack watches


@dataclass(frozen=True)
class RegionCount:
    region: str
    running: int  # every running instance
    opted_in: int  # of those, carrying the team tag and the opt-in tag: what a stack there would sweep


def current_region() -> str:
    return boto3.session.Session().region_name or "us-east-1"


def listed_regions() -> list[str]:
    """The regions with an idle-reaper stack, as the CDK app lists them (IDLE_REAPER_REGIONS)."""
    return [r.strip() for r in os.environ.get("IDLE_REAPER_REGIONS", "").split(",") if r.strip()]


def watched_regions(home: str) -> list[str]:
    """The regions with an idle-reaper stack; `home` first, and at least."""
    return [home, *(r for r in listed_regions() if r != home)]


def home_region(here: str) -> str:
    """The first region the stack lists: the one that counts the regions without a stack, once for all."""
    return next(iter(listed_regions()), here)


def count_unwatched(ec2_in: Callable[[str], Any], watched: Sequence[str], tags: TagKeys) -> list[RegionCount]:
    """Running instances in every enabled region that no stack watches: without this, a team that
    launches in another region is never looked at, in silence. One DescribeRegions call, then one
    paginated DescribeInstances per unwatched region (1,000 a page, only the tags read)."""
    regions = {r["RegionName"] for r in ec2_in(watched[0]).describe_regions()["Regions"]}  # enabled ones
    counts = []
    for region in sorted(regions - set(watched)):
        running = opted_in = 0
        pages = (
            ec2_in(region)
            .get_paginator("describe_instances")
            .paginate(
                Filters=[{"Name": "instance-state-name", "Values": ["running"]}], PaginationConfig={"PageSize": 1000}
            )
        )
        for page in pages:
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    tag = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                    running += 1
                    opted_in += bool(tag.get(tags.team, "").strip()) and (
                        tags.managed is None or tag.get(tags.managed) == "true"
                    )
        if running:
            counts.append(RegionCount(region, running, opted_in))
    return counts


UNWATCHED_KEY = "unwatched-regions"  # the last daily count, a lookup item in the home region's table
UNWATCHED_KEEP = timedelta(days=8)


def save_unwatched(store: StateStore, counts: Sequence[RegionCount], at: datetime) -> None:
    value = {"counted_at": at.isoformat(), "regions": [c.__dict__ for c in counts]}
    store.put_lookup(UNWATCHED_KEY, json.dumps(value), at + UNWATCHED_KEEP)


def last_unwatched(store: StateStore, now: datetime) -> tuple[datetime, list[RegionCount]] | None:
    """The last daily count the sweep stored (None: never counted, or over a week ago)."""
    raw = store.get_lookup(UNWATCHED_KEY, now)
    if raw is None:
        return None
    value = json.loads(raw)
    return datetime.fromisoformat(value["counted_at"]), [RegionCount(**c) for c in value["regions"]]
