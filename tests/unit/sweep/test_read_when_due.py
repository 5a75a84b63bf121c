"""Read a machine only when its decision can change (core/reading.py): busy machines are read about hourly,
and nothing a machine does between reads is lost or acted on late. Skipping only ever concerns machines
whose warning cannot come yet; every other machine, and every bad next-read time, is read at once."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.aws import Concurrency
from idle_reaper.core import Action, Machine, MachineRecord, State
from idle_reaper.core.answers import snooze, started_by_person, stopped_by_person
from idle_reaper.core.reading import READ_REFRESH, not_due, parse_next_read
from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.sweep import SweepReport, run_sweep
from testkit.aws import CountingStateStore, FakeAws, quiet_after, steady

T = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"
DAY_AGO = T - timedelta(days=1)
POLICY = {"idle_minutes": 90, "warn_minutes": 30}  # no warning before 60 quiet minutes


@pytest.fixture(autouse=True, scope="module")
def one_task_at_a_time() -> Iterator[None]:
    """The sweeps' thread pools run their tasks one after another: over the in-memory fakes the same calls and
    answers (what is counted here, reads and writes, does not depend on their order), without the threads each
    pool starts, which were half the time of the fleets test below (3.0 s -> 1.4 s)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Concurrency, "runner", staticmethod(lambda fn, items, workers: [fn(item) for item in items]))
        yield


def account(policy: dict[str, int] = POLICY, read_when_due: bool = True) -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings(read_when_due=read_when_due).model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(policy))
    return aws


def sweep(aws: FakeAws, store: CountingStateStore, now: datetime) -> SweepReport:
    return run_sweep(aws.adapters(store=store), now=now)


def gmd_queries(aws: FakeAws) -> int:
    return sum(len(kw["MetricDataQueries"]) for op, kw in aws.cloudwatch.requests if op == "GetMetricData")


def test_a_busy_machine_is_read_about_hourly_and_what_it_did_meanwhile_is_still_seen() -> None:
    aws = account()
    box = aws.launch("m5.large", team="ml", profile=steady(70.0), launch_time=DAY_AGO)
    store = CountingStateStore()
    sweep(aws, store, T)
    stored = store.records[box]
    due = parse_next_read(stored.next_read_at)
    assert due is not None and T < due <= T + READ_REFRESH
    assert "busy until" in stored.next_read_why
    reads = []
    for n in range(1, 25):  # two hours of 5-minute sweeps
        before = gmd_queries(aws)
        d = sweep(aws, store, T + timedelta(minutes=5 * n)).decisions[0]
        reads.append(gmd_queries(aws) > before)
        assert d.read == reads[-1]
        if not d.read:
            assert d.action is Action.NONE and d.reason.startswith("not read: busy until")
    assert 2 <= sum(reads) <= 3, reads  # hourly, at the machine's own point in the hour


def test_a_machine_that_went_quiet_between_reads_is_warned_on_the_same_sweep_as_when_read_every_sweep() -> None:
    quiet_from = T + timedelta(minutes=12)  # goes quiet soon after the first read
    warned: dict[bool, datetime | None] = {}
    for read_when_due in (True, False):
        aws = account(read_when_due=read_when_due)
        aws.launch("m5.large", team="ml", profile=quiet_after(quiet_from, (60.0,), (1.0,)), launch_time=DAY_AGO)
        store = CountingStateStore()
        warned[read_when_due] = None
        for n in range(0, 40):
            now = T + timedelta(minutes=5 * n)
            d = sweep(aws, store, now).decisions[0]
            if d.action is Action.WARN:
                warned[read_when_due] = now
                break
    assert warned[True] is not None and warned[True] == warned[False]


