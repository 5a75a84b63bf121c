"""Organization mode end to end against moto (issue 30): a member account's running instances in regions outside
the organization's `regions` are counted once a day by the member shard worker, through the member role of the
account's unit in the first organization region; shown by account name in `status` (CLI and `/idle-reaper status`
for admins), told to the admins once a week per (account, region); a denied region is named; a failing count
never breaks the unit's sweep and is tried again; the hub's own count is its own, as before."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, time, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError
from test_accounts import Org, org  # noqa: F401  (org: the organization fixture)
from test_member_machines import REGION, fan_out, in_organization, member_instance
from test_slack import _replies_from, command, ephemeral_text  # noqa: F401  (_replies_from: the autouse fixture)
from test_sweep_faults import admin_alerts
from test_unwatched_regions import run_in, run_with

from idle_reaper.aws import DynamoStateStore, client, table_name
from idle_reaper.aws.accounts import MemberAccess, MemberCredentials
from idle_reaper.aws.regions import last_member_counted, last_unwatched, members_unwatched
from idle_reaper.handlers import fanout
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.policy import Settings
from idle_reaper.sweep import Adapters
from idle_reaper.sweep import members as members_module
from idle_reaper.sweep.members import sweep_member_accounts
from idle_reaper_tools import cli, local
from idle_reaper_tools.fake_slack import LambdaContextStub

pytestmark = pytest.mark.integration

OPTED_IN = {"Team": "ml", local.MANAGED_TAG: "true"}
NORTH, DENIED = "eu-north-1", "eu-west-3"


def denying(
    region: str, operation: str = "DescribeInstances", on: Callable[[], bool] = lambda: True
) -> Callable[[MemberCredentials], Any]:
    """The real member_ec2, except that `operation` in `region` gets EC2's answer under an SCP that denies it
    (while `on()`)."""
    real = members_module.member_ec2

    def regions_ec2(held: MemberCredentials) -> Any:
        def ec2_in(where: str) -> Any:
            ec2 = real(held)(where)
            if where == region:
                message = "You are not authorized to perform this operation. ... with an explicit deny"
                error = ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": message}}, operation)

                def refuse(**kwargs: Any) -> None:
                    if on():  # asked at each call: aws.client keeps the client this handler is on
                        raise error

                ec2.meta.events.register(f"before-call.ec2.{operation}", refuse, unique_id=f"deny-{region}-{operation}")
            return ec2

        return ec2_in

    return regions_ec2


def admins_hub(org: Org, monkeypatch: pytest.MonkeyPatch) -> tuple[MemberAccess, MemberCredentials]:  # noqa: F811
    """The hub in organization mode with an admin, and the training account's member credentials."""
    members = in_organization(org, monkeypatch, Settings(admins=["U0ADMIN"]))
    training = members.sessions.credentials(org.accounts["training"], REGION)
    assert isinstance(training, MemberCredentials)
    return members, training


