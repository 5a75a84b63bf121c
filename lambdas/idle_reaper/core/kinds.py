"""What kind of machine this is, and so what a stop can do to it and what a stop saves.

EC2 refuses StopInstances for a one-time Spot instance and for an instance-store root; a fleet that maintains
capacity replaces a machine it loses; a machine in a capacity reservation or a Capacity Block leaves the
reservation billed when it stops. Pure: the adapter reads DescribeInstances, DescribeSpotInstanceRequests and
DescribeCapacityReservations in bulk and hands their items here; nothing here calls AWS.

A look-up that failed (throttled, denied) makes the machine UNKNOWN: never stopped, never told, looked up
again at the next sweep. Unknown is never stoppable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from idle_reaper.core.endpoints import IN_SERVICE, EndpointFacts, describe_missing
from idle_reaper.core.studio import AppFacts
from idle_reaper.policy import TeamPolicy

# AWS-managed tags EC2 puts on the instances a fleet launched.
FLEET_TAG = "aws:ec2:fleet-id"
SPOT_FLEET_TAG = "aws:ec2spot:fleet-request-id"

# A Spot request in one of these states still stands behind its instance (a stopped persistent request is
# "disabled"); closed, cancelled or failed ones no longer do.
_LIVE_REQUEST = frozenset({"open", "active", "disabled"})


# An EC2 instance id. A SageMaker notebook instance's machine id is its name; one named like this would share
# its id with an EC2 machine in the state table, so discovery leaves it out.
_EC2_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")


def is_ec2_id(machine_id: str) -> bool:
    return _EC2_INSTANCE_ID.fullmatch(machine_id) is not None


class Kind(StrEnum):
    """The kind of machine, as `status`, the audit and `sweep --json` show it."""

    ON_DEMAND = "on-demand"  # EBS root, nothing in the way: a stop saves its price
    SPOT = "spot"  # a persistent Spot request that stops or hibernates: a stop saves the Spot price
    SPOT_ONE_TIME = "spot-one-time"  # EC2 cannot stop it; terminating ends it
    SPOT_RELAUNCHING = "spot-relaunching"  # a persistent request that terminates: it would launch a replacement
    SPOT_REQUEST_GONE = "spot-request-gone"  # its Spot request cannot be found: what a stop does is unknown
    INSTANCE_STORE = "instance-store"  # EC2 cannot stop an instance-store root; terminating ends it
    FLEET = "fleet"  # an EC2 Fleet or Spot Fleet member: the fleet would replace it
    RESERVED = "capacity-reservation"  # in an active On-Demand Capacity Reservation: a stop saves nothing
    CAPACITY_BLOCK = "capacity-block"  # in a Capacity Block for ML: a stop saves nothing
    UNKNOWN = "unknown"  # a look-up failed this sweep: cannot be stopped
    NOTEBOOK = "notebook"  # a SageMaker notebook instance, InService: a stop keeps its ML storage volume
    NOTEBOOK_BUSY = "notebook-not-in-service"  # Pending, Updating, Stopping, Failed...: SageMaker refuses a stop
    ENDPOINT = "endpoint"  # a SageMaker real-time endpoint, InService: deleted, its configuration kept to recreate it
    ENDPOINT_BUSY = "endpoint-not-in-service"  # Creating, Updating, ...: SageMaker refuses to delete it meanwhile
    ENDPOINT_SAVES_NOTHING = "endpoint-scales-to-zero"  # serverless, inference components, minimum 0: reported only
    ENDPOINT_NOT_RESTORABLE = "endpoint-not-restorable"  # its configuration or model is gone: never deleted
    STUDIO_APP = "studio-app"  # a SageMaker Studio app, InService: deleted, its space and storage kept


@dataclass(frozen=True)
class InstanceFacts:
    """What DescribeInstances says about a machine's kind. Part of `Machine`, so a machine that changed kind
    since it was listed counts as changed (`Fleet.still_as_listed`)."""

    lifecycle: str | None = None  # InstanceLifecycle: None (on-demand), spot, capacity-block, scheduled, ...
    root_device: str = "ebs"  # RootDeviceType
    spot_request_id: str | None = None
    fleet: str | None = None  # "EC2 Fleet fleet-…" or "Spot Fleet sfr-…"
    reservation_id: str | None = None  # CapacityReservationId
    notebook_status: str | None = None  # a SageMaker notebook instance's NotebookInstanceStatus; None: EC2
    notebook_config: str | None = None  # the lifecycle configuration attached to a notebook instance, if any
    endpoint: EndpointFacts | None = None  # a SageMaker endpoint's (core/endpoints.py); None: not an endpoint
    studio: AppFacts | None = None  # a SageMaker Studio app's (core/studio.py); None: not an app

    @classmethod
    def of(cls, instance: Mapping[str, Any], tags: Mapping[str, str]) -> InstanceFacts:
        """From one DescribeInstances item and its tags."""
        fleet = None
        if tags.get(FLEET_TAG):
            fleet = f"EC2 Fleet {tags[FLEET_TAG]}"
        elif tags.get(SPOT_FLEET_TAG):
            fleet = f"Spot Fleet {tags[SPOT_FLEET_TAG]}"
        return cls(
            lifecycle=instance.get("InstanceLifecycle") or None,
            root_device=instance.get("RootDeviceType") or "ebs",
            spot_request_id=instance.get("SpotInstanceRequestId") or None,
            fleet=fleet,
            reservation_id=instance.get("CapacityReservationId") or None,
        )

    @property
    def needs_spot_request(self) -> bool:
        return self.lifecycle == "spot" and self.fleet is None and self.spot_request_id is not None


@dataclass(frozen=True)
class SpotRequest:
    request_id: str
    request_type: str  # one-time | persistent
    interruption: str  # terminate | stop | hibernate
    state: str  # open | active | closed | cancelled | failed | disabled
    max_price: float | None = None  # the owner's maximum price per hour, not what is paid

    @classmethod
    def of(cls, item: Mapping[str, Any]) -> SpotRequest:
        """From one DescribeSpotInstanceRequests item."""
        try:
            price: float | None = float(item["SpotPrice"]) if item.get("SpotPrice") else None
        except (TypeError, ValueError):
            price = None
        return cls(
            request_id=item["SpotInstanceRequestId"],
            request_type=item.get("Type") or "one-time",
            interruption=item.get("InstanceInterruptionBehavior") or "terminate",
            state=item.get("State") or "",
            max_price=price,
        )


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    reservation_type: str  # default | capacity-block
    state: str
    instance_type: str
    end: datetime | None = None  # None: no end date (EndDateType unlimited)
    total: int = 0
    available: int = 0

    @classmethod
    def of(cls, item: Mapping[str, Any]) -> Reservation:
        """From one DescribeCapacityReservations item."""
        end = item.get("EndDate")
        return cls(
            reservation_id=item["CapacityReservationId"],
            reservation_type=item.get("ReservationType") or "default",
            state=item.get("State") or "",
            instance_type=item.get("InstanceType") or "",
            end=end.astimezone(UTC) if isinstance(end, datetime) else None,
            total=int(item.get("TotalInstanceCount") or 0),
            available=int(item.get("AvailableInstanceCount") or 0),
        )

    @property
    def is_block(self) -> bool:
        return self.reservation_type == "capacity-block"

    def holds_at(self, now: datetime) -> bool:
        """Billed whether or not the machine runs: active and not past its end."""
        return self.state == "active" and (self.end is None or now < self.end)

    @property
    def label(self) -> str:
        return f"{'Capacity Block' if self.is_block else 'capacity reservation'} {self.reservation_id}"


@dataclass(frozen=True)
class Lookups:
    """What one sweep's batched look-ups found. `failed` maps a request or reservation id whose look-up
    failed (throttled, denied) to why; an id in neither map was looked up and does not exist."""

    spot_requests: Mapping[str, SpotRequest] = field(default_factory=dict)
    reservations: Mapping[str, Reservation] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)


Saves = Literal["price", "spot", "nothing"]


@dataclass(frozen=True)
class MachineKind:
    kind: Kind
    can_stop: bool  # EC2 accepts StopInstances for it, and nothing launches a replacement
    can_terminate: bool  # terminating ends it for good: nothing launches a replacement
    saves: Saves  # what a stop saves: the on-demand price, the Spot price, or nothing
    why: str = ""  # why it is this kind, in words, with its ids ("" for an ordinary machine)
    loses: str = ""  # what terminating loses, when can_terminate
    reservation: Reservation | None = None  # the reservation that bills it, while it does
    spot_max_price: float | None = None

    @property
    def ordinary(self) -> bool:
        return self.kind in (Kind.ON_DEMAND, Kind.SPOT, Kind.NOTEBOOK, Kind.ENDPOINT, Kind.STUDIO_APP)


ON_DEMAND = MachineKind(Kind.ON_DEMAND, can_stop=True, can_terminate=True, saves="price")
NOTEBOOK_IN_SERVICE = "InService"
# StopNotebookInstance keeps the ML storage volume; nothing terminates a notebook instance here.
NOTEBOOK = MachineKind(Kind.NOTEBOOK, can_stop=True, can_terminate=False, saves="price")
# DeleteEndpoint keeps the endpoint configuration, its models and (on the record) the tags: "stop" is deletion.
ENDPOINT = MachineKind(Kind.ENDPOINT, can_stop=True, can_terminate=False, saves="price")
# DeleteApp keeps the space and its storage (and, on the record, what CreateApp needs): "stop" is deletion.
STUDIO_APP = MachineKind(Kind.STUDIO_APP, can_stop=True, can_terminate=False, saves="price")

_TERMINATE_LOSES = "deletes its root volume and every local (instance-store) disk; it can never be started again"


def classify(facts: InstanceFacts, lookups: Lookups, now: datetime) -> MachineKind:
    """The kind of one machine. A fleet comes first (whatever else it is, the fleet replaces it), then a
    look-up that failed, then a reservation that bills it now, then what EC2 lets a stop do. A SageMaker
    notebook instance is stoppable only InService (SageMaker answers ValidationException in any other state);
    an endpoint as endpoint_kind says."""
    if facts.endpoint is not None:
        return endpoint_kind(facts.endpoint)
    if facts.studio is not None:  # listed only InService (aws/studio.py)
        return STUDIO_APP
    if facts.notebook_status is not None:
        if facts.notebook_status == NOTEBOOK_IN_SERVICE:
            return NOTEBOOK
        return _untouchable(
            Kind.NOTEBOOK_BUSY,
            f"a SageMaker notebook instance that is {facts.notebook_status}, not InService: SageMaker stops only "
            "an InService notebook instance, so idle-reaper waits for it to be InService again",
        )
    if facts.fleet:
        return _untouchable(Kind.FLEET, f"a member of {facts.fleet}, which would launch a replacement for it")
    for needed in (facts.spot_request_id if facts.lifecycle == "spot" else None, facts.reservation_id):
        if needed and needed in lookups.failed:
            why = f"{needed} could not be read ({lookups.failed[needed]}); not stopped until it can be"
            return _untouchable(Kind.UNKNOWN, why)
    reservation = lookups.reservations.get(facts.reservation_id or "")
    billed = reservation if reservation is not None and reservation.holds_at(now) else None
    storage = _by_purchase(facts, lookups)
    if billed is not None:
        until = f"until {billed.end:%Y-%m-%d %H:%M} UTC" if billed.end else "with no end date"
        return MachineKind(
            Kind.CAPACITY_BLOCK if billed.is_block else Kind.RESERVED,
            can_stop=storage.can_stop,
            can_terminate=False,
            saves="nothing",
            why=f"runs in {billed.label}, billed {until} whether or not the machine runs",
            reservation=billed,
        )
    # No reservation bills it now (none, ended, or no longer listed): from a reservation's end, the machine
    # is what it was bought as.
    return storage


def endpoint_kind(facts: EndpointFacts) -> MachineKind:
    """An endpoint not InService is held (SageMaker refuses DeleteEndpoint while it is being created or updated);
    one whose configuration or model is gone could never be brought back, so it is reported, never deleted; and so
    is one whose deletion saves nothing (serverless, inference components, a minimum of 0)."""
    if facts.status != IN_SERVICE:
        return _untouchable(
            Kind.ENDPOINT_BUSY,
            f"a SageMaker endpoint that is {facts.status}, not InService: SageMaker does not delete it while it "
            "is, so idle-reaper waits for it to be InService again",
        )
    if not facts.restorable:
        return _untouchable(
            Kind.ENDPOINT_NOT_RESTORABLE,
            f"a SageMaker endpoint that could not be brought back once deleted: its {describe_missing(facts.missing)} "
            "is gone, so idle-reaper does not delete it (delete it yourself if nobody needs it)",
        )
    if facts.saves_nothing:
        return _untouchable(
            Kind.ENDPOINT_SAVES_NOTHING, f"a SageMaker endpoint whose deletion saves nothing: {facts.saves_nothing}"
        )
    return ENDPOINT


def _by_purchase(facts: InstanceFacts, lookups: Lookups) -> MachineKind:
    """The kind a machine has by how it was bought and what it boots from, with no reservation in the way."""
    instance_store = facts.root_device != "ebs"
    if facts.lifecycle == "spot":
        request = lookups.spot_requests.get(facts.spot_request_id or "")
        if request is None:
            return _untouchable(
                Kind.SPOT_REQUEST_GONE,
                f"a Spot instance whose request {facts.spot_request_id or '(none)'} cannot be found, so whether "
                "EC2 would stop it is unknown",
            )
        live = request.state in _LIVE_REQUEST
        if request.request_type == "persistent" and live and request.interruption in ("stop", "hibernate"):
            if instance_store:
                return _instance_store(request)
            return MachineKind(
                Kind.SPOT, can_stop=True, can_terminate=False, saves="spot", spot_max_price=request.max_price
            )
        if request.request_type == "persistent" and live:
            return _untouchable(
                Kind.SPOT_RELAUNCHING,
                f"a Spot instance of persistent request {request.request_id}, which would launch a replacement if "
                "it ended; cancel the request to end it",
            )
        return MachineKind(
            Kind.SPOT_ONE_TIME,
            can_stop=False,
            can_terminate=True,
            saves="nothing",
            why=f"a one-time Spot instance (request {request.request_id}): EC2 cannot stop it, only terminate it",
            loses=_TERMINATE_LOSES,
            spot_max_price=request.max_price,
        )
    if instance_store:
        return _instance_store(None)
    return ON_DEMAND


def _untouchable(kind: Kind, why: str) -> MachineKind:
    """Neither stopped nor terminated by idle-reaper, and no savings counted."""
    return MachineKind(kind, can_stop=False, can_terminate=False, saves="nothing", why=why)


def _instance_store(request: SpotRequest | None) -> MachineKind:
    return MachineKind(
        Kind.INSTANCE_STORE,
        can_stop=False,
        can_terminate=request is None,
        saves="nothing",
        why="its root device is instance store, not EBS: EC2 cannot stop it, only terminate it",
        loses=_TERMINATE_LOSES if request is None else "",
        spot_max_price=request.max_price if request else None,
    )


# ---------------------------------------------------------------------------------------------
# What a stop saves


@dataclass(frozen=True)
class Saving:
    """What an action saves (or an idle hour wastes) an hour: None when its price is unknown; `upper_bound` when
    the figure is the most it could be (a Spot machine priced at on-demand, or at its maximum price). The rule
    that makes each is core/dollars.py's."""

    hourly: float | None
    upper_bound: bool = False

    def text(self) -> str:
        if self.hourly is None:
            return "unknown"
        return f"{'at most ' if self.upper_bound else ''}${self.hourly:,.2f}/h"


