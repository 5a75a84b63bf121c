"""`idle-reaper organization import-state` (issue 30, moving an account into organization mode) against moto in
server mode: the old single-account stack's table lives in the member account (same name as the hub's, another
account), the hub's in the hub account. Its records, audit history, button references and owner cache arrive
under the member keys; a click on an old warning finds the machine there; a newer hub record is kept; a second
run changes nothing; every bad input is refused with nothing written."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError
from test_accounts import Org, org  # noqa: F401  (org: the organization fixture)
from test_member_machines import member_instance, states
from test_slack import _replies_from, click, silent  # noqa: F401  (_replies_from: the fake the replies come from)

from idle_reaper import aws
from idle_reaper.aws import DynamoStateStore
from idle_reaper.aws.accounts import AccountFailure, MemberAccess
from idle_reaper.core import Action, Machine, Signals, assess, decide
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord, State, machine_key
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, TeamPolicy, TeamPolicyRef
from idle_reaper.slack import routing
from idle_reaper.sweep.members import sweep_member_accounts
from idle_reaper.sweep.quiet_hours import QUIET_INDEX, QuietStop, quiet_stops
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import adapters_at, at
from idle_reaper_tools.import_state import Table, apply, compare, plan_import, target_keys

pytestmark = pytest.mark.integration

REGION = "us-east-1"
NOW = at(14)
TABLE = "idle-reaper-state"  # the old stack's table: the same name as the hub's, in the member account
LATER = datetime.now(UTC) + timedelta(days=7)  # lookups live in real time
# The import is run by a person: its clock is real time, so the history and claims the old stack wrote carry
# times of real time too (recent), not the demo's day: an audit item lives 90 days, a claim 30, and written on
# the demo's day they would be expired (not copied) when the suite runs that long after it.
WRITTEN = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)


class Moving:
    """The hub (organization mode, the training account excluded) and the training account's old table."""

    def __init__(self, organization: Org, monkeypatch: pytest.MonkeyPatch) -> None:
        local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
        targets = [organization.ml]
        config = {"prefix": "idle-reaper", "targets": targets, "regions": [REGION], "hubAccount": local.ACCOUNT}
        monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
        self.org = organization
        self.account = organization.accounts["training"]
        self.role = f"arn:aws:iam::{self.account}:role/OrganizationAccountAccessRole"
        self.exclude([self.account])
        assumed = aws.client("sts").assume_role(RoleArn=self.role, RoleSessionName="test")["Credentials"]
        self.old_ddb = aws.client(
            "dynamodb",
            REGION,
            credentials={
                "aws_access_key_id": assumed["AccessKeyId"],
                "aws_secret_access_key": assumed["SecretAccessKey"],
                "aws_session_token": assumed["SessionToken"],
            },
        )
        aws.create_table(self.old_ddb, TABLE)
        self.old = DynamoStateStore(self.old_ddb, TABLE)
        self.hub = DynamoStateStore(aws.client("dynamodb"), aws.table_name())

    def exclude(self, accounts: list[str]) -> None:
        aws.client("ssm").put_parameter(
            Name="/idle-reaper/organization", Value=json.dumps({"exclude": accounts}), Type="String", Overwrite=True
        )

    def key(self, instance_id: str) -> str:
        return machine_key(instance_id, self.account, REGION)

    def run(self, *extra: str, account: str | None = None, table: str = TABLE, role: str | None = "") -> int:
        argv = ["organization", "import-state", "--from-table", table, "--account", account or self.account]
        argv += ["--region", REGION, *extra]
        if role is not None:
            argv += ["--from-role", role or self.role]
        return cli.main(argv)

    def hub_items(self) -> list[dict[str, Any]]:
        items = aws.client("dynamodb").scan(TableName=aws.table_name())["Items"]
        return sorted(items, key=lambda i: (i["pk"]["S"], i["sk"]["S"]))


@pytest.fixture
def moving(org: Org, monkeypatch: pytest.MonkeyPatch) -> Moving:  # noqa: F811
    return Moving(org, monkeypatch)


