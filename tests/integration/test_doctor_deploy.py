"""`idle-reaper doctor`'s deploy checks against moto in server mode, with AWS's real answers in front where moto
has none (testkit/deploy_answers.py): the stack and its version, the sweep's schedule, the alarm topic, the
Lambda concurrency quota, the regions, the agent association and a signed ping of the real Slack handler."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from test_doctor import by_status, doctor

from idle_reaper import aws
from idle_reaper.aws.deploy import DEPLOY_CHECKS as STACK_CHECKS
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at
from testkit.deploy_answers import (
    ASSOCIATION_ID,
    STACK,
    DeployAnswers,
    access_denied,
    association,
    deploy_stack,
    set_stack_status,
    set_stack_version,
)
from testkit.ec2_answers import Answer
from testkit.function_url import slack_function_url

pytestmark = pytest.mark.integration

THREE_REGIONS = ["eu-west-1", "us-east-1", "us-west-2"]
DEPLOY_CHECKS = {*STACK_CHECKS, "deploy.regions"}  # a stack's own, then the regions without one


def outputs(region: str = "us-east-1") -> dict[str, str]:
    stack = aws.client("cloudformation", region).describe_stacks(StackName=STACK)["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}


def test_a_healthy_deploy_passes_every_deploy_check_each_labelled_with_its_region(
    healthy: dict[str, str], deployed: DeployAnswers, capsys: Any
) -> None:
    code, findings = doctor(capsys)
    assert code == 0
    statuses = {f["check"]: f["status"] for f in findings}
    assert {c: statuses.get(c) for c in DEPLOY_CHECKS} == dict.fromkeys(DEPLOY_CHECKS, "ok")
    assert all(f["message"].startswith("us-east-1: ") for f in findings if f["check"] != "deploy.regions")
    gpu = next(f for f in findings if f["check"] == "signals.gpu")
    assert f"State Manager association {ASSOCIATION_ID}: last status Success (3 success)" in gpu["message"]
    concurrency = next(f for f in findings if f["check"] == "deploy.concurrency")
    assert "quota 1000" in concurrency["message"] and "reservation of 11" in concurrency["message"]


def _disable_schedule(_: DeployAnswers) -> str:
    rule = outputs()["SweepScheduleName"]
    aws.client("events").disable_rule(Name=rule)
    return rule


def _delete_schedule(_: DeployAnswers) -> str:
    rule = outputs()["SweepScheduleName"]
    aws.client("events").delete_rule(Name=rule)
    return rule


def _topic_without_cloudwatch(_: DeployAnswers) -> str:
    """The topic policy enforce_ssl alone writes: a policy replaces SNS's default, and nothing allows CloudWatch."""
    topic = outputs()["AlarmTopicArn"]
    policy = json.loads(aws.client("sns").get_topic_attributes(TopicArn=topic)["Attributes"]["Policy"])
    policy["Statement"] = [s for s in policy["Statement"] if s.get("Effect") == "Deny"]
    aws.client("sns").set_topic_attributes(TopicArn=topic, AttributeName="Policy", AttributeValue=json.dumps(policy))
    return topic


def _nobody_subscribed(answers: DeployAnswers) -> str:
    """The relay's subscription removed and the admin's e-mail never confirmed."""
    sns, topic = aws.client("sns"), outputs()["AlarmTopicArn"]
    for sub in sns.list_subscriptions_by_topic(TopicArn=topic)["Subscriptions"]:
        sns.unsubscribe(SubscriptionArn=sub["SubscriptionArn"])
    sns.subscribe(TopicArn=topic, Protocol="email", Endpoint="ops@example.com")
    answers.pending.add("ops@example.com")
    return topic


def _email_pending(answers: DeployAnswers) -> str:
    aws.client("sns").subscribe(TopicArn=outputs()["AlarmTopicArn"], Protocol="email", Endpoint="ops@example.com")
    answers.pending.add("ops@example.com")
    return "email ops@example.com"