# Kinds a person's "Stop now" must not stop: EC2 refuses, or something launches a replacement.
NEVER_STOPPED = frozenset(
    {
        Kind.SPOT_ONE_TIME,
        Kind.SPOT_RELAUNCHING,
        Kind.SPOT_REQUEST_GONE,
        Kind.INSTANCE_STORE,
        Kind.FLEET,
        Kind.NOTEBOOK_BUSY,
        Kind.ENDPOINT_BUSY,
        Kind.ENDPOINT_SAVES_NOTHING,
        Kind.ENDPOINT_NOT_RESTORABLE,
    }
)
# A SageMaker endpoint's kinds: its "stop" is DeleteEndpoint, its "start" CreateEndpoint from its configuration.
ENDPOINT_KINDS = frozenset(
    {Kind.ENDPOINT, Kind.ENDPOINT_BUSY, Kind.ENDPOINT_SAVES_NOTHING, Kind.ENDPOINT_NOT_RESTORABLE}
)
DELETED_KINDS = ENDPOINT_KINDS | {Kind.STUDIO_APP}  # a "stop" deletes them, and "start" recreates them
# Kinds terminating ends for good (nothing relaunches them): the owner's "Terminate now" applies.
TERMINABLE = frozenset({Kind.SPOT_ONE_TIME, Kind.INSTANCE_STORE})


