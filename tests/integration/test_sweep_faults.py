"""Sweep faults against moto's DynamoDB and EC2 and the local Slack fake: overlapping sweeps, a state table
that fails after a warning was posted, and a warning that can never be delivered. In every case the owner
is told at most once, the machine is acted on at most once, the stop waits for a delivered warning (or
undelivered_warning_max_minutes), and the admins are told."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.core import Decision, State
from idle_reaper.notify import Delivery, PermanentDeliveryFailure
from idle_reaper.slack import SlackNotifier, make_client
from idle_reaper.sweep import Adapters, SweepReport, run_sweep
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at
from testkit.interleave import Gate, interleave, stepped

pytestmark = pytest.mark.integration

T0 = at(14)  # quiet since 11:00: warned now; the stop is due 20 min after a delivered warning
HOLD = timedelta(minutes=240)  # undelivered_warning_max_minutes (the default)


def idle(_t: datetime) -> tuple[float, float | None]:
    return (1.0, None)


class Clock:
    """The wall clock the state table's leases use, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


class FailingStateWrites:
    """moto's DynamoDB client, except that while `failing`, writes of machine records fail the way
    DynamoDB answers when it is down (500 InternalServerError, after botocore's own retries)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failing = False
        self.failed = 0

    def put_item(self, **kwargs: Any) -> Any:
        if self.failing and kwargs["Item"]["sk"] == {"S": "state"}:
            self.failed += 1
            error = {"Code": "InternalServerError", "Message": "Internal server error"}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}}, "PutItem")
        return self.inner.put_item(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def notebook(aws: Any, slack: Any) -> str:
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20, slack_channel="C0MLTEAM")})
    ssm = aws_client("ssm")
    settings = json.loads(ssm.get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    settings["admins"] = ["U0ADMIN"]
    ssm.put_parameter(Name="/idle-reaper/settings", Value=json.dumps(settings), Type="String", Overwrite=True)
    instance_id = local.launch("notebook", "m5.large", team="ml", launch_time=at(8), owner="U0BOB")
    local.write_metrics(instance_id, idle, at(11), at(23))
    return instance_id


def aws_client(service: str) -> Any:
    return aws.client(service)


def adapters(store: aws.DynamoStateStore, notifier: Any = None) -> Adapters:
    return Adapters(
        policies=aws.PolicyStore(aws_client("ssm"), aws.ssm_prefix()),
        fleet=aws.Fleet(aws_client("ec2"), aws_client("autoscaling")),
        metrics=aws.MetricsReader(aws_client("cloudwatch")),
        store=store,
        notifier=notifier or SlackNotifier(make_client("xoxb-test", 5), store),
    )


def dynamo_store(clock: Clock, dynamodb: Any = None) -> aws.DynamoStateStore:
    return aws.DynamoStateStore(dynamodb or aws_client("dynamodb"), aws.table_name(), clock=clock)


def warnings_posted(slack: Any) -> list[str]:
    return [c.params["channel"] for c in slack.calls_to("chat.postMessage") if "Idle machine" in c.params["text"]]


def admin_alerts(slack: Any) -> list[str]:
    return [c.params["text"] for c in slack.calls_to("chat.postMessage") if "admin alert" in c.params["text"]]


def stopped_updates(slack: Any) -> list[str]:
    return [c.params["channel"] for c in slack.calls_to("chat.update") if c.params["text"].startswith("Stopped")]


def only(report: SweepReport) -> Decision:
    (d,) = report.decisions
    return d


def hold_until_reaped(sweep: Callable[[datetime], Decision], since: datetime) -> Decision:
    """Sweep every 55 min (often enough to keep watching a 60-min window): nothing is stopped before
    undelivered_warning_max_minutes, then it is."""
    now = since
    while now < T0 + HOLD:
        d = sweep(now)
        assert d.action.value == "none" and d.state is State.WARNED, (now, d.reason)
        now += timedelta(minutes=55)
    d = sweep(now)
    assert d.action.value == "stop", d.reason
    return d


# ---------------------------------------------------------------------------------------------
# Two overlapping sweeps (the full grid runs against the in-memory twin in tests/unit)


def both(clock: Clock, now: datetime) -> Callable[[str], Callable[[Gate], SweepReport]]:
    def sweep(name: str) -> Callable[[Gate], SweepReport]:
        return lambda gate: run_sweep(stepped(adapters(dynamo_store(clock)), gate), now=now, sweep_id=name)

    return sweep


@pytest.mark.parametrize(("pause_a", "pause_b"), [("claimed", None), ("posted", "loaded"), ("recording", None)])
def test_overlapping_sweeps_post_one_warning(notebook: str, slack: Any, pause_a: str, pause_b: str | None) -> None:
    sweep = both(Clock(), T0)
    result = interleave(sweep("A"), sweep("B"), pause_a=pause_a, pause_b=pause_b)
    assert result.gate_a.reached.is_set()
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"], "one warning: the owner's DM and the channel"
    record = dynamo_store(Clock()).load([notebook])[notebook]
    assert record.warning_delivered_at == T0 and len(record.messages) == 2
    assert dynamo_store(Clock()).claim_of(notebook) is None
    key = {"pk": {"S": f"machine#{notebook}"}, "sk": {"S": "state"}}
    item = aws_client("dynamodb").get_item(TableName=aws.table_name(), Key=key)["Item"]
    assert "claim_owner" not in item and "claim_until" not in item, "the claim was released"
    ttl = datetime.fromtimestamp(int(item["expires_at"]["N"]), tz=UTC) - datetime.now(UTC)
    assert timedelta(days=29, hours=23) < ttl <= aws.RECORD_TTL, "the record expires 30 days after its last write"


@pytest.mark.parametrize(("pause_a", "pause_b"), [("acted", None), ("claimed", "listed"), ("posted", "claimed")])
def test_overlapping_sweeps_stop_once(notebook: str, slack: Any, pause_a: str, pause_b: str | None) -> None:
    clock = Clock()
    run_sweep(adapters(dynamo_store(clock)), now=T0)
    sweep = both(clock, T0 + timedelta(minutes=25))
    result = interleave(sweep("A"), sweep("B"), pause_a=pause_a, pause_b=pause_b)

    assert result.gate_a.passed.count("acted") + result.gate_b.passed.count("acted") == 1, "one StopInstances"
    assert local.instance_states([notebook]) == {notebook: "stopped"}
    assert sorted(stopped_updates(slack)) == ["C0MLTEAM", "D0BOB"], "each copy of the message says Stopped once"
    assert dynamo_store(clock).load([notebook])[notebook].state is State.REAPED
    assert dynamo_store(clock).claim_of(notebook) is None


# ---------------------------------------------------------------------------------------------
# The state table fails right after a warning was posted


class TableDownAfterPosting(SlackNotifier):
    """Slack works; DynamoDB fails on every write right after the warning was posted."""

    def __init__(self, store: aws.DynamoStateStore, table: FailingStateWrites) -> None:
        super().__init__(make_client("xoxb-test", 5), store)
        self.table = table

    def warn(self, decision: Decision) -> Delivery | None:
        delivery = super().warn(decision)
        self.table.failing = True
        return delivery


def test_a_warning_whose_outcome_was_lost_is_found_delivered_and_stopped_on_time_with_its_notice(
    notebook: str, slack: Any
) -> None:
    clock = Clock()
    table = FailingStateWrites(aws_client("dynamodb"))
    failing = dynamo_store(clock, table)
    first = only(run_sweep(adapters(failing, TableDownAfterPosting(failing, table)), now=T0))
    assert table.failed >= 1 and first.error and "outcome not recorded" in first.error
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"]
    table.failing = False  # DynamoDB is back

    store = dynamo_store(clock)
    stored = store.load([notebook])[notebook]
    assert stored.warning_post_started_at == T0 and stored.warning_delivered_at is None, "the intent was recorded"
    assert stored.warning_ref, "with the buttons' reference: they work the moment the message exists"
    posted = [c for c in slack.calls_to("chat.postMessage") if "Idle machine" in c.params["text"]]
    assert all(c.params["metadata"]["event_payload"]["refs"] == [stored.warning_ref] for c in posted)

    blocked = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=5)))
    assert blocked.error and "another sweep is handling it" in blocked.error, "the claim still holds"

    clock.now += aws.SWEEP_LEASE  # the first sweep's claim lapses
    found = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=10)))
    assert "the warning was found delivered at 14:00 UTC" in found.reason and found.error is None
    resolved = store.load([notebook])[notebook]
    assert resolved.warning_delivered_at == T0 and resolved.warning_post_started_at is None
    assert sorted(m.split("|")[0] for m in resolved.messages) == ["C0MLTEAM", "D0BOB"]
    assert len(slack.calls_to("conversations.history")) >= 1

    stop = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=20)))  # warn_minutes after delivery
    assert stop.action.value == "stop" and "never delivered" not in stop.reason
    assert local.instance_states([notebook]) == {notebook: "stopped"}
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"], "never posted a second time"
    assert sorted(stopped_updates(slack)) == ["C0MLTEAM", "D0BOB"], "the stop is told where the warning was"
    assert admin_alerts(slack) == []


class DiesAfterClaiming(SlackNotifier):
    """The sweep claims the machine (the intent to post is written) and dies before posting anything."""

    def warn(self, decision: Decision) -> Delivery | None:
        raise SystemExit("the Lambda timed out")


def test_a_warning_claimed_but_never_posted_is_posted_by_the_next_sweep_not_assumed_delivered(
    notebook: str, slack: Any
) -> None:
    clock = Clock()
    store = dynamo_store(clock)
    with pytest.raises(SystemExit):
        run_sweep(adapters(store, DiesAfterClaiming(make_client("xoxb-test", 5), store)), now=T0)
    assert warnings_posted(slack) == []
    assert store.load([notebook])[notebook].warning_post_started_at == T0
    clock.now += aws.SWEEP_LEASE
    later = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=5)))
    assert later.error is None and "delivery unknown" not in later.reason
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"], "Slack showed no such post: posted now"
    record = store.load([notebook])[notebook]
    assert record.warning_delivered_at == T0 + timedelta(minutes=5)
    # The owner gets warn_minutes from this delivery, not from the claim.
    assert only(run_sweep(adapters(store), now=T0 + timedelta(minutes=20))).action.value == "none"
    assert only(run_sweep(adapters(store), now=T0 + timedelta(minutes=25))).action.value == "stop"


def test_a_lost_outcome_that_slack_cannot_be_asked_about_holds_the_stop_and_is_never_posted_twice(
    notebook: str, slack: Any
) -> None:
    clock = Clock()
    table = FailingStateWrites(aws_client("dynamodb"))
    failing = dynamo_store(clock, table)
    run_sweep(adapters(failing, TableDownAfterPosting(failing, table)), now=T0)
    table.failing = False
    store = dynamo_store(clock)
    clock.now += aws.SWEEP_LEASE
    slack.errors["conversations.history"] = "internal_error"
    later = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=25)))
    assert later.action.value == "none" and "delivery unknown" in later.reason and "no stop until" in later.reason
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"], "not posted again while it cannot be told"
    assert local.instance_states([notebook]) == {notebook: "running"}
    slack.errors.clear()
    run_sweep(adapters(store), now=T0 + timedelta(minutes=30))
    assert store.load([notebook])[notebook].warning_delivered_at == T0, "resolved once Slack answers"
    assert sorted(warnings_posted(slack)) == ["C0MLTEAM", "D0BOB"]


# ---------------------------------------------------------------------------------------------
# A warning that can never be delivered


class ChannelNotFound(SlackNotifier):
    """Slack answers channel_not_found to every warning; admin alerts go through."""

    def __init__(self, store: aws.DynamoStateStore) -> None:
        super().__init__(make_client("xoxb-test", 5), store)
        self.attempts = 0

    def warn(self, decision: Decision) -> Delivery | None:
        self.attempts += 1
        raise PermanentDeliveryFailure("channel_not_found: the team's slack_channel C0MLTEAM does not exist")


def test_an_undeliverable_warning_is_reported_once_shown_in_status_and_not_retried(
    notebook: str, slack: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    store = dynamo_store(Clock())
    notifier = ChannelNotFound(store)
    first = only(run_sweep(adapters(store, notifier), now=T0))
    assert first.action.value == "warn" and "channel_not_found" in first.reason
    for minutes in (5, 10, 25, 60):
        d = only(run_sweep(adapters(store, notifier), now=T0 + timedelta(minutes=minutes)))
        assert d.action.value == "none" and "not sent again: channel_not_found" in d.reason

    assert notifier.attempts == 1, "a permanent failure is not retried every sweep"
    (alert,) = admin_alerts(slack)
    assert notebook in alert and "channel_not_found" in alert and "idle-reaper status" in alert
    assert local.instance_states([notebook]) == {notebook: "running"}, "an undelivered warning holds the stop"

    assert cli.main(["status", "--json", "--now", (T0 + timedelta(minutes=60)).isoformat()]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["state"] == "warned" and row["delivery_error"].startswith("channel_not_found")
    assert cli.main(["status", "--now", (T0 + timedelta(minutes=60)).isoformat()]) == 0
    assert "WARNING UNDELIVERABLE: channel_not_found" in capsys.readouterr().out

    reaped = hold_until_reaped(lambda now: only(run_sweep(adapters(store, notifier), now=now)), T0 + timedelta(hours=1))
    assert local.instance_states([notebook]) == {notebook: "stopped"} and "never delivered" in reaped.reason
    assert notifier.attempts == 1 and len(admin_alerts(slack)) == 1


# ---------------------------------------------------------------------------------------------
# What the alarms see


@pytest.mark.parametrize("broken", [False, True])
def test_every_sweep_emits_teams_in_safe_mode(aws: Any, broken: bool, capsys: pytest.CaptureFixture[str]) -> None:
    from idle_reaper.handlers import sweep as sweep_handler
    from idle_reaper_tools.fake_slack import LambdaContextStub

    teams = {"ml": local.team_policy_json(idle_minutes=60)}
    if broken:
        teams["vision"] = local.team_policy_json(idle_minutes=5)  # below the minimum: invalid, safe mode
    local.init_account(teams=teams)
    now = datetime.now(UTC)
    box = local.launch("nb", "m5.large", team="vision", launch_time=now - timedelta(hours=5))
    local.write_metrics(box, idle, now - timedelta(hours=3), now)

    sweep_handler.handler({}, LambdaContextStub())
    out = capsys.readouterr().out
    (blob,) = [json.loads(line) for line in out.splitlines() if '"TeamsInSafeMode"' in line]
    emitted = {k: v[0] if isinstance(v, list) else v for k, v in blob.items()}  # Powertools may list a value
    assert emitted["TeamsInSafeMode"] == (1 if broken else 0)
    # No Slack configured: the warning is only logged, so it counts as undelivered (its stop is held).
    assert emitted["WarningsUndelivered"] == (0 if broken else 1)


# ---------------------------------------------------------------------------------------------
# The in-memory twin and DynamoDB share the claim semantics


@pytest.mark.parametrize("kind", ["memory", "dynamo"])
def test_both_state_stores_share_the_claim_semantics(aws: Any, kind: str) -> None:
    from idle_reaper import aws as adapters_module
    from idle_reaper.core import MachineRecord

    clock = Clock()
    if kind == "dynamo":
        adapters_module.create_table(aws_client("dynamodb"), adapters_module.table_name())
        store: Any = dynamo_store(clock)
    else:
        store = adapters_module.InMemoryStateStore(clock=clock)
    v1 = MachineRecord("i-1", "ml", State.WARNED, version=1)

    def at(version: int) -> MachineRecord:
        return MachineRecord("i-1", "ml", State.WARNED, version=version)

    assert store.save(v1, "A", hold=True) and store.claim_of("i-1")[0] == "A"
    assert not store.save(at(2), "B"), "another sweep cannot write while A holds the claim"
    assert not store.save(at(2), "B", hold=True), "... nor claim it"
    assert store.save(at(2), "A", hold=True), "the holder may write and keep holding"
    assert not store.save(at(2), "A"), "the version still decides"
    clock.now += adapters_module.SWEEP_LEASE
    assert store.claim_of("i-1") is None, "a claim lapses after its lease"
    assert store.save(at(3), "B", hold=True) and store.claim_of("i-1")[0] == "B", "a lapsed claim is taken over"
    assert not store.save(at(4), "A"), "the old holder has lost it"
    assert store.save(at(4), "B") and store.claim_of("i-1") is None, "writing without hold releases it"
    assert store.save(at(5), "C", hold=True)
    # A person's answer (no holder) never lands while a sweep holds the machine: the sweep may be stopping
    # it right now, and a "keep" recorded in that moment would be a promise the machine breaks.
    assert not store.save(at(6)), "a person's answer waits for a live claim"
    assert store.claim_of("i-1")[0] == "C"
    assert store.save(at(6), "C"), "the holder records its outcome and releases the claim"
    assert store.save(at(7)), "then the person's answer lands, decided by the version"
    assert store.load(["i-1"])["i-1"] == at(7)
