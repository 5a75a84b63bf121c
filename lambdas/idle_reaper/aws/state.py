"""The state table (DynamoDB): machine records, claims, lookups and the audit trail; and its in-memory twin."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from idle_reaper.aws.clients import DDB_WORKERS, AwsError, chunks, error_code, run_concurrently, wall_clock
from idle_reaper.aws.limits import Pacing
from idle_reaper.core.records import MachineRecord, State, parse_machine_key

DDB_BATCH_GET = 100
# BatchGetItem's unprocessed keys: asked again at most this many times in all, after a jittered backoff doubling from
# UNPROCESSED_BACKOFF seconds (at most 0.05 x 2^7 = 6.4 s before the last; about 6 s in all on average).
UNPROCESSED_ATTEMPTS = 8
UNPROCESSED_BACKOFF = 0.05
OWNER_INDEX = "owner-index"  # the state table's GSI on owner_slack_id (the Slack status and keep commands)
AUDIT_TTL_DAYS = 90
CLAIM_TTL_DAYS = 30  # an admin alert for a policy still broken after this long is sent again
RECORD_TTL = timedelta(days=30)  # a machine's record expires this long after its last write (machine gone)
# The partition key of a set's entries (StateStore.put_entries): "entries#<group>"; the sweep may delete only these
# of its own (infra/stack.py).
ENTRIES_PREFIX = "entries#"
# How long a sweep's claim on a machine lasts: longer than a sweep Lambda may run (15 min at most), so a
# live sweep never loses its claim, and a crashed sweep's claim blocks that machine for one lease at most.
SWEEP_LEASE = timedelta(minutes=15)


# ---------------------------------------------------------------------------------------------
# Lifecycle state (DynamoDB) and its in-memory twin


def _machine_pk(key: str) -> str:
    """A machine's partition key: its records.machine_key (the instance id alone for the hub's machines, so
    their items are what they were before organization mode) after "machine#". A key that no machine_key made
    is refused here, before anything is read or written."""
    parse_machine_key(key)
    return f"machine#{key}"


def _machine_keys(keys: Sequence[str]) -> list[str]:
    """The machine keys among `keys`, without repeats: text that is no key (a name typed in Slack) names no
    record, so loading it finds nothing instead of failing."""
    found = []
    for key in sorted(set(keys)):
        try:
            parse_machine_key(key)
        except ValueError:
            continue
        found.append(key)
    return found


def _entry_live(expires: Any, now: datetime) -> bool:
    """Whether an entry's TTL (epoch seconds) is still ahead; one without a readable TTL is live (and read)."""
    try:
        return int(expires) > now.timestamp()
    except (TypeError, ValueError):
        return True


class UnprocessedKeys(BotoCoreError):
    """DynamoDB left keys of a BatchGetItem unprocessed past every retry: the read failed as a whole."""

    fmt = "{what}"


@dataclass(frozen=True)
class AuditEntry:
    instance_id: str  # the machine's key (records.machine_key): the instance id alone for the hub's machines
    at: datetime
    entry: Mapping[str, Any]


def _audit_item(a: AuditEntry) -> dict[str, Any]:
    return {
        "pk": _machine_pk(a.instance_id),
        "sk": f"audit#{a.at.isoformat()}#{a.entry.get('action', '')}",
        "expires_at": int((a.at + timedelta(days=AUDIT_TTL_DAYS)).timestamp()),
        "entry": json.dumps(a.entry, default=str, sort_keys=True),
    }


