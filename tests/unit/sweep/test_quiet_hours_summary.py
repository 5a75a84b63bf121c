"""Quiet hours are not lost: which stops a summary reports (pure), and the sweep's index of them over the
in-memory fakes: one summary per owner after quiet hours, none twice, a corrupted index never fails a sweep.
The index at fleet scale, split per stop: test_quiet_hours_index.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from idle_reaper.core import MachineRecord, State, quiet_hours_reports
from idle_reaper.notify import LoggingNotifier
from idle_reaper.sweep import QUIET_INDEX, QuietStop, logger, quiet_stops, run_sweep
from testkit.aws import CountingStateStore, FakeAws, steady

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


def night_account(owners: tuple[str, ...], settings: str = "{}") -> tuple[FakeAws, list[str]]:
    """A team with quiet hours at night and idle machines of these owners, running since the day before."""
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", settings)
    aws.ssm.store(f"{PREFIX}/teams/ml", POLICY)
    boxes = [
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NIGHT - timedelta(days=1), owner=o)
        for o in owners
    ]
    return aws, boxes


def index(store: CountingStateStore, now: datetime = NIGHT) -> dict[str, list[str]]:
    """The hub's stops not told yet, by team (the keys in order)."""
    stops, bad = quiet_stops(store, "hub", now)
    assert not bad
    found: dict[str, list[str]] = {}
    for s in stops:
        found.setdefault(s.team, []).append(s.key)
    return found


def through_the_night(aws: FakeAws, store: CountingStateStore) -> LoggingNotifier:
    """The night's two sweeps: the warning (recorded, not posted) and the stop 40 minutes later."""
    notifier = LoggingNotifier(logger, delivers=True)
    for now in (NIGHT, NIGHT + timedelta(minutes=40)):
        run_sweep(aws.adapters(store=store, notifier=notifier), now=now)
    return notifier


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
    aws, boxes = night_account(("U0BOB", "U0BOB", "U0ANN"))
    store = CountingStateStore()
    notifier = through_the_night(aws, store)
    assert all(aws.ec2.state_of(i) == "stopped" for i in boxes)
    assert index(store) == {"ml": boxes}
    assert all(kind not in ("quiet_summary", "reaped") for kind, _ in notifier.sent), "quiet: nothing said"

    morning = NIGHT + timedelta(hours=8, minutes=5)
    for _ in range(2):  # the first sweep after quiet hours, and a re-run
        run_sweep(aws.adapters(store=store, notifier=notifier), now=morning)
    summaries = sorted(ids for kind, ids in notifier.sent if kind == "quiet_summary")
    assert summaries == sorted([f"{boxes[0]},{boxes[1]}", boxes[2]])
    assert index(store, morning) == {}
    assert all(store.records[i].quiet_stop_at is None for i in boxes)

    # The index of the previous version (one item), unreadable: left as it is, and no sweep fails.
    store.put_lookup(QUIET_INDEX, "{not json", morning + timedelta(days=1))
    report = run_sweep(aws.adapters(store=store, notifier=notifier), now=morning + timedelta(minutes=15))
    assert not report.errors and len([k for k, _ in notifier.sent if k == "quiet_summary"]) == 2


class RacingStore(CountingStateStore):
    """Another shard notes its own quiet-hours stop at the very moment this sweep notes its own."""

    raced = False

    def put_entries(self, group: str, entries, expires: datetime) -> dict[str, str]:
        if group == "quiet-stops#hub" and not self.raced:
            self.raced = True
            theirs = QuietStop("i-0000000000000ffff", "ml", NIGHT.isoformat())
            super().put_entries(group, {theirs.key: theirs.value}, expires)
        return super().put_entries(group, entries, expires)


def test_concurrent_updates_of_the_index_lose_no_stop() -> None:
    aws, boxes = night_account(("U0BOB", "U0BOB"))
    store = RacingStore()
    through_the_night(aws, store)

    assert store.raced and all(aws.ec2.state_of(i) == "stopped" for i in boxes)
    assert sorted(index(store)["ml"]) == sorted([*boxes, "i-0000000000000ffff"]), "the other shard's entry and ours"


