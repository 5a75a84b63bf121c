"""Issue 43, item 2: the quiet-hours index at fleet scale, inside DynamoDB's 400 KB item (the in-memory store
refuses a larger item as DynamoDB does, testkit/aws/state.py). It was one item holding every stop not told yet
(23 bytes a hub machine, 46 a member account's): about 17,800 stops of the hub, or 8,000 of member accounts, made
its write fail, and those morning summaries were lost. Now each stop is an item of its own, in its account and
region's partition, read by the one invocation that sweeps there.

The machines' stops are given to report_quiet_hours as the sweep gives them (decisions whose record says stopped
during quiet hours): a sweep of 20,000 machines through the fakes takes a minute, the index alone a second."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from idle_reaper.core import Action, MachineRecord, State
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.signals import Machine
from idle_reaper.notify import LoggingNotifier
from idle_reaper.sweep import logger, quiet_hours
from idle_reaper.sweep.quiet_hours import report_quiet_hours
from testkit.aws import CountingStateStore, FakeAws

NIGHT = datetime(2026, 11, 20, 23, 0, tzinfo=UTC)
MORNING = NIGHT + timedelta(hours=8, minutes=5)  # quiet hours end at 07:00
PREFIX = "/idle-reaper"
EVERY_DAY = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
NIGHTS = {"name": "nights", "days": EVERY_DAY, "start": "22:00", "end": "07:00", "quiet_hours": True}
POLICY = {"idle_minutes": 60, "warn_minutes": 20, "timezone": "UTC", "schedules": [NIGHTS]}
OWNERS = 500  # a summary per owner: 40 machines each at 20,000
REGION = "eu-west-1"


class Night:
    """A team with quiet hours at night, its machines stopped during them (records as the stop wrote them)."""

    def __init__(self) -> None:
        aws = FakeAws()
        aws.ssm.store(f"{PREFIX}/settings", "{}")
        aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(POLICY))
        self.store = CountingStateStore()
        self.notifier = LoggingNotifier(logger, delivers=True)
        self.adapters = aws.adapters(store=self.store, notifier=self.notifier)
        self.settings, _ = self.adapters.policies.load_settings()
        self.refs = self.adapters.policies.load_teams(self.settings)

    def stopped(self, count: int, start: int = 0, account: str | None = None) -> list[Decision]:
        region = REGION if account else None
        decisions = []
        for i in range(start, start + count):
            owner = f"U0{account or 'HUB'}{i % OWNERS:04d}"
            machine = Machine(
                f"i-{i:017x}", "m5.large", "ml", NIGHT - timedelta(days=1), owner=owner, account=account, region=region
            )
            record = MachineRecord(
                machine.instance_id,
                "ml",
                State.REAPED,
                version=1,
                last_action="stop",
                last_action_at=NIGHT,
                owner=owner,
                quiet_stop_at=NIGHT,
                account=account,
                region=region,
            )
            self.store.records[record.key] = record  # what the stop wrote
            decisions.append(Decision(machine, State.REAPED, Action.STOP, "idle", None, record))
        return decisions

    def report(self, decisions: list[Decision], now: datetime, **where: object) -> None:
        report_quiet_hours(self.adapters, decisions, self.refs, self.settings, now, **where)  # type: ignore[arg-type]

    def alerts(self) -> list[str]:
        return [text for kind, text in self.notifier.sent if kind == "admin_alert"]

    def told(self) -> Counter[str]:
        """How many times each machine was in a morning summary."""
        return Counter(i for kind, ids in self.notifier.sent if kind == "quiet_summary" for i in ids.split(","))


def test_twenty_thousand_stops_of_the_hub_in_one_night_are_each_told_once() -> None:
    night = Night()
    decisions = night.stopped(20_000)
    before = Counter(night.store.counts)
    night.report(decisions, NIGHT)
    # Before: "20000 machines stopped during quiet hours will not be in their owners' morning summary (the state
    # table refused the update: ... ValidationException: Item size has exceeded the maximum allowed size)".
    assert not night.alerts()
    # A PutItem a stop; and the sweep's one pass over the hub's stops (the old item looked for, the partition read
    # in 3 pages of 1 MB), which tells none: the team is still in its quiet hours.
    assert night.store.counts - before == {"PutItem": 20_000, "GetItem": 1, "Query": 3}
    assert not night.told()

    before = Counter(night.store.counts)
    night.report([], MORNING)
    told = night.told()
    assert set(told) == {d.machine.instance_id for d in decisions} and set(told.values()) == {1}
    assert len([k for k, _ in night.notifier.sent if k == "quiet_summary"]) == OWNERS
    # The morning pass, once a sweep: the old item looked for (GetItem), the hub's partition read (20,000
    # entries of 128 bytes: 3 pages of 1 MB), the records (100 a BatchGetItem), each told record written and its
    # entry removed.
    calls = night.store.counts - before
    assert {op: calls[op] for op in ("GetItem", "Query", "BatchGetItem", "DeleteItem")} == {
        "GetItem": 1,
        "Query": 3,
        "BatchGetItem": 200,
        "DeleteItem": 20_000,
    }

    night.report([], MORNING + timedelta(minutes=5))  # the next sweep: nothing left, nothing told again
    assert set(night.told().values()) == {1}
    assert quiet_hours.quiet_stops(night.store, "hub", MORNING) == ([], {})


def test_nine_thousand_stops_in_member_accounts_are_each_told_once_by_their_own_unit() -> None:
    a, b = "210987654321", "123456789012"
    night = Night()
    of_a, of_b = night.stopped(4_500, account=a), night.stopped(4_500, start=4_500, account=b)
    night.report(of_a + of_b, NIGHT)
    # Before: one item of 9,000 member keys (414 KB) refused, and this alert for all of them.
    assert not night.alerts()

    night.report([], MORNING)  # the hub's own sweep reads the hub's stops alone
    assert not night.told()
    before = Counter(night.store.counts)
    night.report([], MORNING, member=(a, REGION))  # account a's unit: its stops, and nobody else's
    assert night.told() == Counter({d.machine.instance_id: 1 for d in of_a})
    calls = night.store.counts - before
    assert (calls["GetItem"], calls["Query"], calls["BatchGetItem"]) == (0, 1, 45), "its partition, once"
    night.report([], MORNING, member=(b, REGION))
    night.report([], MORNING + timedelta(minutes=5), member=(a, REGION))
    assert night.told() == Counter({d.machine.instance_id: 1 for d in of_a + of_b})
    assert quiet_hours.quiet_stops(night.store, f"{a}/{REGION}", MORNING) == ([], {})


# ---------------------------------------------------------------------------------------------
# The new layout (these reach the new functions through the module, so this file still runs on the code before)


def entry(key: str, team: str = "ml", at: datetime | None = NIGHT) -> tuple[str, str]:
    return key, quiet_hours.QuietStop(key, team, at.isoformat() if at else None).value


def test_an_old_single_index_found_after_an_upgrade_mid_night_is_moved_and_each_stop_told_once() -> None:
    """The deploy upgrades during the night: the old item holds the stops of the night so far (hub and member
    machines), the new code notes its own as entries. The hub's morning pass moves the old item's into the entries and
    empties it; every stop is told once, each by the invocation of its account-region."""
    account = "210987654321"
    night = Night()
    old_hub, new_hub = night.stopped(3), night.stopped(2, start=3)
    (member,) = night.stopped(1, start=5, account=account)
    old = {"ml": [d.machine.key for d in old_hub], "data": [member.machine.key]}
    night.store.put_lookup(quiet_hours.QUIET_INDEX, json.dumps(old), NIGHT + timedelta(days=7))
    upgraded = NIGHT  # the first sweep of the new code: it stops two, and moves the old item
    night.report(new_hub, upgraded)
    assert night.store.get_lookup(quiet_hours.QUIET_INDEX, upgraded) is None, "emptied once moved"
    stops, _ = quiet_hours.quiet_stops(night.store, "hub", NIGHT)
    assert [(s.key, s.team) for s in stops] == [(d.machine.key, "ml") for d in old_hub + new_hub]
    moved, _ = quiet_hours.quiet_stops(night.store, f"{account}/{REGION}", NIGHT)
    assert [(s.key, s.team) for s in moved] == [(member.machine.key, "data")], "to the partition of its unit"
    # An old sweep still running writes the old item again: the next sweep moves it again, and tells nothing twice.
    night.store.put_lookup(quiet_hours.QUIET_INDEX, json.dumps({"ml": [old_hub[0].machine.key]}), MORNING)
    night.report([], upgraded + timedelta(minutes=5))

    night.report([], MORNING)
    night.report([], MORNING, member=(account, REGION))
    night.report([], MORNING + timedelta(minutes=5))
    assert night.told() == Counter({d.machine.instance_id: 1 for d in [*old_hub, *new_hub, member]})
    assert night.store.get_lookup(quiet_hours.QUIET_INDEX, MORNING) is None


def test_an_unreadable_entry_is_said_and_left_as_it_is_and_the_others_are_told(monkeypatch) -> None:
    night = Night()
    (good,) = night.stopped(1)
    bad = dict(
        [
            ("not a key", "{}"),
            ("i-00000000000000aaa", "{not json"),
            entry("210987654321/eu-west-1/i-00000000000000bbb"),  # a member machine's, in the hub's partition
            ("i-00000000000000ccc", json.dumps({"team": "ml", "stopped_at": "yesterday"})),
            ("i-00000000000000ddd", json.dumps({"stopped_at": None})),
            ("i-00000000000000eee", json.dumps({"team": "ml", "stopped_at": "2026-11-20T23:00:00"})),
        ]
    )
    night.store.put_entries("quiet-stops#hub", bad, NIGHT + timedelta(days=7))
    said: list[tuple[str, dict]] = []
    monkeypatch.setattr(quiet_hours.logger, "warning", lambda msg, extra=None: said.append((msg, extra or {})))
    night.report([good], NIGHT)
    for now in (MORNING, MORNING + timedelta(minutes=5)):
        night.report([], now)
    assert night.told() == Counter({good.machine.instance_id: 1})
    assert night.store.entries("quiet-stops#hub", MORNING) == bad, "left as they are, for their TTL to end"
    whys = {e["key"]: e["why"] for msg, e in said if msg.startswith("unreadable entry of the quiet-hours index")}
    assert whys == {
        "not a key": "'not a key' is not a machine key",
        "i-00000000000000aaa": "its value is not a JSON object with a team: '{not json'",
        "210987654321/eu-west-1/i-00000000000000bbb": (
            "'210987654321/eu-west-1/i-00000000000000bbb' runs in 210987654321/eu-west-1, not in hub"
        ),
        "i-00000000000000ccc": "stopped_at is not an ISO-8601 time: 'yesterday'",
        "i-00000000000000ddd": "its value is not a JSON object with a team: '{\"stopped_at\": null}'",
        "i-00000000000000eee": "stopped_at has no time zone: '2026-11-20T23:00:00'",
    }


def test_shards_noting_at_once_lose_no_stop_and_each_is_told_once() -> None:
    """Eight shards note 1,000 stops each at once (nothing read and written back: none can lose another's), while
    the hub's pass runs; the morning tells each stop once."""
    from idle_reaper.aws.clients import run_concurrently

    night = Night()
    shards = [night.stopped(1_000, start=i * 1_000) for i in range(8)]
    run_concurrently(lambda d: night.report(d, NIGHT, tell=d is shards[0]), shards, 8)  # shard 0 reads
    assert not night.alerts()
    assert len(quiet_hours.quiet_stops(night.store, "hub", NIGHT)[0]) == 8_000
    night.report([], MORNING)
    assert night.told() == Counter({d.machine.instance_id: 1 for shard in shards for d in shard})


def test_a_stop_noted_again_while_its_summary_is_sent_stays_for_the_next_sweep() -> None:
    """The removal of a told stop is conditional on the entry read: an entry written again while the summary is
    sent (a later stop of the machine) stays, for the next sweep to judge from the machine's record."""
    night = Night()
    (box,) = night.stopped(1)
    night.report([box], NIGHT)
    again = dict([entry(box.machine.key, "ml", NIGHT + timedelta(hours=1))])

    class Meanwhile(LoggingNotifier):
        def quiet_summary(self, stopped):  # type: ignore[no-untyped-def]
            night.store.put_entries("quiet-stops#hub", again, MORNING + timedelta(days=7))
            return super().quiet_summary(stopped)

    meanwhile = Meanwhile(logger, delivers=True)
    night.adapters = replace(night.adapters, notifier=meanwhile)
    night.report([], MORNING)
    assert meanwhile.sent == [("quiet_summary", box.machine.instance_id)]
    assert night.store.entries("quiet-stops#hub", MORNING) == again


def test_a_fanned_out_sweep_reads_the_hubs_stops_once_in_its_first_shard() -> None:
    from idle_reaper.sweep import run_sharded
    from testkit.aws import steady

    class Reads(CountingStateStore):
        queried: list[str]

        def entries(self, group: str, now: datetime) -> dict[str, str]:
            self.queried.append(group)
            return super().entries(group, now)

    night = Night()
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", "{}")
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(POLICY))
    for i in range(12):  # six idle (stopped in the night), six busy (still running in the morning)
        profile = steady(1.0 if i < 6 else 80.0)
        aws.launch("m5.large", team="ml", profile=profile, launch_time=NIGHT - timedelta(days=1), owner=f"U0{i}")
    store = Reads()
    adapters = aws.adapters(store=store, notifier=night.notifier)
    for now in (NIGHT, NIGHT + timedelta(minutes=40), MORNING):
        store.queried = []
        sharded = run_sharded(adapters, now=now, shard_size=2, workers=3)
        assert sharded.plan.shards >= 3 and not sharded.gathered.failed
        assert store.queried == ["quiet-stops#hub"], "one read a sweep, however many shards"
    assert len(night.told()) == 6 and set(night.told().values()) == {1}