def seed_old_state(m: Moving) -> None:
    """What a single-account stack leaves: a snooze, a warning in flight (shared message, button reference), a
    machine stopped in quiet hours whose owner is not told yet, history, the owner cache, and its own chores."""
    base = MachineRecord("i-0snoozed", "ml", version=3, owner="bob@example.com", owner_slack_id="U0BOB")
    records = [
        replace(
            base,
            state=State.SNOOZED,
            idle_since=at(12),
            snoozed_until=at(18),
            snoozed_by="U0BOB",
            snoozes_today=1,
            snooze_day="2026-11-20",
            quiet_history="9:120,13:45",
            updated_at=at(13, 50),
        ),
        replace(
            base,
            instance_id="i-0warned",
            name="trainer",
            state=State.WARNED,
            idle_since=at(13),
            warned_at=at(13, 40),
            warning_delivered_at=at(13, 40),
            stop_not_before=at(14, 0),
            warning_ref="REF-WARNED",
            group_ref="GROUP-1",
            messages=("D0BOB|1700000000.000100",),
            updated_at=at(13, 40),
        ),
        replace(base, instance_id="i-0quiet", state=State.REAPED, quiet_stop_at=at(3), updated_at=at(3)),
        replace(base, instance_id="i-0newer", state=State.IDLE, reason="old", updated_at=at(10)),
    ]
    for record in records:
        assert m.old.save(record)
    keep = {"action": "keep", "by": "U0BOB", "instance_id": "i-0snoozed"}
    m.old.audit("i-0snoozed", WRITTEN - timedelta(hours=1, minutes=30), keep)
    m.old.audit("i-0snoozed", WRITTEN - timedelta(hours=5), {"action": "warn"})
    m.old.audit("i-0warned", WRITTEN - timedelta(minutes=20), {"action": "warn"})
    m.old.put_lookup("ref#REF-WARNED", "i-0warned", LATER)
    m.old.put_lookup("ref#REF-OLD", "i-0gone", LATER)  # a machine the old table no longer has: not copied
    group = {"ids": ["i-0warned"], "refs": {"i-0warned": "REF-WARNED"}, "lines": {"i-0warned": "trainer"}, "title": ""}
    m.old.put_lookup("group#GROUP-1", json.dumps(group), LATER)
    m.old.put_lookup("groupline#GROUP-1#i-0warned", json.dumps({"text": "kept", "start": None}), LATER)
    m.old.put_lookup("owner#bob@example.com", "U0BOB", LATER)
    m.old.put_lookup("ref#REF-EXPIRED", "i-0warned", datetime.now(UTC) - timedelta(minutes=1))  # TTL not run yet
    m.old.put_lookup(QUIET_INDEX, json.dumps({"ml": ["i-0quiet"]}), LATER)
    m.old.put_lookup("last-sweep", "{}", LATER)  # the old deployment's own bookkeeping: left behind
    assert m.old.claim_once("doctor#day#2026-11-20", WRITTEN)
    # The hub already knows i-0newer under its member key, newer than the old table's: kept.
    hub_newer = MachineRecord(
        "i-0newer",
        "ml",
        State.ACTIVE,
        version=7,
        reason="busy (hub)",
        updated_at=at(13),
        account=m.account,
        region=REGION,
    )
    assert m.hub.save(hub_newer)


