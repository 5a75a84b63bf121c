"""The weekly digest: what the reaper saved, what is still wasted, and whether a team's window is right.

Pure: figures from what the reaper itself recorded (audit entries and machine records), for an ISO week;
no boto3, no Slack, no clock. docs/policy.md ("The weekly digest") defines every figure.

- A stop (stop, hibernate, release to its group, termination) saves its audited `hourly_savings` from its
  time until the machine is seen running again (the `running_again` entry: the machine's own launch time), or
  until the end point (the week's end, or `now` for the week under way), and at most RECOVERY_HORIZON.
  Each stretch belongs to the team the machine was in when it was stopped, and is counted once.
- A keep ("keep" answers) wastes the machine's hourly cost from the answer until the keep ends, the machine
  is next heard of, or the end point: idle hours a person chose to pay for.
- Organization mode: every figure also belongs to the account the machine runs in (its machine key says
  which; none: the hub's own account). A digest with any member account's machine in it says them by account
  (core/digest_text.py names each: its name from the directory and its id; an account the directory no longer
  lists, say one that left the organization, by its id). A digest of the hub's account alone has none.

Its words, the Slack text, are core/digest_text.py's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from idle_reaper.core.dollars import of_record, saves_while_running
from idle_reaper.core.endpoints import words_for
from idle_reaper.core.records import UNWANTED_WITHIN_MINUTES, MachineRecord, State, parse_machine_key
from idle_reaper.core.sections import MACHINES, Section, section_of, sections
from idle_reaper.core.under_used import UnderUsed, under_used
from idle_reaper.policy import DAYS, TeamPolicy

# Audit actions that stop paying for a machine, and their words.
RECOVERING = {
    "stop": "stops",
    "hibernate": "hibernations",
    "unprotect": "releases",
    "terminate": "terminations",
    "terminate_instance": "terminations",
}
DELETIONS = "deletions"  # a stop of an endpoint or a Studio app is its deletion, and is counted as one
RUNNING_AGAIN = "running_again"  # the sweep saw a machine it had stopped running again (or a person started it)
KEEP = "keep"  # a person's keep answer
WARN = "warn"
# A stopped machine nobody started for this long is no longer counted: it was not wanted, and "saved" for
# ever would grow every week without anything happening.
RECOVERY_HORIZON = timedelta(days=7)
TREND_WEEKS = 8
TOP_MACHINES = 5
# A machine's record seen this recently means it still runs (records are refreshed at least hourly).
FRESH_RECORD = timedelta(hours=2)
ADMINS = "admins"  # the admins' digest destination


def account_of(key: str) -> str | None:
    """The member account a machine key names (None: the hub's own account, or a key no sweep wrote)."""
    try:
        return parse_machine_key(key).account
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Weeks


@dataclass(frozen=True, order=True)
class Week:
    year: int
    number: int

    @property
    def label(self) -> str:
        return f"{self.year}-W{self.number:02d}"

    def span(self, zone: str = "UTC") -> tuple[datetime, datetime]:
        """Monday 00:00 to the next Monday 00:00, local time in `zone`, as UTC datetimes."""
        tz = ZoneInfo(zone)
        monday = date.fromisocalendar(self.year, self.number, 1)
        start = datetime.combine(monday, time(0), tzinfo=tz)
        end = datetime.combine(monday + timedelta(days=7), time(0), tzinfo=tz)
        return start.astimezone(UTC), end.astimezone(UTC)

    def previous(self, weeks: int = 1) -> Week:
        monday = datetime.combine(date.fromisocalendar(self.year, self.number, 1), time(12), UTC)
        return week_of(monday - timedelta(weeks=weeks))


_WEEK = re.compile(r"^(\d{4})-W(\d{2})$")


def parse_week(text: str) -> Week:
    """'2026-W47' -> Week; ValueError saying what is expected for anything else."""
    m = _WEEK.match(text.strip())
    if m:
        year, number = int(m.group(1)), int(m.group(2))
        try:
            date.fromisocalendar(year, number, 1)
        except ValueError:
            raise ValueError(f"{text!r}: {year} has no ISO week {number}") from None
        return Week(year, number)
    raise ValueError(f"{text[:40]!r} is not an ISO week; expected YEAR-Wnn, e.g. 2026-W47")


def week_of(at: datetime, zone: str = "UTC") -> Week:
    iso = at.astimezone(ZoneInfo(zone)).isocalendar()
    return Week(iso.year, iso.week)


def digest_due(policy: TeamPolicy, now: datetime) -> Week | None:
    """The week whose digest is due at `now` for a team with this policy (the last whole ISO week, local
    time): its local digest day and time have passed this week, and it is not quiet hours (then a later hourly
    check sends it). None: not yet."""
    local = now.astimezone(ZoneInfo(policy.timezone))
    hour, minute = (int(p) for p in policy.digest_time.split(":"))
    due = (DAYS.index(policy.digest_day), hour * 60 + minute)
    if (local.weekday(), local.hour * 60 + local.minute) < due:
        return None
    from idle_reaper.policy import effective_policy  # the schedules say when quiet hours are

    if effective_policy(policy, now).quiet_hours:
        return None
    return week_of(now, policy.timezone).previous()  # the last whole week is what the digest tells


def claim_key(destination: str, week: Week) -> str:
    """The once-only claim of one destination's digest for one week."""
    return f"digest#{destination}#{week.label}"


# ---------------------------------------------------------------------------------------------
# Events: the audit entries the digest reads


@dataclass(frozen=True)
class Event:
    instance_id: str
    at: datetime
    action: str
    team: str
    owner: str
    instance_type: str
    hourly_savings: float | None
    hourly_cost: float | None
    by: str = ""  # who answered (keep, stop now, start again)
    until: datetime | None = None  # a keep's end
    warned_at: str = ""
    account: str | None = None  # the member account (None: the hub's own)
    upper_bound: bool = False  # hourly_savings is the most a stop saves (Spot), not what it saves
    hourly_waste: float | None = None  # a keep's: what an idle hour wastes (None: an older entry, hourly_cost)
    waste_upper_bound: bool = False


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        at = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _money(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def events_of(entries: Iterable[tuple[str, datetime, Mapping[str, Any]]]) -> list[Event]:
    """The audit entries that say something happened (failed and dry-run actions say nothing), oldest first."""
    out = []
    for instance_id, at, entry in entries:
        action = str(entry.get("action") or "")
        if entry.get("error") or action.startswith("would_") or action in ("", "none"):
            continue
        when = _time(entry.get("running_since")) if action == RUNNING_AGAIN else None
        out.append(
            Event(
                instance_id=instance_id,
                at=(when or at).astimezone(UTC),
                action=action,
                team=str(entry.get("team") or ""),
                owner=str(entry.get("owner") or ""),
                instance_type=str(entry.get("instance_type") or ""),
                hourly_savings=_money(entry.get("hourly_savings")),
                hourly_cost=_money(entry.get("hourly_cost")),
                by=str(entry.get("snoozed_by") or entry.get("by") or ""),
                until=_time(entry.get("snoozed_until")),
                warned_at=str(entry.get("warned_at") or ""),
                account=account_of(instance_id),
                upper_bound=entry.get("savings_upper_bound") is True,
                hourly_waste=_money(entry.get("hourly_waste")),
                waste_upper_bound=entry.get("waste_upper_bound") is True,
            )
        )
    # At the same moment: the sweep's warning or stop, then the machine running (again: a stop it came back
    # from at once saved nothing), then a person's answer.
    order = {WARN: 0, RUNNING_AGAIN: 2, KEEP: 3}
    return sorted(out, key=lambda e: (e.at, e.instance_id, order.get(e.action, 1)))


def running_again_entry(
    instance_id: str, team: str, owner: str | None, instance_type: str | None, since: datetime, by: str = ""
) -> dict[str, Any]:
    """The audit entry of a machine seen running again after the reaper stopped it: its stop's savings end
    at `since` (its launch time, or when a person started it)."""
    return {
        "instance_id": instance_id,
        "team": team,
        "owner": owner,
        "instance_type": instance_type,
        "action": RUNNING_AGAIN,
        "running_since": since.isoformat(),
        "by": by,
        "error": None,
    }


def answer_entry(record: MachineRecord, action: str, by: str, hourly_cost: float | None) -> dict[str, Any]:
    """The audit entry of a person's answer: a keep, or a stop now or terminate now (`action` is the stop's).
    What it saves (a stop) or wastes (a keep) an hour is the one rule's (core/dollars.py), by the machine's kind
    and its on-demand `hourly_cost`."""
    rule = of_record(record, hourly_cost)
    saving = rule.idle if action == KEEP else rule.saved_by(action)
    money = (
        {"hourly_waste": saving.hourly, "waste_upper_bound": saving.upper_bound}
        if action == KEEP
        else {"hourly_savings": saving.hourly, "savings_upper_bound": saving.upper_bound}
    )
    return {
        "instance_id": record.instance_id,
        "team": record.team,
        "owner": record.owner,
        "instance_type": record.instance_type,
        "action": action,
        "by": by,
        "snoozed_by": record.snoozed_by if action == KEEP else None,
        "snoozed_until": record.snoozed_until.isoformat() if action == KEEP and record.snoozed_until else None,
        "hourly_cost": hourly_cost,
        **money,
        "error": None,
    }


# ---------------------------------------------------------------------------------------------
# Stretches: what each machine saved or wasted, and where it was


@dataclass(frozen=True)
class Stretch:
    instance_id: str
    team: str
    owner: str
    kind: str  # a RECOVERING action, or KEEP
    start: datetime
    end: datetime | None  # None: still open at the end point
    hourly: float | None  # what it saves (a stop) or costs (a keep) an hour; None: no price known
    by: str = ""
    account: str | None = None  # the member account (None: the hub's own)
    upper_bound: bool = False  # `hourly` is the most it can be (Spot): its dollars are "up to"
    running: bool = False  # a release whose machine its group still runs: it saves no hours (core/dollars.py)

    def hours_in(self, lo: datetime, hi: datetime) -> float:
        end = min(self.end or hi, hi)
        return max(0.0, (end - max(self.start, lo)).total_seconds() / 3600)

    def saved_hours_in(self, lo: datetime, hi: datetime) -> float:
        """The machine-hours of [lo, hi) a stop saved: none while the machine still runs."""
        return 0.0 if self.running else self.hours_in(lo, hi)


def stretches(events: Sequence[Event]) -> list[Stretch]:
    """Per machine, in time order: a stop opens a stretch until the machine is seen running again (or
    anything else the sweep records about it: it is running then), capped at RECOVERY_HORIZON; a keep opens
    one until its end or the next event. A second stop while stopped does not open another: never twice."""
    by_machine: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_machine[e.instance_id].append(e)
    out: list[Stretch] = []
    for evs in by_machine.values():
        stopped: Event | None = None
        kept: Event | None = None
        for e in evs:
            if stopped is not None and e.action not in RECOVERING:
                out.append(_stretch(stopped, e.at))
                stopped = None
            if kept is not None and e.action != KEEP:
                out.append(_stretch(kept, min(kept.until or e.at, e.at)))
                kept = None
            if e.action == KEEP:
                if kept is not None:
                    out.append(_stretch(kept, min(kept.until or e.at, e.at)))
                kept = e
            elif e.action in RECOVERING and stopped is None:
                stopped = e
        if stopped is not None:
            out.append(_stretch(stopped, None))
        if kept is not None:
            out.append(_stretch(kept, kept.until))
    return out


def _stretch(e: Event, end: datetime | None) -> Stretch:
    if e.action in RECOVERING:
        cap = e.at + RECOVERY_HORIZON
        end = cap if end is None else min(end, cap)
        return Stretch(
            e.instance_id, e.team, e.owner, e.action, e.at, end, e.hourly_savings, e.by, e.account, e.upper_bound
        )
    # An entry from before the rule recorded a keep's waste: its hourly cost.
    waste, bound = (e.hourly_waste, e.waste_upper_bound) if e.hourly_waste is not None else (e.hourly_cost, False)
    return Stretch(e.instance_id, e.team, e.owner, KEEP, e.at, end, waste, e.by, e.account, bound)


# ---------------------------------------------------------------------------------------------
# The figures


@dataclass(frozen=True)
class Recovered:
    """Stops of one kind: how many began this week, and the hours and dollars all of them saved in it."""

    count: int = 0
    hours: float = 0.0
    dollars: float = 0.0
    upper_bound: bool = False  # some of its dollars are Spot savings at the most they can be: "up to"


@dataclass(frozen=True)
class Kept:
    """One owner's machines kept idle by answers this week."""

    owner: str
    keeps: int
    hours: float
    dollars: float
    by: tuple[str, ...]  # who answered
    upper_bound: bool = False  # some of its dollars are a Spot machine's at the most they can be


@dataclass(frozen=True)
class AtRisk:
    """A running machine the reaper cannot act on right now, and what it costs an hour."""

    instance_id: str
    name: str
    team: str
    state: str  # unknown, safe_mode or exempt
    hourly_cost: float | None
    idle_hours: float | None = None  # exempt: hours of the week it sat idle (None: not read, or no data)
    account: str | None = None  # the member account (None: the hub's own)
    key: str = ""  # its machine key (records.machine_key): what exempt_idle is keyed by
    idle_hourly: float | None = None  # what an idle hour of it wastes, by the rule (core/dollars.py)
    idle_upper_bound: bool = False  # idle_hourly is the most it can be (Spot): "up to"

    @property
    def idle_dollars(self) -> float:  # exempt: what its idle hours of the week wasted (0: not read, no price)
        return (self.idle_hours or 0.0) * (self.idle_hourly or 0.0)


@dataclass(frozen=True)
class TrendWeek:
    week: Week
    recovered: float
    wasted: float
    has_data: bool
    upper_bound: bool = False  # its recovered dollars include Spot savings at the most they can be


@dataclass
class Digest:
    destination: str  # the team, or ADMINS
    team: str | None  # None: every team (the admins' digest)
    week: Week
    start: datetime
    end: datetime  # the week's end, or `now` for a week under way
    has_data: bool = False
    recovered: dict[str, Recovered] = field(default_factory=dict)  # by RECOVERING word
    unpriced_hours: float = 0.0  # stopped hours of machines without a known price
    kept: list[Kept] = field(default_factory=list)
    at_risk: list[AtRisk] = field(default_factory=list)
    group_idle: list[AtRisk] = field(default_factory=list)  # idle group members released, still running
    under_used: list[UnderUsed] = field(default_factory=list)
    stops: int = 0
    unwanted_stops: int = 0
    window_stops: tuple[int, int] = (0, 0)  # the machines' stops and unwanted ones: what idle_minutes decides
    warnings: int = 0
    warnings_without_stop: int = 0
    suggestion: str = ""
    trend: list[TrendWeek] = field(default_factory=list)
    top_waste: list[tuple[str, float]] = field(default_factory=list)  # machine, kept dollars
    teams: dict[str, tuple[float, float]] = field(default_factory=dict)  # admins: team -> (recovered, wasted)
    # Organization mode: account (None: the hub's) -> (recovered, wasted); empty when the hub's account is alone.
    accounts: dict[str | None, tuple[float, float]] = field(default_factory=dict)
    account_names: Mapping[str, str] = field(default_factory=dict)  # account id -> its name (the directory's)
    idle_minutes: int | None = None
    spot_in: set[tuple[str, str | None]] = field(default_factory=set)  # (team, account) whose savings are "up to"
    spot_kept_in: set[tuple[str, str | None]] = field(default_factory=set)  # ... whose kept-idle waste is "up to"
    sections: list[Section] = field(default_factory=list)  # every kind but machines, each its own (core/sections.py)

    @property
    def recovered_hours(self) -> float:
        return sum(r.hours for r in self.recovered.values())

    @property
    def recovered_dollars(self) -> float:
        return sum(r.dollars for r in self.recovered.values())

    recovered_upper_bound = property(lambda self: any(r.upper_bound for r in self.recovered.values()))
    kept_upper_bound = property(lambda self: any(k.upper_bound for k in self.kept))

    @property
    def exempt_idle(self) -> list[AtRisk]:
        """The exempt machines whose idle hours of the week were read, most wasteful first."""
        read = [a for a in self.at_risk if a.state == State.EXEMPT.value and a.idle_hours is not None]
        return sorted(read, key=lambda a: (-a.idle_dollars, -(a.idle_hours or 0.0), a.name))

    @property
    def exempt_idle_dollars(self) -> float:  # still wasted, exempt and idle: the text's figure and the chart's
        return sum(a.idle_dollars for a in self.exempt_idle)

    @property
    def kept_hours(self) -> float:
        return sum(k.hours for k in self.kept)

    @property
    def kept_dollars(self) -> float:
        return sum(k.dollars for k in self.kept)


def _in_scope(team: str | None, item_team: str) -> bool:
    return team is None or item_team == team


def _week_money(
    all_stretches: Sequence[Stretch], team: str | None, lo: datetime, hi: datetime, account: str | bool | None = True
) -> tuple[float, float]:
    """Recovered and wasted dollars of [lo, hi) of one team (None: all), in one account (True: all; None: the
    hub's)."""
    recovered = wasted = 0.0
    for s in all_stretches:
        if _in_scope(team, s.team) and (account is True or s.account == account) and s.hourly is not None:
            money = s.hours_in(lo, hi) * s.hourly
            if s.kind == KEEP:
                wasted += money
            else:
                recovered += money
    return recovered, wasted


def _has_data(
    events: Sequence[Event], all_stretches: Sequence[Stretch], team: str | None, lo: datetime, hi: datetime
) -> bool:
    return any(_in_scope(team, e.team) and lo <= e.at < hi for e in events) or any(
        _in_scope(team, s.team) and s.hours_in(lo, hi) > 0 for s in all_stretches
    )


def build_digest(
    entries: Iterable[tuple[str, datetime, Mapping[str, Any]]],
    records: Iterable[MachineRecord],
    week: Week,
    *,
    now: datetime,
    team: str | None = None,
    zone: str = "UTC",
    policy: TeamPolicy | None = None,
    prices: Mapping[str, float] | None = None,
    exempt_idle: Mapping[str, float | None] | None = None,
    account_names: Mapping[str, str] | None = None,
) -> Digest:
    """The digest of `week` (in `zone`) for one team, or for every team (team None: the admins'), from the
    audit entries (of this week and the TREND_WEEKS before, and any stop still open) and the records now.
    `exempt_idle`: idle hours of exempt machines by machine key. `account_names`: member account id -> name."""
    events, records = events_of(entries), list(records)
    # A group member released but still running (its group kept it) has saved nothing yet: no dollars, no hours.
    kept_by_group = {a.key for a in _at_risk(records, None, now, {}, group=True)}
    all_stretches = [
        replace(s, hourly=0.0, running=True)
        if not saves_while_running(s.kind) and s.instance_id in kept_by_group
        else s
        for s in stretches(events)
    ]
    lo, week_end = week.span(zone)
    hi = min(week_end, now)
    d = Digest(
        team or ADMINS,
        team,
        week,
        lo,
        hi,
        idle_minutes=policy.idle_minutes if policy else None,
        account_names=dict(account_names or {}),
    )
    d.has_data = _has_data(events, all_stretches, team, lo, hi)

    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, False])
    kept: dict[str, list[Any]] = {}
    waste_by_machine: dict[str, float] = defaultdict(float)
    saved: dict[str, tuple[float, float, bool]] = {}  # by machine key: hours, dollars, upper bound
    for s in all_stretches:
        if not _in_scope(team, s.team):
            continue
        hours = s.hours_in(lo, hi)
        money = hours * s.hourly if s.hourly is not None else 0.0
        if s.kind == KEEP:
            if not lo <= s.start < hi and hours == 0:
                continue
            line = kept.setdefault(s.owner or s.instance_id, [0, 0.0, 0.0, set(), False])
            line[0] += lo <= s.start < hi
            line[1] += hours
            line[2] += money
            line[4] = line[4] or (s.upper_bound and money > 0)
            if s.by:
                line[3].add(s.by)
            waste_by_machine[s.instance_id] += money
            continue
        deleted = s.kind == "stop" and words_for(s.instance_id).deletes
        figures = kinds[DELETIONS if deleted else RECOVERING[s.kind]]
        started_here = lo <= s.start < hi
        hours = s.saved_hours_in(lo, hi)
        h, m, b = saved.get(s.instance_id, (0.0, 0.0, False))
        saved[s.instance_id] = (h + hours, m + money, b or (s.upper_bound and money > 0))
        figures[0] += started_here
        figures[1] += hours
        figures[2] += money
        figures[3] = figures[3] or (s.upper_bound and money > 0)
        if s.hourly is None:
            d.unpriced_hours += hours
        if started_here:
            unwanted = s.end is not None and s.end - s.start <= timedelta(minutes=UNWANTED_WITHIN_MINUTES)
            d.stops += 1
            d.unwanted_stops += unwanted
            if not deleted:  # an endpoint's or app's deletion follows its own window, not idle_minutes
                d.window_stops = (d.window_stops[0] + 1, d.window_stops[1] + unwanted)
    d.recovered = {word: Recovered(int(c), h, m, bool(b)) for word, (c, h, m, b) in kinds.items()}
    d.kept = sorted(
        (Kept(owner, int(n), h, m, tuple(sorted(by)), b) for owner, (n, h, m, by, b) in kept.items()),
        key=lambda k: (-k.dollars, -k.hours, k.owner),
    )
    d.top_waste = sorted(((i, m) for i, m in waste_by_machine.items() if m > 0), key=lambda p: (-p[1], p[0]))
    d.top_waste = d.top_waste[:TOP_MACHINES]
    d.warnings, d.warnings_without_stop = _warnings(events, records, team, lo, hi)
    d.suggestion = window_suggestion(d)
    idle = exempt_idle or {}
    d.at_risk = [replace(a, idle_hours=idle.get(a.key)) for a in _at_risk(records, team, now, prices or {})]
    d.group_idle = _at_risk(records, team, now, prices or {}, group=True)
    d.under_used = under_used(records, week, team, prices or {})
    d.sections = sections(records, saved, team, now, prices or {})
    for back in range(TREND_WEEKS - 1, -1, -1):
        w = week.previous(back) if back else week
        wlo, wend = w.span(zone)
        whi = min(wend, now)
        recovered, wasted = _week_money(all_stretches, team, wlo, whi)
        spot = (s for s in all_stretches if s.upper_bound and s.kind != KEEP and s.hourly and _in_scope(team, s.team))
        bound = any(s.hours_in(wlo, whi) > 0 for s in spot)
        d.trend.append(TrendWeek(w, recovered, wasted, _has_data(events, all_stretches, team, wlo, whi), bound))
    if team is None:
        for t in sorted({s.team for s in all_stretches} | {e.team for e in events if lo <= e.at < hi}):
            team_money = _week_money(all_stretches, t, lo, hi)
            if any(team_money) or any(e.team == t and lo <= e.at < hi for e in events):
                d.teams[t] = team_money
    d.accounts = _by_account(events, all_stretches, d, team, lo, hi)
    spots = [s for s in all_stretches if s.upper_bound and s.hourly and _in_scope(team, s.team)]
    d.spot_in = {(s.team, s.account) for s in spots if s.kind != KEEP and s.hours_in(lo, hi) > 0}
    d.spot_kept_in = {(s.team, s.account) for s in spots if s.kind == KEEP and s.hours_in(lo, hi) > 0}
    return d


