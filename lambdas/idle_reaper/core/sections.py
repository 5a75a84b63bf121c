"""What `status` and the weekly digest show of each kind of resource apart: machines, SageMaker endpoints, and any
kind added later (Studio apps). Each record has a kind label, and where a resource that is not a machine stands, its
cost and what deleting it saved are said here, in words.

A kind is named by its words (core/endpoints.words_for: the noun its messages use); its label is that noun's plural
("machines", "endpoints"). A kind added to words_for gets its own section in `status` and the digest with nothing
added here: only the machines are named, as they keep the digest's own lines and `status`'s own table.

Pure: from records, the digest's stretches summed per machine, and prices."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from idle_reaper.core.endpoints import MACHINE_WORDS, Restore, endpoint_name, is_endpoint_id, words_for
from idle_reaper.core.kinds import NEVER_STOPPED, Kind
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.core.studio import studio_parts
from idle_reaper.pricing import hourly_price

MACHINES = "machines"
SHOWN = 10  # resources a digest section names; the rest are counted
# Kinds held while SageMaker changes them (not reported as never acted on: acted on once they are in service).
_HELD = frozenset({Kind.NOTEBOOK_BUSY.value, Kind.ENDPOINT_BUSY.value})
# What a machine's record says was done to it, by its last action (a deletion is its kind's words').
_MACHINE_DONE = {
    "hibernate": "hibernated",
    "unprotect": "released to its Auto Scaling group",
    "terminate": "terminated",
}
T = TypeVar("T")


def section_of(key: str) -> str:
    """The kind label of the resource a machine id or key names: "machines", "endpoints", ..."""
    return words_for(key).noun + "s"


def grouped(items: Iterable[T], label_of: Callable[[T], str]) -> list[tuple[str, list[T]]]:
    """`items` by their kind's label (`label_of`: section_of of each), in the order `status` shows them: the
    machines first, then each other kind by its label ("endpoints", "Studio apps"); a kind with none is left out."""
    by_label: dict[str, list[T]] = {}
    for item in items:
        by_label.setdefault(label_of(item), []).append(item)
    return sorted(by_label.items(), key=lambda pair: (pair[0] != MACHINES, pair[0].lower()))


def named(key: str, name: str | None) -> str:
    """A resource as a reader meets it among others: a machine by its name (or id), any other kind by its noun
    and name ("endpoint demo-llm", "Studio app lab-space"), never called a machine."""
    words, machine_id = words_for(key), key.rsplit("/", 1)[-1]
    if words.noun == MACHINE_WORDS.noun:
        return name or machine_id
    if not name:  # its id without the kind's prefix: the endpoint's name, the app's space
        name = endpoint_name(machine_id) if is_endpoint_id(machine_id) else studio_parts(machine_id)[1]
    return f"{words.noun} {name}"


def kinds_said(keys: Iterable[str]) -> tuple[str, str]:
    """What a message listing `keys` calls them together, and what is done to them: ("machines", "stopped"),
    ("endpoints", "deleted"), ("machines and endpoints", "stopped or deleted"), ("machines, endpoints and Studio
    apps", ...). Machines first, as `status` orders them; no keys: machines."""
    keys = list(keys)
    labels = [label for label, _ in grouped(keys, section_of)] or [MACHINES]
    nouns = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]
    done = sorted({words_for(k).stopped for k in keys} or {MACHINE_WORDS.stopped}, reverse=True)  # stopped first
    return nouns, " or ".join(done)


def _at(when: datetime) -> str:
    return f"{when:%Y-%m-%d %H:%M} UTC"


def _why(record: MachineRecord) -> str:
    """The kind's reason in its note ("endpoint-scales-to-zero: a SageMaker endpoint whose deletion ..." -> "a ...")."""
    return record.kind_note.split(": ", 1)[-1] if record.kind_note else record.reason


