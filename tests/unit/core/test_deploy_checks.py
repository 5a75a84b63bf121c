"""The doctor's reading of a topic policy (does it let CloudWatch alarms publish?), on the shapes SNS and the
stack write and the ways an edited policy refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from idle_reaper.core.deploy_checks import lets_cloudwatch_publish
from testkit.deploy_answers import topic_policy

TOPIC = "arn:aws:sns:us-east-1:123456789012:alarms"
# What SNS gives a topic without a policy of its own (the account's alarms may publish under it).
SNS_DEFAULT = {
    "Version": "2008-10-17",
    "Id": "__default_policy_ID",
    "Statement": [
        {
            "Sid": "__default_statement_ID",
            "Effect": "Allow",
            "Principal": {"AWS": "*"},
            "Action": ["SNS:GetTopicAttributes", "SNS:Subscribe", "SNS:Publish"],
            "Resource": TOPIC,
            "Condition": {"StringEquals": {"AWS:SourceOwner": "123456789012"}},
        }
    ],
}
CLOUDWATCH_ALLOWED: dict[str, Any] = {
    "Effect": "Allow",
    "Principal": {"Service": ["events.amazonaws.com", "cloudwatch.amazonaws.com"]},
    "Action": "sns:*",
    "Resource": TOPIC,
}


@pytest.mark.parametrize(
    ("policy", "allowed"),
    [
        (json.loads(topic_policy(TOPIC, "us-east-1")), True),  # the stack's: enforce_ssl's Deny and the Allow
        (SNS_DEFAULT, True),
        ({"Statement": CLOUDWATCH_ALLOWED}, True),  # a single statement, not a list
        (
            {
                "Statement": [
                    s for s in json.loads(topic_policy(TOPIC, "us-east-1"))["Statement"] if s["Effect"] == "Deny"
                ]
            },
            False,
        ),
        ({"Statement": [{**CLOUDWATCH_ALLOWED, "Principal": {"Service": "events.amazonaws.com"}}]}, False),
        ({"Statement": [{**CLOUDWATCH_ALLOWED, "Action": "sns:Subscribe"}]}, False),
        ({"Statement": [CLOUDWATCH_ALLOWED, {"Effect": "Deny", "Principal": "*", "Action": "SNS:Publish"}]}, False),
        ({}, False),
    ],
    ids=["stack", "sns-default", "one-statement", "ssl-deny-only", "other-service", "no-publish", "deny-all", "empty"],
)
def test_a_topic_policy_lets_cloudwatch_publish_only_when_it_allows_and_nothing_denies(
    policy: dict[str, Any], allowed: bool
) -> None:
    assert lets_cloudwatch_publish(policy) is allowed
