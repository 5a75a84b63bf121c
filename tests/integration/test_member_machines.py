"""Organization mode end to end (issue 30), against moto in server mode with several accounts and the local
Slack fake: the hub sweeps a machine in a member account through that account's member role, warns its owner,
and a click on "Stop now" stops it in that account, through that account's credentials."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_accounts import Org, denied, org, real_sts  # noqa: F401  (org: the organization fixture)
from test_slack import _replies_from, click, command, ephemeral_text, silent  # noqa: F401  (_replies_from)
from test_unwatched_regions import run_with

from idle_reaper.aws import DynamoStateStore, client, table_name
from idle_reaper.aws.accounts import MemberAccess, MemberCredentials
from idle_reaper.core.records import MachineRecord, State, machine_key
from idle_reaper.handlers import fanout
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.policy import Settings
from idle_reaper.slack import routing
from idle_reaper.sweep.members import sweep_member_accounts
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import adapters_at, at
from idle_reaper_tools.fake_slack import LambdaContextStub
from testkit.emf import emf_blobs

pytestmark = pytest.mark.integration

REGION = "us-east-1"


class HubAccount:
    """The hub's own account, where member_instance wants a member's credentials."""

    account = local.ACCOUNT
    region = REGION

    def client(self, service: str) -> Any:
        return client(service)


def member_instance(
    held: MemberCredentials | HubAccount, owner: str, launched: datetime, *, name: str = "trainer"
) -> str:
    """An opted-in machine in the member account, quiet since `launched`, as its own EC2 and CloudWatch see it."""
    from moto.ec2.models import ec2_backends

    tags = {"Name": name, "Team": "ml", "Owner": owner, local.MANAGED_TAG: "true"}
    instance_id = run_with(held.client("ec2"), tags)
    ec2_backends[held.account][held.region].get_instance(instance_id).launch_time = launched.astimezone(UTC).replace(
        tzinfo=None
    )
    points, t = [], launched
    while t < launched + timedelta(hours=10):
        dims = [{"Name": "InstanceId", "Value": instance_id}]
        points.append({"MetricName": "CPUUtilization", "Dimensions": dims, "Timestamp": t, "Value": 1.0})
        t += timedelta(minutes=5)
    for i in range(0, len(points), 500):
        held.client("cloudwatch").put_metric_data(Namespace="AWS/EC2", MetricData=points[i : i + 500])
    return instance_id


def states(held: MemberCredentials, instance_id: str) -> str:
    out = held.client("ec2").describe_instances(InstanceIds=[instance_id])
    return str(out["Reservations"][0]["Instances"][0]["State"]["Name"])


def in_organization(org: Org, monkeypatch: pytest.MonkeyPatch, settings: Settings | None = None) -> MemberAccess:  # noqa: F811
    """The hub in organization mode over the ml OU (its team `ml` idle after an hour; `settings`, or the defaults):
    the sweep's member access."""
    local.init_account(settings, teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [REGION], "hubAccount": local.ACCOUNT}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    members = MemberAccess.from_environment("sweep")
    assert members is not None
    return members