def test_stops_whose_quiet_hours_do_not_end_within_six_days_are_told_to_the_admins() -> None:
    """An entry leaves the index 7 days after its stop (its TTL): a stop still waiting after 6 (quiet hours that do
    not end, a team in safe mode) is said to the admins, once a day, never dropped in silence."""
    night = Night()
    (box,) = night.stopped(1)
    night.report([box], NIGHT)
    for minutes in (0, 30):  # 23:00 and 23:30 six days later: quiet hours again
        night.report([], NIGHT + timedelta(days=6, minutes=minutes))
    (alert,) = night.alerts()
    assert "1 machines stopped during quiet hours more than 6 days ago (teams: ml)" in alert
    assert box.machine.key in alert and not night.told()


def test_an_owner_with_stops_in_two_accounts_gets_one_summary_a_sweep_and_every_stop_once() -> None:
    """The hub's pass and account a's unit run in the same sweep: the owner is claimed once a sweep, so the unit's
    stop waits for the next sweep (its own pass, five minutes later), never lost nor told twice."""
    a = "210987654321"
    night = Night()
    (hub,), (member,) = night.stopped(1), night.stopped(1, start=1, account=a)
    for d in (hub, member):
        night.store.records[d.record.key] = replace(d.record, owner="U0SAME")
    night.report([hub, member], NIGHT)
    night.report([], MORNING)
    night.report([], MORNING, member=(a, REGION))
    assert night.told() == Counter({hub.machine.instance_id: 1})
    night.report([], MORNING + timedelta(minutes=5), member=(a, REGION))
    assert night.told() == Counter({hub.machine.instance_id: 1, member.machine.instance_id: 1})