# ---------------------------------------------------------------------------------------------
# What the reaper does with it under a team's policy


# hold: nothing this sweep, nothing said (a look-up failed; the next sweep looks again)
Mode = Literal["stop", "notify", "terminate", "hold"]


@dataclass(frozen=True)
class Handling:
    """What reaching the end of the idle window brings for this machine under its policy: a stop (or
    hibernation: the usual), a notice to its owner only, (opted in) termination after a longer window, or,
    while a look-up fails, nothing at all."""

    mode: Mode
    idle_minutes: int  # this machine's window: the team's, or the longer one termination waits for
    scarce: bool = False  # its family's capacity may not come back once stopped
    tell_admins: bool = False  # the admins hear of it too (a fleet, a reservation)
    why_not_stop: str = ""  # for notify: why nothing is stopped, in words


def family_of(instance_type: str) -> str:
    """'g5' for g5.xlarge, and for SageMaker's ml.g5.xlarge: the hardware decides GPU-awareness and scarcity."""
    return instance_type.removeprefix("ml.").split(".", 1)[0]


def handling(kind: MachineKind, instance_type: str, policy: TeamPolicy) -> Handling:
    """The handling of one machine under its team's policy."""
    idle_minutes = policy.idle_minutes
    scarce = family_of(instance_type) in policy.scarce_families
    if kind.kind in (Kind.UNKNOWN, Kind.NOTEBOOK_BUSY, Kind.ENDPOINT_BUSY):
        return Handling("hold", idle_minutes, scarce, why_not_stop=kind.why)
    if kind.reservation is not None:
        if policy.reserved_capacity_action == "stop" and kind.can_stop:
            return Handling("stop", idle_minutes, scarce)  # the warning says the stop saves nothing
        return Handling("notify", idle_minutes, scarce, tell_admins=True, why_not_stop=kind.why)
    if kind.kind is Kind.FLEET:
        return Handling("notify", idle_minutes, scarce, tell_admins=True, why_not_stop=kind.why)
    if not kind.can_stop:
        after = policy.terminate_unstoppable_after_minutes
        if kind.can_terminate and after is not None:
            return Handling("terminate", max(idle_minutes, after), scarce)
        return Handling("notify", idle_minutes, scarce, why_not_stop=kind.why)
    if scarce:
        window = policy.scarce_idle_minutes or idle_minutes
        if policy.scarce_action == "notify_only":
            why = f"{family_of(instance_type)} capacity is scarce and this team's policy only reports such machines"
            return Handling("notify", window, scarce, why_not_stop=why)
        return Handling("stop", window, scarce)
    return Handling("stop", idle_minutes)


