"""Quiet hours are not lost: which stops a summary reports (pure), and the sweep's index of them over the
in-memory fakes: one summary per owner after quiet hours, none twice, a corrupted index never fails a sweep."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from idle_reaper.core import MachineRecord, State, quiet_hours_reports
from idle_reaper.notify import LoggingNotifier
from idle_reaper.sweep import QUIET_INDEX, logger, run_sweep
from testkit.fake_aws import CountingStateStore, FakeAws, steady

NIGHT = datetime(2026, 11, 20, 23, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"
NIGHTS = {"name": "nights", "days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"], "start": "22:00"}
POLICY = json.dumps(
    {
        "idle_minutes": 60,
        "warn_minutes": 20,
        "timezone": "UTC",
        "schedules": [{**NIGHTS, "end": "07:00", "quiet_hours": True}],
    }
)


def stopped(i: str, owner: str | None, at: datetime | None, **kw) -> MachineRecord:
    return MachineRecord(i, "ml", State.REAPED, last_action="stop", owner=owner, quiet_stop_at=at, **kw)


def test_reports_group_by_owner_oldest_first_and_skip_what_is_no_longer_stopped() -> None:
    t = NIGHT
    records = [
        stopped("i-2", "bob@example.com", t + timedelta(minutes=30)),
        stopped("i-1", "BOB@example.com ", t),
        stopped("i-3", "ann@example.com", t, owner_slack_id="U0ANN"),
        stopped("i-4", None, t),  # no owner: alone
        stopped("i-5", "bob@example.com", None),  # stopped in the daytime: told at the time
        MachineRecord("i-6", "ml", State.ACTIVE, last_action="start", owner="bob@example.com", quiet_stop_at=t),
        MachineRecord("i-7", "ml", State.REAPED, last_action="unprotect", owner="bob@example.com", quiet_stop_at=t),
    ]
    groups = [[r.instance_id for r in g] for g in quiet_hours_reports(records)]
    assert groups == [["i-1", "i-2"], ["i-3"], ["i-4"]]


def test_the_sweep_sends_one_summary_per_owner_once_and_survives_a_corrupted_index() -> None:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", "{}")
    aws.ssm.store(f"{PREFIX}/teams/ml", POLICY)
    boxes = [
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NIGHT - timedelta(days=1), owner=o)
        for o in ("U0BOB", "U0BOB", "U0ANN")
    ]
    store = CountingStateStore()
    notifier = LoggingNotifier(logger, delivers=True)
    for now in (NIGHT, NIGHT + timedelta(minutes=40)):
        run_sweep(aws.adapters(store=store, notifier=notifier), now=now)
    assert all(aws.ec2.state_of(i) == "stopped" for i in boxes)
    assert json.loads(store.get_lookup(QUIET_INDEX, NIGHT) or "{}") == {"ml": boxes}
    assert all(kind not in ("quiet_summary", "reaped") for kind, _ in notifier.sent), "quiet: nothing said"

    morning = NIGHT + timedelta(hours=8, minutes=5)
    for _ in range(2):  # the first sweep after quiet hours, and a re-run
        run_sweep(aws.adapters(store=store, notifier=notifier), now=morning)
    summaries = sorted(ids for kind, ids in notifier.sent if kind == "quiet_summary")
    assert summaries == sorted([f"{boxes[0]},{boxes[1]}", boxes[2]])
    assert json.loads(store.get_lookup(QUIET_INDEX, morning) or "{}") == {}
    assert all(store.records[i].quiet_stop_at is None for i in boxes)

    store.put_lookup(QUIET_INDEX, "{not json", morning + timedelta(days=1))
    report = run_sweep(aws.adapters(store=store, notifier=notifier), now=morning + timedelta(minutes=15))
    assert not report.errors and len([k for k, _ in notifier.sent if k == "quiet_summary"]) == 2


class RacingStore(CountingStateStore):
    """Another shard adds its own quiet-hours stop to the index between this sweep's read and its write."""

    raced = False

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        if key == QUIET_INDEX and not self.raced:
            self.raced = True
            theirs = json.loads(self.get_lookup(key, now) or "{}")
            theirs.setdefault("ml", []).append("i-0othershard")
            self.put_lookup(key, json.dumps(theirs), expires)
        return super().replace_lookup(key, value, expires, expected=expected, now=now)


def test_concurrent_updates_of_the_index_lose_no_stop() -> None:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", "{}")
    aws.ssm.store(f"{PREFIX}/teams/ml", POLICY)
    boxes = [
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NIGHT - timedelta(days=1), owner="U0BOB")
        for _ in range(2)
    ]
    store = RacingStore()
    notifier = LoggingNotifier(logger, delivers=True)
    for now in (NIGHT, NIGHT + timedelta(minutes=40)):
        run_sweep(aws.adapters(store=store, notifier=notifier), now=now)

    assert store.raced and all(aws.ec2.state_of(i) == "stopped" for i in boxes)
    index = json.loads(store.get_lookup(QUIET_INDEX, NIGHT) or "{}")
    assert sorted(index["ml"]) == sorted([*boxes, "i-0othershard"]), "the other shard's entry and ours"


def test_replace_lookup_writes_only_over_what_was_read() -> None:
    store = CountingStateStore()
    later = NIGHT + timedelta(days=1)
    assert store.replace_lookup("k", "a", later, expected=None, now=NIGHT)
    assert not store.replace_lookup("k", "b", later, expected=None, now=NIGHT), "someone wrote it first"
    assert not store.replace_lookup("k", "b", later, expected="x", now=NIGHT)
    assert store.replace_lookup("k", "b", later, expected="a", now=NIGHT)
    assert store.get_lookup("k", NIGHT) == "b"
    assert store.replace_lookup("k", "c", later + timedelta(days=1), expected=None, now=later), "expired = absent"
