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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from idle_reaper.aws import Concurrency, InMemoryStateStore
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


@pytest.fixture(autouse=True, scope="module")
def one_task_at_a_time() -> Iterator[None]:
    """The sweep's thread pools run their tasks one after another. One machine, in-memory fakes: the same
    calls, answers and decisions in the same order (a single conversation's posts, where Died is raised,
    never ran on a pool), without starting a dozen threads a sweep, which was two thirds of this module's
    time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Concurrency, "runner", staticmethod(lambda fn, items, workers: [fn(item) for item in items]))
        yield


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


def from_the_warning(*steps: tuple[str, bool], quiet: int = 6) -> list[tuple[int, str, bool]]:
    """Sweeps 5 minutes apart from the first, which warns (the machine has been quiet for hours): the given
    (fault, click after it) steps, then `quiet` fault-free sweeps, past the stop warn_minutes later."""
    return [(5, fault, click) for fault, click in steps] + [(5, "none", False)] * quiet


# What the random plans below may or may not draw, drawn every run: each fault at the sweep that posts the
# warning, with and without a click right after it (the click lands on a claim a dead or failed sweep left,
# or on the warning); and each fault that leaves the post's outcome unknown, followed by a Slack whose
# history cannot be read until the dead sweep's claim has lapsed: the stop must wait. Seeded, the 60 random
# plans alone caught neither a lost post assumed delivered when Slack cannot be asked nor the answer time run
# from an undelivered warning (0 runs of 3); these plans catch both every run.
KNOWN_PLANS = [
    *(from_the_warning((fault, click)) for fault in FAULTS for click in (False, True)),
    *(
        from_the_warning((fault, False), *[("history_down", False)] * 4)
        for fault in ("ddb_before_post", "ddb_after_post", "dies_after_post")
    ),
]


def known_plans(test: Any) -> Any:
    for plan in reversed(KNOWN_PLANS):
        test = example(plan)(test)
    return test


# 60 random plans, as before: cheap now that a sweep starts no threads and a plan ends once nothing can
# change any more (only 544 of the 1,983 sweeps 60 plans drew came before that point). Seeded bugs they
# still catch, as before: a post whose outcome was lost posted again instead of looked for, the record keeping
# another reference than the posted buttons carry.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(days())
@known_plans
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
        record = store.records.get(box)
        if aws.ec2.state_of(box) != "running" and (record is None or record.state is not State.WARNED):
            # Stopped, and recorded so: no sweep lists it again and no click applies (only a warned record is
            # answered below), so nothing the checks below look at can change in the rest of the plan.
            break
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