# ---------------------------------------------------------------------------------------------
# Words: what the warning, the log and `status` say about the kind


def scarce_note(instance_type: str) -> str:
    return (
        f"{family_of(instance_type)} capacity is scarce: once stopped, it may not start again for hours or days "
        "(EC2 answers InsufficientInstanceCapacity until capacity returns)"
    )


def caveats(kind: MachineKind, how: Handling, instance_type: str) -> list[str]:
    """What the kind adds to a stop or termination warning (and to its decision's reason)."""
    found = []
    if how.mode == "terminate":
        found.append(f"{kind.why}; terminating {kind.loses}")
    if kind.reservation is not None:
        found.append(f"a stop frees its reserved slot but saves nothing: it {kind.why}")
    if how.scarce:
        found.append(scarce_note(instance_type))
    return found


def warning_sentence(kind: MachineKind, how: Handling, instance_type: str, at: str, *, reaped_verb: str) -> str:
    """The warning's first sentence (Slack mrkdwn, ids as written). `at` is when the action is due,
    `reaped_verb` what a stop does here ("stopped", "hibernated", "released to its Auto Scaling group")."""
    if how.mode in ("notify", "hold"):
        return notice_sentence(kind, how, instance_type)
    verb = "terminated" if how.mode == "terminate" else reaped_verb
    more = caveats(kind, how, instance_type)
    return f"It will be *{verb}* at {at} unless someone keeps it" + (f": {'; '.join(more)}." if more else ".")