def test_replace_lookup_writes_only_over_what_was_read() -> None:
    store = CountingStateStore()
    later = NIGHT + timedelta(days=1)
    assert store.replace_lookup("k", "a", later, expected=None, now=NIGHT)
    assert not store.replace_lookup("k", "b", later, expected=None, now=NIGHT), "someone wrote it first"
    assert not store.replace_lookup("k", "b", later, expected="x", now=NIGHT)
    assert store.replace_lookup("k", "b", later, expected="a", now=NIGHT)
    assert store.get_lookup("k", NIGHT) == "b"
    assert store.replace_lookup("k", "c", later + timedelta(days=1), expected=None, now=later), "expired = absent"


class FlakyWhileOtherShardRuns(LoggingNotifier):
    """Shard A's summary post: while it is in flight shard B (same sweep, another shard) runs its
    report_quiet_hours; then A's post fails transiently (None: 'try again later')."""

    def __init__(self, other):
        super().__init__(logger, delivers=True)
        self.other = other

    def quiet_summary(self, stopped):
        if self.other is not None:
            other, self.other = self.other, None
            other()
        self.sent.append(("quiet_summary_failed", ",".join(r.instance_id for r in stopped)))
        return None


def test_quiet_summary_not_lost_when_another_shard_sees_the_claim_of_a_post_that_then_fails() -> None:
    aws, boxes = night_account(("U0BOB", "U0BOB"))
    store = CountingStateStore()
    through_the_night(aws, store)
    assert index(store) == {"ml": boxes}

    morning = NIGHT + timedelta(hours=8, minutes=5)
    other = LoggingNotifier(logger, delivers=True)
    a = FlakyWhileOtherShardRuns(
        lambda: run_sweep(aws.adapters(store=store, notifier=other), now=morning, instance_ids=[])
    )
    run_sweep(aws.adapters(store=store, notifier=a), now=morning, instance_ids=[])
    assert [k for k, _ in a.sent] == ["quiet_summary_failed"]
    # A said "retry next sweep"; the next sweep must send the summary.
    later = LoggingNotifier(logger, delivers=True)
    run_sweep(aws.adapters(store=store, notifier=later), now=morning + timedelta(minutes=5), instance_ids=[])
    assert ("quiet_summary", ",".join(boxes)) in later.sent + other.sent, (
        f"summary lost; index={index(store, morning)}; records={[store.records[i].quiet_stop_at for i in boxes]}"
    )


class HookStore(CountingStateStore):
    hook = None

    def save(self, record, holder=None, *, hold=False):
        ok = super().save(record, holder, hold=hold)
        if self.hook and record.quiet_stop_at is None and holder is None:
            hook, self.hook = self.hook, None
            hook()
        return ok


def test_two_shards_never_send_the_same_owner_two_quiet_summaries() -> None:
    aws, boxes = night_account(("U0BOB", "U0BOB"))
    store = HookStore()
    through_the_night(aws, store)
    morning = NIGHT + timedelta(hours=8, minutes=5)
    a, b = LoggingNotifier(logger, delivers=True), LoggingNotifier(logger, delivers=True)
    # shard B runs while shard A is recording its summary's outcome machine by machine
    store.hook = lambda: run_sweep(aws.adapters(store=store, notifier=b), now=morning, instance_ids=[])
    run_sweep(aws.adapters(store=store, notifier=a), now=morning, instance_ids=[])
    told = [ids for kind, ids in a.sent + b.sent if kind == "quiet_summary"]
    assert told == [",".join(boxes)], f"owner got {told}"


class ThrottledOnce(CountingStateStore):
    fail_next_index_write = False

    def put_entries(self, group, entries, expires):
        if group.startswith("quiet-stops#") and self.fail_next_index_write:
            self.fail_next_index_write = False
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "ProvisionedThroughputExceededException"}}, "PutItem")
        return super().put_entries(group, entries, expires)


def test_a_quiet_stop_whose_index_write_failed_once_is_still_reported_after_quiet_hours() -> None:
    aws, (box,) = night_account(("U0BOB",))
    store = ThrottledOnce()
    n = LoggingNotifier(logger, delivers=True)
    run_sweep(aws.adapters(store=store, notifier=n), now=NIGHT)  # warned (quiet hours: recorded)
    store.fail_next_index_write = True  # one throttled write
    run_sweep(aws.adapters(store=store, notifier=n), now=NIGHT + timedelta(minutes=40))  # stopped
    assert aws.ec2.state_of(box) == "stopped" and store.records[box].quiet_stop_at is not None
    for minutes in (0, 5, 10):
        run_sweep(aws.adapters(store=store, notifier=n), now=NIGHT + timedelta(hours=8, minutes=5 + minutes))
    assert ("quiet_summary", box) in n.sent, "stopped at night, owner never told"


