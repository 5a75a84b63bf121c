"""One message per owner across accounts (issue 30), against moto in server mode with several accounts and the
local Slack fake: bob's idle machines in three member accounts and the hub, each (account, region) swept as a
unit of its own, reach him as one DM listing them all; each line's buttons act on its own machine, in its own
account; "Keep all" keeps them across accounts; later answers edit that message."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_accounts import Org, aws_client, new_account, org  # noqa: F401  (org: the organization fixture)
from test_member_machines import fan_out, in_organization, member_instance, states
from test_slack import _replies_from, click, record, silent  # noqa: F401  (_replies_from: the fake for clicks)
from test_slack_per_owner import buttons

from idle_reaper.aws import DynamoStateStore, client, table_name
from idle_reaper.aws.accounts import MemberAccess, MemberCredentials
from idle_reaper.core.records import State, machine_key
from idle_reaper.handlers import fanout
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.slack import routing
from idle_reaper.sweep import run_sweep
from idle_reaper.sweep.members import sweep_member_accounts
from idle_reaper.sweep.notices import send_sweep_notices
from idle_reaper_tools import local
from idle_reaper_tools.demo import adapters_at as swept_at  # Slack's notifier tells the sweep's time
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import LambdaContextStub

pytestmark = pytest.mark.integration

REGION = "us-east-1"


def idle(_t: datetime) -> tuple[float, float]:
    return (1.0, 0.0)


def organization(org: Org, monkeypatch: pytest.MonkeyPatch) -> MemberAccess:  # noqa: F811
    """The hub in organization mode over the ml OU, with a third enrolled account (research)."""
    org.accounts["research"] = new_account(aws_client("organizations"), "research", org.ml, org.root)
    return in_organization(org, monkeypatch)


def held(members: MemberAccess, account: str) -> MemberCredentials:
    found = members.sessions.credentials(account, REGION)
    assert isinstance(found, MemberCredentials)
    return found


def landed(slack: Any) -> list[Any]:
    """The posts Slack took (a refused one is recorded by the fake too, without a ts)."""
    return [c for c in slack.calls_to("chat.postMessage") if "_ts" in c.params]


def the_message(slack: Any, channel: str) -> tuple[str, dict[str, Any]]:
    """The one message posted to `channel`, as it stands now (every edit applied)."""
    (post,) = [c for c in landed(slack) if c.params["channel"] == channel]
    ts = post.params["_ts"]
    return f"{channel}|{ts}", slack.messages[(channel, ts)]


def test_an_owner_with_machines_in_three_accounts_and_the_hub_gets_one_message(
    org: Org,  # noqa: F811
    slack: Any,
    clock: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    members = organization(org, monkeypatch)
    cached = routing.answer_access  # the Slack function's own, kept while warm: cleared before and after
    cached.cache_clear()
    try:
        accounts = {name: held(members, org.accounts[name]) for name in ("training", "alice-sandbox", "research")}
        bobs = {name: member_instance(creds, "U0BOB", at(8)) for name, creds in accounts.items()}
        alices = member_instance(accounts["training"], "U0ALICE", at(8))  # another owner, in bob's account
        hub = local.launch("hubbox", "g5.xlarge", team="ml", launch_time=at(8), owner="U0BOB")
        local.write_metrics(hub, idle, at(8), at(18))
        keys = {name: machine_key(i, accounts[name].account, REGION) for name, i in bobs.items()} | {"hub": hub}

        # The hub's own sweep, then every member (account, region) as a unit of its own (16 at once), as one
        # sweep: the hub's lone warning is posted first, and the member units join its message.
        run_sweep(swept_at(at(14)), now=at(14), message_scope="sweep-1")
        outcomes = sweep_member_accounts(swept_at(at(14)), members, at(14), message_scope="sweep-1")
        assert all(o.error is None for o in outcomes), [o.describe() for o in outcomes]

        message, shown = the_message(slack, "D0BOB")
        text = json.dumps(shown["blocks"])
        stored = {name: record(key) for name, key in keys.items()}
        for name, r in stored.items():
            assert r.messages == (message,) and r.warning_delivered_at == at(14), name
            assert r.key.split("/")[-1] in text
        (group_ref,) = {r.group_ref for r in stored.values()}
        shown_buttons = buttons(shown["blocks"])
        assert sorted(shown_buttons["keep_2h"]) == sorted(r.warning_ref for r in stored.values())
        assert sorted(shown_buttons["stop_now"]) == sorted(r.warning_ref for r in stored.values())
        assert shown_buttons["keep_all"] == [group_ref]
        assert all(accounts[n].account in text for n in accounts)  # each line says its account
        # Alice's machine, in the same account as one of bob's, is in her message only.
        _, hers = the_message(slack, "D0ALICE")
        assert alices in json.dumps(hers["blocks"]) and alices not in text
        assert not any(i in json.dumps(hers["blocks"]) for i in [*bobs.values(), hub])
        posts = len(slack.calls_to("chat.postMessage"))
        assert posts == 2

        # "Stop now" on the research machine's line stops it in research, through its member role, and edits
        # the shared message: that line says so, the others keep their buttons.
        assert silent(click("U0BOB", "stop_now", stored["research"].warning_ref))
        assert states(accounts["research"], bobs["research"]) in ("stopping", "stopped")
        assert {states(accounts[n], bobs[n]) for n in ("training", "alice-sandbox")} == {"running"}
        assert local.instance_states([hub]) == {hub: "running"}
        assert record(keys["research"]).last_action == "stop"
        _, shown = the_message(slack, "D0BOB")
        assert "Stopped" in json.dumps(shown["blocks"]) or "stopping" in json.dumps(shown["blocks"]).lower()
        assert stored["research"].warning_ref not in buttons(shown["blocks"])["keep_2h"]

        # "Keep all" keeps the other three, in three accounts; a second click changes nothing.
        assert silent(click("U0BOB", "keep_all", group_ref))
        for name in ("training", "alice-sandbox", "hub"):
            assert record(keys[name]).state is State.SNOOZED and record(keys[name]).snoozed_by == "U0BOB"
        _, shown = the_message(slack, "D0BOB")
        assert "keep_all" not in buttons(shown["blocks"]) and json.dumps(shown["blocks"]).count("<@U0BOB> kept") == 3
        assert len(slack.calls_to("chat.postMessage")) == posts, "answers edit the shared message"
        store = DynamoStateStore(client("dynamodb"), table_name())
        assert store.load([alices]) == {}  # never under a bare key
        assert record(machine_key(alices, accounts["training"].account, REGION)).state is State.WARNED
    finally:
        cached.cache_clear()


@pytest.mark.parametrize("fanned_out", [False, True])
def test_the_sweep_handlers_share_the_message_between_the_hub_and_the_member_shards(
    org: Org,  # noqa: F811
    slack: Any,
    monkeypatch: pytest.MonkeyPatch,
    fanned_out: bool,
) -> None:
    """Through the scheduled handler: swept in place (no state machine) or fanned out (the hub's shard and the
    member shards run by the shard workers), the units of one sweep share bob's message."""
    members = organization(org, monkeypatch)
    now = datetime.now(UTC)  # the handlers use the wall clock
    accounts = [held(members, org.accounts[name]) for name in ("training", "research")]
    ids = [member_instance(creds, "U0BOB", now - timedelta(hours=3)) for creds in accounts]
    hub = local.launch("hubbox", "g5.xlarge", team="ml", launch_time=now - timedelta(hours=3), owner="U0BOB")
    local.write_metrics(hub, idle, now - timedelta(hours=3), now + timedelta(hours=1))
    if fanned_out:
        sfn, arn = client("stepfunctions"), fan_out(monkeypatch)
    sweep_handler.member_access.cache_clear()  # the functions' own, kept while warm
    try:
        sweep_handler.handler({}, LambdaContextStub())
        if fanned_out:
            [execution] = sfn.list_executions(stateMachineArn=arn)["executions"]
            plan = json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"])
            assert len(plan["shards"]) == 4  # the hub's machines, and a member shard per enrolled account
            events = [
                {k: plan[k] for k in ("sweep_id", "now", "dry_run", "concurrent_shards")} | {"shard": shard}
                for shard in plan["shards"]
            ]
            with ThreadPoolExecutor(len(events)) as pool:  # the Map runs the shards at once
                list(pool.map(lambda event: fanout.shard_handler(event, LambdaContextStub()), events))
    finally:
        sweep_handler.member_access.cache_clear()
    message, shown = the_message(slack, "D0BOB")
    text = json.dumps(shown["blocks"])
    assert hub in text and all(i in text for i in ids)
    keys = [hub, *(machine_key(i, c.account, REGION) for i, c in zip(ids, accounts, strict=True))]
    assert {record(k).messages for k in keys} == {(message,)}
    items = [
        i["pk"]["S"]
        for i in client("dynamodb").scan(TableName=table_name())["Items"]
        if i["pk"]["S"].startswith("lookup#ownermsg#")
    ]
    assert len(items) == 1 and "#U0BOB#" in items[0]