# AWS: "You can't modify or cancel a Capacity Block"
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-capacity-blocks.html).
CAPACITY_BLOCK_FIXED = "AWS does not allow a Capacity Block to be modified or cancelled"


def reservation_sentence(reservation: Reservation) -> str:
    """What an idle machine's owner and the admins are told of the reservation it runs in. Whether the reservation
    itself is idle comes from its slots (TotalInstanceCount, AvailableInstanceCount): the other machines running
    in it. A Capacity Block cannot be released, only used until it ends."""
    end = f"until {reservation.end:%Y-%m-%d %H:%M} UTC" if reservation.end else "with no end date"
    others = max(0, reservation.total - reservation.available - 1)  # in use, not by this machine
    billed = f"the reservation is billed {end} whether or not the machine runs"
    if others:
        head = (
            f"It is idle, but its {reservation.label} is not: {others} of its other {reservation.total - 1} slots "
            f"are in use. This machine's slot is idle; {billed}"
        )
    else:
        free = f" ({reservation.available} more of its slots unused)" if reservation.available else ""
        head = f"It is idle, and so is its {reservation.label}{free}: {billed}"
    head += ", so idle-reaper does not stop it (a stop would save nothing)."
    if reservation.is_block:
        return f"{head} {CAPACITY_BLOCK_FIXED}: use it, or let another team run in it until it ends."
    if others:
        return f"{head} Use it, or let someone else run in its slot."
    return f"{head} Use it, share it, or release the reservation (cancel it: EC2 CancelCapacityReservation)."


