"""`idle-reaper organization import-state`: an account that ran a single-account stack joins the hub with its
state (issue 30, "Moving an account").

The old stack's state table keys its machines `machine#<instance-id>`; the hub keys a member account's machines
`machine#<account>/<region>/<instance-id>` (core/records.py machine_key). This copies, from the old table into
the hub's, under the member keys:

- every machine record (snoozes, warnings in flight, quiet history, usage profile, owner, ...), with its
  `account` and `region` set;
- every audit item (the machine's history, its sort key and TTL unchanged);
- with `same_slack_app` (the old stack's Slack app is the hub's, so its buttons now reach the hub): the button
  references (`ref#`), the shared messages (`group#`, `groupline#`) with their machine keys rewritten, so a
  click on an old warning finds the machine under its new key and the hub edits the old message in place.
  Without it, an old button cannot reach the hub (its app's request URL is the old stack's endpoint) and the
  hub's bot cannot edit the old app's messages: references and messages are not copied, and the old app's
  warning is taken out of every record that holds one (an unknown or safe-mode record keeps the times of the
  warning before it, which the hub would take for its own): a warning in flight goes back to "idle", so the hub
  warns again with buttons that work (the stop waits `warn_minutes` from that new warning); an unknown or
  safe-mode record keeps its state. Snoozes are kept either way.
- the owner cache (email -> Slack user id), and the machines stopped during quiet hours whose owners have
  not been told yet (the hub's quiet-hours index), so the morning summary still comes.

Everything else in the old table belongs to the old deployment (its sweeps' manifests and claims, its one-time
admin alerts, its doctor's memory) and is left behind, counted.

Every write is conditional: nothing of the hub's is overwritten except a machine record that is older than
the old table's (by `updated_at`), unchanged since it was read and not claimed by a hub sweep; a hub record
that is newer or the same is kept, and so is one with an active snooze (someone pressed Keep on the hub's
warning) or a warning the hub sent itself. An active keep of the old record's that lasts longer than the kept
hub record's is carried into it (the same conditions). So a second run changes nothing, and a run after a late
click on the old stack copies only that click. A live claim of the old stack's sweep on any machine refuses
the whole import (the old reaper is running); an old table that is not in the account and region being moved
(read with the caller's credentials when --from-role is forgotten) is refused; an unreadable machine item is
counted and left behind.
The plan is pure (plan_import, compare); the CLI (admin.py cmd_import_state) checks the inputs and wires."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.aws.accounts import MemberAccount, OrganizationConfig
from idle_reaper.aws.clients import chunks, error_code, wall_clock
from idle_reaper.aws.state import DDB_BATCH_GET, DynamoStateStore, StateStore, item_to_record, record_to_item
from idle_reaper.core.records import MachineRecord, State, machine_key, parse_machine_key
from idle_reaper.policy import PolicyError
from idle_reaper.sweep.quiet_hours import (
    HUB_SCOPE,
    QUIET_INDEX,
    QUIET_STOPS,
    QuietStop,
    note_quiet_stops,
    parse_stop,
    scope_of,
)
from idle_reaper.sweep.quiet_hours import quiet_stops as stored_quiet_stops
from idle_reaper_tools.admin import EXIT_ERROR, _Fail, _run

Key = tuple[str, str]  # (pk, sk)

# What a moved warning's record says until the hub warns again.
REWARN_REASON = "moved into organization mode: warned again from the hub's Slack app"

KIND_NAMES = {
    "audit": "audit items",
    "ref": "button references",
    "group": "shared messages",
    "groupline": "shared message lines",
    "owner": "owner cache entries",
}


# ---------------------------------------------------------------------------------------------
# The plan (pure)


# What compare() decides for a record: "copy" (written under the member key), or the hub's is kept, and why.
VERDICTS = {
    "copy": "copy",
    "newer": "keep the hub's (newer)",
    "same": "already imported",
    "snoozed": "keep the hub's (active snooze)",
    "warned": "keep the hub's (the hub's own warning)",
    "unreadable": "keep the hub's (unreadable)",
}


@dataclass(frozen=True)
class OldWarning:
    """The old record's warning as the old stack sent it, before the import took it out: when, and its messages."""

    warned_at: datetime | None = None
    refs: frozenset[str] = frozenset()

    @classmethod
    def of(cls, record: MachineRecord) -> OldWarning:
        return cls(record.warned_at, _message_refs(record))


