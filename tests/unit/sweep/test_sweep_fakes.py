"""run_sweep with the real adapters over the in-memory AWS fakes: bad input and faults make the
reaper do less, never more. Fast, no network."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.aws import Fleet
from idle_reaper.core import Action, Decision, Machine, MachineRecord, State
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import Settings, TagKeys
from idle_reaper.sweep import SweepReport, logger, run_sweep
from testkit.aws import CountingStateStore, FakeAws, steady

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
WARN_SWEEP = NOW - timedelta(minutes=30)  # ml policy: warn at 60 quiet minutes, stop at 90, 30 min after the warning
DAY_AGO = NOW - timedelta(days=1)
PREFIX = "/idle-reaper"
ML = '{"idle_minutes": 90, "warn_minutes": 30}'
IDLE = steady(1.0)
BUSY = steady(70.0)
WRITE_OPS = ("StopInstances", "SetInstanceProtection", "TerminateInstanceInAutoScalingGroup")


def account(teams: dict[str, str] | None = None, settings: Settings | None = None) -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", (settings or Settings()).model_dump_json())
    for team, text in (teams or {"ml": ML}).items():
        aws.ssm.store(f"{PREFIX}/teams/{team}", text)
    return aws


def box(aws: FakeAws, team: str = "ml", profile=IDLE, instance_type: str = "m5.large", **kw: Any) -> str:
    return aws.launch(instance_type, team=team, profile=profile, launch_time=DAY_AGO, **kw)


def sweep(aws: FakeAws, store, now: datetime, notifier=None, **kw: Any) -> SweepReport:
    return run_sweep(aws.adapters(store=store, notifier=notifier), now=now, **kw)


def by_id(report: SweepReport) -> dict[str, Decision]:
    return {d.machine.instance_id: d for d in report.decisions}


def touched(aws: FakeAws) -> set[str]:
    """Every instance id any write call named."""
    ids: set[str] = set()
    for op in WRITE_OPS:
        for client in (aws.ec2, aws.autoscaling):
            for request in client.requests_of(op):
                ids.update(request.get("InstanceIds") or [request.get("InstanceId")])
    return ids


def writes(aws: FakeAws) -> int:
    return aws.write_calls()


def state_writes(store: CountingStateStore) -> tuple[int, int]:
    return store.counts["save"], store.counts["audit"]


class DiscoveryHook(Fleet):
    """The real Fleet, with something happening right after its last look before acting (a race with the
    world: the sweep re-reads the machines it is about to act on, so earlier changes are caught there)."""

    def __init__(self, aws: FakeAws, after: Callable[[list[Machine]], None]) -> None:
        super().__init__(aws.ec2, aws.autoscaling)
        self.after = after

    def still_as_listed(self, machines: Sequence[Machine], tags: TagKeys) -> set[str]:
        unchanged = super().still_as_listed(machines, tags)
        self.after(list(machines))
        return unchanged


class FrozenDiscovery(Fleet):
    """The real Fleet acting, but discovery answers what it saw earlier (a sweep that started earlier)."""

    def __init__(self, aws: FakeAws, machines: list[Machine]) -> None:
        super().__init__(aws.ec2, aws.autoscaling)
        self.machines = machines

    def discover(
        self, tags: TagKeys, *, notebooks: bool = True, endpoints: bool = True, studio: bool = False
    ) -> list[Machine]:
        return list(self.machines)


class StaleStore:
    """Loads the records as they were before another sweep saved; writes go to the shared store."""

    def __init__(self, shared: CountingStateStore, snapshot: dict[str, MachineRecord]) -> None:
        self._shared = shared
        self._snapshot = dict(snapshot)

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        wanted = set(instance_ids)
        return {i: r for i, r in self._snapshot.items() if i in wanted}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


# ---------------------------------------------------------------------------------------------


def test_invalid_team_policy_changes_nothing_for_that_team_while_others_are_swept():
    aws = account({"ml": ML, "research": '{"idle_minutes": 5}'})
    aws.autoscaling.add_group("research-workers")
    ml_idle = box(aws)
    research_idle = box(aws, "research")
    research_busy_member = box(aws, "research", BUSY, group="research-workers", protected=False)
    research_idle_member = box(aws, "research", IDLE, group="research-workers", protected=True)
    research = {research_idle, research_busy_member, research_idle_member}
    store = CountingStateStore()

    first = sweep(aws, store, WARN_SWEEP)
    second = sweep(aws, store, NOW)

    assert by_id(first)[ml_idle].action is Action.WARN
    assert by_id(second)[ml_idle].action is Action.STOP and by_id(second)[ml_idle].error is None
    assert aws.ec2.state_of(ml_idle) == "stopped"

    assert touched(aws) == {ml_idle}, "only the valid team's machine may be written to"
    assert aws.ec2.state_of(research_idle) == "running"
    assert not aws.autoscaling.protected(research_busy_member), "a safe-mode team gets no protection change"
    assert aws.autoscaling.protected(research_idle_member), "a safe-mode team keeps its protection"
    for report in (first, second):
        for i in research:
            d = by_id(report)[i]
            assert d.state is State.SAFE_MODE and d.action is Action.NONE
            assert f"{PREFIX}/teams/research" in d.reason and "idle_minutes" in d.reason
        assert any(f"{PREFIX}/teams/research" in w for w in report.warnings)


def test_machine_gone_between_discovery_and_stop_is_recorded_without_crashing():
    aws = account()
    stays, vanishes = box(aws), box(aws)
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)
    warned_version = store.records[vanishes].version

    adapters = aws.adapters(store=store)
    adapters.fleet = DiscoveryHook(aws, lambda machines: aws.ec2.forget(vanishes))
    report = run_sweep(adapters, now=NOW)

    decisions = by_id(report)
    assert decisions[stays].action is Action.STOP and decisions[stays].error is None
    assert aws.ec2.state_of(stays) == "stopped"
    gone = decisions[vanishes]
    assert gone.error and "InvalidInstanceID.NotFound" in gone.error
    record = store.records[vanishes]
    assert record.last_action == "stop_failed" and "InvalidInstanceID.NotFound" in record.reason
    assert record.version > warned_version
    assert any("InvalidInstanceID.NotFound" in str(entry.get("error")) for entry in store.history(vanishes))
    assert [len(r["InstanceIds"]) for r in aws.ec2.requests_of("StopInstances")] == [2, 1, 1]


def test_failing_cloudwatch_batch_leaves_its_machines_unknown_and_the_rest_are_acted_on():
    aws = account()
    # 900 queries (CPU, GPU, human activity: GPU boxes): two GetMetricData calls
    boxes = [box(aws, profile=steady(1.0, 0.0), instance_type="g5.xlarge") for _ in range(300)]
    store = CountingStateStore()
    warned = sweep(aws, store, WARN_SWEEP)
    assert all(d.action is Action.WARN for d in warned.decisions)

    calls_so_far = aws.cloudwatch.calls["GetMetricData"]
    aws.cloudwatch.inject("GetMetricData", "Throttling", on_calls={calls_so_far + 2})
    report = sweep(aws, store, NOW)

    throttled_request = aws.cloudwatch.requests_of("GetMetricData")[-1]
    lost = {q["MetricStat"]["Metric"]["Dimensions"][0]["Value"] for q in throttled_request["MetricDataQueries"]}
    # 900 queries: 500 in the first call, 400 in the second (134 machines, one of them straddling both calls)
    assert len(lost) == 134
    decisions = by_id(report)
    for i in boxes:
        if i in lost:
            assert decisions[i].state is State.UNKNOWN and decisions[i].action is Action.NONE
            assert aws.ec2.state_of(i) == "running"
        else:
            assert decisions[i].action is Action.STOP and aws.ec2.state_of(i) == "stopped"
    assert touched(aws) == set(boxes) - lost

    # The unknown sweep did not throw the warning away: once metrics are back they are stopped.
    aws.cloudwatch.clear_faults()
    later = sweep(aws, store, NOW + timedelta(minutes=5))
    assert {d.machine.instance_id for d in later.decisions if d.action is Action.STOP} == lost
    assert {aws.ec2.state_of(i) for i in boxes} == {"stopped"}


def test_overlapping_sweeps_cannot_both_act_on_the_same_machine():
    aws = account()
    a, b = box(aws), box(aws)
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)

    # Sweep 2 starts: it discovers and loads the records, then stalls while sweep 1 runs to the end.
    seen = Fleet(aws.ec2, aws.autoscaling).discover(TagKeys())
    snapshot = store.load([m.instance_id for m in seen])
    first_notifier = LoggingNotifier(logger, delivers=True)
    first = sweep(aws, store, NOW, notifier=first_notifier)
    assert {d.action for d in first.decisions} == {Action.STOP}
    stops_after_first = aws.ec2.calls["StopInstances"]

    second_notifier = LoggingNotifier(logger, delivers=True)
    adapters = aws.adapters(store=StaleStore(store, snapshot), notifier=second_notifier)
    adapters.fleet = FrozenDiscovery(aws, seen)
    second = run_sweep(adapters, now=NOW)

    for d in second.decisions:
        assert d.action is Action.STOP, "the stale sweep decides to stop too ..."
        assert d.error and "another sweep" in d.error, "... but its conditional write loses"
    assert aws.ec2.calls["StopInstances"] == stops_after_first, "the second sweep made no stop call"
    assert second_notifier.sent == []
    assert all(store.records[i].state is State.REAPED for i in (a, b))
    assert store.counts["ConditionalCheckFailed"] == 2


def test_overlapping_first_sweeps_warn_once():
    aws = account()
    nb = box(aws)
    store = CountingStateStore()
    one, two = LoggingNotifier(logger, delivers=True), LoggingNotifier(logger, delivers=True)

    stale = StaleStore(store, {})  # loaded before the other sweep saved anything
    first = sweep(aws, store, WARN_SWEEP, notifier=one)
    second = sweep(aws, stale, WARN_SWEEP, notifier=two)

    assert by_id(first)[nb].action is Action.WARN and by_id(first)[nb].error is None
    assert by_id(second)[nb].error and "another sweep" in (by_id(second)[nb].error or "")
    assert one.sent + two.sent == [("warning", nb)]


@pytest.mark.parametrize("how", ["flag", "settings"])
def test_dry_run_makes_no_write_call_and_saves_no_state(how):
    settings = Settings(dry_run=how == "settings")
    aws = account({"ml": ML, "platform": '{"asg_action": "terminate"}'}, settings=Settings())
    aws.autoscaling.add_group("ml-workers")
    aws.autoscaling.add_group("platform-workers", min_size=0)
    notebook = box(aws)
    idle_member = box(aws, group="ml-workers", protected=True)
    doomed_member = box(aws, "platform", group="platform-workers", protected=True)
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)  # a real sweep: the warnings went out
    busy_member = box(aws, profile=BUSY, group="ml-workers", protected=False)  # joined since
    aws.ssm.store(f"{PREFIX}/settings", settings.model_dump_json())

    writes_before, saved_before = writes(aws), state_writes(store)
    records_before = dict(store.records)
    notifier = LoggingNotifier(logger, delivers=True)
    report = sweep(aws, store, NOW, notifier=notifier, dry_run=how == "flag")

    assert report.dry_run
    labels = {d.machine.instance_id: d.action_label for d in report.decisions}
    assert labels == {
        notebook: "would_stop",
        idle_member: "would_unprotect",
        doomed_member: "would_terminate",
        busy_member: "would_protect",
    }
    assert writes(aws) == writes_before
    assert state_writes(store) == saved_before and store.records == records_before
    assert notifier.sent == []
    assert aws.ec2.state_of(notebook) == "running"
    assert aws.autoscaling.protected(idle_member) and not aws.autoscaling.protected(busy_member)
    assert doomed_member in aws.autoscaling.groups["platform-workers"].members


def test_idle_group_members_are_never_stopped_and_terminations_respect_min_size():
    aws = account({"platform": '{"asg_action": "terminate"}'})
    aws.autoscaling.add_group("workers", min_size=2)
    members = [box(aws, "platform", group="workers", protected=True) for _ in range(4)]
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)
    report = sweep(aws, store, NOW)

    actions = sorted(d.action.value for d in report.decisions)
    assert actions == ["terminate", "terminate", "unprotect", "unprotect"]
    assert aws.ec2.calls["StopInstances"] == 0
    group = aws.autoscaling.groups["workers"]
    assert group.desired == 2 == group.min_size
    assert len(group.members) == 2 and not any(group.members.values())
    assert sum(aws.ec2.state_of(i) == "shutting-down" for i in members) == 2


def test_a_team_with_a_24_hour_window_does_not_make_the_whole_fleet_pay_twice_for_metrics():
    # COST BUG (sweep.py _fetch_signals + aws.py MetricsReader.fetch): the whole fleet is fetched over
    # the LONGEST window in use and packed 500 queries per call whatever the datapoint count. One team
    # with idle_minutes=1440 gives every query ~292 five-minute points, 500 x 292 > GetMetricData's
    # 100,800 datapoints per call, so every full batch needs a NextToken page that re-sends (and is
    # counted as requesting again) all 500 metrics: calls and requested metrics nearly double for every
    # team. Fix: group machines by lookback and size each batch to min(500, 100_800 // points per
    # query), so each metric is requested once per sweep.
    aws = account({"ml": ML, "overnight": '{"idle_minutes": 1440, "warn_minutes": 60}'})
    for n in range(300):  # GPU boxes: both metrics carry datapoints
        box(aws, "overnight" if n % 10 == 0 else "ml", steady(1.0, 0.0), "g5.xlarge")
    sweep(aws, CountingStateStore(), NOW)
    requested = aws.cloudwatch.metrics_requested
    assert requested == 3 * 300, (  # CPU, GPU and the human-activity metric
        f"{requested} metrics requested for 300 machines x 3 metrics: NextToken pages re-requested "
        f"{requested - 900}; GetMetricData calls {aws.cloudwatch.calls['GetMetricData']}"
    )


def test_a_team_with_a_short_window_is_read_over_its_own_window_not_the_longest_in_use():
    # A call has one range. Packed in the listing's order, every call of a fleet of 60- and 120-minute teams
    # holds both and reads all of them over 120 + 15 minutes; packed shortest window first, the 60-minute team's
    # machines fill calls of their own 75-minute range but for the one call the two teams share (its range the
    # longer one), in as many calls as before.
    aws = account({"short": '{"idle_minutes": 60, "warn_minutes": 20}', "long": ML.replace("90", "120")})
    teams = {box(aws, "short" if n % 2 else "long", steady(1.0, 0.0), "g5.xlarge"): n % 2 for n in range(600)}
    report = sweep(aws, CountingStateStore(), NOW)

    requests = aws.cloudwatch.requests_of("GetMetricData")
    assert len(requests) == 3 * 600 // 500 + 1  # ceil(metrics x machines / 500): no call added
    minutes = {
        q["MetricStat"]["Metric"]["Dimensions"][0]["Value"]: (NOW - r["StartTime"]) / timedelta(minutes=1)
        for r in requests
        for q in r["MetricDataQueries"]
    }
    short = [minutes[i] for i, is_short in teams.items() if is_short]
    long = [minutes[i] for i, is_short in teams.items() if not is_short]
    assert set(long) == {120 + 15 + 5}  # its window, the largest gap, one period
    assert set(short) == {80, 140} and short.count(140) <= 500 // 3 + 1  # one call shared with the long team
    assert {d.signal for d in report.decisions} == {"idle"}  # every window covered: read whole, decided


def test_the_person_signal_is_fetched_only_for_teams_whose_policy_reads_it():
    # Each metric query is billed: a team with human_active_minutes 0 must not pay for the collector's metric.
    aws = account({"ml": ML, "cpu-only": '{"human_active_minutes": 0}'})
    for n in range(100):
        box(aws, "cpu-only" if n % 2 else "ml", steady(1.0, 0.0), "g5.xlarge")
    sweep(aws, CountingStateStore(), NOW)
    assert aws.cloudwatch.metrics_requested == 3 * 50 + 2 * 50, "CPU, GPU and person for ml; CPU and GPU alone"


def test_a_stopped_machine_seen_running_again_ends_its_savings_in_the_audit_at_its_launch():
    """The digest's savings of a stop end when the machine runs again: the sweep audits that, with the launch."""
    from idle_reaper.core.digest import RUNNING_AGAIN, build_digest, week_of

    aws = account()
    machine = box(aws)
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)
    assert by_id(sweep(aws, store, NOW))[machine].action is Action.STOP
    assert aws.ec2.state_of(machine) == "stopped"
    sweep(aws, store, NOW + timedelta(minutes=30))  # still stopped: not listed, nothing audited
    assert [e["action"] for _, _, e in store.audits].count(RUNNING_AGAIN) == 0
    started = NOW + timedelta(hours=2)
    aws.ec2.instances[machine].set_state("running")
    aws.ec2.instances[machine].api["LaunchTime"] = started
    aws.cloudwatch.add(machine, BUSY, started)
    sweep(aws, store, started + timedelta(minutes=10))
    again = [(at, e) for _, at, e in store.audits if e["action"] == RUNNING_AGAIN]
    assert [e["running_since"] for _, e in again] == [started.isoformat()]
    sweep(aws, store, started + timedelta(minutes=15))  # seen once: not audited again
    assert [e["action"] for _, _, e in store.audits].count(RUNNING_AGAIN) == 1
    digest = build_digest(store.audits, [], week_of(NOW), now=NOW + timedelta(days=1), team="ml")
    assert digest.recovered["stops"].hours == pytest.approx(2.0)
    assert digest.recovered_dollars == pytest.approx(2 * 0.096)  # m5.large on demand