def notice_sentence(kind: MachineKind, how: Handling, instance_type: str) -> str:
    """What an owner (and, for a fleet or a reservation, the admins) are told instead of a stop."""
    if kind.reservation is not None:
        return reservation_sentence(kind.reservation)
    if kind.kind is Kind.FLEET:
        return (
            f"It is idle, but idle-reaper cannot stop it: it is {kind.why}. To shrink the fleet, lower its target "
            "capacity."
        )
    if kind.can_terminate:
        return (
            f"It is idle, but idle-reaper cannot stop it: it is {kind.why}. Terminating {kind.loses}. Keep it, or "
            "terminate it now."
        )
    if how.scarce and kind.can_stop:
        return f"It is idle. It is not {_stopped(kind)}: {how.why_not_stop}. {scarce_note(instance_type)}."
    return f"It is idle, but idle-reaper does not {_stopped(kind, 'stop', 'delete')} it: it is {kind.why}."


def _stopped(kind: MachineKind, machine: str = "stopped", endpoint: str = "deleted") -> str:
    return endpoint if kind.kind in DELETED_KINDS else machine


# Where the stack's lifecycle configuration fetches the activity collector from, in its notebook-agent bucket.
NOTEBOOK_AGENT_KEY = "notebook-agent/idle_reaper_activity.py"


