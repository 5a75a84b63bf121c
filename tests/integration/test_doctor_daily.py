"""The doctor inside the deploy: the sweep's daily subset tells the admins once per new failure (and again when a
failure that cleared comes back), a faulty check is unknown and never takes the sweep down, and
`/idle-reaper doctor` answers admins in Slack with the failing lines. moto in server mode, the Slack fake."""

from __future__ import annotations

import itertools
import json
import threading
import urllib.parse
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from slack_sdk import WebClient
from test_doctor import ADMIN, ADMIN_CHANNEL, MEMBER, OWNER, TEAM_CHANNEL, healthy, launch_and_publish, snapshot

from idle_reaper import aws
from idle_reaper.aws.deploy import DEPLOY_CHECKS
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.slack import SlackNotifier
from idle_reaper.sweep import Adapters, run_sweep
from idle_reaper.sweep.adapters import SweepRead
from idle_reaper.sweep.doctor_daily import DailyDoctor, list_afresh, run_daily_doctor
from idle_reaper_tools.fake_slack import BOT_USER, LambdaContextStub, signed_request
from testkit.deploy_answers import STACK, DeployAnswers

pytestmark = pytest.mark.integration
__all__ = ["healthy"]  # the fixture, shared with test_doctor.py

_names = itertools.count()


def daily_alerts(slack: Any) -> list[str]:
    """The daily check's admin alerts, one per destination (the admin's DM and the admin channel)."""
    return [c.params["text"] for c in slack.calls_to("chat.postMessage") if "daily check" in c.params["text"]]


def bot_leaves(slack: Any) -> None:
    """A private team channel the bot is removed from (a public one it would join again by itself)."""
    slack.private_channels.add(TEAM_CHANNEL)
    slack.channels[TEAM_CHANNEL] = [MEMBER]


def daily(adapters: Adapters, now: datetime, read: SweepRead | None = None) -> DailyDoctor:
    done = run_daily_doctor(adapters, now, read, lambda: 240.0)
    assert done is not None
    return done


def statuses(done: DailyDoctor) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in done.findings:
        out.setdefault(f.check, set()).add(f.status)
    return out


def test_a_new_failure_is_told_once_not_the_next_day_and_again_when_it_comes_back(
    healthy: dict[str, str], slack: Any
) -> None:
    adapters = Adapters.from_environment()
    day = datetime.now(UTC)
    first = daily(adapters, day)
    assert statuses(first) == {c: {"ok"} for c in ("policy.teams", "slack.channels", "people.owners", "signals.gpu")}
    assert not first.told and not daily_alerts(slack)
    assert run_daily_doctor(adapters, day + timedelta(hours=1), None, lambda: 240.0) is None, "once a day"

    bot_leaves(slack)  # the bot is removed from the (private) team channel
    broken = daily(adapters, day + timedelta(days=1))
    (told,) = broken.told
    assert told.check == "slack.channels" and told.subjects == (TEAM_CHANNEL,)
    alerts = daily_alerts(slack)
    assert len(alerts) == 2 and all(TEAM_CHANNEL in text and "/invite @idle-reaper" in text for text in alerts)
    assert sorted(c.params["channel"] for c in slack.calls_to("chat.postMessage")) == sorted([ADMIN_CHANNEL, "D0ADMIN"])

    still = daily(adapters, day + timedelta(days=2))
    assert statuses(still)["slack.channels"] == {"fail"} and not still.told
    assert len(daily_alerts(slack)) == 2, "the same failure is not told every day"

    slack.channels[TEAM_CHANNEL] = [MEMBER, BOT_USER]  # fixed: the bot is invited again
    fixed = daily(adapters, day + timedelta(days=3))
    assert statuses(fixed)["slack.channels"] == {"ok"} and not fixed.told
    bot_leaves(slack)  # the bot is removed from the (private) team channel
    again = daily(adapters, day + timedelta(days=4))
    assert [f.check for f in again.told] == ["slack.channels"]
    assert len(daily_alerts(slack)) == 4


def test_the_daily_check_reuses_the_sweeps_reads(healthy: dict[str, str], slack: Any) -> None:
    """A GPU machine without GPU metrics is found in what the sweep read: no GetMetricData of its own; emails
    the sweep resolved come from its cache, so only the member ids are asked."""
    nogpu = launch_and_publish("nogpu", "p3.2xlarge")
    adapters = Adapters.from_environment()
    now = datetime.now(UTC)
    adapters.store.put_lookup("owner#bob@example.com", OWNER, now + timedelta(days=7))  # as the sweep caches it
    report = run_sweep(adapters, now=now)
    slack.calls.clear()
    done = daily(adapters, now, report.read)
    assert done.metric_calls == 0
    (told,) = done.told
    assert told.check == "signals.gpu" and told.subjects == (nogpu,)
    assert done.cache_reads == 1  # bob@example.com: from the cache, no users.lookupByEmail
    asked = [c.method for c in slack.calls if c.method != "chat.postMessage" and c.method != "conversations.open"]
    assert sorted(asked) == ["auth.test", "conversations.info", "conversations.info", "users.info"]
    assert done.slack_calls == 4