def _message_refs(record: MachineRecord) -> frozenset[str]:
    return frozenset(r for r in (record.warning_ref, record.group_ref, *record.messages) if r)


@dataclass(frozen=True)
class RecordMove:
    old_key: str  # the instance id (the old table's key)
    record: MachineRecord  # as it will be written under its member key
    expires_at: int | None
    hub: MachineRecord | None = None  # the hub's record under the member key, when there is one
    rewarn: bool = False  # the old app's warning was taken out: the hub warns again
    old_warning: OldWarning = OldWarning()  # frozen: one default serves all
    verdict: str = "copy"  # a key of VERDICTS (compare())
    # The hub's kept record with the old record's later active keep in it: written over the hub's (apply()).
    carried: MachineRecord | None = None
    hub_expires_at: int | None = None  # the hub record's TTL, kept with it


@dataclass(frozen=True)
class ItemCopy:
    kind: str  # "audit", "ref", "group", "groupline", "owner"
    item: dict[str, Any]  # the hub's item, plain values
    exists: bool = False  # the hub has an item under this key (kept)

    @property
    def key(self) -> Key:
        return (str(self.item["pk"]), str(self.item["sk"]))


@dataclass
class ImportPlan:
    account: str
    region: str
    records: list[RecordMove] = field(default_factory=list)
    items: list[ItemCopy] = field(default_factory=list)
    quiet: dict[str, list[str]] = field(default_factory=dict)  # team -> member keys still to be told
    left: Counter[str] = field(default_factory=Counter)  # what was not copied, by kind
    claimed: list[tuple[str, datetime]] = field(default_factory=list)  # old machines a sweep holds, until

    def member_key(self, instance_id: str) -> str:
        return machine_key(instance_id, self.account, self.region)


def _live(item: Mapping[str, Any], now: datetime) -> bool:
    expires = item.get("expires_at")
    return expires is None or int(expires) > now.timestamp()


def _without_old_messages(record: MachineRecord) -> tuple[MachineRecord, bool]:
    """The record with no reference to the old Slack app's messages nor to its warning, whatever the state: an
    unknown or safe-mode record keeps the times of the warning before it, and the hub would take them for a
    warning of its own (lifecycle._stretch) and stop a machine whose owner could not answer. A warning in flight
    goes back to idle (its quiet stretch, snoozes and history kept), so the hub's next sweep warns again with
    its own buttons; an unknown or safe-mode record stays so until the hub sees the machine."""
    moved = replace(record, messages=(), warning_ref=None, group_ref=None, warning_owed=())
    warning = (
        record.warned_at,
        record.warning_delivered_at,
        record.stop_not_before,
        record.warning_post_started_at,
        record.delivery_error,
    )
    if record.state is not State.WARNED and not record.warning_held and all(v is None for v in warning):
        return moved, False
    moved = replace(
        moved,
        warned_at=None,
        warning_delivered_at=None,
        stop_not_before=None,
        warning_post_started_at=None,
        delivery_error=None,
        warning_held=False,
    )
    if record.state is State.WARNED:
        moved = replace(moved, state=State.IDLE, reason=REWARN_REASON)
    return moved, record.state is not State.REAPED