class StateStore(Protocol):
    """The state table. A sweep that posts or acts on a machine first claims it: the claim rides on the
    conditional write of the machine's record, so claiming costs no extra call, and every later write by
    another sweep fails until the claim is released or its lease (SWEEP_LEASE, on the store's clock) ends."""

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        """The records of these machine keys (records.machine_key; the instance id for the hub's machines),
        by key."""
        ...

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

    def put_entries(self, group: str, entries: Mapping[str, str], expires: datetime) -> dict[str, str]:
        """One small item per entry of `group` (a set that grows with the fleet, kept in a partition of its own:
        ENTRIES_PREFIX + group, sort key the entry's key), each written alone, so writers at once never lose each
        other's and no item grows. Returns the keys not written, each with why."""
        ...

    def entries(self, group: str, now: datetime) -> dict[str, str]:
        """The live entries of `group`, by key: one Query of its partition, every page, eventually consistent
        (the caller says why that is enough)."""
        ...

    def remove_entries(self, group: str, entries: Mapping[str, str]) -> list[str]:
        """Delete each entry of `group` that still holds the value given (conditional: one written again
        meanwhile stays). The keys not removed."""
        ...

    def claim_once(self, key: str, at: datetime) -> bool:
        """True for the first caller to claim `key` (a conditional write), False for every later one until the
        claim ends, CLAIM_TTL_DAYS after it was made (`at`), whether or not DynamoDB has deleted it yet."""
        ...

    def release_claim(self, key: str) -> None: ...

    def records_of_owner(self, slack_user_id: str) -> list[MachineRecord]:
        """The machines whose owner is this Slack user (the table's owner-index; never a scan)."""
        ...

    def records_and_audit(self, start: datetime, end: datetime) -> tuple[list[MachineRecord], list[AuditEntry]]:
        """Every machine record, and the audit entries written in [start, end]: what the weekly digest reads."""
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


_TUPLE_FIELDS = {"messages", "warning_owed"}  # lists in the item
_WRITTEN_WHEN_SET = {"warning_owed", "spot_max_price"}  # left out while empty: most items never hold one


def record_to_item(record: MachineRecord) -> dict[str, Any]:
    item: dict[str, Any] = {"pk": _machine_pk(record.key), "sk": "state"}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None or (f.name in _WRITTEN_WHEN_SET and not value):
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
        elif f.name in _TUPLE_FIELDS:
            value = tuple(value)
        values[f.name] = value
    return MachineRecord(**values)


