"""The doctor in organization mode (core/doctor.py check_members): one line per failing member account, one
for what could not be checked (unknown, never ok), a count of the healthy ones."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from idle_reaper.core.doctor import MachineSignals, MemberUnitFacts, check_members

NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
A, B, C, D, E = (str(n) * 12 for n in range(1, 6))


def gpu_box(instance_id: str, *, publishes: bool, complete: bool = True) -> MachineSignals:
    return MachineSignals(
        instance_id=instance_id,
        team="ml",
        gpu_expected=True,
        collector_expected=False,
        max_gap_minutes=15,
        complete=complete,
        cpu=[NOW - timedelta(minutes=5)],
        gpu=3 if publishes else 0,
        user=0,
    )


def healthy(account: str, region: str, name: str = "") -> MemberUnitFacts:
    return MemberUnitFacts(account, name or f"acct-{account[0]}", region, gpu=[gpu_box("i-ok", publishes=True)])


def test_one_line_per_failing_account_one_for_the_unknown_and_a_count_of_the_healthy() -> None:
    units = [
        healthy(A, "eu-west-1"),
        healthy(A, "us-east-2"),
        # B: its role missing in one region, a GPU box without GPU metrics in the other: one line, both said.
        MemberUnitFacts(
            B,
            "sandbox-b",
            "eu-west-1",
            role_reason="role-missing",
            role_detail="the member role is missing (AccessDenied)",
        ),
        MemberUnitFacts(B, "sandbox-b", "us-east-2", gpu=[gpu_box("i-0blind", publishes=False)]),
        # C: not reached in time in one region: unknown, never counted healthy.
        healthy(C, "eu-west-1"),
        MemberUnitFacts(C, "acct-3", "us-east-2", reached=False),
        # D: denied by an SCP; E: suspended since it was listed (a warning, not a fault).
        MemberUnitFacts(D, "", "eu-west-1", role_reason="denied-by-scp", role_detail="a service control policy denies"),
        healthy(D, "us-east-2"),
        MemberUnitFacts(E, "old", "eu-west-1", role_reason="suspended", role_detail="the account is suspended"),
        MemberUnitFacts(E, "old", "us-east-2", role_reason="suspended", role_detail="the account is suspended"),
    ]
    findings = check_members(units)
    by_subject = {f.subjects: f for f in findings if f.check == "members.account"}
    assert sorted(by_subject) == [(B,), (D,), (E,)]
    b = by_subject[(B,)]
    assert b.status == "fail"
    assert b.message == (
        f"member account {B} 'sandbox-b': eu-west-1: role-missing: the member role is missing (AccessDenied); "
        "us-east-2: 1 GPU machine(s) without GPU metrics in the last hour: i-0blind"
    )
    assert "stack instance" in b.fix and "GPU agent tag" in b.fix
    assert by_subject[(D,)].status == "fail" and by_subject[(D,)].message.startswith(f"member account {D}: eu-west-1")
    assert by_subject[(E,)].status == "warn"
    [unknown] = [f for f in findings if f.check == "members.unknown"]
    assert unknown.status == "unknown" and unknown.subjects == (f"{C}/us-east-2 (not reached in time)",)
    [summary] = [f for f in findings if f.check == "members"]
    assert summary.status == "ok" and summary.message.startswith("1 of 5 member account(s) healthy")  # A alone


def test_nothing_read_is_never_ok() -> None:
    # The role assumed, but the GPU machines' metrics could not be read; a throttled AssumeRole.
    units = [
        MemberUnitFacts(A, "a", "eu-west-1", gpu=[gpu_box("i-1", publishes=False, complete=False)]),
        MemberUnitFacts(B, "b", "eu-west-1", role_reason="throttled", role_detail="AWS throttled the call"),
        MemberUnitFacts(C, "c", "eu-west-1"),  # nothing read at all
        MemberUnitFacts(D, "d", "eu-west-1", excluded=True),  # excluded: its role is all there is to check
    ]
    findings = check_members(units)
    assert [f.check for f in findings if f.status == "fail"] == []
    [unknown] = [f for f in findings if f.check == "members.unknown"]
    assert [s.split(" ")[0] for s in unknown.subjects] == [f"{A}/eu-west-1", f"{B}/eu-west-1", f"{C}/eu-west-1"]
    assert [f.message for f in findings if f.check == "members"] == [
        "1 of 4 member account(s) healthy in every region: the member role assumed, its GPU machines publishing "
        "GPU metrics"
    ]


def test_the_cli_says_once_that_it_cannot_read_member_metrics_and_checks_the_stacks() -> None:
    units = [
        MemberUnitFacts(A, "a", "eu-west-1"),
        MemberUnitFacts(B, "b", "eu-west-1", stack="OUTDATED/FAILED: ResourceLogicalId:HubRole, Role exists"),
    ]
    findings = check_members(units, gpu_unread="not with these credentials", skipped=[E], listing_error="Throttling")
    checks = {f.check: f for f in findings}
    assert checks["members.gpu"].status == "unknown"
    assert (
        checks["members.account"].subjects == (B,)
        and "member stack OUTDATED/FAILED" in checks["members.account"].message
    )
    assert checks["members.suspended"].subjects == (E,) and checks["members.suspended"].status == "warn"
    assert checks["members.listing"].status == "unknown"
    assert checks["members"].message.startswith("1 of 2")
    assert "members.unknown" not in checks


def test_no_member_account_is_a_warning_not_ok() -> None:
    [finding] = check_members([])
    assert (finding.check, finding.status) == ("members", "warn")


def test_a_failed_listing_with_no_account_known_is_unknown_not_none_enrolled() -> None:
    [finding] = check_members([], listing_error="AccessDeniedException: not allowed")
    assert (finding.check, finding.status) == ("members.listing", "unknown")
    assert "AccessDeniedException" in finding.message and "no earlier listing is known" in finding.message
    # With an earlier listing, that listing's accounts are checked and said so.
    findings = check_members([healthy(A, "eu-west-1")], listing_error="Throttling")
    assert "the last listing was checked" in next(f for f in findings if f.check == "members.listing").message


def test_where_no_gpu_metrics_were_read_the_ok_line_does_not_claim_them() -> None:
    findings = check_members([MemberUnitFacts(A, "a", "eu-west-1")], gpu_unread="not with these credentials")
    [ok] = [f for f in findings if f.check == "members"]
    assert ok.message == "1 of 1 member account(s) in every region: member role assumed (as the sweep last saw it)"
    assert "GPU" not in ok.message
