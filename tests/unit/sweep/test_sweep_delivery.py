"""How the sweep carries a warning's delivery from sweep to sweep: a warning that cannot be delivered is
reported to the admins once and not retried, a transient failure is retried, a new quiet stretch starts
clean, and every record gets its TTL. In-memory twin and AWS fakes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from idle_reaper.aws import RECORD_TTL, InMemoryStateStore
from idle_reaper.core import Action, Decision, State
from idle_reaper.notify import Delivery, PermanentDeliveryFailure
from idle_reaper.policy import Settings
from idle_reaper.sweep import SweepReport, run_sweep
from testkit.aws import FakeAws, quiet_after, steady

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
WARN_SWEEP = NOW - timedelta(minutes=30)
DAY_AGO = NOW - timedelta(days=1)
ML = '{"idle_minutes": 90, "warn_minutes": 30}'


class ScriptedNotifier:
    """Answers each warning as told: "deliver", "pending" (None), "permanent" or "crash"."""

    def __init__(self, *answers: str, alert_fails: int = 0) -> None:
        self.answers = list(answers)
        self.warnings = 0
        self.alerts: list[str] = []
        self.alert_fails = alert_fails

    def warn(self, decision: Decision) -> Delivery | None:
        self.warnings += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer == "permanent":
            raise PermanentDeliveryFailure("not_in_channel: the bot is not in C0ML")
        if answer == "crash":
            raise RuntimeError("something unexpected")
        return Delivery(messages=("C0ML|1.0",), ref="ref") if answer == "deliver" else None

    def resolved(self, decision: Decision) -> None:
        return None

    def reaped(self, decision: Decision) -> Delivery | None:
        return None

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        if self.alert_fails > 0:
            self.alert_fails -= 1
            raise RuntimeError("no admin received the alert")
        self.alerts.append(text)


def account(profile=None) -> tuple[FakeAws, str]:
    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings(admins=["U0ADMIN"]).model_dump_json())
    aws.ssm.store("/idle-reaper/teams/ml", ML)
    machine = aws.launch("m5.large", team="ml", profile=profile or steady(1.0), launch_time=DAY_AGO, owner="U0BOB")
    return aws, machine


def sweep(aws: FakeAws, store: InMemoryStateStore, notifier: ScriptedNotifier, now: datetime) -> Decision:
    report: SweepReport = run_sweep(aws.adapters(store=store, notifier=notifier), now=now)
    (d,) = report.decisions
    return d


def test_a_permanent_failure_is_alerted_once_not_retried_and_still_holds_the_stop():
    aws, machine = account()
    store, notifier = InMemoryStateStore(), ScriptedNotifier("permanent", alert_fails=1)
    first = sweep(aws, store, notifier, WARN_SWEEP)
    assert first.action is Action.WARN and "cannot be delivered: not_in_channel" in first.reason
    assert store.records[machine].delivery_error == "not_in_channel: the bot is not in C0ML"
    assert notifier.alerts == [], "nobody received the first alert ..."

    for minutes in (5, 30, 60):
        d = sweep(aws, store, notifier, WARN_SWEEP + timedelta(minutes=minutes))
        assert d.action is Action.NONE and d.state is State.WARNED
    assert notifier.warnings == 1
    assert len(notifier.alerts) == 1, "... so the next sweep alerted again, and then never more"
    assert machine in notifier.alerts[0] and "not_in_channel" in notifier.alerts[0]
    assert aws.ec2.state_of(machine) == "running"


def test_a_transient_failure_or_a_crashing_notifier_is_retried_and_delivered_once():
    aws, machine = account()
    store, notifier = InMemoryStateStore(), ScriptedNotifier("pending", "crash", "deliver")
    for minutes in (0, 5, 10, 15):
        sweep(aws, store, notifier, WARN_SWEEP + timedelta(minutes=minutes))
    assert notifier.warnings == 3, "pending, crashed, delivered; nothing after that"
    record = store.records[machine]
    assert record.warning_delivered_at == WARN_SWEEP + timedelta(minutes=10)
    assert record.warning_post_started_at is None and record.delivery_error is None
    assert notifier.alerts == []


def test_a_new_quiet_stretch_starts_clean_and_is_warned_again():
    busy_between = quiet_after(WARN_SWEEP + timedelta(minutes=5), (1.0,), (70.0,))
    aws, machine = account(lambda t: busy_between(t) if t < NOW else (1.0,))
    store, notifier = InMemoryStateStore(), ScriptedNotifier("permanent", "deliver")
    sweep(aws, store, notifier, WARN_SWEEP)
    assert store.records[machine].delivery_error
    busy = sweep(aws, store, notifier, NOW)
    assert busy.state in (State.ACTIVE, State.IDLE) and store.records[machine].delivery_error is None

    again = sweep(aws, store, notifier, NOW + timedelta(minutes=70))
    assert again.action is Action.WARN and notifier.warnings == 2
    assert store.records[machine].warning_delivered_at == NOW + timedelta(minutes=70)


def test_every_record_write_sets_its_ttl_on_the_stores_clock():
    clock = datetime(2030, 1, 1, tzinfo=UTC)
    aws, machine = account()
    store = InMemoryStateStore(clock=lambda: clock)
    sweep(aws, store, ScriptedNotifier("deliver"), WARN_SWEEP)
    assert store.expires[machine] == clock + RECORD_TTL == clock + timedelta(days=30)
