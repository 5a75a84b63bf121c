"""What `idle-reaper doctor` reads from a deployed stack is what the stack writes: its outputs, its name, the
reservations it asks for in its template."""

from __future__ import annotations

from typing import Any

from synthesis import Synth

import idle_reaper
from idle_reaper.aws.deploy import STACK_ENV
from idle_reaper.core.deploy_checks import ASSOCIATION_OUTPUT, SCHEDULE_OUTPUT, TOPIC_OUTPUT, VERSION_OUTPUT
from idle_reaper_tools.doctor_deploy import default_stack_name, stack_name_for
from infra.stack import IdleReaperProps


def test_the_stack_carries_its_version_and_names_the_sweep_schedule_the_topic_and_the_association(
    synth: Synth,
) -> None:
    template: dict[str, Any] = synth.template()
    outputs = template["Outputs"]
    assert outputs[VERSION_OUTPUT]["Value"] == idle_reaper.__version__
    rule = outputs[SCHEDULE_OUTPUT]["Value"]["Ref"]
    # The rule named is the one starting the sweep, on the schedule's interval (not the digest's hourly rule).
    sweep = next(
        k
        for k, v in template["Resources"].items()
        if v["Properties"].get("Handler") == "idle_reaper.handlers.sweep.handler"
    )
    props = template["Resources"][rule]["Properties"]
    assert props["ScheduleExpression"] == "rate(5 minutes)"
    assert props["Targets"][0]["Arn"] == {"Fn::GetAtt": [sweep, "Arn"]}
    assert template["Resources"][outputs[TOPIC_OUTPUT]["Value"]["Ref"]]["Type"] == "AWS::SNS::Topic"
    association = outputs[ASSOCIATION_OUTPUT]["Value"]["Fn::GetAtt"]
    assert template["Resources"][association[0]]["Type"] == "AWS::SSM::Association"
    # The doctor sums what the template reserves: the sweep's 1 and the Slack endpoint's 10 by default.
    reserved = [
        v["Properties"]["ReservedConcurrentExecutions"]
        for v in template["Resources"].values()
        if v["Type"] == "AWS::Lambda::Function" and "ReservedConcurrentExecutions" in v["Properties"]
    ]
    assert sorted(reserved) == [1, 10]


def test_the_doctor_looks_for_the_stack_by_the_name_cdk_gives_it() -> None:
    assert default_stack_name() == IdleReaperProps().stack_name == "IdleReaper"
    assert stack_name_for("idle-reaper-staging") == IdleReaperProps(prefix="idle-reaper-staging").stack_name


def test_the_slack_function_knows_its_stack_for_the_deploy_checks(synth: Synth) -> None:
    """`/idle-reaper doctor` checks the stack it runs in: the Slack function is told its CloudFormation name."""
    template: dict[str, Any] = synth.template()
    [slack] = [
        v["Properties"]
        for v in template["Resources"].values()
        if v["Type"] == "AWS::Lambda::Function"
        and v["Properties"].get("Handler") == "idle_reaper.handlers.slack.handler"
    ]
    assert slack["Environment"]["Variables"][STACK_ENV] == IdleReaperProps().stack_name
