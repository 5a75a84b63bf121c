"""The machines: EC2 instances and their Auto Scaling groups, discovered in bulk and acted on in batches."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from idle_reaper.aws.clients import (
    CALL_WIDE_ERRORS,
    AwsError,
    chunks,
    error_code,
    for_this_process,
    run_concurrently,
    run_in_processes,
)
from idle_reaper.aws.limits import (
    EC2_DESCRIBE_QUOTA,
    EC2_STOP_QUOTAS,
    EC2_TERMINATE_QUOTAS,
    MUTATING_WAIT_SECONDS,
    Pace,
    Pacing,
    ResourcePace,
    paced_pages,
)
from idle_reaper.core.endpoints import Restore, endpoint_name, is_endpoint_id, is_studio_id
from idle_reaper.core.kinds import InstanceFacts, Lookups, Reservation, SpotRequest, is_ec2_id
from idle_reaper.core.reports import GroupCapacity
from idle_reaper.core.signals import Machine
from idle_reaper.core.studio import AppRestore
from idle_reaper.policy import (
    TagKeys,
)

if TYPE_CHECKING:
    from idle_reaper.aws.endpoints import Endpoints
    from idle_reaper.aws.notebooks import NotebookInstances
    from idle_reaper.aws.studio import StudioApps

ASG_INSTANCES_PER_CALL = 50  # DescribeAutoScalingInstances and SetInstanceProtection limit
ASG_GROUPS_PER_CALL = 50  # DescribeAutoScalingGroups: names per call without MaxRecords
FILTER_VALUES = 200  # values in one DescribeInstances filter
STOP_BATCH = 200  # StopInstances documents no limit; smaller batches fail smaller
SPOT_REQUEST_FILTER_VALUES = 200  # request ids in one DescribeSpotInstanceRequests filter
RESERVATIONS_PER_CALL = 100  # capacity reservation ids in one DescribeCapacityReservations call
ACTION_WORKERS = 8
# Child processes the planner lists the zones (and a full zone's parts) in, at most (Lambda's largest function
# has 6 vCPUs): parsing DescribeInstances is botocore CPU, about 0.35 ms an instance (benchmarks/botocore_cpu.py),
# which threads cannot overlap under the GIL; processes can, one vCPU each.
LISTING_PROCESSES = 6
PAGE_SIZE = 1000  # DescribeInstances' largest page


# ---------------------------------------------------------------------------------------------
# Listing a zone in parts: by the last hex digit of the instance id


# An instance id is "i-" and 8 or 17 lowercase hex digits, so its last character is one of these 16, and the
# EC2 filter value "i-*<d>" matches exactly the ids ending in <d>: EC2's describe filters take wildcards ("*"
# zero or more characters, "?" zero or one; Amazon EC2 User Guide, "List and filter using the CLI and API"), and
# a value matches the whole id, not a substring of it. So these parts are disjoint and every id is in one
# (`partition_errors` proves it of any partition by suffixes; tests check it of this one and refuse wrong ones).
ID_DIGITS = "0123456789abcdef"
ID_PARTS: tuple[tuple[str, ...], ...] = tuple((f"i-*{d}",) for d in ID_DIGITS)
_ID_PREFIX = "i-*"


def matches_id_part(instance_id: str, value: str) -> bool:
    """Whether the instance-id filter value `value` ("i-*" and a suffix of hex digits) matches `instance_id`."""
    return value.startswith(_ID_PREFIX) and instance_id.startswith("i-") and instance_id.endswith(value[3:])


def partition_errors(parts: Sequence[Sequence[str]]) -> list[str]:
    """Why `parts` (each the instance-id filter values of one part, OR-ed) does not split every instance id into
    exactly one part; empty when it does. Values must be "i-*" and a suffix of k hex digits (the same k for all):
    an id's last k digits are then one of the 16**k strings of k digits, and an id is in the parts holding its
    suffix; so the parts are a partition if and only if every such string is the suffix of exactly one value."""
    values = [v for part in parts for v in part]
    errors = [
        f"{v!r} is not 'i-*' and hex digits"
        for v in values
        if not v.startswith(_ID_PREFIX) or not v[3:] or set(v[3:]) - set(ID_DIGITS)
    ]
    if errors or not values:
        return errors or ["no parts"]
    lengths = {len(v) - 3 for v in values}
    if len(lengths) > 1:
        return [f"suffixes of different lengths {sorted(lengths)}: the parts cannot be shown disjoint"]
    (k,) = lengths
    if k > 8:
        return [f"suffixes of {k} digits: an id may have only 8"]
    owners: dict[str, int] = {}
    for index, part in enumerate(parts):
        for v in part:
            if v[3:] in owners:
                errors.append(f"ids ending in {v[3:]!r} are in parts {owners[v[3:]]} and {index}")
            owners[v[3:]] = index
    if len(owners) < len(ID_DIGITS) ** k:
        errors.append(f"{len(ID_DIGITS) ** k - len(owners)} suffixes of {k} digits are in no part")
    return errors


class ListingIncomplete(BotoCoreError):
    """EC2's answers to a listing in parts do not add up to the whole (a part listed an id outside it, two parts
    listed one machine, or the parts missed a running machine): the fleet is not swept from it."""

    fmt = "{what}"


Result = TypeVar("Result")


# ---------------------------------------------------------------------------------------------
# Fleet (EC2 + Auto Scaling)


def _joined(listings: Iterable[tuple[list[Machine], dict[str, str]]]) -> tuple[list[Machine], dict[str, str]]:
    """Listings of disjoint parts of the fleet as one: the machines, and instance id -> the group its tag names."""
    machines: list[Machine] = []
    asg_tagged: dict[str, str] = {}
    for found, tagged in listings:
        machines += found
        asg_tagged.update(tagged)
    return machines, asg_tagged


def _filters(tags: TagKeys, only: list[dict[str, Any]]) -> list[dict[str, Any]]:
    filters = [
        {"Name": "instance-state-name", "Values": ["running"]},
        {"Name": "tag-key", "Values": [tags.team]},
        *only,
    ]
    if tags.managed:
        # The reaper's own opt-in: a cost-allocation `Team` tag alone never makes a machine reapable.
        filters.append({"Name": f"tag:{tags.managed}", "Values": ["true"]})
    return filters


def _machines_of(pages: Iterable[Mapping[str, Any]], tags: TagKeys) -> tuple[list[Machine], dict[str, str]]:
    machines: list[Machine] = []
    asg_tagged: dict[str, str] = {}
    for page in pages:
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


def _listed_once(parts: Sequence[Sequence[str]], listed: Sequence[Sequence[Machine]]) -> set[str]:
    """The ids the parts listed, each checked to be of its own part and listed once (ListingIncomplete if not)."""
    seen: set[str] = set()
    for values, machines in zip(parts, listed, strict=True):
        for m in machines:
            if not any(matches_id_part(m.instance_id, v) for v in values) or m.instance_id in seen:
                raise ListingIncomplete(
                    what=f"the listing by instance id returned {m.instance_id} for the part {list(values)}, "
                    "or twice: EC2 did not apply the instance-id filter as documented"
                )
            seen.add(m.instance_id)
    return seen


Ec2 = tuple[Any, Pace]  # an EC2 client, and the pace its Describe* requests wait on


def _spread(ec2: Ec2, processes: int, fn: Callable[[Ec2, Any], Result], items: Sequence[Any]) -> list[Result]:
    """`fn((ec2 client, pace), item)` over `items`, results in order: in up to `processes` child processes
    (items dealt round-robin, threads within each, a client of the child's own and its share of the pace), else on
    threads here."""
    processes = min(processes, len(items))
    if processes <= 1:
        return run_concurrently(lambda item: fn(ec2, item), items, ACTION_WORKERS)
    client, pace = ec2

    def share_of(share: tuple[Sequence[Any], Pace]) -> list[Result]:
        own = (for_this_process(client), share[1])
        return run_concurrently(lambda item: fn(own, item), share[0], ACTION_WORKERS)

    with pace.handed_out(processes) as paces:
        shares = run_in_processes(share_of, [(items[i::processes], paces[i]) for i in range(processes)])
    return [shares[i % processes][i // processes] for i in range(len(items))]


Listing = tuple[list[Machine], dict[str, str]]  # machines, and instance id -> the group its tag names
Split = Sequence[tuple[list[dict[str, Any]], set[str]]]  # the full zones: each one's filters, its first page's ids


def _described(ec2: Ec2, tags: TagKeys, only: list[dict[str, Any]]) -> Listing:
    """The machines DescribeInstances lists through `ec2` (every page, each paced), and the group each member's
    tag names (instance id -> group)."""
    client, pace = ec2
    return _machines_of(
        paced_pages(pace, client.describe_instances, Filters=_filters(tags, only), MaxResults=PAGE_SIZE), tags
    )


def _listed_full_zones(ec2: Ec2, processes: int, tags: TagKeys, split: Split) -> list[Listing]:
    """The full zones listed in parts (`_listed_in_parts`); or, when EC2 answered the parts wrongly (an id outside
    its part, or twice, or a first page's machine in no part), listed page after page as before the parts. AWS
    documents filter wildcards for describe calls in general, not instance-id by name: an EC2 that does not apply
    them costs a sweep its speed, never its machines."""
    try:
        return _listed_in_parts(ec2, processes, tags, split)
    except ListingIncomplete as exc:
        logging.getLogger(__name__).warning("listing full zones in sequence: %s", exc)
        units = [unit for unit, _ in split]
        return _spread(ec2, processes, lambda own, unit: _described(own, tags, unit), units)


def _listed_in_parts(ec2: Ec2, processes: int, tags: TagKeys, split: Split) -> list[Listing]:
    """Each unit (its filters, and the ids its first page listed) listed again in ID_PARTS parts, side by
    side, and checked: a part lists only ids of its own part (so no machine twice), and every machine the
    unit's first page listed is listed by a part or no longer running as discovery lists it (so none
    missed: an EC2 that took the wildcard literally, or ignored it, raises ListingIncomplete here, never
    sweeps a part)."""
    parts = [(unit, values) for unit, _ in split for values in ID_PARTS]
    listed = _spread(
        ec2,
        processes,
        lambda own, part: _described(own, tags, [*part[0], {"Name": "instance-id", "Values": list(part[1])}]),
        parts,
    )
    seen = _listed_once([values for _, values in parts], [machines for machines, _ in listed])
    missed = sorted(set().union(*(first for _, first in split)) - seen)
    if missed:  # listed by a first page, by no part: stopped (or untagged) since, or missed by the parts
        batches = list(chunks(missed, FILTER_VALUES))
        still = _joined(
            run_concurrently(
                lambda batch: _described(ec2, tags, [{"Name": "instance-id", "Values": list(batch)}]),
                batches,
                ACTION_WORKERS,
            )
        )[0]
        if still:
            raise ListingIncomplete(
                what=f"{len(still)} running machine(s) (such as {still[0].instance_id}) were listed by a zone's "
                "first page but by none of its parts by instance id: EC2 did not apply the instance-id "
                "wildcard as documented"
            )
    return listed


@dataclass(frozen=True)
class ActionOutcome:
    instance_id: str
    error: str | None = None  # None: done


class Fleet:
    """EC2 machines and, when given, SageMaker notebook instances, endpoints and Studio apps: one list of machines,
    and actions routed by id (an EC2 instance id, a notebook's name, endpoint:<name>, studio:<domain>:<...>)."""

    def __init__(
        self,
        ec2: Any,
        autoscaling: Any,
        notebooks: NotebookInstances | None = None,
        *,
        listing_processes: int = 1,
        endpoints: Endpoints | None = None,
        studio: StudioApps | None = None,
    ) -> None:
        self.ec2 = ec2
        self.autoscaling = autoscaling
        self.notebooks = notebooks
        self.endpoints = endpoints
        # Why endpoints could not be listed at the last discovery (None: they were, or none asked).
        self.endpoints_unlisted: str | None = None
        self.studio = studio
        self.studio_unlisted: str | None = None  # and Studio apps
        self.studio_failed: tuple[str, ...] = ()  # the Studio apps the last discovery listed Failed, as endpoints'
        # The endpoints the last discovery listed Failed (machine ids): sweep/endpoints.py tell_failed_bring_backs.
        self.endpoints_failed: tuple[str, ...] = ()
        # Child processes a discovery lists in (1: threads of this process; the planner uses more).
        self.listing_processes = max(1, min(listing_processes, LISTING_PROCESSES))
        # Why notebook instances could not be listed at the last discovery (None: they were, or none asked).
        self.notebooks_unlisted: str | None = None
        # What every EC2 Describe* request of this Fleet waits on: EC2's bucket for the account and region, or this
        # worker's share of it (shared_by).
        self.describe_pace = Pace(EC2_DESCRIBE_QUOTA)
        self.stop_pace = ResourcePace("StopInstances", EC2_STOP_QUOTAS)  # and the others of EC2's mutating buckets
        self.terminate_pace = ResourcePace("TerminateInstances", EC2_TERMINATE_QUOTAS)

    @property
    def _described_by(self) -> Ec2:
        return self.ec2, self.describe_pace

    def shared_by(self, workers: int, *, after_listing: bool = False) -> Fleet:
        """This Fleet for one of `workers` working in its account and region at once (the hub's shards, a large
        member unit's parts): its Describe* requests, and its stops and terminations, paced on its share of EC2's
        buckets, so that together they stay inside them. `after_listing`: the account-region was listed just before
        (the planner's listing, moments before the hub's shards start), so the Describe* bucket may be empty: none of
        its burst is counted on, only its refill. A copy: the same clients (and the same kind of Fleet)."""
        shared = copy.copy(self)
        shared.endpoints_failed = shared.studio_failed = ()  # the lister's to tell (sweep/endpoints.py), not again
        shared.describe_pace = Pace(EC2_DESCRIBE_QUOTA.share(workers), full=not after_listing)
        shared.stop_pace = self.stop_pace.shared_by(workers)
        shared.terminate_pace = self.terminate_pace.shared_by(workers)
        return shared

    def discover(
        self, tags: TagKeys, *, notebooks: bool = True, endpoints: bool = True, studio: bool = False
    ) -> list[Machine]:
        """The EC2 machines, the notebook instances, the endpoints and (a sweep's listing: `studio`) the Studio apps.
        A SageMaker listing that fails leaves its kind out of this sweep (`*_unlisted` say why)."""
        machines = self._discover_ec2(tags)
        self.notebooks_unlisted = self.endpoints_unlisted = self.studio_unlisted = None
        self.endpoints_failed = self.studio_failed = ()
        if self.notebooks is not None and notebooks:
            try:
                machines += self.notebooks.discover(tags)
            except AwsError as exc:
                self.notebooks_unlisted = f"{error_code(exc)}: {exc}"
        if self.endpoints is not None and endpoints:
            listed, self.endpoints_failed, self.endpoints_unlisted = _listed_with_failed(self.endpoints, tags)
            machines += listed
        if self.studio is not None and studio:
            listed, self.studio_failed, self.studio_unlisted = _listed_with_failed(self.studio, tags)
            machines += listed
        return machines

    def _discover_ec2(self, tags: TagKeys) -> list[Machine]:
        """Running machines carrying the team tag (and the opt-in tag, when one is set), joined with their
        ASG membership and protection.

        DescribeInstances pages follow each other (each needs the last one's token): 200 pages at 200,000
        machines. So the fleet is listed in parts that list side by side: first by Availability Zone (every
        instance is in exactly one), one page each; a zone whose first page comes back full with a NextToken
        is then listed again in ID_PARTS parts, by the last hex digit of the instance id (`_listed_in_parts`),
        however the fleet spreads over the zones. With `listing_processes` > 1 each round runs in that many
        child processes (the units dealt round-robin, threads within each), so botocore's parsing runs on as
        many vCPUs; else on threads of this process. Any part's failure fails the listing, as one listing's
        would: a fleet listed in part is never swept as if it were whole."""
        zones = self._zones()
        units: list[list[dict[str, Any]]] = [[{"Name": "availability-zone", "Values": [z]}] for z in zones] or [[]]
        firsts = _spread(
            self._described_by, self.listing_processes, lambda ec2, unit: self._first_page(ec2, tags, unit), units
        )
        listings = [(machines, tagged) for machines, tagged, more in firsts if not more]
        split = [
            (unit, {m.instance_id for m in machines})
            for unit, (machines, _, more) in zip(units, firsts, strict=True)
            if more
        ]
        if split:
            listings += _listed_full_zones(self._described_by, self.listing_processes, tags, split)
        machines, asg_tagged = _joined(listings)
        machines.sort(key=lambda m: m.instance_id)  # one order whatever part answered first
        return self._with_membership(machines, asg_tagged)

    def _first_page(
        self, ec2: Ec2, tags: TagKeys, only: list[dict[str, Any]]
    ) -> tuple[list[Machine], dict[str, str], bool]:
        """The first page of a unit's listing (a page of 1,000), and whether more pages follow."""
        client, pace = ec2
        pace.take()
        page = client.describe_instances(Filters=_filters(tags, only), MaxResults=PAGE_SIZE)
        machines, asg_tagged = _machines_of([page], tags)
        return machines, asg_tagged, bool(page.get("NextToken"))

    def _zones(self) -> list[str]:
        """The region's zones an instance can run in (local zones the account opted into included); none
        when they cannot be listed (a role deployed before this call was granted): then the fleet is listed
        in one sequence, as before, complete but slower."""
        try:
            self.describe_pace.take()
            response = self.ec2.describe_availability_zones(
                AllAvailabilityZones=True,
                Filters=[{"Name": "opt-in-status", "Values": ["opt-in-not-required", "opted-in"]}],
            )
        except AwsError:
            return []
        return sorted({z["ZoneName"] for z in response.get("AvailabilityZones", [])})

    def still_as_listed(self, machines: Sequence[Machine], tags: TagKeys) -> set[str]:
        """Those of `machines` that are still as discovery described them: running, same launch, same group
        and protection. A sweep that listed its machines before another sweep (or a person) acted on them
        must not act again on what it saw then."""
        try:
            current = {m.instance_id: m for m in self.describe_ids([m.instance_id for m in machines], tags)}
        except AwsError:
            if not any(m.is_notebook or m.deleted_by_stop for m in machines):
                raise
            # SageMaker machines that cannot be described again are not acted on; EC2 machines are checked.
            ec2 = [m for m in machines if not (m.is_notebook or m.deleted_by_stop)]
            current = {m.instance_id: m for m in self.describe_ids([m.instance_id for m in ec2], tags)}
        # A member account's machines carry their account and region (this Fleet's clients work in them).
        return {m.instance_id for m in machines if (c := current.get(m.instance_id)) and _where(c, m) == m}

    def describe_ids(self, instance_ids: Sequence[str], tags: TagKeys) -> list[Machine]:
        """Those of the given machines that discovery would list now (running, tagged), described afresh:
        200 ids a DescribeInstances call, the calls concurrently, then their groups in one go. A shard
        worker's discovery. Notebook instances and endpoints among the ids are listed again by name."""
        instance_ids, names, endpoint_ids, studio_ids = _split(self, instance_ids)
        found = self.notebooks.discover(tags, names) if self.notebooks is not None and names else []
        if self.endpoints is not None and endpoint_ids:
            found += self.endpoints.discover(tags, [endpoint_name(m) for m in endpoint_ids])
        if self.studio is not None and studio_ids:
            found += self.studio.discover(tags, studio_ids)

        def describe(batch: Sequence[str]) -> tuple[list[Machine], dict[str, str]]:
            return _described(self._described_by, tags, [{"Name": "instance-id", "Values": list(batch)}])

        batches = list(chunks(sorted(set(instance_ids)), FILTER_VALUES))
        return self._with_membership(*_joined(run_concurrently(describe, batches, ACTION_WORKERS))) + found

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
        batches = list(chunks(sorted(set(asg_tagged.values())), ASG_GROUPS_PER_CALL))
        for found in run_concurrently(describe, batches, ACTION_WORKERS):
            membership.update(found)
        return membership

    def group_capacity(self, names: Iterable[str]) -> dict[str, GroupCapacity]:
        result: dict[str, GroupCapacity] = {}
        for batch in chunks(sorted(set(names)), ASG_GROUPS_PER_CALL):
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
        first, so the others still hibernate (and keep their notebook kernels). Notebook instances are
        stopped with StopNotebookInstance, one call each (their ML storage volume is kept); endpoints deleted with
        DeleteEndpoint, one call each (their configuration, models and the record's copy of their tags kept); Studio
        apps with DeleteApp, one call each (their space and its storage kept)."""
        instance_ids, names, endpoint_ids, studio_ids = _split(self, instance_ids)
        stopped = self.notebooks.stop(names) if self.notebooks is not None and names else []
        if self.endpoints is not None and endpoint_ids:
            stopped += self.endpoints.delete(endpoint_ids)
        if self.studio is not None and studio_ids:
            stopped += self.studio.delete(studio_ids)
        until = Pacing.clock() + MUTATING_WAIT_SECONDS  # EC2's buckets: a batch not sent by then is RateHeld

        def call(ids: Sequence[str]) -> None:
            self.stop_pace.take(len(ids), until)
            try:
                self.ec2.stop_instances(InstanceIds=list(ids), Hibernate=hibernate)
            except ClientError as exc:
                if hibernate and len(ids) == 1 and error_code(exc) == "UnsupportedHibernationConfiguration":
                    self.stop_pace.take(1, until)
                    self.ec2.stop_instances(InstanceIds=list(ids), Hibernate=False)
                else:
                    raise

        return _batched(instance_ids, min(STOP_BATCH, self.stop_pace.batch), call) + stopped

    def terminate(self, instance_ids: Sequence[str]) -> list[ActionOutcome]:
        """TerminateInstances in batches that bisect on failure: only ever for machines EC2 cannot stop, on a
        team's opt-in (terminate_unstoppable_after_minutes) or their owner's confirmed click."""

        until = Pacing.clock() + MUTATING_WAIT_SECONDS

        def call(ids: Sequence[str]) -> None:
            self.terminate_pace.take(len(ids), until)
            self.ec2.terminate_instances(InstanceIds=list(ids))

        return _batched(instance_ids, min(STOP_BATCH, self.terminate_pace.batch), call)

    def kind_lookups(self, machines: Sequence[Machine]) -> Lookups:
        """What says what kind each machine is beyond DescribeInstances: the Spot requests of its Spot machines
        (DescribeSpotInstanceRequests filtered by request id, 200 a call) and the capacity reservations machines
        run in (DescribeCapacityReservations, 100 ids a call), each asked only when a listed machine needs it,
        the calls concurrently. A call that fails marks its ids failed: those machines are unknown (never
        stopped) this sweep, and the next sweep asks again."""
        return _kind_lookups(self._described_by, machines)

    def start(self, instance_id: str, endpoint: Restore | AppRestore | None = None) -> ActionOutcome:
        """Start it; an endpoint (a Studio app): CreateEndpoint (CreateApp) from what its record kept (`endpoint`)."""
        if self.studio is not None and is_studio_id(instance_id):
            return self.studio.recreate(instance_id, endpoint if isinstance(endpoint, AppRestore) else None)
        if self.endpoints is not None and is_endpoint_id(instance_id):
            return self.endpoints.recreate(instance_id, endpoint if isinstance(endpoint, Restore) else None)
        if self.notebooks is not None and not is_ec2_id(instance_id):
            return self.notebooks.start(instance_id)
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


def _split(fleet: Fleet, ids: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
    """(EC2 instance ids, notebook instance names, endpoint machine ids, Studio app machine ids), as `fleet` routes
    them (a Fleet without notebook instances takes every other id for an EC2 id)."""
    apps = [i for i in ids if is_studio_id(i)] if fleet.studio is not None else []
    endpoints = [i for i in ids if is_endpoint_id(i)] if fleet.endpoints is not None else []
    rest = [i for i in ids if i not in endpoints and i not in apps]
    if fleet.notebooks is None:
        return rest, [], endpoints, apps
    return [i for i in rest if is_ec2_id(i)], [i for i in rest if not is_ec2_id(i)], endpoints, apps


def _listed_with_failed(lister: Any, tags: TagKeys) -> tuple[list[Machine], tuple[str, ...], str | None]:
    """A SageMaker kind that can be brought back (endpoints, Studio apps): what it lists, those it lists Failed,
    and why it could not be listed (None: it could)."""
    failed: list[str] = []
    try:
        return lister.discover(tags, failed=failed), tuple(failed), None
    except AwsError as exc:
        return [], tuple(failed), f"{error_code(exc)}: {exc}"


def _kind_lookups(described_by: Ec2, machines: Sequence[Machine]) -> Lookups:
    """Fleet.kind_lookups, on the client and pace of EC2's Describe* requests."""
    ec2, pace = described_by
    spot_ids = sorted({m.facts.spot_request_id or "" for m in machines if m.facts.needs_spot_request})
    reservation_ids = sorted({m.facts.reservation_id or "" for m in machines if m.facts.reservation_id})

    def spot(batch: Sequence[str]) -> Lookups:
        found: dict[str, SpotRequest] = {}
        try:
            pages = paced_pages(
                pace,
                ec2.describe_spot_instance_requests,
                Filters=[{"Name": "spot-instance-request-id", "Values": list(batch)}],
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
            pace.take()
            out = ec2.describe_capacity_reservations(CapacityReservationIds=list(batch))
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
        *(lambda b=b: spot(b) for b in chunks(spot_ids, SPOT_REQUEST_FILTER_VALUES)),
        *(lambda b=b: reservations(b) for b in chunks(reservation_ids, RESERVATIONS_PER_CALL)),
    ]
    return _merged(run_concurrently(lambda task: task(), tasks, ACTION_WORKERS))


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
    for done in run_concurrently(lambda batch: _bisect(batch, call), list(chunks(ids, size)), ACTION_WORKERS):
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


def _where(found: Machine, listed: Machine) -> Machine:
    """`found` (as this Fleet describes it) in the account and region `listed` was swept in."""
    return replace(found, account=listed.account, region=listed.region) if listed.account else found