def test_import_keeps_snoozes_warnings_and_history_under_the_member_keys(
    moving: Moving, slack: Any, clock: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    m = moving
    seed_old_state(m)
    assert m.run("--same-slack-app") == 0
    out = capsys.readouterr().out
    assert f"i-0snoozed -> {m.key('i-0snoozed')}: copy" in out
    assert f"i-0newer -> {m.key('i-0newer')}: keep the hub's (newer)" in out
    assert "records: 3 copied, 1 kept" in out
    assert "audit items: 3 copied, 0 already there" in out
    assert "button references: 1 copied" in out
    assert "owner cache entries: 1 copied" in out
    assert "quiet-hours summaries still owed: 1 machine(s) added" in out
    assert "not copied: 1 once items of the old deployment" in out

    moved = m.hub.load([m.key(i) for i in ("i-0snoozed", "i-0warned", "i-0quiet", "i-0newer")])
    snoozed, warned = moved[m.key("i-0snoozed")], moved[m.key("i-0warned")]
    assert (snoozed.account, snoozed.region, snoozed.instance_id) == (m.account, REGION, "i-0snoozed")
    assert (snoozed.state, snoozed.snoozed_until, snoozed.snoozed_by) == (State.SNOOZED, at(18), "U0BOB")
    assert (snoozed.snoozes_today, snoozed.quiet_history, snoozed.version) == (1, "9:120,13:45", 3)
    assert (warned.state, warned.warning_ref, warned.messages) == (
        State.WARNED,
        "REF-WARNED",
        ("D0BOB|1700000000.000100",),
    )
    assert warned.stop_not_before == at(14) and warned.group_ref == "GROUP-1"
    assert moved[m.key("i-0newer")].reason == "busy (hub)" and moved[m.key("i-0newer")].version == 7
    assert not m.hub.load(["i-0snoozed", "i-0warned"])  # never under the bare keys: those are the hub's machines
    # History, under the member key, entry for entry.
    history = sorted(m.hub.history(m.key("i-0snoozed")), key=lambda e: str(e["action"]))
    assert [e["action"] for e in history] == ["keep", "warn"]
    # A machine's entry says where it runs, as the hub's own entries for member machines do.
    assert (history[0]["instance_id"], history[0]["account"], history[0]["region"]) == ("i-0snoozed", m.account, REGION)
    assert m.hub.get_lookup("ref#REF-WARNED", NOW) == m.key("i-0warned")
    assert m.hub.get_lookup("ref#REF-OLD", NOW) is None
    assert "ref#REF-EXPIRED" not in json.dumps(m.hub_items()) and "not copied: 1 expired items" in out
    group = json.loads(m.hub.get_lookup("group#GROUP-1", NOW) or "{}")
    assert group["ids"] == [m.key("i-0warned")] and group["refs"] == {m.key("i-0warned"): "REF-WARNED"}
    assert m.hub.get_lookup(f"groupline#GROUP-1#{m.key('i-0warned')}", NOW) is not None
    assert m.hub.get_lookup("owner#bob@example.com", NOW) == "U0BOB"
    # The old table's quiet-hours index (one item, as before the index was split): in the member's partition.
    stops, _ = quiet_stops(m.hub, f"{m.account}/{REGION}", NOW)
    assert [(s.key, s.team) for s in stops] == [(m.key("i-0quiet"), "ml")]
    assert m.hub.get_lookup("last-sweep", NOW) is None and m.hub.claim_once("doctor#day#2026-11-20", NOW)

    # Running it again changes nothing.
    before = m.hub_items()
    assert m.run("--same-slack-app") == 0
    out = capsys.readouterr().out
    assert "records: 0 copied, 4 kept" in out and "audit items: 0 copied, 3 already there" in out
    assert "already imported" in out
    assert m.hub_items() == before

    # A click on the old warning's button (the same Slack app, now the hub's) keeps the machine under its new key.
    routing.answer_access.cache_clear()
    try:
        assert MemberAccess.from_environment("answer") is not None
        assert silent(click("U0BOB", "keep_2h", "REF-WARNED"))
    finally:
        routing.answer_access.cache_clear()
    kept = m.hub.load([m.key("i-0warned")])[m.key("i-0warned")]
    assert (kept.state, kept.snoozed_by) == (State.SNOOZED, "U0BOB")
    assert m.old.load(["i-0warned"])["i-0warned"].state is State.WARNED  # the old table is only read


def test_another_slack_app_warns_again_and_keeps_the_snoozes(
    moving: Moving, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --same-slack-app an old button cannot reach the hub: no reference is copied, the warning in
    flight goes back to idle (the hub warns again with its own buttons), and the snooze is kept."""
    m = moving
    seed_old_state(m)
    assert m.run() == 0
    assert "the old app's warning dropped: the hub warns again" in capsys.readouterr().out
    moved = m.hub.load([m.key("i-0warned"), m.key("i-0snoozed")])
    warned = moved[m.key("i-0warned")]
    assert (warned.state, warned.warned_at, warned.warning_ref, warned.messages) == (State.IDLE, None, None, ())
    assert warned.idle_since == at(13)  # its quiet stretch is kept: the hub warns at once, stops warn_minutes later
    assert moved[m.key("i-0snoozed")].snoozed_until == at(18)
    assert m.hub.get_lookup("ref#REF-WARNED", NOW) is None and m.hub.get_lookup("group#GROUP-1", NOW) is None
    assert m.hub.get_lookup("owner#bob@example.com", NOW) == "U0BOB"


@pytest.mark.parametrize(
    ("state", "same_app"),
    [(State.WARNED, False), (State.WARNED, True), (State.UNKNOWN, False), (State.SAFE_MODE, False)],
)
def test_after_the_move_the_hub_stops_only_on_a_warning_that_could_be_answered(
    moving: Moving, slack: Any, state: State, same_app: bool
) -> None:
    """The old stack warned at 13:40 and the stop is due at 14:00. When its buttons reach the hub (the same
    Slack app), the hub's first sweep stops the machine as the old stack would have; when they cannot, the
    hub warns again with its own buttons and the machine keeps running. So too when the old stack's last sweep
    after its warning saw no data (unknown) or an invalid policy (safe mode): those keep the warning's times, and
    the hub must not take them for a warning of its own."""
    m = moving
    members = MemberAccess.from_environment("sweep")
    assert members is not None
    held = members.sessions.credentials(m.account, REGION)
    assert not isinstance(held, AccountFailure)
    instance = member_instance(held, "U0BOB", at(8))
    record = MachineRecord(
        instance,
        "ml",
        state,
        version=5,
        owner="U0BOB",
        owner_slack_id="U0BOB",
        idle_since=at(8),
        warned_at=at(13, 40),
        warning_delivered_at=at(13, 40),
        stop_not_before=at(14),
        warning_ref="REF-OLD-APP",
        messages=("D0BOB|1700000000.000200",),
        # The old stack's last sweep that saw the machine quiet (one that saw no data, or safe mode, leaves it).
        observed_at=at(14) if state is State.WARNED else at(13, 40),
        updated_at=at(14),
    )
    assert m.old.save(record)
    assert m.run(*(["--same-slack-app"] if same_app else [])) == 0
    imported = m.hub.load([m.key(instance)])[m.key(instance)]
    if not same_app:  # the old app's warning is gone; an unknown or safe-mode record stays so until the hub sees
        assert (imported.warned_at, imported.stop_not_before, imported.warning_ref) == (None, None, None)
        assert imported.state is (State.IDLE if state is State.WARNED else state)
    m.exclude([])  # the move is done: the hub sweeps the account
    outcomes = {o.account: o for o in sweep_member_accounts(adapters_at(at(14, 5)), members, at(14, 5))}
    report = outcomes[m.account].report
    assert report is not None
    (decision,) = report.decisions
    if same_app:
        assert decision.action.value == "stop", decision.reason
        assert states(held, instance) in ("stopping", "stopped")
        return
    assert decision.action.value == "warn" and states(held, instance) == "running"
    post = next(c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB")
    new_ref = next(b["elements"][0]["value"] for b in post.params["blocks"] if b["type"] == "actions")
    assert new_ref != "REF-OLD-APP"
    assert m.hub.load([m.key(instance)])[m.key(instance)].warning_ref == new_ref


def test_a_later_change_in_the_old_table_is_copied_and_the_hub_record_is_guarded(moving: Moving) -> None:
    """A click answered by the old stack after the first import (its record newer than the hub's copy) is
    brought over by a second run; a record the hub has changed since is not overwritten."""
    m = moving
    seed_old_state(m)
    assert m.run("--same-slack-app") == 0
    old = m.old.load(["i-0warned"])["i-0warned"]
    assert m.old.save(
        replace(old, version=old.version + 1, state=State.SNOOZED, snoozed_until=at(16), updated_at=at(14))
    )
    assert m.run("--same-slack-app") == 0
    copied = m.hub.load([m.key("i-0warned")])[m.key("i-0warned")]
    assert (copied.state, copied.snoozed_until) == (State.SNOOZED, at(16))
    assert copied.version == 4  # past the hub's copy (3): a sweep that read the first copy cannot write over it


SOON = datetime.now(UTC).replace(microsecond=0)  # the import's clock is real time: keeps that last are past it


def _soon(hours: float) -> datetime:
    return SOON + timedelta(hours=hours)


@pytest.mark.parametrize(
    "case", ["hub snoozed", "hub warned", "old keep later", "old keep into hub warning", "hub snooze over"]
)
def test_a_hub_record_with_a_keep_or_its_own_warning_is_kept_and_a_later_old_keep_carried_into_it(
    moving: Moving, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old record is newer (by updated_at) than the hub's, yet the hub's is kept when someone pressed Keep
    on the hub's warning (an active snooze) or the hub sent its own warning (its buttons are the ones that
    work); when the old record holds a later active keep, that keep is carried into the hub's record. A snooze
    that is over holds nothing: the newer old record is copied."""
    m = moving
    hub_base = MachineRecord(
        "i-0both", "ml", State.IDLE, version=4, idle_since=at(12), updated_at=at(13), account=m.account, region=REGION
    )
    old = MachineRecord("i-0both", "ml", State.IDLE, version=9, idle_since=at(11), reason="old", updated_at=at(14))
    if case in ("hub snoozed", "old keep later"):
        hub = replace(hub_base, state=State.SNOOZED, snoozed_until=_soon(1), snoozed_by="U0HUB")
    elif case == "hub snooze over":
        hub = replace(hub_base, state=State.SNOOZED, snoozed_until=at(12), snoozed_by="U0HUB")
    else:
        hub = replace(
            hub_base,
            state=State.WARNED,
            warned_at=at(12, 50),
            warning_delivered_at=at(12, 50),
            stop_not_before=at(13, 10),
            warning_ref="REF-HUB",
            messages=("D0BOB|1700000000.000900",),
        )
    if case in ("old keep later", "old keep into hub warning"):
        old = replace(old, state=State.SNOOZED, snoozed_until=_soon(5), snoozed_by="U0BOB")
    assert m.hub.save(hub) and m.old.save(old)
    ttl = [i["expires_at"] for i in m.hub_items() if i["pk"]["S"] == f"machine#{m.key('i-0both')}"]
    assert m.run() == 0
    out = capsys.readouterr().out
    found = m.hub.load([m.key("i-0both")])[m.key("i-0both")]
    if case == "hub snooze over":
        assert f"-> {m.key('i-0both')}: copy" in out
        assert (found.reason, found.idle_since) == ("old", at(11))
        return
    why = "active snooze" if case in ("hub snoozed", "old keep later") else "the hub's own warning"
    assert f"-> {m.key('i-0both')}: keep the hub's ({why})" in out
    assert found.reason != "old" and found.idle_since == at(12)  # the hub's record, not the old one
    if case == "hub warned":
        assert (found.state, found.warning_ref, found.messages) == (hub.state, "REF-HUB", hub.messages)
    if case in ("hub snoozed", "hub warned"):
        assert (found.snoozed_until, found.snoozed_by, found.version) == (hub.snoozed_until, hub.snoozed_by, 4)
        assert "records: 0 copied, 1 kept" in out
        return
    # The old stack's later keep lives on in the hub's record (its warning and state as the hub left them).
    assert (found.snoozed_until, found.snoozed_by) == (_soon(5), "U0BOB")
    assert found.version == 5 and found.warning_ref == hub.warning_ref
    assert [i["expires_at"] for i in m.hub_items() if i["pk"]["S"] == f"machine#{m.key('i-0both')}"] == ttl
    assert "the old stack's keep until" in out
    assert "1 kept (the hub's), the old stack's later keep carried into 1" in out
    before = m.hub_items()
    assert m.run() == 0  # and once only
    assert m.hub_items() == before


def test_a_carried_keep_makes_the_hub_keep_the_machine_not_stop_it(moving: Moving) -> None:
    """The hub warned (stop due 13:10; its record is the newer) and the old stack's owner pressed Keep until later:
    the keep is carried into the hub's record, and the hub's sweep, through decide(), keeps the machine."""
    m = moving
    hub = MachineRecord(
        "i-0kept",
        "ml",
        State.WARNED,
        version=4,
        idle_since=at(8),
        warned_at=at(12, 50),
        warning_delivered_at=at(12, 50),
        stop_not_before=at(13, 10),
        warning_ref="REF-HUB",
        observed_at=at(13),
        updated_at=at(13),
        account=m.account,
        region=REGION,
    )
    old = MachineRecord("i-0kept", "ml", State.SNOOZED, version=2, snoozed_until=_soon(5), updated_at=at(12, 55))
    assert m.hub.save(hub) and m.old.save(old)
    assert m.run() == 0
    record = m.hub.load([m.key("i-0kept")])[m.key("i-0kept")]
    assert _decide_quiet(hub, at(13, 20)).action is Action.STOP  # without the keep: stopped, as the hub warned
    decision = _decide_quiet(record, at(13, 20))
    assert decision.action is Action.NONE and decision.record.snoozed_until == _soon(5), decision.reason


def _decide_quiet(record: MachineRecord, now: datetime) -> Decision:
    """The core's decision for the record's machine, quiet (1 % CPU) for the last three hours."""
    policy = TeamPolicy(idle_minutes=60, warn_minutes=20)
    machine = Machine(
        instance_id=record.instance_id,
        instance_type="m5.large",
        team="ml",
        launch_time=now - timedelta(days=1),
        account=record.account,
        region=record.region,
    )
    points = [(now - timedelta(minutes=5 * i), 1.0) for i in range(36, 0, -1)]
    period = timedelta(minutes=5)
    assessment = assess(machine, Signals(cpu=points), policy, now=now, period=period, gpu_families=DEFAULT_GPU_FAMILIES)
    ref = TeamPolicyRef(team="ml", policy=policy, source="/idle-reaper/teams/ml", version=1)
    return decide(machine, ref, assessment, record, now=now)


def test_the_overwrite_holds_only_while_the_hub_record_is_as_read_and_unclaimed(moving: Moving) -> None:
    """Between compare() and apply() a hub sweep writes the record (a new version), or holds a live claim on
    it: the old record, though newer, is not written over it."""
    m = moving
    hub = MachineRecord(
        "i-0race", "ml", State.IDLE, version=2, reason="hub", updated_at=at(13), account=m.account, region=REGION
    )
    assert m.hub.save(hub)
    assert m.old.save(MachineRecord("i-0race", "ml", State.IDLE, version=6, reason="old", updated_at=at(14)))
    hub_table = Table(aws.client("dynamodb"), aws.table_name())
    now = datetime.now(UTC)
    for race in ("changed", "claimed"):
        plan = plan_import(Table(m.old_ddb, TABLE).scan(), m.account, REGION, same_slack_app=False, now=now)
        plan = compare(plan, hub_table.get_many(target_keys(plan)), now)
        assert [mv.verdict for mv in plan.records] == ["copy"]
        if race == "changed":
            hub = replace(hub, version=hub.version + 1, reason="hub swept meanwhile", updated_at=at(13, 30))
            assert m.hub.save(hub)
        else:  # a live claim, the record otherwise as read
            aws.client("dynamodb").update_item(
                TableName=aws.table_name(),
                Key={"pk": {"S": f"machine#{m.key('i-0race')}"}, "sk": {"S": "state"}},
                UpdateExpression="SET claim_until = :until, claim_by = :by",
                ExpressionAttributeValues={
                    ":until": {"N": str(int((now + timedelta(minutes=10)).timestamp()))},
                    ":by": {"S": "hub-sweep"},
                },
            )
        done = apply(plan, hub_table, now, lambda adding: 0)
        assert (done.copied["records"], done.kept["records"]) == (0, 1), race
        found = m.hub.load([m.key("i-0race")])[m.key("i-0race")]
        assert (found.reason, found.version) == (hub.reason, hub.version), race


def test_dry_run_prints_the_plan_and_writes_nothing(moving: Moving, capsys: pytest.CaptureFixture[str]) -> None:
    m = moving
    seed_old_state(m)
    before = m.hub_items()
    assert m.run("--same-slack-app", "--dry-run") == 0
    out = capsys.readouterr().out
    assert f"i-0warned -> {m.key('i-0warned')}: copy" in out
    assert "records: 3 to copy, 1 kept (the hub's is newer), 0 already imported" in out
    assert "audit items: 3 to copy, 0 already there" in out and "dry run: nothing was written" in out
    assert m.hub_items() == before


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing table", "no such table"),
        ("short account", "an AWS account id is 12 digits"),
        ("account outside the targets", "not a member account of this hub"),
        ("the hub's own account", "the hub's own account"),
        ("region not watched", "the hub does not watch it"),
        ("the hub's own table", "is the hub's own table"),
        ("not excluded", "is not excluded"),
        ("role of another account", "not of"),
        ("live claim", "the old stack's sweep holds 1 machine(s)"),
        ("a table of the caller's account", "not in the account and region being moved"),
        ("the hub's table in another account", "not the hub's account"),
        ("role refused", "cannot assume it (AccessDenied"),
        ("scan denied", "cannot read it (AccessDeniedException"),
    ],
)
def test_bad_inputs_are_refused_with_nothing_written(
    moving: Moving, case: str, expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = moving
    seed_old_state(m)
    before = m.hub_items()
    made = aws.client

    def refusing(operation: str, code: str) -> Any:
        """aws.client, with AWS's refusal of `operation` (moto allows it) for the member account's calls."""

        def refuse(**_: Any) -> None:
            raise ClientError({"Error": {"Code": code, "Message": "not authorized"}}, operation)

        def client(service: str, region: str | None = None, **kw: Any) -> Any:
            found = made(service, region, **kw)
            if service == "sts" or kw.get("credentials"):
                found.meta.events.register(f"provide-client-params.{service}.{operation}", refuse)
            return found

        return client

    if case == "missing table":
        code = m.run(table="no-such-state")
    elif case == "short account":
        code = m.run(account="12345", role=None)
    elif case == "account outside the targets":
        code = m.run(account=m.org.accounts["payments"], role=None)
    elif case == "the hub's own account":
        code = m.run(account=local.ACCOUNT, role=None)
    elif case == "region not watched":
        argv = ["organization", "import-state", "--from-table", TABLE, "--account", m.account, "--region", "eu-west-1"]
        code = cli.main(argv)
    elif case == "the hub's own table":
        code = m.run(role=None)  # the caller's own credentials: the hub account's table of that name
    elif case == "not excluded":
        m.exclude([m.org.accounts["alice-sandbox"]])
        code = m.run()
    elif case == "role of another account":
        code = m.run(role=f"arn:aws:iam::{m.org.accounts['alice-sandbox']}:role/OrganizationAccountAccessRole")
    elif case == "a table of the caller's account":  # --from-role forgotten: another account's table of that name
        aws.create_table(aws.client("dynamodb"), "idle-reaper-old-state")
        before = m.hub_items()
        code = m.run(table="idle-reaper-old-state", role=None)
    elif case == "the hub's table in another account":  # IDLE_REAPER_TABLE, or the credentials, of another account
        config = {**json.loads(os.environ["IDLE_REAPER_ORGANIZATION"]), "hubAccount": m.org.accounts["payments"]}
        monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
        code = m.run()
    elif case == "role refused":
        monkeypatch.setattr(aws, "client", refusing("AssumeRole", "AccessDenied"))
        code = m.run()
    elif case == "scan denied":
        monkeypatch.setattr(aws, "client", refusing("Scan", "AccessDeniedException"))
        code = m.run()
    else:
        record = m.old.load(["i-0snoozed"])["i-0snoozed"]
        assert m.old.save(replace(record, version=record.version + 1), "old-sweep", hold=True)
        code = m.run()
    assert code == (2 if case in ("role refused", "scan denied") else 1)
    assert expected in capsys.readouterr().err
    assert m.hub_items() == before


def hub_slack_function(environment: dict[str, str]) -> None:
    """The hub's Slack function, as the stack names it (<prefix>-slack), with this environment."""
    import io
    import zipfile

    trust = {
        "Statement": [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]
    }
    role = aws.client("iam").create_role(RoleName="slack-fn", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    code = io.BytesIO()
    with zipfile.ZipFile(code, "w") as z:
        z.writestr("index.py", "def handler(event, context):\n    return None\n")
    aws.client("lambda").create_function(
        FunctionName="idle-reaper-slack",
        Runtime="python3.12",
        Role=role,
        Handler="index.handler",
        Code={"ZipFile": code.getvalue()},
        Environment={"Variables": environment},
    )


@pytest.mark.parametrize("hub", ["organization mode", "single-account mode", "no function"])
def test_the_hub_is_read_from_its_slack_function_when_the_environment_does_not_say(
    moving: Moving, monkeypatch: pytest.MonkeyPatch, hub: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An admin's shell has no IDLE_REAPER_ORGANIZATION: the hub's settings come from its Slack function."""
    m = moving
    seed_old_state(m)
    config = os.environ["IDLE_REAPER_ORGANIZATION"]
    monkeypatch.delenv("IDLE_REAPER_ORGANIZATION")
    if hub == "organization mode":
        hub_slack_function({"IDLE_REAPER_ORGANIZATION": config})
    elif hub == "single-account mode":
        hub_slack_function({"IDLE_REAPER_TABLE": TABLE})
    assert m.run("--dry-run") == (0 if hub == "organization mode" else 1)
    captured = capsys.readouterr()
    if hub == "organization mode":
        assert "records: 3 to copy" in captured.out
    elif hub == "single-account mode":
        assert "idle-reaper-slack is not in organization mode" in captured.err
    else:
        assert "no hub here" in captured.err


def test_the_plan_leaves_out_what_is_not_a_single_account_stack_s() -> None:
    """Pure: a hub's table given as the old one (member keys), a shared message naming a machine the old table
    has no record of, an unreadable quiet-hours index: each left out and counted, never guessed at."""
    account = "210987654321"
    live = int((datetime.now(UTC) + timedelta(days=1)).timestamp())
    items = [
        {"pk": "machine#i-0a", "sk": "state", "instance_id": "i-0a", "team": "ml", "state": "idle", "version": 2},
        {"pk": f"machine#{account}/us-east-1/i-0b", "sk": "state", "instance_id": "i-0b", "team": "ml"},
        {"pk": "machine#not a key", "sk": "state"},
        # Unreadable records of the old table: a bad date, no team, a claim that is not a number.
        {"pk": "machine#i-0d", "sk": "state", "team": "ml", "state": "idle", "updated_at": "yesterday"},
        {"pk": "machine#i-0e", "sk": "state", "instance_id": "i-0e", "state": "idle"},
        {"pk": "machine#i-0f", "sk": "state", "team": "ml", "state": "idle", "claim_until": "soon"},
        {"pk": "machine#i-0g", "sk": "state", "team": "ml", "state": "idle", "expires_at": "never"},
        {"pk": "lookup#group#G", "sk": "lookup", "value": json.dumps({"ids": ["i-0gone"], "refs": {}, "lines": {}})},
        {"pk": f"lookup#{QUIET_INDEX}", "sk": "lookup", "value": "[not json", "expires_at": live},
        # The quiet-hours index as it is now, an item a stop: one readable, one not.
        {
            "pk": "entries#quiet-stops#hub",
            "sk": "i-0a",
            "value": QuietStop("i-0a", "ml", None).value,
            "expires_at": live,
        },
        {"pk": "entries#quiet-stops#hub", "sk": "i-0e", "value": "{not json", "expires_at": live},
        {"pk": "lookup#ref#R", "sk": "lookup", "value": "i-0a", "expires_at": live},
    ]
    plan = plan_import(items, account, REGION, same_slack_app=True, now=datetime.now(UTC))
    assert [m.record.key for m in plan.records] == [machine_key("i-0a", account, REGION)]
    assert [(c.kind, c.item["value"]) for c in plan.items] == [("ref", machine_key("i-0a", account, REGION))]
    assert plan.left == {
        "member machines' items (the old table is a hub's)": 1,
        "unreadable machine items": 5,
        "button references and shared messages (no record of their machine)": 1,
        "unreadable quiet-hours index": 1,
        "unreadable quiet-hours index entries": 1,
    }
    assert plan.quiet == {"ml": [machine_key("i-0a", account, REGION)]}
    other_app = plan_import(items, account, REGION, same_slack_app=False, now=datetime.now(UTC))
    assert not other_app.items
    assert other_app.left["button references and shared messages (the old Slack app's)"] == 2


def test_the_hubs_own_account_is_moved_only_where_the_hub_sweeps_it_as_a_member(
    org: Org,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training account is the hub (inside the ml OU) with a stack in eu-west-1 alone: in us-east-1 it is a
    member, so an old stack's table of its own there is moved like a member's; in eu-west-1 its own stack sweeps
    it under its own keys, nothing to move."""
    import argparse

    from idle_reaper_tools import import_state

    hub = org.accounts["training"]
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [REGION, "eu-west-1"], "hubAccount": hub}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps({**config, "hubRegions": ["eu-west-1"]}))
    member, hub_account = import_state._member(argparse.Namespace(account=hub, region=REGION))
    assert (member.id, member.name, hub_account) == (hub, "training", hub)
    with pytest.raises(import_state._Fail, match="swept in eu-west-1 by the hub's own stack"):
        import_state._member(argparse.Namespace(account=hub, region="eu-west-1"))