def _by_account(
    events: Sequence[Event], all_stretches: Sequence[Stretch], d: Digest, team: str | None, lo: datetime, hi: datetime
) -> dict[str | None, tuple[float, float]]:
    """Each account's recovered and wasted dollars of the week, for every account with anything this digest
    tells (money, an event, a machine not watched, an under-used one); empty when that is the hub's alone."""
    seen: set[str | None] = {e.account for e in events if _in_scope(team, e.team) and lo <= e.at < hi}
    seen |= {s.account for s in all_stretches if _in_scope(team, s.team) and s.hours_in(lo, hi) > 0}
    seen |= {a.account for a in d.at_risk} | {u.account for u in d.under_used}
    if seen <= {None}:
        return {}
    return {a: _week_money(all_stretches, team, lo, hi, a) for a in seen}


def _warnings(
    events: Sequence[Event], records: Iterable[MachineRecord], team: str | None, lo: datetime, hi: datetime
) -> tuple[int, int]:
    """Warnings given this week, and those that led to no stop: the machine was busy again (its next event is
    another warning or it was seen running) without a stop or a keep. One still open now is not counted."""
    open_warnings = {(r.key, r.warned_at.isoformat()) for r in records if r.warned_at and r.state is State.WARNED}
    by_machine: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_machine[e.instance_id].append(e)
    given = without_stop = 0
    for instance_id, evs in by_machine.items():
        seen: set[str] = set()
        for i, e in enumerate(evs):
            if e.action != WARN or e.warned_at in seen or not _in_scope(team, e.team) or not lo <= e.at < hi:
                continue
            seen.add(e.warned_at)
            given += 1
            later = [n for n in evs[i + 1 :] if not (n.action == WARN and n.warned_at == e.warned_at)]
            if later:
                without_stop += later[0].action not in RECOVERING and later[0].action != KEEP
            else:  # nothing since: busy again (not audited) or gone, unless the warning is still open now
                without_stop += (instance_id, e.warned_at) not in open_warnings
    return given, without_stop