def state_words(record: MachineRecord, now: datetime) -> str:
    """Where the resource stands, for `status` and the digest: watched, warned, kept until when, deleted (and
    whether it can be brought back), reported and never deleted (and why), exempt, unknown."""
    words = words_for(record.key)
    kept = Restore.parse(record.endpoint)
    if record.state is State.REAPED:
        if not words.deletes:  # a machine: stopped (or hibernated, released, terminated) by its last action
            action = record.last_action or "stop"
            done = _MACHINE_DONE.get(action.removesuffix("_instance"), words.stopped)
            return f"{done} since {_at(record.last_action_at or now)}"
        if record.endpoint is None:
            return f"{words.stopped} since {_at(record.last_action_at or now)}; nothing kept to recreate it"
        failed = f" (the last try failed: {kept.failed})" if kept is not None and kept.failed else ""
        since = _at(record.last_action_at or now)
        return f"{words.stopped} since {since}, restorable: {words.start_button} recreates it{failed}"
    if kept is not None and kept.pending_by:
        return f"being brought back by {kept.pending_by} since {kept.pending_since or '?'}"
    if record.state is State.EXEMPT:
        return f"exempt (tagged): reported, never {words.stopped}"
    if record.state in (State.UNKNOWN, State.SAFE_MODE):
        state = record.state.value.replace("_", " ")
        return f"{state}: {record.reason.removeprefix(record.state.value + ': ')}; never {words.stopped} while {state}"
    if record.machine_kind in _HELD:
        return f"held: {_why(record)}"
    if record.machine_kind in NEVER_STOPPED:
        return f"reported, never {words.stopped}: {_why(record)}"
    if record.state is State.SNOOZED and record.snoozed_until and record.snoozed_until > now:
        return f"kept until {_at(record.snoozed_until)} by {record.snoozed_by or '?'}"
    if record.state is State.WARNED:
        when = f" at {_at(record.stop_not_before)}" if record.stop_not_before else ""
        return f"warned: {words.stopped}{when} unless someone keeps it"
    return "watched" + (f", idle since {_at(record.idle_since)}" if record.idle_since else "")


@dataclass(frozen=True)
class Resource:
    """One resource of a section: what it is, what it costs an hour running, where it stands, and what its
    deletion saved in the digest's week."""

    key: str
    name: str
    team: str
    hardware: str  # its instance type and count ("ml.g5.2xlarge x2 + ml.m5.large")
    hourly: float | None  # on-demand price of its instances an hour (None: not known)
    state: str
    saved_hours: float = 0.0
    saved_dollars: float = 0.0
    upper_bound: bool = False  # saved_dollars is the most it can be (core/dollars.py)
    account: str | None = None


@dataclass(frozen=True)
class Section:
    label: str  # "endpoints", ...
    resources: tuple[Resource, ...]

    @property
    def saved_dollars(self) -> float:
        return sum(r.saved_dollars for r in self.resources)

    @property
    def saved_hours(self) -> float:
        return sum(r.saved_hours for r in self.resources)

    @property
    def upper_bound(self) -> bool:
        return any(r.upper_bound and r.saved_dollars for r in self.resources)


def sections(
    records: Iterable[MachineRecord],
    saved: Mapping[str, tuple[float, float, bool]],
    team: str | None,
    now: datetime,
    prices: Mapping[str, float],
) -> list[Section]:
    """The digest's sections of every kind but machines, by label: each resource of `team` (None: all) its record
    knows, with what its deletions saved (`saved`: machine key -> (hours, dollars, upper bound) in the week), most
    saved first, then the costliest."""

    def resource(r: MachineRecord) -> Resource:
        hours, dollars, bound = saved.get(r.key, (0.0, 0.0, False))
        price = hourly_price(r.instance_type or "", prices)
        name, hardware = r.name or r.instance_id, r.instance_type or "unknown"
        return Resource(r.key, name, r.team, hardware, price, state_words(r, now), hours, dollars, bound, r.account)

    mine = [r for r in records if team is None or r.team == team]
    return [
        Section(
            label, tuple(sorted(map(resource, found), key=lambda x: (-x.saved_dollars, -(x.hourly or 0.0), x.name)))
        )
        for label, found in grouped(mine, lambda r: section_of(r.key))
        if label != MACHINES
    ]


def usd(value: float, upper_bound: bool = False) -> str:
    """Dollars; "up to" when they hold a Spot machine's figure at the most it can be (core/dollars.py)."""
    return f"{'up to ' if upper_bound else ''}${value:,.2f}"


def section_text(section: Section) -> str:
    """A digest section in words (Slack mrkdwn; names and teams come from tags: the sender escapes)."""
    words = words_for(section.resources[0].key)  # sections() makes none without resources
    shown = []
    for x in section.resources[:SHOWN]:
        cost = f"{usd(x.hourly)}/h" if x.hourly is not None else "no known price"
        hours = f"{x.saved_hours:,.1f} h {words.stopped}"
        saved = f"; saved {usd(x.saved_dollars, x.upper_bound)} ({hours})" if x.saved_hours else ""
        shown.append(f"{x.name} ({x.team}, {x.hardware}, {cost}): {x.state}{saved}")
    more = f" and {len(section.resources) - SHOWN} more" if len(section.resources) > SHOWN else ""
    total = usd(section.saved_dollars, section.upper_bound)
    head = f"{section.label.capitalize()} ({len(section.resources)}): {words.stopped} ones saved {total}"
    return f"{head} ({section.saved_hours:,.1f} h this week). " + " · ".join(shown) + more