def notebook_lifecycle_config(prefix: str) -> str:
    """The name of the lifecycle configuration a stack ships (infra/notebooks.py), from its deploy prefix: two
    stacks with different prefixes fit in one account and region (the default's is idle-reaper-notebook-agent)."""
    return f"{prefix}-notebook-agent"


def notebook_attach_how(config: str) -> str:
    """How an admin attaches the stack's lifecycle configuration `config` to a notebook instance."""
    return (
        f"attach the lifecycle configuration {config} (SageMaker console: stop the notebook instance, Edit, "
        "Lifecycle configuration; or `aws sagemaker update-notebook-instance --notebook-instance-name NAME "
        f"--lifecycle-config-name {config}` while it is stopped), then start it"
    )


def notebook_no_data_note(hourly: float | None, attached: str | None, ours: str) -> str:
    """What `status` and the admins' daily note say of a notebook instance that publishes no CPU data, by what
    is attached to it: nothing, another lifecycle configuration (another stack's too), or `ours` (the stack's
    own) that does not publish."""
    cost = f"${hourly:,.2f}/h" if hourly is not None else "an unknown price"
    head = f"a SageMaker notebook instance without CPU data (costs {cost}): unknown, never stopped"
    if attached == ours:
        return (
            f"{head}; {ours} is attached but nothing arrives: see the notebook's log "
            "(CloudWatch /aws/sagemaker/NotebookInstances, LifecycleConfigOnStart) and check that its execution "
            "role may cloudwatch:PutMetricData"
        )
    if attached:
        how = notebook_attach_how(ours)
        return f"{head}; its lifecycle configuration is {attached}, not this deployment's: {how}"
    return f"{head}; to have it watched, {notebook_attach_how(ours)}"


# What a notebook instance that publishes CPU may still leave out, and why: for `status` and the daily note.
NOTEBOOK_GAPS = {
    "GPU": "no GPU data (the agent's GPU plugin needs nvidia-smi: see the notebook's LifecycleConfigOnStart log)",
    "network": "no network data (it started before idle-reaper's lifecycle configuration published network: it "
    "will from its next start)",
    "activity": "no activity-collector data (the OnStart script fetches the collector from the stack's bucket, "
    f"stack output NotebookAgentObject, key {NOTEBOOK_AGENT_KEY}: the notebook's execution role needs "
    "s3:GetObject on it; the notebook's LifecycleConfigOnStart log says why it did not run)",
}


def notebook_gaps_note(missing: Sequence[str]) -> str:
    """What `status` and the admins' daily note say of a notebook instance that publishes CPU but not all a
    policy reads (`missing`: keys of NOTEBOOK_GAPS). Without GPU or network data it is unknown, never stopped;
    without the collector, CPU, GPU and network decide."""
    return "; ".join(NOTEBOOK_GAPS[m] for m in missing)


def describe(kind: MachineKind) -> str:
    """One line for `status` and the audit: the kind and, when it matters, why."""
    return kind.kind.value if kind.ordinary else f"{kind.kind.value}: {kind.why}"
