"""Alarm notifications (SNS) to the admins in Slack. Wiring only.

The stack subscribes this function to its alarm topic, so every alarm state change reaches the admins
(`settings.admins` by DM, `settings.admin_channel` if set) without anyone subscribing an e-mail address.
With no admin configured there is nowhere to post: it logs the alarm at WARNING and returns (raising
would only trip its own errors alarm, for nothing anyone could read). When Slack cannot be reached or
the credentials are missing it raises: SNS and Lambda retry the delivery, and the relay's errors alarm
goes to a topic of its own (e-mail only), never back through this relay."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, ConfigDict, ValidationError

from idle_reaper.aws.clients import client, ssm_prefix
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.notify import logger
from idle_reaper.slack.notifier import SlackNotifier, load_secrets, make_client

# An alarm relay has no 3 s deadline; leave room for a Retry-After or two.
SLACK_BUDGET_SECONDS = 10.0
# Slack's text limit is 40,000 characters; an alarm line is far shorter, a stray message may not be.
MAX_TEXT = 3000


class AlarmNotification(BaseModel):
    """The fields of CloudWatch's alarm notification JSON (the SNS message body) that admins need."""

    model_config = ConfigDict(extra="ignore")

    AlarmName: str
    NewStateValue: str
    NewStateReason: str = ""
    OldStateValue: str | None = None
    Region: str = ""
    AlarmArn: str | None = None

    def describe(self) -> str:
        # The ARN names the region code (eu-west-1); `Region` is its display name (EU (Ireland)).
        region = self.AlarmArn.split(":")[3] if self.AlarmArn and self.AlarmArn.count(":") >= 5 else self.Region
        was = f" (was {self.OldStateValue})" if self.OldStateValue else ""
        return f"alarm {self.AlarmName} is {self.NewStateValue}{was} in {region}: {self.NewStateReason}"


def describe(subject: str | None, message: str) -> str:
    """One line for Slack: an alarm's name, state, region and reason; any other message as it came."""
    try:
        return AlarmNotification.model_validate_json(message).describe()[:MAX_TEXT]
    except ValidationError:
        # Not an alarm (e.g. the GPU agent rollout's failure event): still the admins' business.
        return (f"{subject}: {message}" if subject else message)[:MAX_TEXT]


def messages(event: dict[str, Any]) -> list[str]:
    records = event.get("Records")
    if not isinstance(records, list) or not records:
        raise ValueError("not an SNS event: no Records")
    texts = []
    for record in records:
        sns = record.get("Sns") if isinstance(record, dict) else None
        if not isinstance(sns, dict) or not isinstance(sns.get("Message"), str):
            raise ValueError("not an SNS event: a record has no Sns.Message")
        texts.append(describe(sns.get("Subject"), sns["Message"]))
    return texts


def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, int]:
    texts = messages(event)
    settings, _ = PolicyStore(client("ssm"), ssm_prefix()).load_settings()
    if not settings.admins and not settings.admin_channel:
        logger.warning(
            "an alarm reached nobody in Slack: set admins or admin_channel in the settings parameter",
            extra={"alarms": texts},
        )
        return {"relayed": 0}
    notifier = SlackNotifier(make_client(load_secrets().bot_token, SLACK_BUDGET_SECONDS), InMemoryStateStore())
    for text in texts:
        notifier.admin_alert(text, settings.admins, settings.admin_channel)  # raises when nobody received it
        logger.info("alarm relayed to admins", extra={"alarm": text})
    return {"relayed": len(texts)}