def test_a_member_accounts_other_regions_are_counted_shown_by_name_and_told_once_a_week(
    org: Org,  # noqa: F811
    slack: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    members, training = admins_hub(org, monkeypatch)
    monkeypatch.delenv("IDLE_REAPER_REGIONS", raising=False)
    monkeypatch.setattr(members_module, "member_ec2", denying(DENIED))
    arn = fan_out(monkeypatch)
    now = datetime.now(UTC)  # the handlers use the wall clock
    machine = member_instance(training, "U0BOB", now - timedelta(hours=3))
    run_with(training.client("ec2", NORTH), OPTED_IN)
    run_with(training.client("ec2", NORTH), {"Team": "ml"})  # a cost tag alone: running, not the reaper's
    run_in(NORTH, OPTED_IN)  # the hub's own account: the hub's count, as before

    sweep_handler.member_access.cache_clear()
    try:
        sweep_handler.handler({}, LambdaContextStub())  # the planner: the hub's own count, the member units' shards
        execution = client("stepfunctions").list_executions(stateMachineArn=arn)["executions"][0]
        plan = json.loads(client("stepfunctions").describe_execution(executionArn=execution["executionArn"])["input"])
        results = [
            fanout.shard_handler(
                {k: plan[k] for k in ("sweep_id", "now", "dry_run", "concurrent_shards")} | {"shard": shard},
                LambdaContextStub(),
            )
            for shard in plan["shards"]
        ]
        fanout.gather_handler({**plan, "results": results}, LambdaContextStub())
    finally:
        sweep_handler.member_access.cache_clear()

    store = DynamoStateStore(client("dynamodb"), table_name())
    # The member unit was swept as ever, and its account counted: the training account by name, its denied region.
    assert any(r["machines"] == 1 for r in results)
    [counted] = [c for c in members_unwatched(store, now) if c.account == training.account]
    assert counted.name == "training" and [(c.region, c.running, c.opted_in) for c in counted.regions] == [
        (NORTH, 2, 1)
    ]
    assert DENIED in counted.denied
    # The hub's own count is the hub's: its instance in eu-north-1, not the member's.
    hub_count = last_unwatched(store, now)
    assert hub_count is not None and [(c.region, c.running) for c in hub_count[1]] == [(NORTH, 1)]
    # Told once: the hub's region, and the member account's, naming it and the fix.
    alerts = admin_alerts(slack)
    [member_alert] = [a for a in alerts if training.account in a]
    assert f"in {NORTH} of member account training ({training.account}) are tagged for idle-reaper" in member_alert
    assert f"Add {NORTH} to the `organization` block's `regions` and deploy" in member_alert

    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"account training ({training.account}): {NORTH}: 2 running, 1 tagged for idle-reaper" in out
    assert f"account training ({training.account}): not counted, the member role may not look there" in out
    assert cli.main(["status", "--json"]) == 0
    [row] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if "member_unwatched_regions" in x]
    [entry] = [e for e in row["member_unwatched_regions"] if e["account"] == training.account]
    assert entry["name"] == "training" and entry["regions"] == [{"region": NORTH, "running": 2, "opted_in": 1}]
    assert f"training ({training.account}): {NORTH}: 2 running" in ephemeral_text(command("U0ADMIN", "status"))
    assert "tagged for idle-reaper" not in ephemeral_text(command("U0BOB", "status"))  # admins only

    # The rest of the day: not counted again; the same week: not told again; the next week: told again.
    adapters = Adapters.from_environment()
    # Later sweeps of the same ISO week (the weekly claim's), whatever day the test runs on: two hours and a day
    # later when the week has room for them (not on a Sunday), else between now and the week's end.
    monday = datetime.combine(now.date() - timedelta(days=now.weekday()), time(0), tzinfo=UTC)
    room = monday + timedelta(days=7) - now
    for later in (now + min(timedelta(hours=2), room / 3), now + min(timedelta(days=1), room * 2 / 3)):
        swept = {o.account: o for o in sweep_member_accounts(adapters, members, later)}
        assert [d.machine.instance_id for d in swept[training.account].report.decisions] == [machine]  # type: ignore[union-attr]
    assert len(admin_alerts(slack)) == len(alerts)
    sweep_member_accounts(adapters, members, now + timedelta(days=7))
    assert len([a for a in admin_alerts(slack) if training.account in a]) == 2


def test_a_failing_count_never_breaks_the_units_sweep_and_is_tried_again(
    org: Org,  # noqa: F811
    slack: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    members, training = admins_hub(org, monkeypatch)
    morning = datetime(2026, 11, 23, 6, 0, tzinfo=UTC)
    machine = member_instance(training, "U0BOB", morning - timedelta(hours=3))
    run_with(training.client("ec2", NORTH), OPTED_IN)
    # A member stack not yet updated: its role may not call DescribeRegions.
    old_stack = [True]
    monkeypatch.setattr(members_module, "member_ec2", denying(REGION, "DescribeRegions", lambda: old_stack[0]))
    store = DynamoStateStore(client("dynamodb"), table_name())

    out = {o.account: o for o in sweep_member_accounts(Adapters.from_environment(), members, morning)}

    (decision,) = out[training.account].report.decisions  # type: ignore[union-attr]
    assert decision.machine.instance_id == machine and out[training.account].error is None
    assert last_member_counted(store, training.account, morning) is None
    old_stack[0] = False  # the member stack is updated
    sweep_member_accounts(Adapters.from_environment(), members, morning + timedelta(minutes=5))
    assert last_member_counted(store, training.account, morning) is None, "not retried every sweep"
    sweep_member_accounts(Adapters.from_environment(), members, morning + timedelta(hours=1))
    assert last_member_counted(store, training.account, morning) == morning + timedelta(hours=1)
    [counted] = members_unwatched(store, morning + timedelta(hours=1))
    assert counted.account == training.account and counted.regions[0].opted_in == 1
