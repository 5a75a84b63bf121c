"""The doctor's checks on their own (core/doctor.py): facts in, findings out. A fact that could not be gathered
is unknown, never ok; each line not ok names its subjects and its fix."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from idle_reaper.core.doctor import (
    LIST_LIMIT,
    MANIFEST_BOT_SCOPES,
    Finding,
    LastSweep,
    MachineSignals,
    OwnedMachine,
    PolicyFacts,
    Remembered,
    SlackFacts,
    TeamContacts,
    check_gpu_metrics,
    check_groups,
    check_last_sweep,
    check_people,
    check_policy,
    check_signals,
    check_slack,
    failed,
    finding_key,
    largest_gap_minutes,
    listed,
    remember,
    tally,
)
from idle_reaper.policy import TeamPolicy, TeamPolicyRef

NOW = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
START = NOW - timedelta(minutes=60)


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def ref(team: str, valid: bool = True) -> TeamPolicyRef:
    policy = TeamPolicy() if valid else None
    error = None if valid else "idle_minutes: too small"
    return TeamPolicyRef(team=team, policy=policy, source=f"/idle-reaper/teams/{team}", version=1, error=error)


# -- the finding itself --------------------------------------------------------------------------


def test_a_finding_is_a_strict_stable_shape() -> None:
    f = Finding(check="slack.channels", status="fail", subjects=("C1",), message="out", fix="/invite")
    assert f.line() == "FAIL    slack.channels: out\n        fix: /invite"
    assert Finding(check="x", status="ok", message="fine", fix="ignored").line() == "OK      x: fine"
    with pytest.raises(ValidationError):
        Finding(check="x", status="broken", message="m")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Finding.model_validate({"check": "x", "status": "ok", "message": "m", "extra": 1})
    assert failed([f]) and not failed([Finding(check="x", status="unknown", message="m")])


def test_tally_and_long_lists() -> None:
    findings = [Finding(check=c, status=s, message="m") for c, s in (("a", "ok"), ("b", "fail"), ("c", "ok"))]
    assert tally(findings) == "2 ok, 0 warn, 1 fail, 0 unknown"
    many = [f"i-{n}" for n in range(LIST_LIMIT + 3)]
    assert listed(many).endswith("i-9 and 3 more") and listed(["a"]) == "a"


def test_a_failures_key_is_its_check_and_subjects_in_any_order() -> None:
    one = Finding(check="signals.gpu", status="fail", subjects=("i-1", "i-2"), message="m")
    same = Finding(check="signals.gpu", status="fail", subjects=("i-2", "i-1"), message="other words")
    assert finding_key(one) == finding_key(same)
    assert finding_key(one) != finding_key(one.model_copy(update={"subjects": ("i-1",)}))
    assert finding_key(one) != finding_key(one.model_copy(update={"check": "people.owners"}))


# -- remembering failures between daily runs ------------------------------------------------------


def fail(check: str, *subjects: str) -> Finding:
    return Finding(check=check, status="fail", subjects=subjects, message="m")


def test_remember_new_failures_and_release_the_cleared_ones() -> None:
    gpu, channel = fail("signals.gpu", "i-1"), fail("slack.channels", "C1")
    first = remember({}, [gpu, channel])
    assert first.failing == {"signals.gpu": (finding_key(gpu),), "slack.channels": (finding_key(channel),)}
    assert first.cleared == ()
    ok = Finding(check="slack.channels", status="ok", message="m")
    more = fail("signals.gpu", "i-1", "i-2")  # another set of subjects: another failure
    second = remember(first.failing, [more, ok])
    assert second.failing == {"signals.gpu": (finding_key(more),)}
    assert sorted(second.cleared) == sorted([finding_key(gpu), finding_key(channel)])


def test_a_check_that_could_not_look_forgets_nothing() -> None:
    channel = fail("slack.channels", "C1")
    told = remember({}, [channel]).failing
    unknown = Finding(check="slack.channels", status="unknown", message="could not check")
    assert remember(told, [unknown]) == remember(told, []) == Remembered(told, ())
    partly = remember(told, [fail("slack.channels", "C2"), unknown])
    assert partly.cleared == () and set(partly.failing["slack.channels"]) == {
        finding_key(channel),
        finding_key(fail("slack.channels", "C2")),
    }


# -- policy --------------------------------------------------------------------------------------


def test_policy_names_the_bad_settings_the_safe_mode_teams_and_teams_without_policy() -> None:
    facts = PolicyFacts("/idle-reaper/settings", ("admins: bad id",), {"ml": ref("ml"), "cv": ref("cv", False)}, None)
    found = by_check(check_policy(facts))
    assert found["policy.settings"].status == "fail" and "admins: bad id" in found["policy.settings"].message
    assert found["policy.settings"].subjects == ("/idle-reaper/settings",)
    assert found["policy.teams"].subjects == ("cv",) and "idle_minutes: too small" in found["policy.teams"].message
    assert found["policy.default"].status == "unknown"
    fine = by_check(check_policy(PolicyFacts("/s", (), {"ml": ref("ml")}, ["ml", "nlp", "nlp"])))
    assert fine["policy.settings"].status == fine["policy.teams"].status == "ok"
    assert fine["policy.default"].status == "warn" and fine["policy.default"].subjects == ("nlp",)


# -- Slack ---------------------------------------------------------------------------------------


def slack(**kw: object) -> SlackFacts:
    base: dict[str, object] = {
        "auth_error": None,
        "granted_scopes": MANIFEST_BOT_SCOPES,
        "required_scopes": MANIFEST_BOT_SCOPES,
        "signing_secret_present": True,
    }
    return SlackFacts(**{**base, **kw})  # type: ignore[arg-type]


def test_slack_unreachable_is_unknown_and_a_refused_token_fails() -> None:
    down = by_check(check_slack(slack(auth_error="unreachable: HTTP 503")))
    assert down["slack.token"].status == "unknown" and set(down) == {"slack.signing_secret", "slack.token"}
    refused = by_check(check_slack(slack(auth_error="invalid_auth", signing_secret_present=False)))
    assert refused["slack.token"].status == "fail" and "invalid_auth" in refused["slack.token"].message
    assert refused["slack.signing_secret"].status == "fail"


def test_scopes_channels_and_users_name_what_is_wrong() -> None:
    facts = slack(
        granted_scopes=MANIFEST_BOT_SCOPES - {"files:write"},
        channels={"C1": "not_member", "C2": "not_found", "C3": None, "C4": "member"},
        channel_teams={"C1": ["team ml"], "C2": ["admin channel"]},
        users={"U1": False, "U2": None, "U3": True},
        user_roles={"U1": ["admin"]},
    )
    found = check_slack(facts)
    scopes = by_check(found)["slack.scopes"]
    assert scopes.status == "fail" and scopes.subjects == ("files:write",)
    channels = [f for f in found if f.check == "slack.channels"]
    assert [(f.status, f.subjects) for f in channels] == [("fail", ("C2",)), ("fail", ("C1",)), ("unknown", ())]
    assert "C1 (team ml)" in channels[1].message and "C3" in channels[2].message
    users = [f for f in found if f.check == "slack.users"]
    assert [(f.status, f.subjects) for f in users] == [("fail", ("U1",)), ("unknown", ())]
    assert "U1 (admin)" in users[0].message
    assert by_check(check_slack(slack(granted_scopes=None)))["slack.scopes"].status == "unknown"
    assert by_check(check_slack(slack()))["slack.channels"].status == "ok"


# -- people --------------------------------------------------------------------------------------


def test_owners_that_resolve_to_nobody_are_listed_per_team() -> None:
    machines = [
        OwnedMachine("i-1", "ml", "gone@example.com", False),
        OwnedMachine("i-2", "ml", None, False),
        OwnedMachine("i-3", "cv", "U0CAROL", None),
        OwnedMachine("i-4", "cv", "U0DAN", True),
    ]
    found = check_people(machines, [TeamContacts("ml", None, 0)])
    owners = [f for f in found if f.check == "people.owners"]
    assert [(f.status, f.subjects) for f in owners] == [("fail", ("i-1", "i-2")), ("unknown", ())]
    assert "team ml: 2" in owners[0].message and "no Owner tag" in owners[0].message
    reachable = by_check(found)["people.reachable"]
    assert reachable.status == "fail" and reachable.subjects == ("ml",)
    with_channel = check_people(machines, [TeamContacts("ml", "C1", 0)])
    assert by_check(with_channel)["people.reachable"].status == "ok"
    assert [f.status for f in check_people(None, [])] == ["unknown"]


# -- signals -------------------------------------------------------------------------------------


def signals(instance_id: str, *, gpu: int = 12, user: int = 12, minutes: range = range(0, 60, 5), **kw: object):
    fields: dict[str, object] = {
        "instance_id": instance_id,
        "team": "ml",
        "gpu_expected": True,
        "collector_expected": True,
        "max_gap_minutes": 15,
        "complete": True,
        "cpu": [START + timedelta(minutes=m) for m in minutes],
        "gpu": gpu,
        "user": user,
    }
    return MachineSignals(**{**fields, **kw})  # type: ignore[arg-type]


def test_largest_gap_counts_the_edges() -> None:
    assert largest_gap_minutes([], START, NOW) == 60
    assert largest_gap_minutes([START + timedelta(minutes=10)], START, NOW) == 50


def test_signals_find_missing_gpu_collector_and_cpu_holes_and_say_what_could_not_be_read() -> None:
    machines = [
        signals("i-ok"),
        signals("i-nogpu", gpu=0),
        signals("i-nocollector", user=0),
        signals("i-holey", minutes=range(0, 60, 30)),  # 30-minute holes > 15 + one 5-minute period
        signals("i-unread", gpu=0, complete=False),
        signals("i-silent", gpu=0, minutes=range(0)),  # no CPU either: not running, not an agent fault
    ]
    found = check_signals(machines, START, NOW, 5)
    got = {f.check: (f.status, f.subjects) for f in found}
    assert got["signals.read"][0] == "unknown" and "i-unread" in by_check(found)["signals.read"].message
    assert got["signals.gpu"] == ("fail", ("i-nogpu",))
    assert got["signals.collector"] == ("warn", ("i-nocollector",))
    assert got["signals.cpu"] == ("warn", ("i-holey", "i-silent"))
    tolerated = check_signals([signals("i-ok", minutes=range(0, 60, 20))], START, NOW, 5)
    assert {f.status for f in tolerated} == {"ok"}, "a 20-minute hole is within 15 + one 5-minute period"
    assert [f.status for f in check_signals(None, START, NOW, 5)] == ["unknown"]
    assert check_gpu_metrics([signals("i-cpu", gpu=0, gpu_expected=False)]).status == "ok"


# -- the deploy ----------------------------------------------------------------------------------


def test_last_sweep_ok_stale_missing_failing_or_unreadable() -> None:
    assert check_last_sweep(LastSweep(NOW - timedelta(minutes=4), 0, 0), NOW, 5).status == "ok"
    stale = check_last_sweep(LastSweep(NOW - timedelta(minutes=11), 0, 0), NOW, 5)
    assert stale.status == "fail" and "11 minutes ago" in stale.message
    assert check_last_sweep(LastSweep(NOW - timedelta(minutes=11), 0, 0), NOW, 10).status == "ok"
    assert check_last_sweep(LastSweep(NOW, 1, 0), NOW, 5).status == "warn"
    assert check_last_sweep(None, NOW, 5).status == "fail"
    assert check_last_sweep("unreadable", NOW, 5).status == "unknown"


def test_groups_with_opted_in_members_need_the_tag() -> None:
    untagged = check_groups({"a": 2, "b": 1}, {"a"}, "idle-reaper:managed")
    assert untagged.status == "fail" and untagged.subjects == ("b",) and "Key=idle-reaper:managed" in untagged.fix
    assert check_groups({"a": 1}, {"a"}, "idle-reaper:managed").status == "ok"
    assert check_groups(None, set(), "idle-reaper:managed").status == "unknown"
    assert check_groups(None, set(), None).status == "ok"
