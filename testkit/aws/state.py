"""The in-memory state store, counting what would be DynamoDB requests."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from boto3.dynamodb.types import TypeSerializer

from idle_reaper.aws import (
    DDB_BATCH_GET,
    DDB_WORKERS,
    AuditEntry,
    InMemoryStateStore,
    run_concurrently,
)
from idle_reaper.aws.state import record_to_item
from idle_reaper.core import MachineRecord
from testkit.aws.clients import LatencyModel, client_error
from testkit.aws_rules import ITEM_MAX_BYTES, ITEM_TOO_LARGE, item_size


class CountingStateStore(InMemoryStateStore):
    """InMemoryStateStore that counts what the DynamoDB store would send: BatchGetItem (100 keys per
    call, the calls concurrently as DynamoStateStore makes them), PutItem per state save and per audit
    item. With a latency model, each request is charged. It refuses what DynamoDB refuses: an item over 400 KB
    with its attribute names (ValidationException, as the rules in front of moto: testkit/aws_rules.py)."""

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


def _lookup_item(key: str, value: str, expires: datetime) -> dict[str, Any]:
    return {"pk": f"lookup#{key}", "sk": "lookup", "value": value, "expires_at": int(expires.timestamp())}


def _fits(item: Mapping[str, Any]) -> None:
    """DynamoDB's refusal of an item over 400 KB, counted as DynamoDB counts it (names and values)."""
    wire = {k: _SERIALIZER.serialize(v) for k, v in item.items() if v is not None}
    if item_size(wire) > ITEM_MAX_BYTES:
        raise client_error("PutItem", "ValidationException", ITEM_TOO_LARGE)