def _small_quota(answers: DeployAnswers) -> str:
    answers.concurrency_limit = 100  # 89 left unreserved: less than the 100 Lambda requires
    return "us-east-1"


def _machines_elsewhere(answers: DeployAnswers) -> str:
    answers.enabled_regions = THREE_REGIONS
    ec2 = boto3.client("ec2", region_name="us-west-2")
    tags = [{"Key": "Team", "Value": "ml"}, {"Key": local.MANAGED_TAG, "Value": "true"}]
    ec2.run_instances(
        ImageId=local.AMI,
        InstanceType="m5.large",
        MinCount=2,
        MaxCount=2,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )
    return "us-west-2"


def _stack_failed(_: DeployAnswers) -> str:
    set_stack_status("UPDATE_ROLLBACK_FAILED")
    return STACK


BROKEN: dict[str, tuple[Callable[[DeployAnswers], str], str, str, str]] = {
    # name: (break it, returning a subject to name; the check; its status; a phrase of the fix)
    "schedule disabled": (_disable_schedule, "deploy.schedule", "fail", "aws events enable-rule --name "),
    "schedule deleted": (_delete_schedule, "deploy.schedule", "fail", "cdk deploy"),
    "topic refuses CloudWatch": (_topic_without_cloudwatch, "deploy.alarm_topic", "fail", "cloudwatch.amazonaws.com"),
    "alarms reach nobody": (_nobody_subscribed, "deploy.alarm_subscribers", "fail", "Confirm subscription"),
    "e-mail not confirmed": (_email_pending, "deploy.alarm_subscribers", "warn", "Confirm subscription"),
    "quota too small": (_small_quota, "deploy.concurrency", "fail", "--quota-code L-B99A9384"),
    "machines in a region without a stack": (
        _machines_elsewhere,
        "deploy.regions",
        "warn",
        "regions=us-east-1,us-west-2",
    ),
    "stack failed": (_stack_failed, "deploy.stack", "fail", "describe-stack-events --stack-name IdleReaper"),
    "stack rolled back": (
        lambda _: set_stack_status("UPDATE_ROLLBACK_COMPLETE") or STACK,
        "deploy.stack",
        "warn",
        "describe-stack-events",
    ),
    "stack of another version": (
        lambda _: set_stack_version("0.0.9") or STACK,
        "deploy.version",
        "warn",
        "pip install idle-reaper==0.0.9",
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_each_broken_deploy_thing_fails_exactly_its_check(
    name: str, healthy: dict[str, str], deployed: DeployAnswers, capsys: Any
) -> None:
    breaks, check, status, fix = BROKEN[name]
    subject = breaks(deployed)
    code, findings = doctor(capsys)
    assert code == (1 if status == "fail" else 0)
    assert {f["check"] for f in findings if f["status"] != "ok"} == {check}, findings
    [found] = [f for f in findings if f["check"] == check]
    assert found["status"] == status and subject in found["subjects"] and subject in found["message"]
    assert fix in found["fix"]


def test_a_failed_create_on_a_new_accounts_quota_names_the_quota_increase(
    healthy: dict[str, str], deployed: DeployAnswers, capsys: Any
) -> None:
    """A new account's quota of 10 cannot hold the stack's 11 and the 100 Lambda keeps: the create rolls back
    and its functions are gone, so nothing is held and all 11 are still to reserve."""
    deployed.concurrency_limit = 10
    set_stack_status("ROLLBACK_COMPLETE")
    lambda_ = aws.client("lambda")
    for function in lambda_.list_functions()["Functions"]:
        lambda_.delete_function(FunctionName=function["FunctionName"])
    code, findings = doctor(capsys)
    failing = by_status(findings, "fail")
    assert code == 1 and {"deploy.stack", "deploy.concurrency"} <= set(failing)
    assert "11 execution(s) the stack still has to reserve" in failing["deploy.concurrency"]["message"]
    assert "--desired-value 1000" in failing["deploy.concurrency"]["fix"]
    assert "delete-stack --stack-name IdleReaper" in failing["deploy.stack"]["fix"]


def test_a_failed_association_is_shown_in_the_signals_findings(
    healthy: dict[str, str], deployed: DeployAnswers, capsys: Any
) -> None:
    deployed.associations[ASSOCIATION_ID] = association("Failed", {"Failed": 2, "Success": 5})
    _, findings = doctor(capsys)
    for check in ("signals.gpu", "signals.collector"):
        message = next(f["message"] for f in findings if f["check"] == check)
        assert "last status Failed (2 failed, 5 success)" in message
        assert f"list-association-executions --association-id {ASSOCIATION_ID}" in message


@pytest.mark.parametrize(
    "refused",
    [
        {
            "GetAccountSettings": "deploy.concurrency",
            "DescribeRule": "deploy.schedule",
            "GetTopicAttributes": "deploy.alarm_topic",
            "ListSubscriptionsByTopic": "deploy.alarm_subscribers",
        },
        {"DescribeStacks": "deploy.stack"},
    ],
    ids=["the stack's parts", "the stack"],
)
def test_what_cannot_be_read_is_unknown_never_ok(
    refused: dict[str, str], healthy: dict[str, str], deployed: DeployAnswers, capsys: Any
) -> None:
    for operation in [*refused, "DescribeAssociation"]:
        deployed.fail[operation] = access_denied("service", operation)
    code, findings = doctor(capsys, "--region", "us-east-1")
    assert code == 0
    statuses = {f["check"]: f["status"] for f in findings}
    assert {check: statuses[check] for check in refused.values()} == dict.fromkeys(refused.values(), "unknown")
    if "DescribeRule" in refused:
        gpu = next(f["message"] for f in findings if f["check"] == "signals.gpu")
        assert gpu.endswith("the State Manager association's status could not be read")


def test_no_stack_anywhere_or_in_the_region_asked_is_a_failure_naming_it(
    real_answers: DeployAnswers, slack: Any, capsys: Any
) -> None:
    real_answers.enabled_regions = THREE_REGIONS
    local.init_account()
    code, findings = doctor(capsys)
    failing = by_status(findings, "fail")["deploy.stack"]
    assert code == 1 and failing["subjects"] == [STACK, "us-east-1"]
    assert "no stack IdleReaper in us-east-1" in failing["message"]
    assert by_status(findings, "ok")["deploy.regions"]["message"].startswith("of 3 enabled regions, 0 with a stack")
    deploy_stack(real_answers)
    code, findings = doctor(capsys, "--region", "eu-west-1")
    assert "no stack IdleReaper in eu-west-1" in by_status(findings, "fail")["deploy.stack"]["message"]
    assert "deploy.regions" not in {f["check"] for f in findings}  # --region: that region only


def test_every_region_with_a_stack_is_checked_and_the_calls_are_counted(
    healthy: dict[str, str], deployed: DeployAnswers, slack: Any, capsys: Any
) -> None:
    deployed.enabled_regions = THREE_REGIONS
    deploy_stack(deployed, "eu-west-1")
    deployed.calls.clear()
    code, findings = doctor(capsys, "--send-test")
    assert code == 0, [f for f in findings if f["status"] != "ok"]
    for region in ("eu-west-1", "us-east-1"):
        labelled = {f["check"] for f in findings if f["message"].startswith(f"{region}: ")}
        assert labelled >= DEPLOY_CHECKS - {"deploy.regions"} | {"policy.settings", "slack.token", "signals.gpu"}
    assert len(slack.calls_to("chat.postMessage")) == 2  # the admin and the admin channel, once: not per region
    count = deployed.count
    # Finding the stacks: one DescribeRegions, one DescribeStacks per enabled region; the region without one is
    # counted by the sweep's own count (its DescribeRegions and one DescribeInstances page).
    assert count("DescribeRegions") == 2 and count("DescribeStacks") == 3
    assert count("DescribeInstances", "us-west-2") == 1
    for region in ("eu-west-1", "us-east-1"):
        per_region = {
            op: count(op, region)
            for op in (
                "DescribeRule",
                "GetTopicAttributes",
                "ListSubscriptionsByTopic",
                "GetAccountSettings",
                "GetTemplate",
                "ListStackResources",
                "GetFunctionConcurrency",
                "DescribeAssociation",
            )
        }
        assert per_region == {**dict.fromkeys(per_region, 1), "GetFunctionConcurrency": 2}, region


def test_no_credentials_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli.main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "idle-reaper: doctor cannot run: no AWS credentials: set AWS_PROFILE, run `aws configure` or "
        "`aws sso login`, or run where a role is"
    ]


def test_credentials_aws_refuses_are_one_line_and_exit_2(real_answers: DeployAnswers, capsys: Any) -> None:
    real_answers.fail["DescribeRegions"] = Answer(
        "AuthFailure", "AWS was not able to validate the provided access credentials", 401
    )
    assert cli.main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "idle-reaper: doctor cannot run: AWS refused the credentials (AuthFailure): renew them (aws sso login, "
        "aws configure)"
    ]