class DynamoStateStore:
    def __init__(self, dynamodb: Any, table: str, clock: Callable[[], datetime] | None = None) -> None:
        from boto3.dynamodb.types import TypeDeserializer, TypeSerializer

        self.dynamodb = dynamodb
        self.table = table
        # Wall time, not the sweep's (possibly simulated) clock: leases and TTLs are about real processes.
        self.clock = clock or wall_clock
        self._ser = TypeSerializer()
        self._de = TypeDeserializer()

    def _wire(self, item: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self._ser.serialize(v) for k, v in item.items()}

    def _plain(self, item: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self._de.deserialize(v) for k, v in item.items()}

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        def get(batch: Sequence[str]) -> list[MachineRecord]:
            keys = [{"pk": _machine_pk(i), "sk": "state"} for i in batch]
            return [item_to_record(item) for item in self._batch_get(keys)]

        batches = list(chunks(_machine_keys(instance_ids), DDB_BATCH_GET))
        return {r.key: r for found in run_concurrently(get, batches, DDB_WORKERS) for r in found}

    def _batch_get(self, keys: Sequence[Mapping[str, Any]], *, consistent: bool = False) -> list[dict[str, Any]]:
        """The items of up to DDB_BATCH_GET keys, as plain values. The keys DynamoDB leaves unprocessed (its
        throughput, or a response past 16 MB) are asked again after an exponential backoff with jitter, as
        DynamoDB asks (https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/Programming.Errors.html
        #Programming.Errors.BatchOperations), at most UNPROCESSED_ATTEMPTS times: UnprocessedKeys then, never a
        part of the records returned as if it were all of them."""
        request: dict[str, Any] = {self.table: {"Keys": [self._wire(k) for k in keys]}}
        if consistent:
            request[self.table]["ConsistentRead"] = True
        found: list[dict[str, Any]] = []
        for attempt in range(UNPROCESSED_ATTEMPTS):
            if attempt:
                Pacing.sleep(random.uniform(0, UNPROCESSED_BACKOFF * 2**attempt))
            out = self.dynamodb.batch_get_item(RequestItems=request)
            found += [self._plain(raw) for raw in out["Responses"].get(self.table, [])]
            request = out.get("UnprocessedKeys") or {}
            if not request:
                return found
        left = len(request.get(self.table, {}).get("Keys", []))
        raise UnprocessedKeys(what=f"DynamoDB left {left} of {len(keys)} keys unprocessed {UNPROCESSED_ATTEMPTS} times")

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

    def _put_if(self, item: Mapping[str, Any], condition: str, values: Mapping[str, Any], **names: str) -> bool:
        """A conditional PutItem: False when the condition does not hold (someone wrote first)."""
        try:
            self.dynamodb.put_item(
                TableName=self.table,
                Item=self._wire(item),
                ConditionExpression=condition,
                **({"ExpressionAttributeValues": self._wire(values)} if values else {}),
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
            TableName=self.table, Key=self._wire({"pk": _machine_pk(instance_id), "sk": "state"}), ConsistentRead=True
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

    def put_entries(self, group: str, entries: Mapping[str, str], expires: datetime) -> dict[str, str]:
        """PutItem per entry, concurrently: each is a new item or the same entry written again (idempotent)."""
        ttl = int(expires.timestamp())

        def put(key: str) -> tuple[str, str] | None:
            item = {"pk": f"{ENTRIES_PREFIX}{group}", "sk": key, "value": entries[key], "expires_at": ttl}
            try:
                self.dynamodb.put_item(TableName=self.table, Item=self._wire(item))
            except AwsError as exc:
                return key, f"{error_code(exc)}: {exc}"
            return None

        return dict(found for found in run_concurrently(put, list(entries), DDB_WORKERS) if found is not None)

    def entries(self, group: str, now: datetime) -> dict[str, str]:
        found: dict[str, str] = {}
        for page in self.dynamodb.get_paginator("query").paginate(
            TableName=self.table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues=self._wire({":pk": f"{ENTRIES_PREFIX}{group}"}),
        ):
            for raw in page["Items"]:
                item = self._plain(raw)
                if _entry_live(item.get("expires_at"), now):  # DynamoDB's TTL deletes lazily
                    found[str(item["sk"])] = item["value"] if isinstance(item.get("value"), str) else ""
        return found

    def remove_entries(self, group: str, entries: Mapping[str, str]) -> list[str]:
        def remove(key: str) -> str | None:
            try:
                self.dynamodb.delete_item(
                    TableName=self.table,
                    Key=self._wire({"pk": f"{ENTRIES_PREFIX}{group}", "sk": key}),
                    ConditionExpression="#value = :value",
                    ExpressionAttributeNames={"#value": "value"},
                    ExpressionAttributeValues=self._wire({":value": entries[key]}),
                )
            except AwsError:  # written again meanwhile (ConditionalCheckFailed), or a fault: it stays
                return key
            return None

        return [k for k in run_concurrently(remove, list(entries), DDB_WORKERS) if k is not None]

    def claim_once(self, key: str, at: datetime) -> bool:
        # Expires after CLAIM_TTL_DAYS, so something left broken that long is claimed (and alerted) again.
        item = {
            "pk": f"once#{key}",
            "sk": "once",
            "claimed_at": at.isoformat(),
            "expires_at": int((at + timedelta(days=CLAIM_TTL_DAYS)).timestamp()),
        }
        # An expired claim is a claim no more: DynamoDB deletes expired items "within a few days" of their expiry
        # and reads return them until then (https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/
        # howitworks-ttl.html), so the condition, not the deletion, ends it.
        return self._put_if(item, "attribute_not_exists(pk) OR expires_at <= :now", {":now": int(at.timestamp())})

    def release_claim(self, key: str) -> None:
        self.dynamodb.delete_item(TableName=self.table, Key=self._wire({"pk": f"once#{key}", "sk": "once"}))

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        out = self.dynamodb.query(
            TableName=self.table,
            KeyConditionExpression="pk = :pk AND begins_with(sk, :audit)",
            ExpressionAttributeValues=self._wire({":pk": _machine_pk(instance_id), ":audit": "audit#"}),
        )
        return [json.loads(self._plain(raw)["entry"]) for raw in out["Items"]]

    def records_and_audit(self, start: datetime, end: datetime) -> tuple[list[MachineRecord], list[AuditEntry]]:
        """One Scan of the table, filtered to records and this span's audit items (their sort keys start with
        the UTC time they were written). Once per digest hour that has a digest to send, never per sweep."""
        records: list[MachineRecord] = []
        audits: list[AuditEntry] = []
        values = {":state": "state", ":lo": f"audit#{start.astimezone(UTC).isoformat()}"}
        values[":hi"] = f"audit#{end.astimezone(UTC).isoformat()}~"
        for page in self.dynamodb.get_paginator("scan").paginate(
            TableName=self.table,
            FilterExpression="sk = :state OR sk BETWEEN :lo AND :hi",
            ExpressionAttributeValues=self._wire(values),
        ):
            for raw in page["Items"]:
                item = self._plain(raw)
                if item["sk"] == "state":
                    records.append(item_to_record(item))
                    continue
                at = datetime.fromisoformat(str(item["sk"]).split("#")[1])
                audits.append(AuditEntry(str(item["pk"]).removeprefix("machine#"), at, json.loads(item["entry"])))
        return records, audits

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
        self.sets: dict[str, dict[str, tuple[str, datetime]]] = {}  # group -> key -> (value, expires)
        self.leases: dict[str, tuple[str, datetime]] = {}  # instance id -> (sweep holding it, until)
        self.expires: dict[str, datetime] = {}  # instance id -> when its record's TTL ends
        self.clock = clock or wall_clock
        self._lock = threading.RLock()  # a sweep saves from several threads; check-and-set must be atomic

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        return {i: self.records[i] for i in instance_ids if i in self.records}

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        with self._lock:
            return self._save(record, holder, hold=hold)

    def _save(self, record: MachineRecord, holder: str | None, *, hold: bool) -> bool:
        now, instance_id = self.clock(), record.key
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

    def put_entries(self, group: str, entries: Mapping[str, str], expires: datetime) -> dict[str, str]:
        with self._lock:
            self.sets.setdefault(group, {}).update((k, (v, expires)) for k, v in entries.items())
        return {}

    def entries(self, group: str, now: datetime) -> dict[str, str]:
        with self._lock:
            return {k: v for k, (v, expires) in self.sets.get(group, {}).items() if expires > now}

    def remove_entries(self, group: str, entries: Mapping[str, str]) -> list[str]:
        left = []
        with self._lock:
            held = self.sets.get(group, {})
            for key, value in entries.items():
                if key in held and held[key][0] == value:
                    del held[key]
                else:
                    left.append(key)
        return left

    def claim_once(self, key: str, at: datetime) -> bool:
        with self._lock:
            if key in self.claims and self.claims[key] + timedelta(days=CLAIM_TTL_DAYS) > at:
                return False
            self.claims[key] = at
            return True

    def release_claim(self, key: str) -> None:
        self.claims.pop(key, None)

    def records_of_owner(self, slack_user_id: str) -> list[MachineRecord]:
        return [r for r in self.records.values() if r.owner_slack_id == slack_user_id]

    def records_and_audit(self, start: datetime, end: datetime) -> tuple[list[MachineRecord], list[AuditEntry]]:
        audits = [AuditEntry(i, at, entry) for i, at, entry in self.audits if start <= at <= end]
        return list(self.records.values()), audits


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