def test_what_the_daily_check_resolves_goes_to_the_sweeps_owner_cache(healthy: dict[str, str], slack: Any) -> None:
    """bob@example.com is not cached: the daily check looks him up once and caches him as the sweep does, so
    the sweep's own resolution (and tomorrow's check) asks Slack nothing."""
    adapters = Adapters.from_environment()
    now = datetime.now(UTC)
    assert adapters.store.get_lookup("owner#bob@example.com", now) is None
    daily(adapters, now)
    assert [c.params["email"] for c in slack.calls_to("users.lookupByEmail")] == ["bob@example.com"]
    assert adapters.store.get_lookup("owner#bob@example.com", now) == OWNER
    slack.calls.clear()
    notifier = SlackNotifier(WebClient(token="xoxb-test", base_url=slack.url), adapters.store, clock=lambda: now)
    assert notifier.resolve_owner("bob@example.com") == OWNER and not slack.calls_to("users.lookupByEmail")
    daily(adapters, now + timedelta(days=1))
    assert not slack.calls_to("users.lookupByEmail")


def test_a_machine_the_sweep_did_not_read_is_read_for_its_gpu_alone(healthy: dict[str, str], slack: Any) -> None:
    nogpu = launch_and_publish("nogpu", "p3.2xlarge")
    adapters = Adapters.from_environment()
    read = list_afresh(adapters)
    done = daily(adapters, datetime.now(UTC), SweepRead(read.settings, read.refs, read.machines, {}))
    assert done.metric_calls == 1  # both GPU types' CPU and GPU in one GetMetricData call
    assert [f.subjects for f in done.told] == [(nogpu,)]


def test_slack_down_is_unknown_nothing_is_told_and_the_sweep_finishes(
    healthy: dict[str, str], slack: Any, caplog: Any
) -> None:
    slack.down = True
    result = sweep_handler.handler({}, LambdaContextStub())
    assert result == {"machines": 4, "errors": 0, "dry_run": False}
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    assert set(store.load(list(healthy.values()))) == set(healthy.values()), "every machine swept"
    logged = caplog.text
    assert "daily doctor: UNKNOWN slack.channels: could not check: unreachable: HTTP 503" in logged
    assert "daily doctor: UNKNOWN people.owners: could not check" in logged
    assert not daily_alerts(slack)
    assert store.get_lookup("doctor#failing", datetime.now(UTC)) in (None, "{}")