def test_a_busy_machine_keeps_its_busiest_reading_of_the_week_for_the_digest():
    aws = account()
    busy_cpu = box(aws, profile=steady(20.0), instance_type="m5.xlarge")
    busy_gpu = box(aws, profile=steady(2.0, 35.0), instance_type="g5.2xlarge")
    idle = box(aws)
    store = CountingStateStore()
    sweep(aws, store, NOW)
    assert store.records[busy_cpu].week_peaks == "2026-W47:20:1"  # a CPU-only type: its CPU
    assert store.records[busy_gpu].week_peaks == "2026-W47:35:1"  # a GPU type: its busiest GPU
    assert store.records[idle].week_peaks == ""  # not busy: nothing to size


def test_an_idle_group_member_the_group_keeps_is_in_the_digest_while_it_runs():
    """Issue 44, item 10: released to a group at its minimum size, an idle member keeps running; the sweeps keep
    its record fresh and the digest lists it, with its price."""
    from idle_reaper.core.digest import build_digest, week_of
    from idle_reaper.core.digest_text import digest_text

    aws = account()
    aws.autoscaling.add_group("workers", min_size=1)
    member = box(aws, "ml", group="workers", protected=True)
    store = CountingStateStore()
    sweep(aws, store, WARN_SWEEP)
    assert by_id(sweep(aws, store, NOW))[member].action is Action.UNPROTECT
    later = NOW + timedelta(hours=3)
    for hour in range(1, 4):
        sweep(aws, store, NOW + timedelta(hours=hour))
    record = store.records[member]
    assert record.state is State.REAPED and aws.ec2.state_of(member) == "running"
    d = build_digest([], store.records.values(), week_of(later), now=later, team="ml", prices={"m5.large": 0.096})
    assert "Idle in an Auto Scaling group, still running ($0.10/h)" in digest_text(d)
