"""The alarm relay: CloudWatch alarm notifications (as SNS delivers them) reach the admins in Slack,
against moto (settings in SSM) and the local Slack fake."""

from __future__ import annotations

import json
from typing import Any

import pytest

from idle_reaper import aws
from idle_reaper.handlers import alarms
from idle_reaper.policy import Settings
from idle_reaper.slack import SlackUndelivered
from idle_reaper_tools.fake_slack import LambdaContextStub

pytestmark = pytest.mark.integration

# The Message of a real CloudWatch alarm notification (trimmed of the Trigger block, which is ignored).
ALARM = {
    "AlarmName": "IdleReaper-eu-west-1-MonitoringSweepErrorsAlarm-1A2B3C4D5E6F",
    "AlarmDescription": "A sweep failed or reported errors (see the sweep function's logs).",
    "AWSAccountId": "123456789012",
    "AlarmConfigurationUpdatedTimestamp": "2026-11-20T09:12:44.871+0000",
    "NewStateValue": "ALARM",
    "NewStateReason": "Threshold Crossed: 1 out of the last 1 datapoints [2.0 (23/11/26 10:05:00)] was greater "
    "than or equal to the threshold (1.0) (minimum 1 datapoint for OK -> ALARM transition).",
    "StateChangeTime": "2026-11-23T10:10:31.462+0000",
    "Region": "EU (Ireland)",
    "AlarmArn": "arn:aws:cloudwatch:eu-west-1:123456789012:alarm:IdleReaper-eu-west-1-MonitoringSweepErrorsAlarm"
    "-1A2B3C4D5E6F",
    "OldStateValue": "OK",
    "OKActions": [],
    "AlarmActions": ["arn:aws:sns:eu-west-1:123456789012:IdleReaper-eu-west-1-MonitoringAlarms"],
    "InsufficientDataActions": [],
}


def sns_event(*messages: str, subject: str | None = None) -> dict[str, Any]:
    return {
        "Records": [
            {
                "EventSource": "aws:sns",
                "EventVersion": "1.0",
                "EventSubscriptionArn": "arn:aws:sns:eu-west-1:123456789012:IdleReaper-alarms:0b1c2d3e",
                "Sns": {
                    "Type": "Notification",
                    "MessageId": f"95df01b4-ee98-5cb9-9903-4c221d41eb5{i}",
                    "TopicArn": "arn:aws:sns:eu-west-1:123456789012:IdleReaper-eu-west-1-MonitoringAlarms",
                    "Subject": subject,
                    "Message": message,
                    "Timestamp": "2026-11-23T10:10:31.512Z",
                    "SignatureVersion": "1",
                    "MessageAttributes": {},
                },
            }
            for i, message in enumerate(messages)
        ]
    }


def put_settings(**fields: Any) -> None:
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings",
        Value=Settings.model_validate(fields).model_dump_json(),
        Type="String",
        Overwrite=True,
    )


def alerts(slack: Any) -> list[tuple[str, str]]:
    return [(c.params["channel"], c.params["text"]) for c in slack.calls_to("chat.postMessage")]


def test_an_alarm_reaches_every_admin_and_the_admin_channel(aws: object, slack: Any) -> None:
    put_settings(admins=["U0ADMIN"], admin_channel="C0ADMINS")
    result = alarms.handler(sns_event(json.dumps(ALARM), subject='ALARM: "SweepErrors" in EU (Ireland)'), CTX)
    assert result == {"relayed": 1}
    sent = alerts(slack)
    assert sorted(channel for channel, _ in sent) == ["C0ADMINS", "D0ADMIN"]
    for _, text in sent:
        assert ALARM["AlarmName"] in text and "is ALARM (was OK)" in text
        assert "in eu-west-1" in text and "Threshold Crossed" in text


def test_a_message_that_is_not_an_alarm_is_relayed_as_it_came(aws: object, slack: Any) -> None:
    put_settings(admin_channel="C0ADMINS")
    gpu = "GPU agent rollout failed on i-0abc123def4567890 in eu-west-1 (Failed: 1 out of 2 plugins processed)"
    alarms.handler(sns_event(gpu, json.dumps(ALARM)), CTX)
    texts = [text for _, text in alerts(slack)]
    assert len(texts) == 2 and gpu in texts[0] and ALARM["AlarmName"] in texts[1]


def test_it_fails_loudly_when_slack_is_down(aws: object, slack: Any) -> None:
    put_settings(admins=["U0ADMIN"])
    slack.down = True
    with pytest.raises(SlackUndelivered):
        alarms.handler(sns_event(json.dumps(ALARM)), CTX)


def test_with_no_admin_configured_it_logs_the_alarm_and_returns_without_failing(
    aws: object, slack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The settings are seeded without admins. Raising here would trip the relay's errors alarm on every
    alarm (an endless ALARM/OK flap once that alarm came back through the relay): log and return."""
    put_settings()  # the defaults: no admins, no channel
    assert alarms.handler(sns_event(json.dumps(ALARM)), CTX) == {"relayed": 0}
    assert alerts(slack) == []
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "set admins or admin_channel" in warning.getMessage()
    assert "MonitoringSweepErrorsAlarm" in warning.alarms[0]  # the alarm itself is in the log


@pytest.mark.parametrize("event", [{}, {"Records": []}, {"Records": [{"Sns": {"Subject": "x"}}]}, {"Records": "x"}])
def test_an_event_that_is_not_from_sns_is_refused_before_anything_is_sent(
    aws: object, slack: Any, event: dict[str, Any]
) -> None:
    put_settings(admins=["U0ADMIN"])
    with pytest.raises(ValueError, match="not an SNS event"):
        alarms.handler(event, CTX)
    assert alerts(slack) == []


def test_long_messages_are_cut_to_what_slack_shows() -> None:
    assert len(alarms.describe(None, "x" * 10_000)) == alarms.MAX_TEXT


CTX: Any = LambdaContextStub()


def test_the_handler_imports_in_a_fresh_interpreter_without_tools_or_test_doubles() -> None:
    """Lambda imports only the handler module: it must not depend on a local tool being imported."""
    import subprocess
    import sys

    code = (
        "import sys, idle_reaper.handlers.alarms\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('idle_reaper_tools', 'testkit')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
