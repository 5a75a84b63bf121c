"""The doctor in organization mode against moto in server mode with several accounts: `/idle-reaper doctor`
(the hub's Slack role) assumes each member role and reads the member's GPU machines there; `idle-reaper doctor`
(a person's credentials, which the member role does not trust) reports each account as the sweep's last check
saw it, with its member stack instance, and says once that it cannot read member metrics."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_accounts import Org, denied, org, real_sts  # noqa: F401  (org: the organization fixture)
from test_unwatched_regions import run_with

from idle_reaper import aws
from idle_reaper.aws.accounts import (
    AccountFailure,
    MemberAccess,
    MemberCheck,
    MemberCredentials,
    Reason,
    save_member_check,
)
from idle_reaper.core.doctor import Finding
from idle_reaper.sweep.doctor import member_findings
from idle_reaper_tools import doctor as cli_doctor
from idle_reaper_tools import local

pytestmark = pytest.mark.integration

REGION = "us-east-1"


def gpu_machine(held: MemberCredentials, now: datetime, *, gpu: bool) -> str:
    """An opted-in GPU machine in the member account, publishing CPU (and, with `gpu`, GPU) for the last hour."""
    tags = {"Name": "trainer", "Team": "ml", "Owner": "U0BOB", local.MANAGED_TAG: "true"}
    instance_id = run_with(held.client("ec2"), tags, "g5.xlarge")
    dims = [{"Name": "InstanceId", "Value": instance_id}]
    times = [now - timedelta(minutes=m) for m in range(60, 0, -5)]
    cloudwatch = held.client("cloudwatch")
    for namespace, name in (
        ("AWS/EC2", "CPUUtilization"),
        *((("CWAgent", "nvidia_smi_utilization_gpu"),) if gpu else ()),
    ):
        data = [{"MetricName": name, "Dimensions": dims, "Timestamp": t, "Value": 50.0} for t in times]
        cloudwatch.put_metric_data(Namespace=namespace, MetricData=data)
    return instance_id


@pytest.fixture
def organization(org: Org, monkeypatch: pytest.MonkeyPatch) -> Org:  # noqa: F811
    local.init_account()
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [REGION], "hubAccount": local.ACCOUNT}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    return org


def by_check(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.check, []).append(f)
    return out


def test_the_slack_doctor_checks_each_member_account_through_its_role(organization: Org) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    members = MemberAccess.from_environment("answer")
    assert members is not None
    training, sandbox = organization.accounts["training"], organization.accounts["alice-sandbox"]
    held = members.sessions.credentials(training, REGION)
    assert isinstance(held, MemberCredentials)
    publishing, blind = gpu_machine(held, now, gpu=True), gpu_machine(held, now, gpu=False)
    # alice's sandbox: a service control policy denies the hub's AssumeRole.
    config = members.config
    sts = real_sts({sandbox: denied(sandbox, scp=True)})
    refused = MemberAccess(config, members.directory, config.sessions("answer", members.directory, sts))
    policies = aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())
    findings = by_check(member_findings(refused, policies, now, time.monotonic() + 20))
    lines = {f.subjects[0]: f for f in findings["members.account"]}
    assert sorted(lines) == sorted([training, sandbox])
    assert lines[training].message == (
        f"member account {training} 'training': {REGION}: 1 GPU machine(s) without GPU metrics in the last hour: "
        f"{blind}"
    )
    assert publishing not in lines[training].message
    assert lines[sandbox].message.startswith(f"member account {sandbox} 'alice-sandbox': {REGION}: denied-by-scp:")
    assert "service control" in lines[sandbox].fix
    # The closed account is said once; nothing is unknown; no member account is healthy.
    assert [f.subjects for f in findings["members.suspended"]] == [(organization.accounts["closed"],)]
    assert "members.unknown" not in findings and "members" not in findings


@pytest.mark.filterwarnings("ignore:Tried to parse AWS")  # moto deploys no WaitConditionHandle: nothing to deploy
def test_the_cli_doctor_reports_each_member_account_as_the_last_sweep_saw_it(organization: Org, capsys: Any) -> None:
    now = datetime.now(UTC)
    training, sandbox = organization.accounts["training"], organization.accounts["alice-sandbox"]
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    missing = AccountFailure(sandbox, REGION, Reason.ROLE_MISSING, "AccessDenied: not authorized")
    save_member_check(
        store, MemberCheck(now - timedelta(minutes=5), 2, 1, (missing,), checked=(training, sandbox)), now
    )
    # The member StackSet has a stack instance in training only.
    cloudformation = aws.client("cloudformation")
    template = json.dumps({"Resources": {"Nothing": {"Type": "AWS::CloudFormation::WaitConditionHandle"}}})
    cloudformation.create_stack_set(StackSetName="idle-reaper-members", TemplateBody=template)
    cloudformation.create_stack_instances(StackSetName="idle-reaper-members", Accounts=[training], Regions=[REGION])
    findings = by_check(cli_doctor.member_checks(REGION, "IdleReaper", 5, now, True, {}))
    lines = {f.subjects[0]: f for f in findings["members.account"]}
    assert sorted(lines) == [sandbox]
    assert (
        f"{REGION}: role-missing: " in lines[sandbox].message and "as the last sweep saw it" in lines[sandbox].message
    )
    # training: its role assumed by the last sweep, its stack instance current; its metrics not readable from here.
    assert findings["members"][0].message == (
        "1 of 2 member account(s) in every region: member role assumed (as the sweep last saw it)"
    )
    assert findings["members.gpu"][0].status == "unknown"
    # An old check says nothing of the roles now: unknown, never ok.
    save_member_check(store, MemberCheck(now - timedelta(hours=2), 2, 2, ()), now)
    findings = by_check(cli_doctor.member_checks(REGION, "IdleReaper", 5, now, True, {}))
    assert "members" not in findings and len(findings["members.unknown"][0].subjects) == 2