def test_the_endpoint_answers_a_signed_ping_as_the_handler_does(
    healthy: dict[str, str], slack: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    with slack_function_url() as url:
        code, findings = doctor(capsys, "--region", "us-east-1", "--endpoint", url)
        assert code == 0 and "slack.endpoint" in by_status(findings, "ok")
        # The request URL of the buttons, as the Slack app holds it, works as well.
        code, findings = doctor(capsys, "--region", "us-east-1", "--endpoint", url + "slack/interactions")
        assert "slack.endpoint" in by_status(findings, "ok")
        # A signing secret other than the endpoint's: Slack's requests are refused.
        monkeypatch.setattr("idle_reaper_tools.doctor_deploy._signing_secret", lambda: "not-the-endpoints-secret")
        code, findings = doctor(capsys, "--region", "us-east-1", "--endpoint", url)
        refused = by_status(findings, "fail")["slack.endpoint"]
        assert code == 1 and refused["subjects"] == [url]
        assert "HTTP 401" in refused["message"] and "invalid signature" in refused["message"]
        assert "SlackSecretName" in refused["fix"]
    # Something else at the URL (here the Slack fake, which knows no such method), then nothing at all.
    code, findings = doctor(capsys, "--region", "us-east-1", "--endpoint", slack.url)
    other = by_status(findings, "fail")["slack.endpoint"]["message"]
    assert "HTTP 200" in other and "unknown_method" in other
    code, findings = doctor(capsys, "--region", "us-east-1", "--endpoint", url)
    assert "did not answer" in by_status(findings, "fail")["slack.endpoint"]["message"]


def test_the_deploy_checks_change_nothing(healthy: dict[str, str], deployed: DeployAnswers, capsys: Any) -> None:
    deployed.enabled_regions = THREE_REGIONS
    deploy_stack(deployed, "eu-west-1")
    local.launch("carol", "m5.large", team="ml", launch_time=at(8), owner="U0BOB")

    def snapshot() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for region in ("us-east-1", "eu-west-1"):
            cloudformation = aws.client("cloudformation", region)
            stack = cloudformation.describe_stacks(StackName=STACK)["Stacks"][0]
            topic = outputs(region)["AlarmTopicArn"]
            sns, lambda_ = aws.client("sns", region), aws.client("lambda", region)
            seen[region] = {
                "stack": (stack["StackStatus"], stack["Outputs"]),
                "rules": aws.client("events", region).list_rules()["Rules"],
                "topic": sns.get_topic_attributes(TopicArn=topic)["Attributes"],
                "subscriptions": sns.list_subscriptions_by_topic(TopicArn=topic)["Subscriptions"],
                "concurrency": {
                    f["FunctionName"]: lambda_.get_function_concurrency(FunctionName=f["FunctionName"]).get(
                        "ReservedConcurrentExecutions"
                    )
                    for f in lambda_.list_functions()["Functions"]
                },
                "instances": aws.client("ec2", region).describe_instances()["Reservations"],
            }
        return seen

    before = snapshot()
    doctor(capsys)
    assert snapshot() == before
