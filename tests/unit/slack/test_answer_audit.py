"""A person's answers (keep, stop now, start again) are audited, so the weekly digest can count them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.aws import Fleet, InMemoryStateStore
from idle_reaper.core import MachineRecord, State
from idle_reaper.core.digest import build_digest, week_of
from idle_reaper.policy import TeamPolicy
from idle_reaper.slack.answers import Effects
from testkit.aws import FakeAws, steady

NOW = datetime(2026, 11, 18, 10, 0, tzinfo=UTC)


class Messages:
    def update(self, *_: Any, **__: Any) -> bool:
        return True

    def new_ref(self, *_: Any) -> str:
        return "ref-1"


def test_keep_stop_now_and_start_again_are_audited_and_counted_by_the_digest() -> None:
    aws = FakeAws()
    machine = aws.launch("g5.xlarge", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))
    store = InMemoryStateStore()
    clock = [NOW]
    effects = Effects(store, Fleet(aws.ec2, aws.autoscaling), Messages(), lambda: clock[0])  # type: ignore[arg-type]
    record = MachineRecord(
        machine, "ml", State.WARNED, version=3, warned_at=NOW, owner="ada", instance_type="g5.xlarge"
    )
    store.records[machine] = record
    assert effects.keep("U0ADA", record, TeamPolicy(), NOW + timedelta(hours=2)) is None
    clock[0] = NOW + timedelta(hours=3)
    assert effects.stop_now("U0ADA", store.records[machine]) is None
    clock[0] = NOW + timedelta(hours=7)
    assert effects.start_again("U0ADA", store.records[machine]) is None
    assert [e["action"] for _, _, e in store.audits] == ["keep", "stop", "running_again"]
    digest = build_digest(store.audits, [], week_of(NOW), now=NOW + timedelta(days=1), team="ml")
    assert digest.recovered["stops"].hours == pytest.approx(4.0)
    assert digest.recovered_dollars == pytest.approx(4 * 1.006)
    assert [(k.owner, k.keeps, k.hours, k.by) for k in digest.kept] == [("ada", 1, 2.0, ("U0ADA",))]
    assert digest.kept_dollars == pytest.approx(2 * 1.006)