def plan_import(
    old_items: Iterable[Mapping[str, Any]], account: str, region: str, *, same_slack_app: bool, now: datetime
) -> ImportPlan:
    """What to write into the hub's table for the old table's items (plain values, as a Scan gives them)."""
    plan = ImportPlan(account, region)
    lookups: dict[str, Mapping[str, Any]] = {}
    quiet: list[Mapping[str, Any]] = []  # the quiet-hours stops not told yet, an item each (sweep/quiet_hours.py)
    for item in old_items:
        pk, sk = str(item.get("pk", "")), str(item.get("sk", ""))
        kind, _, rest = pk.partition("#")
        try:
            live = _live(item, now)
        except (ValueError, TypeError):
            plan.left["unreadable machine items" if kind == "machine" else "unreadable items"] += 1
            continue
        if not live:  # TTL deletes lazily: what has expired is gone already
            plan.left["expired items"] += 1
        elif kind == "machine":
            try:
                found = parse_machine_key(rest)
            except ValueError:
                plan.left["unreadable machine items"] += 1
                continue
            if found.account is not None:  # a hub's table, not a single-account stack's
                plan.left["member machines' items (the old table is a hub's)"] += 1
                continue
            if sk == "state":
                try:
                    _add_record(plan, item, rest, same_slack_app, now)
                except (ValueError, TypeError, KeyError, AttributeError):  # a bad date, no team, a claim not a number
                    plan.left["unreadable machine items"] += 1
            elif sk.startswith("audit#"):
                entry = _member_entry(str(item.get("entry", "")), account, region)
                plan.items.append(ItemCopy("audit", {**item, "pk": f"machine#{plan.member_key(rest)}", "entry": entry}))
            else:
                plan.left["other machine items"] += 1
        elif kind == "lookup" and sk == "lookup":
            lookups[rest] = item
        elif kind == "entries" and rest == f"{QUIET_STOPS}#{HUB_SCOPE}":
            quiet.append(item)
        else:
            plan.left[f"{kind or 'unnamed'} items of the old deployment"] += 1
    moved = {m.old_key: m.record.key for m in plan.records}
    for name, item in sorted(lookups.items()):
        copied = _lookup_copy(name, item, moved, same_slack_app)
        if copied is not None:
            plan.items.append(copied)
        elif name == QUIET_INDEX:
            _add_quiet(plan, str(item.get("value", "")), moved)
        elif name.split("#")[0] in ("ref", "group", "groupline"):
            why = "no record of their machine" if same_slack_app else "the old Slack app's"
            plan.left[f"button references and shared messages ({why})"] += 1
        else:
            plan.left[f"{name.split('#')[0]} lookups of the old deployment"] += 1
    for item in quiet:
        _add_quiet_stop(plan, item, moved)
    return plan


def _member_entry(text: str, account: str, region: str) -> str:
    """An audit entry as the hub writes a member machine's (sweep/delivery.py explain): with its account and
    region beside its instance id. An unreadable entry is copied as it is."""
    try:
        entry = json.loads(text)
    except ValueError:
        return text
    if not isinstance(entry, dict) or "instance_id" not in entry:
        return text
    return json.dumps({**entry, "account": account, "region": region}, default=str, sort_keys=True)


def _add_record(plan: ImportPlan, item: Mapping[str, Any], instance_id: str, same_app: bool, now: datetime) -> None:
    """Plan one machine record; raises ValueError (or TypeError, KeyError) when the item is unreadable."""
    claim_until = item.get("claim_until")
    claim = int(claim_until) if claim_until is not None else None
    old = _readable_record({**item, "instance_id": instance_id})
    record = replace(old, account=plan.account, region=plan.region)
    expires = item.get("expires_at")
    expires_at = int(expires) if expires is not None else None
    if claim is not None and claim > now.timestamp():
        plan.claimed.append((instance_id, datetime.fromtimestamp(claim, tz=UTC)))
    rewarn = False
    if not same_app:
        record, rewarn = _without_old_messages(record)
    plan.records.append(RecordMove(instance_id, record, expires_at, rewarn=rewarn, old_warning=OldWarning.of(old)))


def _readable_record(item: Mapping[str, Any]) -> MachineRecord:
    """The record of a state item; ValueError (or TypeError, KeyError) for one the import cannot compare safely:
    a date without its time zone is unreadable too."""
    record = item_to_record(item)
    for f in fields(record):
        value = getattr(record, f.name)
        if isinstance(value, datetime) and value.tzinfo is None:
            raise ValueError(f"{f.name}: no time zone")
    if not isinstance(record.team, str) or not record.team:
        raise ValueError("no team")
    return record


