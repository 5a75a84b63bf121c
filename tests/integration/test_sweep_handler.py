"""The scheduled Lambda handler: one sweep, EMF metrics per team, a loud failure when it cannot run."""

from __future__ import annotations

import pytest

from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper_tools import local
from idle_reaper_tools.fake_slack import LambdaContextStub
from testkit.emf import emf_blobs

pytestmark = pytest.mark.integration


def test_handler_sweeps_and_emits_metrics_per_team(aws, slack, capsys):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    # Real time here: the handler uses the wall clock. Metrics cover the last few hours.
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    busy = local.launch("train", "g5.xlarge", team="ml", launch_time=now - timedelta(hours=5))
    quiet = local.launch("nb", "m5.large", team="vision", launch_time=now - timedelta(hours=5))
    local.write_metrics(busy, lambda t: (2.0, 95.0), now - timedelta(hours=3), now)
    local.write_metrics(quiet, lambda t: (1.0, None), now - timedelta(hours=3), now)
    result = sweep_handler.handler({}, LambdaContextStub())
    assert result == {"machines": 2, "errors": 0, "dry_run": False}
    blobs = emf_blobs(capsys.readouterr().out)
    by_team = {b["team"]: b for b in blobs if "team" in b}
    assert set(by_team) == {"ml", "vision"}
    assert by_team["ml"]["MachinesScanned"] == 1 and by_team["ml"]["WarningsSent"] == 0
    assert by_team["vision"]["WarningsSent"] == 1 and by_team["vision"]["MachinesIdle"] == 1
    names = {m["Name"] for b in blobs for d in b["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]}
    assert {"SweepDurationMs", "SweepErrors", "Snoozes", "EstimatedHourlySavings"} <= names


def test_handler_fails_loudly_when_settings_are_invalid(aws, capsys):
    local.init_account()
    local.aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value="{not json", Type="String", Overwrite=True
    )
    with pytest.raises(Exception, match="settings are invalid"):
        sweep_handler.handler({}, LambdaContextStub())
    blobs = emf_blobs(capsys.readouterr().out)
    assert any(b.get("SweepErrors") == 1 for b in blobs)


def test_a_team_tagged_in_any_language_is_a_dimension_cloudwatch_keeps(aws, slack, capsys):
    """Issue 43 (6): the `team` dimension is the raw tag value, and CloudWatch keeps only ASCII dimension values
    (emf_blobs applies its rules: on the code before, this document failed them). A team tagged `données` is
    reported as `donn%C3%A9es`, one to one, apart from a team tagged `donnees`."""
    from datetime import UTC, datetime, timedelta

    local.init_account()
    now = datetime.now(UTC)
    for team in ("données", "donnees"):
        box = local.launch(f"nb-{team}", "m5.large", team=team, launch_time=now - timedelta(hours=5))
        local.write_metrics(box, lambda t: (1.0, None), now - timedelta(hours=3), now)
    sweep_handler.handler({}, LambdaContextStub())
    teams = {b["team"] for b in emf_blobs(capsys.readouterr().out) if "team" in b}
    assert teams == {"donn%C3%A9es", "donnees"}


def test_a_failing_alarm_relay_is_told_to_the_admins_by_the_sweep(aws, slack, monkeypatch):
    """Issue 43 (11): the alarm on the Slack alarm relay's own errors goes to a topic of its own, which has
    nobody on it unless an alarm e-mail was deployed: a relay that cannot post was told to nobody. Each sweep
    reads that alarm and, while it is in ALARM, tells the admins itself, once a day."""
    from idle_reaper.aws.deploy import RELAY_ALARM_ENV
    from idle_reaper.policy import Settings
    from idle_reaper_tools.fake_slack import BOT_USER

    local.init_account(Settings.model_validate({"admins": ["U0ADMIN"], "admin_channel": "C0ADMINS"}))
    slack.channels.update({"C0ADMINS": [BOT_USER, "U0ADMIN"]})
    cloudwatch, alarm = local.aws.client("cloudwatch"), "IdleReaper-AlarmRelayErrorsAlarm-1A2B3C"
    cloudwatch.put_metric_alarm(
        AlarmName=alarm,
        Namespace="AWS/Lambda",
        MetricName="Errors",
        Statistic="Sum",
        Period=300,
        EvaluationPeriods=1,
        Threshold=1,
        ComparisonOperator="GreaterThanOrEqualToThreshold",
    )
    monkeypatch.setenv(RELAY_ALARM_ENV, alarm)

    def told() -> list[str]:
        texts = [c.params.get("text", "") for c in slack.calls_to("chat.postMessage")]
        return [t for t in texts if "alarm relay is failing" in t]

    sweep_handler.handler({}, LambdaContextStub())
    assert told() == [], "an alarm not in ALARM is not told"
    cloudwatch.set_alarm_state(AlarmName=alarm, StateValue="ALARM", StateReason="Threshold Crossed: 3 errors")
    sweep_handler.handler({}, LambdaContextStub())
    assert len(told()) == 2 and alarm in told()[0], "the admin and the admin channel"
    sweep_handler.handler({}, LambdaContextStub())
    assert len(told()) == 2, "once a day"
