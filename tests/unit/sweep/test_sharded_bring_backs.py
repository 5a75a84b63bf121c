"""An endpoint brought back that SageMaker could not create is told once when the fleet is larger than one shard
(issue 46): the planner lists the fleet, so it finds the Failed endpoint and tells it (sweep/fanout.py); a shard
listed nothing and a worker's share of the fleet carries none, so no shard tells it again. Checked by hand
before (the flow passed with run_sharded and failed with the planner's step disabled); here over the in-memory
fakes, with SageMaker's listing stood in for by the few calls the sweep makes of it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import pytest
from test_sweep_fanout import NOW, account, fleet

from idle_reaper.aws.fleet import ActionOutcome
from idle_reaper.core import Machine, State
from idle_reaper.core.endpoints import Restore, endpoint_id
from idle_reaper.core.records import MachineRecord
from idle_reaper.sweep import fanout, run_sharded
from testkit.aws import CountingStateStore

REASON = "Unable to provision requested ML compute capacity. Please retry using a different ML instance type."
EP = endpoint_id("demo-llm")


class FailedEndpoints:
    """What a sweep asks of aws/endpoints.Endpoints, answered as SageMaker would for one endpoint a person brought
    back and that is Failed: listed Failed (so not running: no machine), its FailureReason, then deleted."""

    def __init__(self) -> None:
        self.failed = ["demo-llm"]
        self.deleted: list[str] = []
        self.listings = 0

    def discover(
        self, tags: object, names: Sequence[str] | None = None, failed: list[str] | None = None
    ) -> list[Machine]:
        self.listings += 1
        if failed is not None:
            failed += [endpoint_id(n) for n in self.failed if names is None or n in names]
        return []

    def failure_reason(self, machine_id: str) -> str:
        assert machine_id == EP and "demo-llm" in self.failed, "DescribeEndpoint of an endpoint that is gone"
        return REASON

    def delete(self, machine_ids: Sequence[str]) -> list[ActionOutcome]:
        self.deleted += machine_ids
        self.failed = [n for n in self.failed if endpoint_id(n) not in machine_ids]
        return [ActionOutcome(m) for m in machine_ids]


def brought_back() -> MachineRecord:
    restore = Restore("demo-llm-config", (("Team", "ml"),), "U0CAROL", (NOW - timedelta(minutes=20)).isoformat())
    return MachineRecord(
        EP,
        "ml",
        State.ACTIVE,
        name="demo-llm",
        instance_type="ml.g4dn.xlarge x2",
        machine_kind="endpoint",
        last_action="start",
        last_action_at=NOW - timedelta(minutes=20),
        endpoint=restore.to_json(),
    )


def sharded_sweeps(planner_tells: bool = True, monkeypatch: pytest.MonkeyPatch | None = None):
    aws, store, endpoints = account(), CountingStateStore(), FailedEndpoints()
    fleet(aws)
    store.save(brought_back())
    if not planner_tells and monkeypatch is not None:
        monkeypatch.setattr(fanout, "tell_failed_bring_backs", lambda *a, **k: 0)
    results = []
    for minutes in (0, 15):  # and the next sweep: told once, not again
        adapters = aws.adapters(store=store)
        adapters.fleet.endpoints = endpoints  # type: ignore[assignment]
        results.append(run_sharded(adapters, now=NOW + timedelta(minutes=minutes), shard_size=3, workers=3))
    return results, store, endpoints


def test_a_failed_bring_back_is_told_once_by_the_planner_of_a_sharded_sweep() -> None:
    (first, _), store, endpoints = sharded_sweeps()
    assert first.plan.shards > 1 and not first.gathered.failed
    assert endpoints.listings == 2  # the planner's listing at each sweep; no shard lists
    again = store.load([EP])[EP]
    kept = Restore.parse(again.endpoint)
    assert again.state is State.REAPED and kept is not None
    assert (kept.failed, kept.pending_by, kept.config) == (REASON, None, "demo-llm-config")
    assert "SageMaker could not create it" in again.reason
    assert endpoints.deleted == [EP], "the failed endpoint deleted once, by the planner alone"
    told = [entry for key, _, entry in store.audits if key == EP]
    assert [e["action"] for e in told] == ["stop"], "deleted again: it saves from now on, counted once"


def test_a_shard_leaves_it_to_its_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's step is what tells it: without it the shards do not (they list nothing, and a worker's share
    of the fleet carries no Failed endpoint), so the bring-back stays pending and the Failed endpoint stays."""
    _, store, endpoints = sharded_sweeps(planner_tells=False, monkeypatch=monkeypatch)
    record = store.load([EP])[EP]
    assert endpoints.deleted == [] and Restore.parse(record.endpoint).pending_by == "U0CAROL"
