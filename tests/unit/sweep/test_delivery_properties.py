"""Delivery under hostile timing (issue 22): for any sequence of sweeps with faults (DynamoDB errors before
and after posts, Slack errors, a Lambda dying after a post or running out of time, a sweep that overlaps a
dead one's claim) and clicks at any point, over the in-memory fakes:

- every stop follows a warning that was delivered warn_minutes before it, or is the documented exception
  (undelivered for undelivered_warning_max_minutes, said in its reason);
- nobody gets two warnings for one episode (one quiet stretch, until a stop or a keep);
- a click on the warning a person has (its reference) is applied or answered "try again", never "no longer
  current", while that warning stands.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idle_reaper.aws import InMemoryStateStore
from idle_reaper.core import Action, Decision, MachineRecord, State
from idle_reaper.core.answers import snooze
from idle_reaper.notify import Delivery, DeliveryUnknown
from idle_reaper.policy import Settings, TeamPolicy
from idle_reaper.sweep import run_sweep
from testkit.aws import FakeAws

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"
POLICY = {"idle_minutes": 60, "warn_minutes": 20, "undelivered_warning_max_minutes": 120}
WARN = timedelta(minutes=20)
FAULTS = ("none", "ddb_before_post", "ddb_after_post", "slack_down", "dies_after_post", "out_of_time", "history_down")


class Died(BaseException):
    """The Lambda was stopped (a timeout): nothing after this point of the sweep runs."""


@dataclass
class Clock:
    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now


class FaultyStore(InMemoryStateStore):
    """The state table; `failing` makes every machine-record write fail as DynamoDB does when it is down."""

    failing = False

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        if self.failing:
            raise ClientError({"Error": {"Code": "InternalServerError", "Message": "down"}}, "PutItem")
        return super().save(record, holder, hold=hold)


@dataclass
class Slack:
    """A Slack that keeps what it was sent (each warning with its reference, as message metadata would)."""

    store: FaultyStore
    fault: str = "none"
    warnings: list[tuple[datetime, str, str]] = field(default_factory=list)  # (when, instance id, ref)
    told_stops: list[str] = field(default_factory=list)
    clock: Clock = field(default_factory=Clock)

    def warn(self, decision: Decision) -> Delivery | None:
        if self.fault == "slack_down":
            return None
        if self.fault == "ddb_before_post":
            self.store.failing = True
            return None  # never reached Slack in the real flow; here: the table fails before the post
        ref = decision.record.warning_ref or "none"
        self.warnings.append((self.clock.now, decision.machine.instance_id, ref))
        if self.fault == "ddb_after_post":
            self.store.failing = True
        if self.fault == "dies_after_post":
            raise Died()
        return Delivery(messages=(f"D0BOB|{len(self.warnings)}",), ref=ref, owner_slack_id="U0BOB")

    def find_warning(self, decision: Decision) -> Delivery | None:
        if self.fault == "history_down":
            raise DeliveryUnknown("Slack answered 503")
        ref = decision.record.warning_ref
        posted = [w for w in self.warnings if w[2] == ref]
        return Delivery(messages=("D0BOB|found",), ref=ref, owner_slack_id="U0BOB") if posted else None

    def resolve_owner(self, owner: str | None) -> str | None:
        return "U0BOB" if owner else None

    def resolved(self, decision: Decision) -> None:
        pass

    def reaped(self, decision: Decision) -> Delivery | None:
        self.told_stops.append(decision.machine.instance_id)
        return Delivery(messages=("D0BOB|stop",), ref="start")

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        pass


@st.composite
def days(draw: st.DrawFn) -> list[tuple[int, str, bool]]:
    """Sweeps 5-15 minutes apart over about seven hours: (minutes since the last, fault, click after it)."""
    steps = draw(st.integers(min_value=20, max_value=45))
    return [
        (
            draw(st.sampled_from((5, 5, 10, 15))),
            draw(st.sampled_from(FAULTS)) if draw(st.integers(0, 3)) == 0 else "none",
            draw(st.integers(0, 9)) == 0,
        )
        for _ in range(steps)
    ]


def quiet_then_busy(t: datetime) -> tuple[float, float | None]:
    # Quiet for four hours (one episode), busy for half an hour, then quiet again (a second episode).
    minutes = (t - T0).total_seconds() / 60
    return (70.0, None) if 240 <= minutes < 270 else (1.0, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(days())
def test_every_stop_is_warned_every_click_is_honoured_and_nobody_is_warned_twice(plan: list[Any]) -> None:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(POLICY))
    box = aws.launch("m5.large", team="ml", profile=quiet_then_busy, launch_time=T0 - timedelta(days=1), owner="U0BOB")
    clock = Clock(T0 - timedelta(hours=2))
    store = FaultyStore(clock=clock)
    slack = Slack(store, clock=clock)
    policy = TeamPolicy(**POLICY)
    stops: list[tuple[datetime, str]] = []
    for minutes, fault, click in plan:
        clock.now += timedelta(minutes=minutes)
        slack.fault, store.failing = fault, False
        budget = (lambda: 5.0) if fault == "out_of_time" else None
        try:
            report = run_sweep(aws.adapters(store=store, notifier=slack), now=clock.now, time_left=budget)  # type: ignore[arg-type]
            stops += [(clock.now, d.reason) for d in report.decisions if d.action is Action.STOP and not d.error]
        except Died:
            pass
        store.failing = False
        if click and slack.warnings:
            posted_at, _, ref = slack.warnings[-1]
            record = store.records.get(box)
            if record and record.state is State.WARNED and record.warned_at and record.warned_at <= posted_at:
                assert record.warning_ref == ref, "the buttons of the warning the owner has must work"
                kept = snooze(record, policy, "U0BOB", clock.now + timedelta(hours=2), clock.now)
                if isinstance(kept, MachineRecord) and not store.save(kept):
                    assert store.claim_of(box) is not None, "'try again' only while a sweep holds the machine"
    # Every stop followed a warning delivered warn_minutes before it, or waited undelivered for the maximum.
    for stopped_at, reason in stops:
        delivered = [w for w in slack.warnings if w[0] <= stopped_at - WARN]
        assert delivered or "never delivered" in reason, (stopped_at, reason, slack.warnings)
    # Nobody got two warnings for one episode: no warning is ever posted twice (a new one has a new reference).
    refs = [w[2] for w in slack.warnings]
    assert len(refs) == len(set(refs)), slack.warnings