def test_fleets_swept_with_and_without_read_when_due_warn_and_stop_alike_and_unread_machines_never_act() -> None:
    rng = random.Random(7)
    plans = []
    # 40 machines, kept (the time went to the thread pools): the first 20 or 12 of these plans no longer catch a
    # seeded bug the 40 do (a machine started recently not read again until an hour later, whatever its warning
    # point): only young machines started during the sweeps show it.
    for _ in range(40):
        kind = rng.choice(("busy", "quiet_after", "spiky", "young"))
        at = T + timedelta(minutes=rng.randrange(-120, 240))
        plans.append((kind, at, rng.choice(("m5.large", "g5.xlarge"))))

    def profile(kind: str, at: datetime):
        if kind == "busy":
            return steady(60.0, 80.0)
        if kind == "spiky":
            return lambda t: (70.0 if (t.minute + at.minute) % 60 < 10 else 1.0, 1.0)
        return quiet_after(at, (60.0, 90.0), (1.0, 0.0))

    outcomes: dict[bool, list[tuple[int, int, str]]] = {}
    reads: dict[bool, int] = {}
    for read_when_due in (True, False):
        aws = account({"idle_minutes": 60, "warn_minutes": 15}, read_when_due=read_when_due)
        ids = []
        for kind, at, itype in plans:
            launch = at if kind == "young" else DAY_AGO
            ids.append(aws.launch(itype, team="ml", profile=profile(kind, at), launch_time=launch))
        store = CountingStateStore()
        seen = []
        for n in range(0, 80):  # six and a half hours
            for d in sweep(aws, store, T + timedelta(minutes=5 * n)).decisions:
                if not d.read:
                    assert d.action is Action.NONE and not d.deliver_warning and d.notify is None
                if d.action is not Action.NONE:
                    seen.append((n, ids.index(d.machine.instance_id), d.action_label))
        outcomes[read_when_due] = seen
        reads[read_when_due] = gmd_queries(aws)
    assert any(label == "stop" for _, _, label in outcomes[True]), "the fleet saw stops"
    assert outcomes[True] == outcomes[False]
    assert reads[True] < 0.7 * reads[False], reads


def test_a_read_that_returns_partial_data_leaves_the_machine_due_at_the_next_sweep() -> None:
    aws = account()
    box = aws.launch("m5.large", team="ml", profile=steady(70.0), launch_time=DAY_AGO)
    store = CountingStateStore()
    aws.cloudwatch.partial_data.add(box)  # CloudWatch keeps answering PartialData: unknown, never idle
    first = sweep(aws, store, T).decisions[0]
    assert first.signal == "unknown" and store.records[box].next_read_at == ""
    aws.cloudwatch.partial_data.clear()
    assert sweep(aws, store, T + timedelta(minutes=5)).decisions[0].read, "read again at the next sweep"
    assert parse_next_read(store.records[box].next_read_at) is not None, "then busy: read about hourly"


# ---------------------------------------------------------------------------------------------
# The pure rule: what makes a machine due at once


def ref(version: int = 1) -> TeamPolicyRef:
    return TeamPolicyRef(team="ml", policy=TeamPolicy(**POLICY), source="/idle-reaper/teams/ml", version=version)


MACHINE = Machine("i-1", "m5.large", "ml", launch_time=DAY_AGO, owner="U0BOB", name="box")
SKIPPABLE = MachineRecord(
    instance_id="i-1",
    team="ml",
    state=State.ACTIVE,
    policy_version="/idle-reaper/teams/ml@v1",
    observed_at=T,
    instance_type="m5.large",
    owner="U0BOB",
    name="box",
    next_read_at=(T + timedelta(minutes=40)).isoformat(),
    next_read_why="busy until 15:00 UTC",
)


def test_a_skippable_record_is_not_due_before_its_time_and_due_at_it() -> None:
    assert not_due(MACHINE, ref(), SKIPPABLE, T + timedelta(minutes=5)).startswith("not read: busy until 15:00")
    assert not_due(MACHINE, ref(), SKIPPABLE, T + timedelta(minutes=40)) == ""


@pytest.mark.parametrize(
    "next_read_at",
    ["", "garbage", "2026-13-40T99:00:00+00:00", "2026-11-20T15:40:00", (T + timedelta(days=3)).isoformat()],
)
def test_a_missing_corrupt_naive_or_far_off_next_read_time_means_read_now(next_read_at: str) -> None:
    record = replace(SKIPPABLE, next_read_at=next_read_at)
    assert not_due(MACHINE, ref(), record, T + timedelta(minutes=5)) == ""