def _lookup_copy(name: str, item: Mapping[str, Any], moved: Mapping[str, str], same_app: bool) -> ItemCopy | None:
    """The hub's copy of one live lookup of the old table, its machine keys rewritten; None: not copied."""
    kind, _, rest = name.partition("#")
    value = str(item.get("value", ""))

    def copy(new_name: str, new_value: str) -> ItemCopy:
        return ItemCopy(kind, {**item, "pk": f"lookup#{new_name}", "value": new_value})

    if kind == "owner":  # email -> Slack user id: the same workspace's
        return copy(name, value)
    if not same_app:
        return None
    if kind == "ref" and value in moved:  # a button's reference -> the machine's key
        return copy(name, moved[value])
    if kind == "groupline":  # groupline#<group ref>#<machine key> -> that machine's line in a shared message
        group_ref, _, old_key = rest.rpartition("#")
        return copy(f"groupline#{group_ref}#{moved[old_key]}", value) if old_key in moved else None
    if kind == "group":  # a shared message: the machines it lists, their references and lines, by key
        try:
            data = json.loads(value)
            ids = [moved[i] for i in data["ids"]]
            refs = {moved[k]: v for k, v in data["refs"].items()}
            lines = {moved[k]: v for k, v in data["lines"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable, or lists a machine the old table has no record of: the message stays as is
        return copy(name, json.dumps({**data, "ids": ids, "refs": refs, "lines": lines}))
    return None


def _add_quiet_stop(plan: ImportPlan, item: Mapping[str, Any], moved: Mapping[str, str]) -> None:
    """One stop of the old table's quiet-hours index (an item a stop) whose owner is not told yet."""
    value = item.get("value")
    try:
        stop = parse_stop(str(item.get("sk", "")), value if isinstance(value, str) else "", HUB_SCOPE)
    except ValueError:
        plan.left["unreadable quiet-hours index entries"] += 1
        return
    if stop.key in moved:
        keys = plan.quiet.setdefault(stop.team, [])
        keys += [] if moved[stop.key] in keys else [moved[stop.key]]


def _add_quiet(plan: ImportPlan, raw: str, moved: Mapping[str, str]) -> None:
    try:
        index = json.loads(raw)
    except ValueError:
        index = None
    if not isinstance(index, dict):
        plan.left["unreadable quiet-hours index"] += 1
        return
    for team, ids in index.items():
        keys = [moved[i] for i in ids if isinstance(i, str) and i in moved] if isinstance(ids, list) else []
        if keys:
            plan.quiet[str(team)] = keys


def compare(plan: ImportPlan, hub_items: Mapping[Key, Mapping[str, Any]], now: datetime) -> ImportPlan:
    """The plan against what the hub's table holds under the same keys (its records and items)."""
    records = []
    for move in plan.records:
        found = hub_items.get((f"machine#{move.record.key}", "state"))
        if found is None:
            records.append(move)
            continue
        try:
            hub = _readable_record(found)
        except (ValueError, TypeError, KeyError, AttributeError):
            records.append(replace(move, verdict="unreadable"))  # never overwritten on a guess
            continue
        expires = found.get("expires_at")
        ttl = int(expires) if isinstance(expires, (int, Decimal)) else None
        records.append(_against(replace(move, hub=hub, hub_expires_at=ttl), hub, now))
    plan.records = records
    plan.items = [replace(c, exists=c.key in hub_items) for c in plan.items]
    return plan


def _against(move: RecordMove, hub: MachineRecord, now: datetime) -> RecordMove:
    """The verdict on one record the hub has too. The newer (by updated_at) is kept, except that a hub record
    with an active snooze (someone pressed Keep on the hub's warning) or a warning the hub sent itself is never
    overwritten; and an active keep of the old record's that lasts longer than the hub's is carried into the
    kept record (a person's answer is not lost either way)."""
    old = move.record
    if hub.updated_at is not None and hub.updated_at == old.updated_at:
        return replace(move, verdict="same")
    if hub.snoozed_until is not None and hub.snoozed_until > now:
        verdict = "snoozed"
    elif _hubs_own_warning(hub, move.old_warning):
        verdict = "warned"
    elif hub.updated_at is None or old.updated_at is None or hub.updated_at > old.updated_at:
        verdict = "newer"  # cannot tell which is newer: the hub's is never overwritten on a guess
    else:
        return replace(move, verdict="copy")
    keep = old.snoozed_until
    if keep is None or keep <= now or (hub.snoozed_until is not None and hub.snoozed_until >= keep):
        return replace(move, verdict=verdict)
    same_day = hub.snooze_day == old.snooze_day
    carried = replace(
        hub,
        snoozed_until=keep,
        snoozed_by=old.snoozed_by,
        snooze_day=old.snooze_day if old.snooze_day else hub.snooze_day,
        snoozes_today=max(hub.snoozes_today, old.snoozes_today) if same_day else old.snoozes_today,
        version=hub.version + 1,
        updated_at=now,
    )
    return replace(move, verdict=verdict, carried=carried)


def _hubs_own_warning(hub: MachineRecord, old: OldWarning) -> bool:
    """The hub's record holds a warning in flight that the hub sent (not one an earlier import copied)."""
    if hub.state is not State.WARNED:
        return False
    return hub.warned_at != old.warned_at or not _message_refs(hub) <= old.refs


def target_keys(plan: ImportPlan) -> list[Key]:
    return [(f"machine#{m.record.key}", "state") for m in plan.records] + [c.key for c in plan.items]


# ---------------------------------------------------------------------------------------------
# The tables (DynamoDB)


class Table(DynamoStateStore):
    """One state table as the import reads and writes it: the state store's DynamoDB calls (batch reads,
    conditional writes), plus a Scan of all its items and its ARN."""

    def arn(self) -> str:
        """The table's ARN; raises ClientError ResourceNotFoundException when there is no such table."""
        return str(self.dynamodb.describe_table(TableName=self.table)["Table"]["TableArn"])

    def scan(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for page in self.dynamodb.get_paginator("scan").paginate(TableName=self.table, ConsistentRead=True):
            items += [self._plain(raw) for raw in page["Items"]]
        return items

    def get_many(self, keys: Sequence[Key]) -> dict[Key, dict[str, Any]]:
        found: dict[Key, dict[str, Any]] = {}
        for batch in chunks(sorted(set(keys)), DDB_BATCH_GET):
            for item in self._batch_get([{"pk": pk, "sk": sk} for pk, sk in batch], consistent=True):
                found[(str(item["pk"]), str(item["sk"]))] = item
        return found

    def put_if(self, item: Mapping[str, Any], condition: str, values: Mapping[str, Any] | None = None) -> bool:
        """A conditional PutItem; False when the condition does not hold."""
        return self._put_if(item, condition, values or {})


@dataclass
class Outcome:
    """What a run wrote, by kind: copied, and kept (the hub's was there, newer or written meanwhile)."""

    copied: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    carried: int = 0  # kept hub records that took the old record's later keep
    quiet_added: int = 0


def apply(
    plan: ImportPlan, hub: Table, now: datetime, update_quiet: Callable[[Mapping[str, Sequence[str]]], int]
) -> Outcome:
    """Write the plan into the hub's table, each write conditional on what compare() saw: never over a hub
    record that is newer, the same, or changed since it was read, nor over any other item of the hub's."""
    out = Outcome()
    for move in plan.records:
        if move.verdict != "copy":
            out.kept["records"] += 1
            if move.carried is not None and move.hub is not None:
                item = {**record_to_item(move.carried), **_hub_ttl(move)}
                out.carried += _put_over(hub, item, move.hub, now)
            continue
        item = record_to_item(move.record)
        if move.expires_at is not None:
            item["expires_at"] = move.expires_at
        if move.hub is None:
            done = hub.put_if(item, "attribute_not_exists(pk)")
        else:
            # Newer than the hub's: written with a version past the hub's, so a sweep that read the hub's record
            # cannot write over this one.
            item["version"] = max(move.record.version, move.hub.version + 1)
            done = _put_over(hub, item, move.hub, now)
        (out.copied if done else out.kept)["records"] += 1
    for copy in plan.items:
        kind = KIND_NAMES[copy.kind]
        if copy.exists:
            out.kept[kind] += 1
            continue
        # A lookup the hub has is never replaced while it lives; an expired one (TTL deletes lazily) may be.
        condition = (
            "attribute_not_exists(pk)" if copy.kind == "audit" else "attribute_not_exists(pk) OR expires_at <= :now"
        )
        values = None if copy.kind == "audit" else {":now": int(now.timestamp())}
        (out.copied if hub.put_if(copy.item, condition, values) else out.kept)[kind] += 1
    if plan.quiet:
        out.quiet_added = update_quiet(plan.quiet)
    return out


def _put_over(hub: Table, item: Mapping[str, Any], read: MachineRecord, now: datetime) -> bool:
    """Write over a hub record only while it is as compare() read it and no sweep holds a live claim on it."""
    values: dict[str, Any] = {":version": read.version, ":now": int(now.timestamp())}
    if read.updated_at is None:
        updated = "attribute_not_exists(updated_at)"
    else:
        updated, values[":updated"] = "updated_at = :updated", record_to_item(read)["updated_at"]
    condition = f"version = :version AND {updated} AND (attribute_not_exists(claim_until) OR claim_until <= :now)"
    return hub.put_if(item, condition, values)


def _hub_ttl(move: RecordMove) -> dict[str, Any]:
    """The hub record's TTL, kept when the import writes its record with a carried keep."""
    return {"expires_at": move.hub_expires_at} if move.hub_expires_at is not None else {}


def add_to_quiet_index(store: StateStore, adding: Mapping[str, Sequence[str]], now: datetime) -> int:
    """Add the moved machines to the hub's quiet-hours index (an entry a stop, in the member account-region's
    partition: its unit tells them), those it does not hold yet. Returns how many were added."""
    stops = [QuietStop(key, team, None) for team, keys in adding.items() for key in keys]
    held: set[str] = set()
    for scope in sorted({scope_of(s.key) for s in stops}):
        found, unreadable = stored_quiet_stops(store, scope, now)
        held |= {s.key for s in found} | set(unreadable)
    new = [s for s in stops if s.key not in held]
    failed = note_quiet_stops(store, new, now) if new else {}
    if failed:
        key, why = next(iter(failed.items()))
        raise RuntimeError(f"{len(failed)} stops not added to the hub's quiet-hours index (the first, {key}: {why})")
    return len(new)


# ---------------------------------------------------------------------------------------------
# The command


_ACCOUNT = re.compile(r"^\d{12}$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::(\d{12}):role/[\w+=,.@/-]{1,512}$")
_TABLE_ARN = re.compile(r"^arn:aws[a-z-]*:dynamodb:([a-z0-9-]+):(\d{12}):table/([\w.-]{3,255})$")
_TABLE_NAME = re.compile(r"^[\w.-]{3,255}$")


def _organization_config() -> OrganizationConfig:
    """The hub's organization settings, as its functions get them: IDLE_REAPER_ORGANIZATION when set, else
    the hub's Slack function's environment (`<prefix>-slack`, the prefix from IDLE_REAPER_TABLE)."""
    config = OrganizationConfig.from_environment()
    if config is not None:
        return config
    function = f"{aws.deploy_prefix()}-slack"
    try:
        found = aws.client("lambda").get_function_configuration(FunctionName=function)
    except ClientError as exc:
        if error_code(exc) == "ResourceNotFoundException":
            raise _Fail(
                f"no hub here: this region has no function {function} (set IDLE_REAPER_TABLE to the hub's table, "
                "and run where the hub is deployed)"
            ) from None
        raise
    config = OrganizationConfig.of_function(found)
    if config is None:
        raise _Fail(f"{function} is not in organization mode: there is no hub to import into (docs/deploying.md)")
    return config


def _source_table(args: argparse.Namespace) -> Table:
    """The old table, read with the member account's credentials (--from-role) or the caller's own."""
    table = str(args.from_table)
    arn = _TABLE_ARN.match(table)
    if arn is None and not _TABLE_NAME.match(table):
        raise _Fail(f"--from-table {table!r}: not a DynamoDB table name or table ARN")
    if arn is not None and (arn.group(1), arn.group(2)) != (args.region, args.account):
        raise _Fail(
            f"--from-table {table}: that table is in account {arn.group(2)}, region {arn.group(1)}, not in the "
            f"account and region being moved ({args.account}, {args.region})"
        )
    credentials = None
    if args.from_role:
        role = _ROLE_ARN.match(args.from_role)
        if role is None:
            raise _Fail(f"--from-role {args.from_role!r}: not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
        if role.group(1) != args.account:
            raise _Fail(f"--from-role {args.from_role}: a role of account {role.group(1)}, not of {args.account}")
        try:
            given = aws.client("sts").assume_role(RoleArn=args.from_role, RoleSessionName="idle-reaper-import-state")
        except ClientError as exc:
            raise _Fail(
                f"--from-role {args.from_role}: cannot assume it ({error_code(exc)}: {exc}). It must exist, trust "
                "your credentials' account, and your credentials need sts:AssumeRole on it; nothing was written",
                EXIT_ERROR,
            ) from None
        c = given["Credentials"]
        credentials = {
            "aws_access_key_id": c["AccessKeyId"],
            "aws_secret_access_key": c["SecretAccessKey"],
            "aws_session_token": c["SessionToken"],
        }
    return Table(aws.client("dynamodb", args.region, credentials=credentials), table)


def _member(args: argparse.Namespace) -> tuple[MemberAccount, str]:
    """The account being moved, as the hub lists it, and the hub's account; a _Fail when it is not one of the
    hub's members."""
    if not _ACCOUNT.match(args.account):
        raise _Fail(f"--account {args.account!r}: an AWS account id is 12 digits")
    config = _organization_config()
    if args.region not in config.regions:
        raise _Fail(
            f"--region {args.region!r}: the hub does not watch it (member regions: {', '.join(config.regions)})"
        )
    if args.account == config.hub_account and args.region not in config.hub_member_regions:
        # Where the hub has a stack its own stacks sweep its account; elsewhere (a hub inside a target OU) it is a
        # member like any other, and a table of an old stack of its own there is moved like a member's.
        raise _Fail(
            f"--account {args.account} is the hub's own account, swept in {args.region} by the hub's own stack: its "
            "machines keep their keys, nothing to move"
        )
    listing = config.directory().current()
    if listing.error is not None:
        raise _Fail(f"cannot list the organization's member accounts ({listing.error})", EXIT_ERROR)
    member = next((a for a in listing.accounts if a.id == args.account), None)
    if member is None:
        skipped = next((s for s in listing.skipped if s.account == args.account), None)
        why = f" ({skipped.describe()})" if skipped else ""
        raise _Fail(
            f"--account {args.account} is not a member account of this hub: not an active account under "
            f"{', '.join(config.targets)}{why}"
        )
    return member, config.hub_account


def _tables(args: argparse.Namespace, hub: Table, hub_account: str) -> Table:
    """The old table, once it is known to exist, not to be the hub's own, and to be in the account and region
    being moved (a table read with the caller's own credentials, --from-role forgotten, is the caller's
    account's: its machines are not the member's); and the hub's table the hub account's."""
    source = _source_table(args)
    try:
        source_arn = source.arn()
    except ClientError as exc:
        if error_code(exc) == "ResourceNotFoundException":
            missing = f"--from-table {source.table}: no such table in account {args.account}, {args.region}"
            raise _Fail(missing) from None
        raise _Fail(f"--from-table {source.table}: cannot read it ({error_code(exc)}: {exc})", EXIT_ERROR) from None
    try:
        hub_arn = hub.arn()
    except ClientError as exc:
        raise _Fail(f"the hub's table {hub.table}: cannot read it ({error_code(exc)})", EXIT_ERROR) from None
    if source_arn == hub_arn:
        raise _Fail(f"--from-table {source.table} is the hub's own table: nothing to import")
    found = _TABLE_ARN.match(source_arn)
    if found is None or (found.group(1), found.group(2)) != (args.region, args.account):
        where = f"in account {found.group(2)}, region {found.group(1)}" if found else f"{source_arn!r}"
        raise _Fail(
            f"--from-table {source.table}: the table read is {where}, not in the account and region being moved "
            f"({args.account}, {args.region}); pass --from-role with a role of account {args.account}, or the "
            "table's ARN"
        )
    found = _TABLE_ARN.match(hub_arn)
    if found is None or found.group(2) != hub_account:
        where = f"in account {found.group(2)}" if found else f"{hub_arn!r}"
        raise _Fail(
            f"the hub's table {hub.table} is {where}, not the hub's account {hub_account}: run with the hub "
            "account's credentials (and IDLE_REAPER_TABLE the hub's table)"
        )
    return source


def _exclusion_note(args: argparse.Namespace, member: MemberAccount) -> str:
    """Whether the hub sweeps the account already: an import into a hub that does must be asked for."""
    store = aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())
    name = store.organization_name
    try:
        organization = store.load_organization()
    except PolicyError as exc:
        raise _Fail(f"{exc}: fix it first") from None
    if organization.excludes(member.id, member.parents):
        return f"account {member.id} ({member.name}) is excluded in {name}: the hub does not sweep it yet"
    note = (
        f"account {member.id} ({member.name}) is not excluded in {name}: the hub may be sweeping it already, and "
        "its newer records are kept"
    )
    if not (args.dry_run or args.while_watched):
        raise _Fail(
            f"{note}. Exclude it first (docs/deploying.md, Organizations, moving an account), or pass "
            "--while-watched to import anyway"
        )
    return note


def describe_move(move: RecordMove, now: datetime) -> str:
    """One machine's line: what the import does with it, and the facts of the record that is kept."""
    r = move.record if move.verdict == "copy" or move.hub is None else move.hub
    facts = [r.state.value]
    if r.snoozed_until is not None and r.snoozed_until > now:
        facts.append(f"kept until {r.snoozed_until:%Y-%m-%d %H:%M} UTC by {r.snoozed_by or 'someone'}")
    if r.state is State.WARNED and r.stop_not_before is not None:
        facts.append(f"warned, stop not before {r.stop_not_before:%Y-%m-%d %H:%M} UTC")
    if move.rewarn and move.verdict == "copy":
        facts.append("the old app's warning dropped: the hub warns again")
    if move.carried is not None and move.carried.snoozed_until is not None:
        by = move.carried.snoozed_by or "someone"
        facts.append(f"the old stack's keep until {move.carried.snoozed_until:%Y-%m-%d %H:%M} UTC by {by} carried in")
    return f"  {move.old_key} -> {move.record.key}: {VERDICTS[move.verdict]} ({'; '.join(facts)})"


def cmd_import_state(args: argparse.Namespace) -> int:
    def body() -> int:
        now = wall_clock()  # claims and TTLs are about real time, as in the state table
        hub = Table(aws.client("dynamodb"), aws.table_name())
        member, hub_account = _member(args)
        source = _tables(args, hub, hub_account)
        note = _exclusion_note(args, member)
        try:
            old_items = source.scan()
        except ClientError as exc:
            raise _Fail(
                f"--from-table {source.table}: cannot read it ({error_code(exc)}: {exc}); it needs dynamodb:Scan on "
                "the table; nothing was written",
                EXIT_ERROR,
            ) from None
        plan = plan_import(old_items, args.account, args.region, same_slack_app=args.same_slack_app, now=now)
        if plan.claimed:
            until = max(u for _, u in plan.claimed)
            ids = ", ".join(i for i, _ in plan.claimed[:5])
            raise _Fail(
                f"the old stack's sweep holds {len(plan.claimed)} machine(s) ({ids}) until {until:%H:%M:%S} UTC: "
                "disable its schedule (SweepScheduleName) and run again after that; nothing was written"
            )
        plan = compare(plan, hub.get_many(target_keys(plan)), now)
        verb = "would import" if args.dry_run else "importing"
        print(f"{verb} {source.table} (account {args.account}, {args.region}) into {hub.table}")
        print(f"  {note}")
        for move in plan.records:
            print(describe_move(move, now))
        if args.dry_run:
            verdicts = Counter(m.verdict for m in plan.records)
            why = {"snoozed": "has an active snooze", "warned": "sent its own warning", "unreadable": "is unreadable"}
            kept = "".join(f"{verdicts[v]} kept (the hub's {w}), " for v, w in why.items() if verdicts[v])
            print(
                f"records: {verdicts['copy']} to copy, {verdicts['newer']} kept (the hub's is newer), {kept}"
                f"{verdicts['same']} already imported"
            )
            if carrying := sum(m.carried is not None for m in plan.records):
                print(f"the old stack's later keep to carry into {carrying} of the hub's records")
            kinds = Counter((c.kind, c.exists) for c in plan.items)
            for kind in sorted({k for k, _ in kinds}):
                print(f"{KIND_NAMES[kind]}: {kinds[(kind, False)]} to copy, {kinds[(kind, True)]} already there")
            if plan.quiet:
                print(f"quiet-hours summaries still owed: {sum(len(v) for v in plan.quiet.values())} machine(s)")
        else:
            store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
            done = apply(plan, hub, now, lambda adding: add_to_quiet_index(store, adding, now))
            carried = f", the old stack's later keep carried into {done.carried}" if done.carried else ""
            print(f"records: {done.copied['records']} copied, {done.kept['records']} kept (the hub's){carried}")
            for kind in sorted(set(done.copied) | set(done.kept)):
                if kind != "records":
                    print(f"{kind}: {done.copied[kind]} copied, {done.kept[kind]} already there")
            if plan.quiet:
                print(f"quiet-hours summaries still owed: {done.quiet_added} machine(s) added to the hub's")
        for kind, count in sorted(plan.left.items()):
            print(f"not copied: {count} {kind}")
        if args.dry_run:
            print("dry run: nothing was written")
        return 0

    return _run(body)