def test_a_single_account_sweep_writes_no_shared_item(aws: object, slack: Any, clock: dict[str, object]) -> None:
    """Without member accounts an owner's message is the sweep's own, as it always was: no item is shared."""
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    ids = [local.launch(n, "g5.xlarge", team="ml", launch_time=at(8), owner="U0BOB") for n in ("a", "b")]
    lone = local.launch("c", "g5.xlarge", team="ml", launch_time=at(8), owner="U0ANN")
    for i in [*ids, lone]:
        local.write_metrics(i, idle, at(8), at(18))
    run_sweep(swept_at(at(14)), now=at(14))
    assert len(slack.calls_to("chat.postMessage")) == 2
    keys = [i["pk"]["S"] for i in client("dynamodb").scan(TableName=table_name())["Items"]]
    assert not [k for k in keys if k.startswith("lookup#ownermsg#")]
    assert record(lone).group_ref is None  # a lone warning: a message of its own, no listing


def owner_items() -> list[dict[str, Any]]:
    items = client("dynamodb").scan(TableName=table_name())["Items"]
    return [json.loads(i["value"]["S"]) for i in items if i["pk"]["S"].startswith("lookup#ownermsg#")]


def test_a_failed_post_or_edit_leaves_those_machines_pending_and_the_next_sweep_posts_them(
    org: Org,  # noqa: F811
    slack: Any,
    clock: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub's post fails (Slack answers internal_error): its machine stays pending, the first member unit
    takes the lead and the next joins it. Then a joiner's edit fails: its machine stays pending, unlisted, and
    is never counted delivered. The next sweep posts both."""
    members = organization(org, monkeypatch)
    accounts = {name: held(members, org.accounts[name]) for name in ("training", "alice-sandbox", "research")}
    bobs = {name: member_instance(creds, "U0BOB", at(8)) for name, creds in accounts.items()}
    keys = {name: machine_key(i, accounts[name].account, REGION) for name, i in bobs.items()}
    hub = local.launch("hubbox", "g5.xlarge", team="ml", launch_time=at(8), owner="U0BOB")
    local.write_metrics(hub, idle, at(8), at(18))
    listing = {a.id: a for a in members.directory.current().accounts}
    units = {name: (listing[c.account], REGION) for name, c in accounts.items()}

    slack.errors["chat.postMessage"] = "internal_error"
    run_sweep(swept_at(at(14)), now=at(14), message_scope="sweep-1")
    assert record(hub).warning_delivered_at is None and record(hub).messages == ()
    assert [item["state"] for item in owner_items()] == ["failed"]
    slack.errors.clear()
    first = [units["training"], units["research"]]
    sweep_member_accounts(swept_at(at(14)), members, at(14), message_scope="sweep-1", units=first)
    message, shown = the_message(slack, "D0BOB")
    text = json.dumps(shown["blocks"])
    assert bobs["training"] in text and bobs["research"] in text and hub not in text
    assert {record(keys[n]).messages for n in ("training", "research")} == {(message,)}
    assert [item["state"] for item in owner_items()] == ["posted"]

    # A later unit of the same sweep whose edit fails: pending, not listed, nothing delivered without a message.
    slack.errors["chat.update"] = "internal_error"
    late = [units["alice-sandbox"]]
    sweep_member_accounts(swept_at(at(14)), members, at(14), message_scope="sweep-1", units=late)
    pending = record(keys["alice-sandbox"])
    assert pending.state is State.WARNED and pending.warning_delivered_at is None and pending.messages == ()
    assert pending.group_ref is None
    _, shown = the_message(slack, "D0BOB")
    assert bobs["alice-sandbox"] not in json.dumps(shown["blocks"])
    assert len(landed(slack)) == 1
    listed = routing_listed(record(keys["training"]).group_ref or "")
    assert keys["alice-sandbox"] not in listed

    # The next sweep posts what is pending: one message for the two, across the hub and the member account.
    slack.errors.clear()
    later = at(14) + timedelta(minutes=5)
    clock["t"] = later
    run_sweep(swept_at(later), now=later, message_scope="sweep-2")
    sweep_member_accounts(swept_at(later), members, later, message_scope="sweep-2", units=late)
    posts = landed(slack)
    assert len(posts) == 2 and posts[1].params["channel"] == "D0BOB"
    again = f"D0BOB|{posts[1].params['_ts']}"
    assert record(hub).messages == (again,) and record(keys["alice-sandbox"]).messages == (again,)
    assert record(hub).warning_delivered_at == later == record(keys["alice-sandbox"]).warning_delivered_at
    assert record(keys["training"]).messages == (message,)  # delivered before: not posted again

    # Their stops, due 20 minutes after delivery, each swept in its own account: they edit the two messages.
    stop = later + timedelta(minutes=25)
    clock["t"] = stop
    run_sweep(swept_at(stop), now=stop, message_scope="sweep-3")
    sweep_member_accounts(swept_at(stop), members, stop, message_scope="sweep-3")
    send_sweep_notices(swept_at(stop), stop, None)  # the members' notices, told by the hub (handlers/sweep.py)
    assert len(landed(slack)) == 2, "outcomes edit the shared messages, never post anew"
    assert local.instance_states([hub]) == {hub: "stopped"}
    assert {states(accounts[n], bobs[n]) for n in bobs} == {"stopped"}
    for channel_ts in (message, again):
        edited = json.dumps(slack.messages[tuple(channel_ts.split("|"))]["blocks"])
        assert edited.count("Stopped") == 2 and "keep_all" not in edited and "start_again" in edited


def routing_listed(group_ref: str) -> tuple[str, ...]:
    raw = DynamoStateStore(client("dynamodb"), table_name()).get_lookup(f"group#{group_ref}", at(14))
    return tuple(json.loads(raw or "{}").get("ids", ()))
