"""The in-memory state store, counting what would be DynamoDB requests."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from boto3.dynamodb.types import TypeSerializer
from botocore.exceptions import ClientError

from idle_reaper.aws import (
    DDB_BATCH_GET,
    DDB_WORKERS,
    AuditEntry,
    InMemoryStateStore,
    run_concurrently,
)
from idle_reaper.aws.state import ENTRIES_PREFIX, record_to_item
from idle_reaper.core import MachineRecord
from testkit.aws.clients import LatencyModel, client_error
from testkit.aws_rules import ITEM_MAX_BYTES, ITEM_TOO_LARGE, item_size


class CountingStateStore(InMemoryStateStore):
    """InMemoryStateStore that counts what the DynamoDB store would send: BatchGetItem (100 keys per
    call, the calls concurrently as DynamoStateStore makes them), PutItem per state save, per audit item and per
    set entry, a Query per MB of a set's partition, DeleteItem per entry removed. With a latency model, each
    request is charged. It refuses what DynamoDB refuses: an item over 400 KB with its attribute names
    (ValidationException, as the rules in front of moto: testkit/aws_rules.py)."""

    def __init__(self, latency: LatencyModel | None = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.latency = latency
        self._count_lock = threading.Lock()

    def _request(self, operation: str, n: int = 1, keys: int = 0) -> None:
        """`keys`: a BatchGetItem's keys, which its CPU grows with (a count, not the keys themselves)."""
        with self._count_lock:
            self.counts[operation] += n
        if self.latency is not None:
            self.latency.charge(f"dynamodb:{operation}", n)
            for _ in range(n):
                self.latency.charge_cpu(f"dynamodb:{operation}", {"Keys": keys} if keys else {}, {})

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        self.counts["load"] += 1
        ids = sorted(set(instance_ids))

        def get(start: int) -> dict[str, MachineRecord]:
            batch = ids[start : start + DDB_BATCH_GET]
            self._request("BatchGetItem", keys=len(batch))
            return super(CountingStateStore, self).load(batch)

        records: dict[str, MachineRecord] = {}
        for found in run_concurrently(get, list(range(0, len(ids), DDB_BATCH_GET)), DDB_WORKERS):
            records.update(found)
        return records

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        self._request("PutItem")
        _fits({**record_to_item(record), "expires_at": 0, "claim_owner": holder or "", "claim_until": 0})
        ok = super().save(record, holder, hold=hold)
        with self._count_lock:
            self.counts["save"] += 1
            if not ok:
                self.counts["ConditionalCheckFailed"] += 1
        return ok

    def put_lookup(self, key: str, value: str, expires: datetime) -> None:
        self._request("PutItem")  # shard manifests and results, alert counters
        _fits(_lookup_item(key, value, expires))
        super().put_lookup(key, value, expires)

    def get_lookup(self, key: str, now: datetime) -> str | None:
        self._request("GetItem")
        return super().get_lookup(key, now)

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        self._request("PutItem")  # conditional
        _fits(_lookup_item(key, value, expires))
        return super().replace_lookup(key, value, expires, expected=expected, now=now)

    def put_entries(self, group: str, entries: Mapping[str, str], expires: datetime) -> dict[str, str]:
        self._request("PutItem", len(entries))  # one a entry
        refused: dict[str, str] = {}
        for key, value in entries.items():
            try:
                _fits(_entry_item(group, key, value, expires))
            except ClientError as exc:
                refused[key] = f"{exc.response['Error']['Code']}: {exc}"
        kept = {k: v for k, v in entries.items() if k not in refused}
        return {**refused, **super().put_entries(group, kept, expires)}

    def entries(self, group: str, now: datetime) -> dict[str, str]:
        # A Query reads at most 1 MB a page (https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/
        # Query.Pagination.html): a page a started MB of the partition's items, expired ones among them.
        with self._lock:
            held = dict(self.sets.get(group, {}))
        size = sum(_size(_entry_item(group, k, v, expires)) for k, (v, expires) in held.items())
        self._request("Query", max(1, -(-size // QUERY_PAGE_BYTES)))
        return super().entries(group, now)

    def remove_entries(self, group: str, entries: Mapping[str, str]) -> list[str]:
        self._request("DeleteItem", len(entries))  # conditional, one a entry
        return super().remove_entries(group, entries)

    def audit(self, instance_id: str, at: datetime, entry: Mapping[str, Any]) -> None:
        self.counts["audit"] += 1
        self._request("PutItem")
        _fits(
            {
                "pk": f"machine#{instance_id}",
                "sk": f"audit#{at.isoformat()}",
                "expires_at": 0,
                "entry": json.dumps(entry, default=str),
            }
        )
        super().audit(instance_id, at, entry)

    def audit_many(self, entries: Sequence[AuditEntry]) -> list[str]:
        def write(a: AuditEntry) -> None:
            self._request("PutItem")
            with self._lock:
                self.audits.append((a.instance_id, a.at, dict(a.entry)))

        run_concurrently(write, list(entries), DDB_WORKERS)
        with self._count_lock:
            self.counts["audit"] += len(entries)
        return []


_SERIALIZER = TypeSerializer()
QUERY_PAGE_BYTES = 1024 * 1024


def _lookup_item(key: str, value: str, expires: datetime) -> dict[str, Any]:
    return {"pk": f"lookup#{key}", "sk": "lookup", "value": value, "expires_at": int(expires.timestamp())}


def _entry_item(group: str, key: str, value: str, expires: datetime) -> dict[str, Any]:
    return {"pk": f"{ENTRIES_PREFIX}{group}", "sk": key, "value": value, "expires_at": int(expires.timestamp())}


def _size(item: Mapping[str, Any]) -> int:
    """An item's size as DynamoDB counts it (names and values)."""
    return item_size({k: _SERIALIZER.serialize(v) for k, v in item.items() if v is not None})


def _fits(item: Mapping[str, Any]) -> None:
    """DynamoDB's refusal of an item over 400 KB, counted as DynamoDB counts it (names and values)."""
    if _size(item) > ITEM_MAX_BYTES:
        raise client_error("PutItem", "ValidationException", ITEM_TOO_LARGE)