@pytest.mark.parametrize(
    ("machine", "record", "policy_ref"),
    [
        (MACHINE, SKIPPABLE, ref(version=2)),  # a new policy version or schedule in force
        (replace(MACHINE, owner="U0ALICE"), SKIPPABLE, ref()),  # its facts changed
        (replace(MACHINE, asg_name="workers", asg_protected=False), replace(SKIPPABLE, asg_name="workers"), ref()),
        (replace(MACHINE, exempt_tag="true"), SKIPPABLE, ref()),
        (replace(MACHINE, launch_time=T + timedelta(minutes=2)), SKIPPABLE, ref()),  # started again since
        (MACHINE, replace(SKIPPABLE, state=State.WARNED, warned_at=T), ref()),
        (MACHINE, replace(SKIPPABLE, state=State.IDLE, idle_since=T), ref()),
        (MACHINE, replace(SKIPPABLE, state=State.SNOOZED), ref()),
        (MACHINE, replace(SKIPPABLE, state=State.REAPED), ref()),
        (MACHINE, SKIPPABLE, TeamPolicyRef(team="ml", policy=None, source="t", version=1, error="bad")),
        (MACHINE, None, ref()),
    ],
)
def test_anything_that_could_change_the_decision_makes_the_machine_due_at_once(
    machine: Machine, record: MachineRecord | None, policy_ref: TeamPolicyRef
) -> None:
    assert not_due(machine, policy_ref, record, T + timedelta(minutes=5)) == ""


def test_an_answer_makes_the_machine_due_at_once() -> None:
    policy = TeamPolicy(**POLICY)
    kept = snooze(SKIPPABLE, policy, "U0BOB", T + timedelta(hours=2), T)
    assert isinstance(kept, MachineRecord) and kept.next_read_at == ""
    assert stopped_by_person(SKIPPABLE, "U0BOB", Action.STOP, T).next_read_at == ""
    assert started_by_person(replace(SKIPPABLE, state=State.REAPED), "U0BOB", T).next_read_at == ""


def test_a_young_machine_is_read_again_when_a_warning_first_becomes_possible() -> None:
    aws = account()
    launch = T - timedelta(minutes=10)
    box = aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=launch)
    store = CountingStateStore()
    d = sweep(aws, store, T).decisions[0]
    assert d.state is State.UNKNOWN
    due = parse_next_read(store.records[box].next_read_at)
    assert due is not None and T < due <= launch + timedelta(minutes=60), "no warning before 60 quiet minutes"


def test_a_gpu_machine_without_gpu_metrics_is_read_again_when_its_warning_could_first_come() -> None:
    aws = account()
    box = aws.launch("g5.xlarge", team="ml", profile=steady(1.0), launch_time=DAY_AGO)  # CPU only, no agent
    store = CountingStateStore()
    d = sweep(aws, store, T).decisions[0]
    assert d.state is State.UNKNOWN and "no GPU metrics" in d.reason
    due = parse_next_read(store.records[box].next_read_at)
    assert due is not None and T < due <= T + timedelta(minutes=60)
    assert "once it reports" in store.records[box].next_read_why


# ---------------------------------------------------------------------------------------------
# A machine only reported on (notify_only) and metrics that cannot exist