def running_now(record: MachineRecord, now: datetime) -> bool:
    """Written by a sweep in the last FRESH_RECORD: the machine was running then (a stopped or gone machine's
    record is no longer written)."""
    return record.updated_at is not None and now - FRESH_RECORD <= record.updated_at <= now + FRESH_RECORD


def _at_risk(
    records: Iterable[MachineRecord], team: str | None, now: datetime, prices: Mapping[str, float], group: bool = False
) -> list[AtRisk]:
    """Running machines the reaper cannot act on now; `group`: released group members that still run."""
    states = (State.REAPED,) if group else (State.UNKNOWN, State.SAFE_MODE, State.EXEMPT)
    return sorted(
        (
            AtRisk(
                r.instance_id,
                r.name or r.instance_id,
                r.team,
                r.state.value,
                prices.get(r.instance_type or ""),
                account=r.account,
                key=r.key,
                idle_hourly=(idle := of_record(r, prices.get(r.instance_type or "")).idle).hourly,
                idle_upper_bound=idle.upper_bound,
            )
            for r in records
            if r.state in states
            and _in_scope(team, r.team)
            and running_now(r, now)
            and (r.asg_name or not group)
            and section_of(r.key) == MACHINES  # another kind's are in its own section
        ),
        key=lambda a: (a.state, -(a.hourly_cost or 0.0), a.name),
    )


def window_suggestion(d: Digest) -> str:
    """One line when the figures say the idle window is too short or too long ("" when they do not)."""
    window = f" (now {d.idle_minutes} min)" if d.idle_minutes else ""
    stops, unwanted = d.window_stops
    if stops >= 3 and unwanted / stops >= 0.2:
        return (
            f"{unwanted} of {stops} stops were started again within an hour: the window looks too short; "
            f"consider a longer idle_minutes{window}."
        )
    if d.warnings >= 3 and d.warnings_without_stop / d.warnings >= 0.5:
        return (
            f"{d.warnings_without_stop} of {d.warnings} warnings led to no stop (the machine was busy again): "
            f"warnings come too early; consider a longer idle_minutes{window}."
        )
    if stops >= 5 and unwanted == 0 and d.warnings_without_stop * 10 <= d.warnings:
        return (
            f"none of {stops} stops was unwanted and nearly every warning led to a stop: the window could be "
            f"shorter{window} and save more."
        )
    return ""
