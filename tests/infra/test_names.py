"""Physical names: every one derives from the deploy's prefix, so a second stack (staging) fits beside the
first in the same account and region, and adding regions later updates the stack a default deploy made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from synthesis import synthesize

from infra.stack import IdleReaperProps

# Properties that give a resource its name in the account (CloudFormation generates one when absent).
NAME_KEYS = (
    "TableName",
    "FunctionName",
    "StateMachineName",
    "DashboardName",
    "LogGroupName",
    "TopicName",
    "QueueName",
    "RoleName",
    "AssociationName",
    "NotebookInstanceLifecycleConfigName",
    "Name",
)


def rendered(value: Any) -> str | None:
    """A name as deployed in a region: literals and Fn::Join of literals and the region; None when
    CloudFormation makes it up (a Ref or GetAtt of something else)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        pieces = [p if isinstance(p, str) else "REGION" if p == {"Ref": "AWS::Region"} else None for p in parts]
        return None if None in pieces else separator.join(p for p in pieces if p is not None)
    if value == {"Ref": "AWS::Region"}:
        return "REGION"
    return None


def physical_names(template: dict[str, Any]) -> set[str]:
    names = set()
    for resource in template["Resources"].values():
        props = resource.get("Properties", {})
        kind = resource["Type"]
        for key in NAME_KEYS:
            # "Name" names the resource only for these types (elsewhere it is e.g. a tag's or a policy's).
            if key == "Name" and kind not in ("AWS::SecretsManager::Secret", "AWS::SSM::Parameter"):
                continue
            name = rendered(props.get(key))
            if name:
                names.add(f"{kind} {name}")
        if kind == "Custom::IdleReaperSeededParameter":  # the SSM parameters the stack seeds once
            names.add(f"AWS::SSM::Parameter {json.loads(props['Create'])['parameters']['Name']}")
    return names


def test_two_stacks_with_different_prefixes_share_no_physical_name(tmp_path: Path) -> None:
    default = synthesize(tmp_path / "default")
    staging = synthesize(tmp_path / "staging", prefix="idle-reaper-staging")
    ours, theirs = physical_names(default.template()), physical_names(staging.template())
    assert ours and ours.isdisjoint(theirs), ours & theirs
    # The default keeps today's names: the CLI's defaults and existing deploys.
    assert {
        "AWS::DynamoDB::Table idle-reaper-state",
        "AWS::SecretsManager::Secret idle-reaper/slack",
        "AWS::Lambda::Function idle-reaper-slack",
        "AWS::StepFunctions::StateMachine idle-reaper-sweep",
        "AWS::SSM::Parameter AmazonCloudWatch-idle-reaper-gpu",
        "AWS::SSM::Parameter /idle-reaper/settings",
        "AWS::SageMaker::NotebookInstanceLifecycleConfig idle-reaper-notebook-agent",
    } <= ours
    assert {
        "AWS::DynamoDB::Table idle-reaper-staging-state",
        "AWS::SecretsManager::Secret idle-reaper-staging/slack",
        "AWS::SSM::Parameter /idle-reaper-staging/settings",
        "AWS::SageMaker::NotebookInstanceLifecycleConfig idle-reaper-staging-notebook-agent",
    } <= theirs
    # The staging functions are told their own table and parameters.
    [sweep] = [
        r["Properties"]
        for r in staging.template()["Resources"].values()
        if r["Type"] == "AWS::Lambda::Function"
        and r["Properties"].get("Handler") == "idle_reaper.handlers.sweep.handler"
    ]
    env = sweep["Environment"]["Variables"]
    assert env["IDLE_REAPER_TABLE"] == {"Ref": next(iter(_of_type(staging.template(), "AWS::DynamoDB::Table")))}
    assert env["IDLE_REAPER_SSM_PREFIX"] == "/idle-reaper-staging"


def _of_type(template: dict[str, Any], kind: str) -> dict[str, Any]:
    return {i: r for i, r in template["Resources"].items() if r["Type"] == kind}


def stack_names(outdir: Path) -> dict[str, str]:
    """Each artifact (what `cdk deploy ID` names) and the CloudFormation stack it deploys."""
    artifacts = json.loads((outdir / "manifest.json").read_text())["artifacts"]
    return {
        artifact: body["properties"].get("stackName", artifact)
        for artifact, body in artifacts.items()
        if body["type"] == "aws:cloudformation:stack"
    }


def test_adding_regions_later_updates_the_default_stack_instead_of_colliding_with_it(tmp_path: Path) -> None:
    synthesize(tmp_path / "one")
    synthesize(tmp_path / "two", regions=["eu-west-1", "us-east-2"])
    synthesize(tmp_path / "staging", regions=["eu-west-1"], prefix="idle-reaper-staging")
    assert stack_names(tmp_path / "one") == {"IdleReaper": "IdleReaper"}
    # CloudFormation names are per region: the eu-west-1 stack of a later multi-region deploy is the stack
    # a default deploy in eu-west-1 made, updated in place with the same names.
    assert stack_names(tmp_path / "two") == {"IdleReaper-eu-west-1": "IdleReaper", "IdleReaper-us-east-2": "IdleReaper"}
    assert stack_names(tmp_path / "staging") == {"idle-reaper-staging-eu-west-1": "idle-reaper-staging"}


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"prefix": "Idle-Reaper"}, "prefix must be"),
        ({"prefix": "idle-reaper-"}, "prefix must be"),
        ({"prefix": "x" * 33}, "prefix must be"),
        ({"prefix": "idle_reaper"}, "prefix must be"),
        ({"sweepReservedConcurrency": "-1"}, "sweepReservedConcurrency must be"),
        ({"slackReservedConcurrency": "ten"}, "whole number"),
    ],
)
def test_a_bad_prefix_or_reservation_fails_synth_naming_the_key(context: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IdleReaperProps.from_context(cdk.App(context=context).node)


def reservations(template: dict[str, Any]) -> dict[str, Any]:
    return {
        r["Properties"]["Handler"]: r["Properties"].get("ReservedConcurrentExecutions")
        for r in _of_type(template, "AWS::Lambda::Function").values()
        if r["Properties"].get("Handler", "").startswith("idle_reaper.")
    }


def test_a_young_account_can_turn_the_reservations_off_or_size_them(tmp_path: Path) -> None:
    default = reservations(synthesize(tmp_path / "default").template())
    assert default["idle_reaper.handlers.sweep.handler"] == 1
    assert default["idle_reaper.handlers.slack.handler"] == 10
    assert sum(v for v in default.values() if v) == 11  # the quota must be 100 + 11 (docs/deploying.md)
    off = reservations(
        synthesize(tmp_path / "off", sweepReservedConcurrency="0", slackReservedConcurrency="0").template()
    )
    assert set(off.values()) == {None}  # nothing reserved: deploys under any quota
    sized = reservations(synthesize(tmp_path / "sized", slackReservedConcurrency="3").template())
    assert sized["idle_reaper.handlers.slack.handler"] == 3 and sized["idle_reaper.handlers.sweep.handler"] == 1