def test_a_machine_only_reported_on_is_read_every_half_hour_and_its_resolved_notice_comes_at_most_that_late() -> None:
    busy_again = T + timedelta(minutes=62)
    notify_only = {"idle_minutes": 90, "warn_minutes": 30, "action": "notify_only"}
    told: dict[bool, list[tuple[int, str]]] = {}
    reads: dict[bool, list[int]] = {}
    for read_when_due in (True, False):
        aws = account(notify_only, read_when_due=read_when_due)
        profile = lambda t: (70.0,) if t >= busy_again else (1.0,)  # noqa: E731
        box = aws.launch("m5.large", team="ml", profile=profile, launch_time=DAY_AGO)  # quiet for a day
        store = CountingStateStore()
        told[read_when_due], reads[read_when_due] = [], []
        for n in range(0, 30):
            d = sweep(aws, store, T + timedelta(minutes=5 * n)).decisions[0]
            assert d.action_label in ("none", "warn", "would_stop"), d.action_label  # nothing is ever stopped
            if d.read:
                reads[read_when_due].append(n)
            if d.notify or d.action is Action.WARN:
                told[read_when_due].append((n, d.notify or d.action_label))
        if read_when_due:
            assert store.records[box].next_read_why == "" or "busy until" in store.records[box].next_read_why
    # Warned at the same sweep; the owner hears it is resolved at most 30 min later than reading every sweep.
    assert [what for _, what in told[False]] == [what for _, what in told[True]] == ["warning", "resolved"]
    (warned, resolved), (warned_due, resolved_due) = ([n for n, _ in told[x]] for x in (False, True))
    assert warned == warned_due == 0 and resolved <= resolved_due <= resolved + 6
    gaps = [b - a for a, b in zip(reads[True], reads[True][1:], strict=False) if a < 12]
    assert max(gaps) == 6 and len(reads[True]) < len(reads[False]) / 2, reads[True]
    assert reads[True][:2] == [0, 6], "planned in the write that records the delivered notice"
    assert aws.ec2.state_of(box) == "running"


def test_a_reported_machine_is_due_at_once_when_its_policy_changes_or_its_owner_answers() -> None:
    reported = replace(
        SKIPPABLE,
        state=State.WARNED,
        warned_at=T,
        idle_since=T - timedelta(hours=2),
        warning_delivered_at=T,
        next_read_why="only reported on, told at 15:00 UTC; nothing is stopped; next read 15:30 UTC",
    )
    assert not_due(MACHINE, ref(), reported, T + timedelta(minutes=5)).startswith("not read: only reported on")
    assert not_due(MACHINE, ref(version=2), reported, T + timedelta(minutes=5)) == ""
    kept = snooze(reported, TeamPolicy(**POLICY), "U0BOB", T + timedelta(hours=2), T)
    assert isinstance(kept, MachineRecord) and not_due(MACHINE, ref(), kept, T + timedelta(minutes=5)) == ""
    assert not_due(MACHINE, ref(), replace(reported, next_read_why="busy until 15:00 UTC"), T) == ""


def queried_metrics(aws: FakeAws) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for op, kw in aws.cloudwatch.requests:
        if op == "GetMetricData":
            for q in kw["MetricDataQueries"]:
                metric = q["MetricStat"]["Metric"]
                found.setdefault(metric["Dimensions"][0]["Value"], set()).add(metric["MetricName"])
    return found


def test_the_gpu_metric_is_read_only_for_types_that_can_have_a_gpu() -> None:
    aws = FakeAws()
    aws.ssm.store(
        f"{PREFIX}/settings",
        Settings(gpu_instance_families=(*Settings().gpu_instance_families, "m7i")).model_dump_json(),
    )
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(POLICY))
    types = ("m5.large", "c6gn.xlarge", "t3.micro", "g5.xlarge", "p4d.24xlarge", "inf2.xlarge", "trn1.2xlarge",
             "dl1.24xlarge", "f1.2xlarge", "mac2.metal", "hpc7g.4xlarge", "m7i.large")  # fmt: skip
    ids = {t: aws.launch(t, team="ml", profile=steady(50.0, 50.0), launch_time=DAY_AGO) for t in types}
    sweep(aws, CountingStateStore(), T)
    found = queried_metrics(aws)
    gpu_read = {t for t, i in ids.items() if "nvidia_smi_utilization_gpu" in found[i]}
    # Only general-purpose, compute, memory and burstable families are certain to have no NVIDIA GPU; a
    # family the settings call GPU (m7i here) and anything unknown is read.
    assert gpu_read == set(types) - {"m5.large", "c6gn.xlarge", "t3.micro"}
    assert all("CPUUtilization" in found[i] for i in ids.values())