def test_a_check_that_raises_is_unknown_and_the_rest_still_run(
    healthy: dict[str, str], slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters = Adapters.from_environment()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CloudWatch exploded")

    monkeypatch.setattr(adapters.metrics, "fetch", broken)
    bot_leaves(slack)  # the bot is removed from the (private) team channel
    done = daily(adapters, datetime.now(UTC))
    assert statuses(done)["signals.gpu"] == {"unknown"}
    assert [f.check for f in done.told] == ["slack.channels"]


def test_past_its_slack_budget_nothing_more_is_asked_and_it_says_so(
    healthy: dict[str, str], slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("idle_reaper.sweep.doctor_daily.DAILY_SLACK_SECONDS", 0.0)
    bot_leaves(slack)  # the bot is removed from the (private) team channel
    done = daily(Adapters.from_environment(), datetime.now(UTC))
    assert not slack.calls and done.slack_calls == 0
    got = statuses(done)
    assert got["slack.channels"] == got["people.owners"] == {"unknown"}
    assert got["signals.gpu"] == got["policy.teams"] == {"ok"}
    assert "out of time" in next(f.message for f in done.findings if f.check == "slack.channels")


def test_a_dry_run_tells_nobody(healthy: dict[str, str], slack: Any) -> None:
    settings = json.loads(aws.client("ssm").get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    dry = json.dumps({**settings, "dry_run": True})
    aws.client("ssm").put_parameter(Name="/idle-reaper/settings", Value=dry, Type="String", Overwrite=True)
    bot_leaves(slack)  # the bot is removed from the (private) team channel
    done = daily(Adapters.from_environment(), datetime.now(UTC))
    assert statuses(done)["slack.channels"] == {"fail"} and not done.told and not daily_alerts(slack)


def test_too_little_time_left_leaves_it_to_the_next_sweep(healthy: dict[str, str], slack: Any) -> None:
    adapters = Adapters.from_environment()
    now = datetime.now(UTC)
    assert run_daily_doctor(adapters, now, None, lambda: 30.0) is None
    assert not slack.calls
    assert run_daily_doctor(adapters, now, None, lambda: 240.0) is not None, "not claimed by the short one"


# ---------------------------------------------------------------------------------------------
# /idle-reaper doctor


def doctor_command(slack: Any, user: str) -> str:
    name = f"doctor-{next(_names)}"
    form = {"command": "/idle-reaper", "text": "doctor", "user_id": user, "response_url": slack.response_url(name)}
    event = signed_request("/slack/commands", urllib.parse.urlencode(form), "local-signing-secret")
    response = slack_handler.handler(event, LambdaContextStub())
    assert response["statusCode"] == 200 and response["body"] == ""  # acknowledged at once, answered later
    (reply,) = slack.replies_to(name)
    assert reply["response_type"] == "ephemeral"
    return str(reply["text"])


def test_the_slack_command_answers_an_admin_with_the_failing_lines(healthy: dict[str, str], slack: Any) -> None:
    ok = doctor_command(slack, ADMIN)
    assert ok.startswith("idle-reaper doctor (us-east-1): all ") and ok.endswith(" checks ok.")
    bot_leaves(slack)  # the bot is removed from the (private) team channel
    slack.users_by_email.clear()
    text = doctor_command(slack, ADMIN)
    lines = text.splitlines()
    assert lines[0].startswith("idle-reaper doctor (us-east-1): ") and "2 fail" in lines[0]
    failing = [line for line in lines if line.startswith("•")]
    assert len(failing) == 2 and all("*FAIL*" in line for line in failing)
    assert "`slack.channels`" in text and TEAM_CHANNEL in text
    assert "invite the bot to the private channel: /invite @idle-reaper" in text
    assert "`people.owners`" in text and "bob@example.com" in text
    assert "*OK*" not in text


def test_the_slack_command_refuses_who_is_not_an_admin(healthy: dict[str, str], slack: Any) -> None:
    refusal = "Only idle-reaper admins (the settings' `admins`) can run `/idle-reaper doctor`."
    for user in (MEMBER, "U0BOB"):
        assert doctor_command(slack, user) == refusal
    assert not slack.calls_to("auth.test") and not slack.calls_to("conversations.info")


def test_the_slack_command_runs_the_deploy_checks_and_a_broken_schedule_is_a_failing_line(
    healthy: dict[str, str], deployed: DeployAnswers, slack: Any
) -> None:
    ok = doctor_command(slack, ADMIN)
    assert ok.endswith(" checks ok.")
    checks = int(ok.split("all ")[1].split(" ")[0])
    assert checks >= 6 + 12, "the deploy checks are among them"
    stack = aws.client("cloudformation").describe_stacks(StackName=STACK)["Stacks"][0]
    rule = next(o["OutputValue"] for o in stack["Outputs"] if o["OutputKey"] == "SweepScheduleName")
    aws.client("events").disable_rule(Name=rule)

    text = doctor_command(slack, ADMIN)

    assert "1 fail" in text.splitlines()[0]
    (failing,) = [line for line in text.splitlines() if line.startswith("•")]
    assert failing.startswith("• *FAIL* `deploy.schedule`: ") and rule in failing and "DISABLED" in failing
    assert f"fix: aws events enable-rule --name {rule} --region us-east-1" in text
    assert deployed.count("DescribeRule") == 2 and deployed.count("GetAccountSettings") == 2


def test_a_deploy_check_that_cannot_finish_in_time_is_unknown_and_the_answer_still_comes(
    healthy: dict[str, str], deployed: DeployAnswers, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, finished = threading.Event(), threading.Event()

    def hangs(*_: Any) -> str:
        release.wait(60.0)  # hangs until the answer is in (not a time: a loaded machine must not matter)
        finished.set()
        return "ENABLED"

    monkeypatch.setattr("idle_reaper.aws.deploy.rule_state", hangs)
    monkeypatch.setattr("idle_reaper.slack.routing.DEPLOY_STAGE_SECONDS", 1.0)
    try:
        text = doctor_command(slack, ADMIN)
        assert not finished.is_set(), "answered without waiting for the hanging call"
    finally:
        release.set()
    unknown = [line for line in text.splitlines() if line.startswith("• *UNKNOWN*")]
    assert {line.split("`")[1] for line in unknown} == set(DEPLOY_CHECKS)
    assert all("could not check: out of time" in line for line in unknown)
    assert "*OK*" not in text and "FAIL" not in text


def test_the_slack_command_changes_nothing(healthy: dict[str, str], slack: Any) -> None:
    """Not even the owner cache: an owner no sweep has resolved is looked up, and not written down."""
    slack.users_by_email["carol@example.com"] = "U0CAROL"
    aws.client("ec2").create_tags(Resources=[healthy["mail"]], Tags=[{"Key": "Owner", "Value": "carol@example.com"}])
    aws.client("ssm").put_parameter(Name="/idle-reaper/teams/cv", Value="{", Type="String", Overwrite=True)
    before = snapshot(slack)
    text = doctor_command(slack, ADMIN)
    assert "`policy.teams`" in text and "cv" in text
    assert [c.params["email"] for c in slack.calls_to("users.lookupByEmail")] == ["carol@example.com"]
    assert snapshot(slack) == before
    assert not slack.calls_to("chat.postMessage") and not slack.calls_to("conversations.open")