def test_warning_click_and_stop_in_a_member_account(
    org: Org,  # noqa: F811
    slack: Any,
    clock: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    members = in_organization(org, monkeypatch)
    cached = routing.answer_access  # the function's own, kept while warm: cleared before and after
    cached.cache_clear()
    try:
        training = members.sessions.credentials(org.accounts["training"], REGION)
        sandbox = members.sessions.credentials(org.accounts["alice-sandbox"], REGION)
        assert isinstance(training, MemberCredentials) and isinstance(sandbox, MemberCredentials)
        in_training = member_instance(training, "U0BOB", at(8))
        in_sandbox = member_instance(sandbox, "U0ALICE", at(8))

        clock["t"] = at(14)
        outcomes = {o.account: o for o in sweep_member_accounts(adapters_at(at(14)), members, at(14))}
        (decision,) = outcomes[training.account].report.decisions  # type: ignore[union-attr]
        assert (decision.machine.account, decision.action.value) == (training.account, "warn")
        post = next(c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB")
        assert training.account in json.dumps(post.params["blocks"])  # the warning says which account
        # The click on bob's warning acts in the training account, through its member role.
        ref = next(b["elements"][0]["value"] for b in post.params["blocks"] if b["type"] == "actions")
        assert silent(click("U0BOB", "stop_now", ref))
        assert states(training, in_training) in ("stopping", "stopped")
        assert states(sandbox, in_sandbox) == "running"  # the other account's machine is untouched
        assert not client("ec2").describe_instances()["Reservations"]  # nothing ever ran in the hub
        store = DynamoStateStore(client("dynamodb"), table_name())
        key = machine_key(in_training, training.account, REGION)
        record = store.load([key])[key]
        assert record.account == training.account and record.last_action == "stop"
        assert in_training not in store.load([in_training])  # never under the hub's bare key

        # Alice's account can no longer be reached (its member role is gone): her click is answered with why,
        # and nothing changes, here or anywhere else.
        sts = real_sts({sandbox.account: denied(sandbox.account)})
        config_now = members.config
        directory = config_now.directory()
        refused = MemberAccess(config_now, directory, config_now.sessions("answer", directory, sts))
        monkeypatch.setattr(routing, "answer_access", lambda: refused)
        alice = next(c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0ALICE")
        ref = next(b["elements"][0]["value"] for b in alice.params["blocks"] if b["type"] == "actions")
        text = ephemeral_text(click("U0ALICE", "stop_now", ref))
        assert f"account {sandbox.account} in {REGION}" in text and "Nothing changed" in text
        assert states(sandbox, in_sandbox) == "running"
        key = machine_key(in_sandbox, sandbox.account, REGION)
        assert store.load([key])[key].state.value == "warned"
    finally:
        cached.cache_clear()


def test_a_hub_inside_a_target_ou_is_a_member_only_in_the_organization_regions_without_a_hub_stack(
    org: Org,  # noqa: F811
    slack: Any,
    clock: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub is the training account (a delegated administrator inside the ml OU), with a stack in us-east-1
    only; the organization's regions are us-east-1 and eu-west-1. Its member stack in eu-west-1 is the only way its
    machines there are swept: the hub sweeps it there as a member account, and in us-east-1 leaves it to its own
    stack (a machine is swept once). A click acts there through the training account's member role."""
    other = "eu-west-1"
    hub = org.accounts["training"]
    local.init_account(None, teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [REGION, other], "hubAccount": hub}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps({**config, "hubRegions": [REGION]}))
    members = MemberAccess.from_environment("sweep")
    assert members is not None
    cached = routing.answer_access
    cached.cache_clear()
    try:
        listed = {a.id for a in members.directory.current().accounts}
        assert hub in listed  # it sits in a target OU
        units = {(a.id, r) for a, r in members.config.units(members.directory.current().accounts)}
        assert (hub, other) in units and (hub, REGION) not in units
        sandbox = org.accounts["alice-sandbox"]
        assert {(sandbox, REGION), (sandbox, other)} <= units  # other members: every organization region
        assert members.hub_member_regions() == (other,)

        there = members.sessions.credentials(hub, other)
        at_home = members.sessions.credentials(hub, REGION)
        assert isinstance(there, MemberCredentials) and isinstance(at_home, MemberCredentials)
        in_other = member_instance(there, "U0BOB", at(8))
        at_hub_region = member_instance(at_home, "U0BOB", at(8), name="kept-by-the-hub-stack")

        clock["t"] = at(14)
        outcomes = sweep_member_accounts(adapters_at(at(14)), members, at(14))
        swept = {d.machine.key: d.action.value for o in outcomes if o.report for d in o.report.decisions}
        assert swept.get(machine_key(in_other, hub, other)) == "warn"
        assert machine_key(at_hub_region, hub, REGION) not in swept  # its own stack's, never as a member's
        assert {(o.account, o.region) for o in outcomes if o.account == hub} == {(hub, other)}

        post = next(c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB")
        ref = next(b["elements"][0]["value"] for b in post.params["blocks"] if b["type"] == "actions")
        assert silent(click("U0BOB", "stop_now", ref))
        assert states(there, in_other) in ("stopping", "stopped")
        assert states(at_home, at_hub_region) == "running"
    finally:
        cached.cache_clear()


def test_a_click_on_a_machine_whose_account_has_left_the_organization_changes_nothing(
    org: Org,  # noqa: F811
    slack: Any,
    clock: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alice is warned of her machine in the sandbox account; the account then leaves the organization (moto's
    Organizations). Her "Stop now" is answered with why, and nothing is stopped or recorded, though the endpoint
    could still get (or holds) credentials there."""
    members = in_organization(org, monkeypatch)
    routing.answer_access.cache_clear()
    try:
        sandbox = members.sessions.credentials(org.accounts["alice-sandbox"], REGION)
        assert isinstance(sandbox, MemberCredentials)
        in_sandbox = member_instance(sandbox, "U0ALICE", at(8))
        clock["t"] = at(14)
        sweep_member_accounts(adapters_at(at(14)), members, at(14))
        alice = next(c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0ALICE")
        ref = next(b["elements"][0]["value"] for b in alice.params["blocks"] if b["type"] == "actions")
        answering = routing.answer_access()
        assert answering is not None
        assert isinstance(answering.sessions.credentials(sandbox.account, REGION), MemberCredentials)  # held

        client("organizations").remove_account_from_organization(AccountId=sandbox.account)
        text = ephemeral_text(click("U0ALICE", "stop_now", ref))
        assert f"account {sandbox.account} in {REGION}: the account has left the organization" in text
        assert "Nothing changed" in text
        assert states(sandbox, in_sandbox) == "running"
        store = DynamoStateStore(client("dynamodb"), table_name())
        key = machine_key(in_sandbox, sandbox.account, REGION)
        assert store.load([key])[key].state is State.WARNED
    finally:
        routing.answer_access.cache_clear()


def test_keep_asks_which_when_one_instance_id_runs_in_two_accounts(aws: object, slack: Any, clock: Any) -> None:
    """`/idle-reaper keep` finds carol's machine in whichever account it runs; the same id (or name) in two
    accounts is never guessed: she is shown both keys, and naming one keeps that one only."""
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    store = DynamoStateStore(client("dynamodb"), table_name())
    a, b = "111111111111", "222222222222"
    for account in (a, b):
        record = MachineRecord("i-0abc", "ml", State.WARNED, account=account, region=REGION, owner_slack_id="U0CAROL")
        assert store.save(replace(record, version=1, name="trainer", owner="U0CAROL", warned_at=at(13)))
    for target in ("trainer", "i-0abc"):
        text = ephemeral_text(command("U0CAROL", f"keep {target} 2h"))
        assert f"`{machine_key('i-0abc', a, REGION)}`" in text and f"`{machine_key('i-0abc', b, REGION)}`" in text
    assert {r.state for r in store.load([machine_key("i-0abc", x, REGION) for x in (a, b)]).values()} == {State.WARNED}
    text = ephemeral_text(command("U0CAROL", f"keep {machine_key('i-0abc', b, REGION)} 2h"))
    assert text.startswith("Kept trainer")
    states = {r.account: r.state for r in store.load([machine_key("i-0abc", x, REGION) for x in (a, b)]).values()}
    assert states == {a: State.WARNED, b: State.SNOOZED}


def test_keep_names_the_hubs_machine_apart_when_a_member_account_runs_the_same_instance_id(
    aws: object, slack: Any, clock: Any
) -> None:
    """The same id in the hub's account and in a member account: the hub's key is the bare id, which matched the
    member's too, so the hub's machine could never be kept. Each key the "which one?" reply names keeps exactly
    the machine it names, and the bare id (the hub's full key) keeps the hub's alone."""
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    store = DynamoStateStore(client("dynamodb"), table_name())
    member = "111111111111"
    hub = MachineRecord("i-0abc", "ml", State.WARNED, owner_slack_id="U0CAROL")
    there = replace(hub, account=member, region=REGION)
    for record in (hub, there):
        assert store.save(replace(record, version=1, name="trainer", owner="U0CAROL", warned_at=at(13)))
    keys = [hub.key, there.key]
    assert keys == ["i-0abc", f"{member}/{REGION}/i-0abc"]

    text = ephemeral_text(command("U0CAROL", "keep trainer 2h"))
    named = re.findall(r"`([^`]+)`", text.partition(":")[2])
    assert named == keys and "(the hub's account)" in text
    assert {r.state for r in store.load(keys).values()} == {State.WARNED}  # asking changes nothing
    for key in named:  # each named key keeps the one machine it names
        before = {k: r.state for k, r in store.load(keys).items()}
        assert ephemeral_text(command("U0CAROL", f"keep {key} 2h")).startswith("Kept trainer (i-0abc)")
        after = {k: r.state for k, r in store.load(keys).items()}
        assert [k for k in keys if after[k] != before[k]] == [key] and after[key] == State.SNOOZED


def test_keep_by_a_member_machines_bare_instance_id_says_how_to_name_it(
    aws: object, slack: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin (or a team member) types the bare id of someone else's machine in a member account: not found by
    it (the hub's key is the bare id), and the reply says how such a machine is named, not that an instance id
    would do; the full key keeps it."""
    local.init_account(
        Settings(admins=["U0ADMIN"]), teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)}
    )
    store = DynamoStateStore(client("dynamodb"), table_name())
    record = MachineRecord("i-0abc", "ml", State.WARNED, account="111111111111", region=REGION, owner_slack_id="U0BOB")
    assert store.save(replace(record, version=1, name="trainer", owner="U0BOB", warned_at=at(13)))
    # Single-account mode: an instance id is how anyone's machine is named; the reply says so, as before.
    assert "someone else's machine is kept by its instance id." in ephemeral_text(command("U0ADMIN", "keep i-0abc 2h"))
    config = {
        "prefix": "idle-reaper",
        "targets": ["ou-ab12-cd34ef56"],
        "regions": [REGION],
        "hubAccount": local.ACCOUNT,
    }
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    routing.answer_access.cache_clear()
    try:
        text = ephemeral_text(command("U0ADMIN", "keep i-0abc 2h"))
        assert (
            "No machine, endpoint or Studio app named `i-0abc` among yours or in the hub's account; nothing changed."
            in text
        )
        assert "in a member account by `account/region/instance-id`" in text
        assert "`/idle-reaper keep 123456789012/us-east-1/i-0abc 2h`" in text
        missing = ephemeral_text(command("U0ADMIN", f"keep 222222222222/{REGION}/i-0abc 2h"))
        elsewhere = f"222222222222/{REGION}/i-0abc"
        assert (
            missing
            == f"No machine, endpoint or Studio app named `{elsewhere}` among yours or in that account and region; "
            "nothing changed."
        )
        assert store.load([record.key])[record.key].state is State.WARNED
        assert ephemeral_text(command("U0ADMIN", f"keep {record.key} 2h")).startswith("Kept trainer (i-0abc)")
        assert store.load([record.key])[record.key].state is State.SNOOZED
    finally:
        routing.answer_access.cache_clear()


def fan_out(monkeypatch: pytest.MonkeyPatch) -> str:
    """A state machine for the scheduled handler to hand its shards to (the test runs them): its ARN."""
    arn: str = client("stepfunctions").create_state_machine(
        name="idle-reaper-sweep",
        definition=json.dumps({"StartAt": "Wait", "States": {"Wait": {"Type": "Pass", "End": True}}}),
        roleArn="arn:aws:iam::123456789012:role/idle-reaper-sweep",
    )["stateMachineArn"]
    monkeypatch.setenv(sweep_handler.FANOUT_ENV, arn)
    return arn


def test_member_units_go_through_the_planner_shard_workers_and_gather_and_status_shows_them(
    org: Org,  # noqa: F811
    slack: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The fan-out in organization mode, end to end against moto through the handlers: the scheduled planner
    writes the member units as a shard after the hub's own and starts the state machine, the shard workers sweep
    them through the member roles, the gather step sums them (per-account metrics) and keeps the sweep's member
    summary, which `status` (CLI, and /idle-reaper status for admins) shows."""
    local.init_account(
        Settings(admins=["U0ADMIN"]), teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)}
    )
    client("ssm").put_parameter(
        Name="/idle-reaper/organization", Value=json.dumps({"exclude": [org.sandbox]}), Type="String", Overwrite=True
    )
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [REGION], "hubAccount": local.ACCOUNT}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    sfn = client("stepfunctions")
    arn = fan_out(monkeypatch)
    members = MemberAccess.from_environment("sweep")
    assert members is not None
    training = members.sessions.credentials(org.accounts["training"], REGION)
    sandbox = members.sessions.credentials(org.accounts["alice-sandbox"], REGION)
    assert isinstance(training, MemberCredentials) and isinstance(sandbox, MemberCredentials)
    now = datetime.now(UTC)  # the handlers use the wall clock
    in_training = member_instance(training, "U0BOB", now - timedelta(hours=3))
    in_sandbox = member_instance(sandbox, "U0ALICE", now - timedelta(hours=3))
    # Bob has a machine in the hub's own account too: his `status` lists both accounts' machines.
    in_hub = member_instance(HubAccount(), "U0BOB", now - timedelta(hours=3), name="notebook")

    sweep_handler.member_access.cache_clear()  # the functions' own, kept while warm
    try:
        # The hub's own machine fits in place, yet with member units the sweep is fanned out: shard 0 the hub's,
        # then the two enrolled accounts (the closed one left out), a shard each (the Map has lanes to spare).
        assert sweep_handler.handler({}, LambdaContextStub()) == {"machines": 1, "shards": 3, "dry_run": False}
        [execution] = sfn.list_executions(stateMachineArn=arn)["executions"]
        plan = json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"])
        assert plan["shards"] == [0, 1, 2]
        results = []
        for shard in plan["shards"]:
            event = {k: plan[k] for k in ("sweep_id", "now", "dry_run", "concurrent_shards")} | {"shard": shard}
            results.append(fanout.shard_handler(event, LambdaContextStub()))
        capsys.readouterr()
        gathered = fanout.gather_handler({**plan, "results": results}, LambdaContextStub())
    finally:
        sweep_handler.member_access.cache_clear()
    assert gathered["machines"] == 2 and gathered["shards"] == 3 and gathered["shards_failed"] == []
    by_account = {b["account"]: b for b in emf_blobs(capsys.readouterr().out) if "account" in b}
    assert set(by_account) == {local.ACCOUNT, training.account}  # the excluded account is not swept
    assert by_account[training.account]["MachinesScanned"] == 1 and by_account[local.ACCOUNT]["MachinesScanned"] == 1
    store = DynamoStateStore(client("dynamodb"), table_name())
    assert store.load([machine_key(in_training, training.account, REGION)])
    assert not store.load([machine_key(in_sandbox, sandbox.account, REGION)])  # excluded: never recorded
    assert states(sandbox, in_sandbox) == "running"

    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 account-regions swept (1 machines)" in out
    assert f"excluded, never touched: account {sandbox.account} 'alice-sandbox': 1 opted-in machine(s)" in out
    assert cli.main(["status", "--json"]) == 0
    [found] = [json.loads(x)["member_sweep"] for x in capsys.readouterr().out.splitlines() if "member_sweep" in x]
    assert found["excluded"] == [{"account": sandbox.account, "name": "alice-sandbox", "opted_in_machines": 1}]
    # Admins see it in Slack too; an owner sees only their own machines.
    assert "excluded, never touched" in ephemeral_text(command("U0ADMIN", "status"))
    mine = ephemeral_text(command("U0BOB", "status"))
    assert "excluded" not in mine
    # Bob's machines in every account, each once: the hub's (no account named) and the training account's.
    lines = [line for line in mine.splitlines() if line.startswith("•")]
    assert len(lines) == 2
    assert any(f"notebook ({in_hub})" in line and "account" not in line for line in lines)
    assert any(f"trainer ({in_training}) · account {training.account} ({REGION})" in line for line in lines)
