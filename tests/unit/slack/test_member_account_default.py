"""A member account's own default policy (`{prefix}/organization` defaults, OrganizationSettings.default_for)
governs its machines outside the sweep too, as the sweep applies it: Slack answers (the keep limits) and
`idle-reaper status` (the team policies read with that default as their base)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from idle_reaper.aws.accounts import MemberAccess, OrganizationConfig
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.core.records import MachineRecord
from idle_reaper.policy import Settings
from idle_reaper.slack.routing import Region
from idle_reaper_tools import admin
from testkit.aws import FakeAws
from testkit.aws.organization import FakeOrganizations, FakeSts

# A world without SageMaker: its notebook instances and endpoints are not listed.
NO_SAGEMAKER = Settings(sagemaker_notebooks=False, sagemaker_endpoints=False).model_dump_json()

NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"
REGION = "eu-west-1"


class Hub:
    """A hub whose organization settings give the accounts of one OU a stricter default: keeps of 2 h at most
    (the hub's default allows 8)."""

    def __init__(self) -> None:
        self.orgs = FakeOrganizations()
        self.sandboxes = self.orgs.add_ou(self.orgs.root)
        self.sandbox = self.orgs.add_account(self.sandboxes, "alice-sandbox")
        self.training = self.orgs.add_account(self.orgs.root, "training")
        self.aws = FakeAws()
        self.aws.ssm.store(f"{PREFIX}/settings", NO_SAGEMAKER)
        self.aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps({"idle_minutes": 90}))
        org = {"defaults": [{"accounts": [self.sandboxes], "default_policy": {"max_snooze_hours": 2}}]}
        self.aws.ssm.store(f"{PREFIX}/organization", json.dumps(org))
        self.policies = PolicyStore(self.aws.ssm, PREFIX)
        config = OrganizationConfig(
            prefix="idle-reaper", targets=(self.orgs.root,), regions=(REGION,), hub_account="9" * 12
        )
        directory = config.directory(self.orgs)
        self.members = MemberAccess(config, directory, config.sessions("answer", directory, FakeSts(lambda: NOW)))


def record(team: str, account: str | None) -> MachineRecord:
    return MachineRecord("i-0abc", team, account=account, region=REGION if account else None, owner_slack_id="U0ANN")


def test_a_slack_answer_for_a_member_machine_takes_its_accounts_keep_limits() -> None:
    hub = Hub()
    region = Region(lambda service: hub.aws.ssm, "t", PREFIX, None, lambda: NOW, members=lambda: hub.members)  # type: ignore[arg-type]
    for team in ("ml", "no-policy"):  # a team policy's unset fields, and a team without one
        policy, refusal = region.authorize("U0ANN", record(team, hub.sandbox))
        assert refusal is None and policy.max_snooze_hours == 2, team
        assert region.authorize("U0ANN", record(team, hub.training))[0].max_snooze_hours == 8  # no entry names it
        assert region.authorize("U0ANN", record(team, None))[0].max_snooze_hours == 8  # the hub's own machine
    assert region.authorize("U0ANN", record("ml", hub.sandbox))[0].idle_minutes == 90  # the team's own field kept


def test_status_reads_a_member_accounts_team_policies_on_its_own_default(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = Hub()
    monkeypatch.setattr(admin, "_parents", lambda account: (hub.sandboxes,) if account == hub.sandbox else ())
    settings, _ = hub.policies.load_settings()
    refs = hub.policies.load_teams(settings)
    in_account = admin._member_settings(hub.policies, settings, refs)
    mine, my_refs = in_account(hub.sandbox)
    assert mine.default_policy.max_snooze_hours == 2 and my_refs is not None
    assert (my_refs["ml"].policy.max_snooze_hours, my_refs["ml"].policy.idle_minutes) == (2, 90)
    assert in_account(hub.training) == (settings, refs)  # no entry names it: the hub's, nothing read again
    calls = sum(hub.aws.ssm.calls.values())
    assert in_account(hub.sandbox)[1] is my_refs  # read once: no call more
    assert sum(hub.aws.ssm.calls.values()) == calls