class IndexRefused(CountingStateStore):
    def put_entries(self, group, entries, expires):
        if group.startswith("quiet-stops#"):
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "PutItem")
        return super().put_entries(group, entries, expires)


def test_stops_the_index_cannot_take_are_reported_to_the_admins() -> None:
    aws, (box,) = night_account(("U0BOB",), settings='{"admins": ["U0ADMIN"]}')
    store = IndexRefused()
    n = through_the_night(aws, store)
    assert aws.ec2.state_of(box) == "stopped" and store.records[box].quiet_stop_at, "stopped; no sweep failed"
    (alert,) = [text for kind, text in n.sent if kind == "admin_alert"]
    assert box in alert and "morning summary" in alert and "AccessDeniedException" in alert


class OutcomeWriteFails(CountingStateStore):
    """DynamoDB fails the one write that records a stop's outcome (the claim's intent was written)."""

    fail_outcome_of: str | None = None

    def save(self, record, holder=None, *, hold=False):
        if record.instance_id == self.fail_outcome_of and not hold and record.state is State.REAPED:
            self.fail_outcome_of = None
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "InternalServerError", "Message": "Internal error"}}, "PutItem")
        return super().save(record, holder, hold=hold)


def test_a_quiet_stop_whose_outcome_write_failed_is_still_in_the_morning_summary() -> None:
    aws, (box,) = night_account(("U0BOB",))
    store = OutcomeWriteFails()
    n = LoggingNotifier(logger, delivers=True)
    run_sweep(aws.adapters(store=store, notifier=n), now=NIGHT)
    store.fail_outcome_of = box
    report = run_sweep(aws.adapters(store=store, notifier=n), now=NIGHT + timedelta(minutes=40))
    (d,) = report.decisions
    assert d.error and d.error.startswith("outcome not recorded") and aws.ec2.state_of(box) == "stopped"
    assert index(store) == {"ml": [box]}, "indexed from what it did"
    morning = NIGHT + timedelta(hours=8, minutes=20)  # past the crashed claim's lease
    run_sweep(aws.adapters(store=store, notifier=n), now=morning)
    assert ("quiet_summary", box) in n.sent


def test_shards_that_load_an_owners_stops_at_different_times_send_one_summary() -> None:
    """Two readers of the hub's stops at one sweep's time (one invocation a sweep reads them; this is the claims'
    part): A loads the index before B's late entry (from the night) lands; B then sees both stops. One summary,
    from whichever claimed the owner first."""
    aws, boxes = night_account(("U0BOB", "U0BOB"))
    store = CountingStateStore()
    through_the_night(aws, store)
    morning = NIGHT + timedelta(hours=8, minutes=5)
    late = boxes[1]
    (entry,) = [s for s in quiet_stops(store, "hub", NIGHT)[0] if s.key == late]
    assert not store.remove_entries("quiet-stops#hub", {late: entry.value})  # B's not yet in
    b = LoggingNotifier(logger, delivers=True)

    class IndexLandsMeanwhile(LoggingNotifier):
        def quiet_summary(self, stopped):
            store.put_entries("quiet-stops#hub", {late: entry.value}, morning + timedelta(days=1))  # B's lands
            run_sweep(aws.adapters(store=store, notifier=b), now=morning, instance_ids=[])  # shard B runs
            return super().quiet_summary(stopped)

    a = IndexLandsMeanwhile(logger, delivers=True)
    run_sweep(aws.adapters(store=store, notifier=a), now=morning, instance_ids=[])
    told = [ids for kind, ids in a.sent + b.sent if kind == "quiet_summary"]
    assert told == [boxes[0]], f"one summary for the owner in this sweep, got {told}"
    later = LoggingNotifier(logger, delivers=True)
    run_sweep(aws.adapters(store=store, notifier=later), now=morning + timedelta(minutes=5), instance_ids=[])
    assert ("quiet_summary", late) in later.sent, "the late stop is told by the next sweep, never lost"
