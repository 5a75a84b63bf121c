"""`idle-reaper doctor`: what would make a deploy quietly useless, decided from gathered facts.

Pure: each check is a function from facts (gathered by the CLI's thin adapters) to findings. A fact that
could not be gathered is None and makes its finding "unknown", never "ok".
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from idle_reaper.policy import TeamPolicyRef

Status = Literal["ok", "warn", "fail", "unknown"]
LIST_LIMIT = 10  # subjects named in a line; --json carries all of them


class Finding(BaseModel):
    """One line of the doctor's answer; `--json` prints a list of these (a stable interface)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    check: str
    status: Status
    subjects: tuple[str, ...] = ()
    message: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status.upper():<7} {self.check}: {self.message}"
        return f"{text}\n        fix: {self.fix}" if self.status != "ok" and self.fix else text


def failed(findings: Sequence[Finding]) -> bool:
    return any(f.status == "fail" for f in findings)


STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "unknown")


def tally(findings: Sequence[Finding]) -> str:
    """ "14 ok, 1 warn, 2 fail, 0 unknown": the last line of the answer."""
    return ", ".join(f"{sum(1 for f in findings if f.status == s)} {s}" for s in STATUSES)


def listed(subjects: Sequence[str]) -> str:
    shown = ", ".join(subjects[:LIST_LIMIT])
    return shown + (f" and {len(subjects) - LIST_LIMIT} more" if len(subjects) > LIST_LIMIT else "")


def verdict(check: str, subjects: Sequence[str], *, ok: str, bad: str, fix: str, status: Status = "fail") -> Finding:
    """`status` naming the subjects when there are any, else ok: the shape of most checks."""
    if not subjects:
        return Finding(check=check, status="ok", message=ok)
    return Finding(check=check, status=status, subjects=tuple(subjects), message=bad, fix=fix)


def outcomes(check: str, ok: str, could_not: str | None, *failures: tuple[Sequence[str], str, str]) -> list[Finding]:
    """A fail per (subjects, message, fix) with subjects, an unknown when some could not be checked, else ok."""
    out = [
        Finding(check=check, status="fail", subjects=tuple(subjects), message=bad, fix=fix)
        for subjects, bad, fix in failures
        if subjects
    ]
    if could_not:
        out.append(unknown(check, could_not))
    return out or [Finding(check=check, status="ok", message=ok)]


def unknown(check: str, why: str, fix: str = "") -> Finding:
    return Finding(check=check, status="unknown", message=f"could not check: {why}", fix=fix)


# ---------------------------------------------------------------------------------------------
# Policy


@dataclass(frozen=True)
class PolicyFacts:
    settings_parameter: str
    settings_problems: tuple[str, ...]  # the sweep's own validation messages; empty when valid or absent
    teams: Mapping[str, TeamPolicyRef]  # every stored team parameter, loaded as the sweep loads it
    machine_teams: Sequence[str] | None  # the Team tag of each opted-in machine; None: could not list them


def check_policy(facts: PolicyFacts) -> list[Finding]:
    out: list[Finding] = []
    if facts.settings_problems:
        out.append(
            Finding(
                check="policy.settings",
                status="fail",
                subjects=(facts.settings_parameter,),
                message=f"{facts.settings_parameter} is invalid, so no sweep runs: "
                + "; ".join(facts.settings_problems),
                fix=f"idle-reaper policy validate --settings FILE, then aws ssm put-parameter --overwrite "
                f"--name {facts.settings_parameter} --value file://FILE",
            )
        )
    else:
        out.append(Finding(check="policy.settings", status="ok", message=f"{facts.settings_parameter} is valid"))
    invalid = sorted((ref for ref in facts.teams.values() if ref.policy is None), key=lambda r: r.team)
    if invalid:
        out.append(
            Finding(
                check="policy.teams",
                status="fail",
                subjects=tuple(ref.team for ref in invalid),
                message=f"{len(invalid)} team(s) in safe mode (nothing of theirs is stopped): "
                + "; ".join(f"{ref.team}: {ref.error}" for ref in invalid[:LIST_LIMIT]),
                fix="idle-reaper policy validate FILE, then idle-reaper policy put TEAM FILE",
            )
        )
    else:
        out.append(Finding(check="policy.teams", status="ok", message=f"{len(facts.teams)} team policies valid"))
    if facts.machine_teams is None:
        out.append(unknown("policy.default", "the opted-in machines could not be listed"))
    else:
        uncovered = sorted({team for team in facts.machine_teams if team not in facts.teams})
        if uncovered:
            out.append(
                Finding(
                    check="policy.default",
                    status="warn",
                    subjects=tuple(uncovered),
                    message=f"{len(uncovered)} team(s) with machines but no policy use the default policy: "
                    + listed(uncovered),
                    fix="idle-reaper policy put TEAM FILE for each, if the default is not what they want",
                )
            )
        else:
            out.append(Finding(check="policy.default", status="ok", message="every team with machines has a policy"))
    return out


# ---------------------------------------------------------------------------------------------
# Slack

# "joins": a public channel the bot is not in yet, which it joins the first time it posts there.
ChannelState = Literal["member", "joins", "not_member", "not_found"]


@dataclass(frozen=True)
class SlackFacts:
    auth_error: str | None  # None: the token works; "unreachable: ..." when Slack could not be asked
    granted_scopes: frozenset[str] | None  # from the x-oauth-scopes header; None: not seen
    required_scopes: frozenset[str]  # the manifest's bot scopes
    signing_secret_present: bool
    channels: Mapping[str, ChannelState | None] = field(default_factory=dict)  # None: could not check
    channel_teams: Mapping[str, Sequence[str]] = field(default_factory=dict)  # channel -> teams (or "admins")
    users: Mapping[str, bool | None] = field(default_factory=dict)  # user id -> exists; None: could not check
    user_roles: Mapping[str, Sequence[str]] = field(default_factory=dict)  # user id -> "admin" / "TEAM member"

    @property
    def reachable(self) -> bool:
        return self.auth_error is None


UNREACHABLE = "unreachable"
# slack/manifest.yml's bot scopes (a test keeps the two equal): what the granted scopes must cover.
MANIFEST_BOT_SCOPES = frozenset(
    {
        "chat:write",
        "chat:write.public",
        "im:write",
        "users:read",
        "users:read.email",
        "commands",
        "usergroups:read",
        "im:history",
        "channels:history",
        "groups:history",
        "channels:join",
        "channels:read",
        "groups:read",
        "files:write",
    }
)


def check_slack(facts: SlackFacts) -> list[Finding]:
    out: list[Finding] = []
    if facts.signing_secret_present:
        out.append(Finding(check="slack.signing_secret", status="ok", message="the signing secret is present"))
    else:
        out.append(
            Finding(
                check="slack.signing_secret",
                status="fail",
                message="no signing secret: every button and /idle-reaper command is refused",
                fix="put signing_secret (Slack app -> Basic Information -> Signing Secret) into the Slack secret",
            )
        )
    if facts.auth_error is not None and facts.auth_error.startswith(UNREACHABLE):
        return [*out, unknown("slack.token", facts.auth_error, "run again when Slack answers")]
    if facts.auth_error is not None:
        return [
            *out,
            Finding(
                check="slack.token",
                status="fail",
                message=f"auth.test refused the bot token ({facts.auth_error}): nobody is warned",
                fix="reinstall the Slack app and put its Bot User OAuth Token into the Slack secret as bot_token",
            ),
        ]
    out.append(Finding(check="slack.token", status="ok", message="the bot token is valid (auth.test)"))
    if facts.granted_scopes is None:
        out.append(unknown("slack.scopes", "Slack sent no x-oauth-scopes header"))
    else:
        missing = sorted(facts.required_scopes - facts.granted_scopes)
        out.append(
            verdict(
                "slack.scopes",
                missing,
                ok="every scope the manifest asks for",
                bad=f"the app lacks scope(s) slack/manifest.yml asks for: {', '.join(missing)}",
                fix="Slack app -> OAuth & Permissions -> Bot Token Scopes: add them, then reinstall the app",
            )
        )
    out += _channels(facts)
    out += _users(facts)
    return out


def _channels(facts: SlackFacts) -> list[Finding]:
    if not facts.channels:
        return [Finding(check="slack.channels", status="ok", message="no team or admin channel configured")]
    could_not = sorted(c for c, state in facts.channels.items() if state is None)
    absent = sorted(c for c, state in facts.channels.items() if state == "not_found")
    outside = sorted(c for c, state in facts.channels.items() if state == "not_member")
    joins = sorted(c for c, state in facts.channels.items() if state == "joins")

    def named(channels: list[str]) -> str:
        return listed([f"{c} ({', '.join(facts.channel_teams.get(c, ()))})" for c in channels])

    ok = f"the bot is in all {len(facts.channels)} channels"
    if joins:
        ok = (
            f"the bot can post in all {len(facts.channels)} channels; it joins the public one(s) it is not in yet "
            f"the first time it posts there: {named(joins)}"
        )
    return outcomes(
        "slack.channels",
        ok,
        f"Slack did not answer for {listed(could_not)}" if could_not else None,
        (
            absent,
            f"channel(s) the bot cannot see (channel_not_found): {named(absent)}",
            "correct slack_channel in the team policy, or invite the bot to the private channel: /invite @idle-reaper",
        ),
        (
            outside,
            f"the bot is not a member of private channel(s): {named(outside)}",
            "in each channel: /invite @idle-reaper",
        ),
    )


def _users(facts: SlackFacts) -> list[Finding]:
    missing = sorted(u for u, exists in facts.users.items() if exists is False)
    could_not = sorted(u for u, exists in facts.users.items() if exists is None)
    return outcomes(
        "slack.users",
        f"all {len(facts.users)} admins and members exist",
        f"Slack did not answer for {listed(could_not)}" if could_not else None,
        (
            missing,
            "user id(s) Slack does not know (user_not_found): "
            + listed([f"{u} ({', '.join(facts.user_roles.get(u, ()))})" for u in missing]),
            "correct admins in the settings or members in the team policy (Slack profile -> Copy member ID)",
        ),
    )


# ---------------------------------------------------------------------------------------------
# People


@dataclass(frozen=True)
class OwnedMachine:
    instance_id: str
    team: str
    owner: str | None
    resolved: bool | None  # the Owner tag names a Slack user; None: could not check


@dataclass(frozen=True)
class TeamContacts:
    team: str
    channel: str | None
    members: int


def check_people(machines: Sequence[OwnedMachine] | None, teams: Sequence[TeamContacts]) -> list[Finding]:
    if machines is None:
        return [unknown("people.owners", "the opted-in machines could not be listed")]
    unresolved = [m for m in machines if m.resolved is False]
    could_not = [m for m in machines if m.resolved is None and m.owner]
    by_team: dict[str, list[str]] = {}
    for m in unresolved:
        by_team.setdefault(m.team, []).append(f"{m.instance_id} ({m.owner or 'no Owner tag'})")
    out = outcomes(
        "people.owners",
        f"all {len(machines)} owners resolve",
        f"Slack did not answer for {len(could_not)} owner(s)" if could_not else None,
        (
            [m.instance_id for m in unresolved],
            f"{len(unresolved)} machine(s) whose Owner is no Slack user: "
            + "; ".join(f"team {t}: {len(ms)}: {listed(ms)}" for t, ms in sorted(by_team.items())),
            "set each machine's Owner tag to its owner's Slack email or member id: "
            "aws ec2 create-tags --resources ID --tags Key=Owner,Value=EMAIL",
        ),
    )
    with_owner = {m.team for m in machines if m.resolved}
    contacts = {t.team: t for t in teams}
    alone = sorted(
        team
        for team in {m.team for m in machines}
        if team not in with_owner and not (contacts.get(team) and (contacts[team].channel or contacts[team].members))
    )
    out.append(
        verdict(
            "people.reachable",
            alone,
            ok="every team has someone to tell",
            bad=f"team(s) with nobody to tell (no owner resolves, no channel, no members): {listed(alone)}",
            fix="give the team a slack_channel or members in its policy, or fix its machines' Owner tags",
        )
    )
    return out


# ---------------------------------------------------------------------------------------------
# Signals: what the last hour of metrics says about the agents

SIGNAL_WINDOW_MINUTES = 60


@dataclass(frozen=True)
class MachineSignals:
    instance_id: str
    team: str
    gpu_expected: bool  # a type that can have a GPU: its GPU metric is read
    collector_expected: bool  # its team's policy reads the human-activity collector
    max_gap_minutes: int
    complete: bool  # False: CloudWatch could not be read for it
    cpu: Sequence[datetime]  # datapoint times of the last hour
    gpu: int
    user: int


def largest_gap_minutes(times: Sequence[datetime], start: datetime, end: datetime) -> float:
    """The longest stretch of the window [start, end] with no datapoint (the lag at the end included)."""
    edges = [start, *sorted(times), end]
    return max((b - a).total_seconds() / 60 for a, b in itertools.pairwise(edges))


def gpu_metrics_missing(read: Sequence[MachineSignals]) -> list[str]:
    """GPU machines that publish CPU but no GPU datapoints (of those CloudWatch could be read for)."""
    return sorted(m.instance_id for m in read if m.complete and m.gpu_expected and m.cpu and not m.gpu)


def check_gpu_metrics(read: Sequence[MachineSignals], *, missing: Sequence[str] = ()) -> Finding:
    """`read`'s GPU machines without GPU metrics, and `missing` (found so where they were read: a fan-out's shards)."""
    no_gpu = sorted({*gpu_metrics_missing(read), *missing})
    return verdict(
        "signals.gpu",
        no_gpu,
        ok="every GPU machine publishes GPU metrics",
        bad=f"{len(no_gpu)} GPU machine(s) without GPU metrics in the last hour (the agent is missing or "
        f"broken; under missing_gpu_metrics: busy they are never idle): {listed(no_gpu)}",
        fix="install the CloudWatch agent with the GPU config on them (docs/deploying.md, step 7)",
    )


def check_signals(
    machines: Sequence[MachineSignals] | None, start: datetime, end: datetime, period_minutes: int
) -> list[Finding]:
    if machines is None:
        return [unknown("signals", "the opted-in machines could not be listed")]
    read = [m for m in machines if m.complete]
    out: list[Finding] = []
    unread = sorted(m.instance_id for m in machines if not m.complete)
    if unread:
        out.append(
            unknown("signals.read", f"CloudWatch could not be read for {len(unread)} machine(s): {listed(unread)}")
        )
    out.append(check_gpu_metrics(read))
    no_collector = sorted(m.instance_id for m in read if m.collector_expected and m.cpu and not m.user)
    out.append(
        verdict(
            "signals.collector",
            no_collector,
            status="warn",
            ok="every machine's collector reports",
            bad=f"{len(no_collector)} machine(s) without collector data in the last hour (a person's input "
            f"cannot keep them): {listed(no_collector)}",
            fix="roll the activity collector out to them (agent/README.md; docs/deploying.md, step 7)",
        )
    )
    # A hole no longer than one period plus the policy's tolerance still counts as covered.
    holes = sorted(
        m.instance_id for m in read if largest_gap_minutes(m.cpu, start, end) > m.max_gap_minutes + period_minutes
    )
    out.append(
        verdict(
            "signals.cpu",
            holes,
            status="warn",
            ok="CPU data covers every machine",
            bad=f"{len(holes)} machine(s) with CPU data holes longer than max_gap_minutes in the last hour "
            f"(judged unknown, never stopped): {listed(holes)}",
            fix="check the machine is running and publishing AWS/EC2 CPUUtilization; raise max_gap_minutes "
            "if the holes are expected",
        )
    )
    return out


# ---------------------------------------------------------------------------------------------
# The deploy


@dataclass(frozen=True)
class LastSweep:
    at: datetime
    failed_shards: int
    errors: int


def check_last_sweep(last: LastSweep | Literal["unreadable"] | None, now: datetime, interval_minutes: int) -> Finding:
    check = "deploy.last_sweep"
    if last == "unreadable":
        return unknown(check, "the state table could not be read")
    if last is None:
        return Finding(
            check=check,
            status="fail",
            message="no sweep has finished in the last 30 days: the schedule is disabled, or every sweep fails",
            fix="aws scheduler get-schedule / the EventBridge rule of the stack: State ENABLED; then read the "
            "sweep function's logs",
        )
    age = (now - last.at).total_seconds() / 60
    if age > 2 * interval_minutes:
        return Finding(
            check=check,
            status="fail",
            subjects=(last.at.isoformat(),),
            message=f"the last sweep finished {age:.0f} minutes ago (at {last.at.isoformat()}), more than two "
            f"{interval_minutes}-minute intervals: the schedule is disabled or the sweep no longer finishes",
            fix="enable the stack's sweep schedule (EventBridge console -> Rules/Schedules) and read the sweep "
            "function's logs",
        )
    if last.failed_shards or last.errors:
        return Finding(
            check=check,
            status="warn",
            message=f"the last sweep ({age:.0f} minutes ago) had {last.failed_shards} failed shard(s) and "
            f"{last.errors} machine error(s)",
            fix="read the sweep and shard functions' logs (idle-reaper status shows the machines' errors)",
        )
    return Finding(check=check, status="ok", message=f"the last sweep finished {age:.0f} minutes ago, cleanly")


def check_groups(opted_in_members: Mapping[str, int] | None, tagged: set[str], opt_in_tag: str | None) -> Finding:
    """Auto Scaling groups whose members are opted in while the group is not: the reaper may not touch the
    group's scale-in protection (its IAM conditions on the group's tag), so those machines are never released."""
    check = "deploy.groups"
    if opt_in_tag is None:
        return Finding(check=check, status="ok", message="no opt-in tag is set: groups need none")
    if opted_in_members is None:
        return unknown(check, "the Auto Scaling groups could not be read")
    untagged = sorted(g for g in opted_in_members if g not in tagged)
    return verdict(
        check,
        untagged,
        ok=f"all {len(opted_in_members)} groups carry {opt_in_tag}",
        bad=f"{len(untagged)} Auto Scaling group(s) with opted-in members but no {opt_in_tag}=true tag "
        f"(their members are never released): {listed(untagged)}",
        fix="aws autoscaling create-or-update-tags --tags ResourceId=GROUP,ResourceType=auto-scaling-group,"
        f"Key={opt_in_tag},Value=true,PropagateAtLaunch=true",
    )


# ---------------------------------------------------------------------------------------------
# The daily subset the sweep runs, and what it remembers between days

# Cheap enough for a sweep: the sweep has read most of what they need already.
DAILY_CHECKS = (
    "policy.teams",
    "slack.channels",
    "people.owners",
    "signals.gpu",
    "studio.tags",
    "studio.lifecycle",
    "studio.signals",
)


def finding_key(finding: Finding) -> str:
    """The failure a finding names: its check and its subjects (hashed: a list of machines can be long). The
    same failure seen again has the same key; another set of subjects is another failure."""
    digest = hashlib.sha256("\n".join(sorted(finding.subjects)).encode()).hexdigest()[:20]
    return f"{finding.check}#{digest}"


@dataclass(frozen=True)
class Remembered:
    """What a daily run leaves for the next: the keys of the failures told (per check), and the keys told
    before whose failure has cleared, so a failure that comes back is told again."""

    failing: Mapping[str, tuple[str, ...]]
    cleared: tuple[str, ...]


def remember(previous: Mapping[str, Sequence[str]], findings: Sequence[Finding]) -> Remembered:
    """A check that could not be told this time (any unknown finding) keeps what it remembered: a failure
    cannot be said to have cleared when nobody could look."""
    failing: dict[str, tuple[str, ...]] = {}
    cleared: list[str] = []
    checks = {f.check for f in findings}
    for check in sorted(checks | set(previous)):
        mine = [f for f in findings if f.check == check]
        now_failing = tuple(sorted(finding_key(f) for f in mine if f.status == "fail"))
        before = tuple(previous.get(check, ()))
        if not mine or any(f.status == "unknown" for f in mine):
            kept = tuple(sorted(set(before) | set(now_failing)))
        else:
            kept = now_failing
            cleared += [key for key in before if key not in now_failing]
        if kept:
            failing[check] = kept
    return Remembered(failing, tuple(cleared))


# ---------------------------------------------------------------------------------------------
# Organization mode: every member account

# What to do about a member account the hub cannot work in, by accounts.Reason (its value).
MEMBER_FIXES = {
    "role-missing": "make sure the member StackSet has a current stack instance in this account and region "
    "(CloudFormation > StackSets > <prefix>-members > Stack instances; one that failed because the region is not "
    "enabled in this account: enable it there, or take it out of the organization's regions) and that its role "
    "trusts this hub's roles",
    "denied-by-scp": "allow sts:AssumeRole on <prefix>-member-<region> for the hub's roles in the service control "
    "policies above this account",
    "region-disabled": "enable the region in this account, or take it out of the organization's regions",
    "suspended": "nothing, if the account was closed on purpose: it is not swept any more",
    "left-organization": "nothing, if it left on purpose: it is not swept any more",
    "error": "see the detail; the sweep reports the same in `idle-reaper status`",
}
MEMBER_STACK_FIX = "read the stack instance's status reason (CloudFormation > StackSets > <prefix>-members) and fix it"
MEMBER_READ_FIX = (
    "update the member StackSet's stack instance in this account and region (its <prefix>-digest-read-<region> "
    "role must trust the hub's digest role), and allow sts:AssumeRole on it in the service control policies"
)
MEMBER_GPU_FIX = (
    "give those machines the GPU agent tag (the member stack's association installs the CloudWatch agent with the "
    "GPU config); docs/deploying.md, step 7"
)
MEMBER_WARN_ONLY = frozenset({"suspended", "left-organization"})  # a choice someone made, not a fault
MEMBER_UNKNOWN = frozenset({"throttled"})  # cannot tell now: unknown, never ok


@dataclass(frozen=True)
class MemberUnitFacts:
    """What the doctor learned of one member account in one region. Nothing learned is not "ok": `reached`
    False (out of time) and a failed read (`unreadable`) are unknown."""

    account: str
    name: str
    region: str
    reached: bool = True
    role_reason: str | None = None  # why the member role could not be assumed (accounts.Reason); None: assumed
    role_detail: str = ""  # what it means and AWS's error ("the member role is missing ... (AccessDenied: ...)")
    stack: str | None = None  # the member stack instance's status where it is not current; None: current/not read
    excluded: bool = False  # organization settings exclude it: its machines are not read
    gpu: Sequence[MachineSignals] | None = None  # the last hour of its GPU machines; None: not read
    unreadable: str = ""  # a read in the account failed after the role was assumed
    # Why the weekly digest could not assume the read role here, as its last run saw it (its exempt machines
    # are "no data" there); None: assumed, or not tried (no exempt machine here), or not read.
    read_role: str | None = None


def _member_label(unit: MemberUnitFacts) -> str:
    name = unit.name.strip()
    return f"{unit.account} {name!r}" if name and name != unit.account else unit.account


def _unit_problem(unit: MemberUnitFacts) -> tuple[Status, str] | None:
    """What is wrong with one (account, region), and how bad; None: healthy, or not known (see _unit_unknown)."""
    if not unit.reached:
        return None
    if unit.role_reason is not None and unit.role_reason not in MEMBER_UNKNOWN:
        status: Status = "warn" if unit.role_reason in MEMBER_WARN_ONLY else "fail"
        return status, f"{unit.region}: {unit.role_reason}: {unit.role_detail}"
    problems = []
    if unit.stack:
        problems.append(f"member stack {unit.stack}")
    if unit.gpu is not None and (no_gpu := _no_gpu(unit.gpu)):
        problems.append(f"{len(no_gpu)} GPU machine(s) without GPU metrics in the last hour: {listed(no_gpu)}")
    if problems:
        return "fail", f"{unit.region}: {'; '.join(problems)}"
    # Nothing unsafe: only the digest's figures for this account's exempt machines are missing.
    return ("warn", f"{unit.region}: the weekly digest's read role: {unit.read_role}") if unit.read_role else None


def _unit_fixes(unit: MemberUnitFacts) -> list[str]:
    if unit.role_reason is not None:
        return [MEMBER_FIXES.get(unit.role_reason, MEMBER_FIXES["error"])]
    fixes = [
        *([MEMBER_STACK_FIX] if unit.stack else []),
        *([MEMBER_GPU_FIX] if unit.gpu and _no_gpu(unit.gpu) else []),
    ]
    return fixes or ([MEMBER_READ_FIX] if unit.read_role else [])  # as _unit_problem: the read role alone


def _no_gpu(read: Sequence[MachineSignals]) -> list[str]:
    return sorted(m.instance_id for m in read if m.complete and m.gpu_expected and m.cpu and not m.gpu)


def _unit_unknown(unit: MemberUnitFacts, gpu_unread: str | None = None) -> str | None:
    """Why one (account, region) could not be told healthy; None: it could."""
    if not unit.reached:
        return "not reached in time"
    if unit.role_reason in MEMBER_UNKNOWN:
        return unit.role_detail or unit.role_reason
    if unit.role_reason is not None:
        return None
    if unit.unreadable:
        return unit.unreadable
    if not unit.excluded and not gpu_unread and (unit.gpu is None or any(not m.complete for m in unit.gpu)):
        return "its GPU machines' metrics could not be read"
    return None


def check_members(
    units: Sequence[MemberUnitFacts],
    *,
    listing_error: str | None = None,
    skipped: Sequence[str] = (),
    gpu_unread: str | None = None,
) -> list[Finding]:
    """Organization mode: one line per member account with a problem (each region's problem named, with the
    fix of each), one line for the account-regions that could not be checked (unknown, never ok), and a count
    of the healthy accounts (every region's role assumed and its GPU machines publishing). `skipped`: accounts
    the listing left out (suspended), said once. `gpu_unread`: why no member account's GPU metrics were read
    (the CLI, whose credentials are not the hub's), said once as unknown."""
    out: list[Finding] = []
    if gpu_unread:
        out.append(unknown("members.gpu", gpu_unread, "ask `/idle-reaper doctor` in Slack: it runs as the hub"))
    by_account: dict[str, list[MemberUnitFacts]] = {}
    for unit in units:
        by_account.setdefault(unit.account, []).append(unit)
    if listing_error:
        # With no earlier listing, nothing is known of the member accounts: not "none enrolled" (a warning).
        known = "the last listing was checked" if by_account else "no earlier listing is known: none was checked"
        out.append(
            unknown(
                "members.listing",
                f"the member accounts could not be listed ({listing_error}); {known}",
                "check the hub's access to AWS Organizations",
            )
        )
    healthy, unknowns = 0, []
    for account in sorted(by_account):
        regions = sorted(by_account[account], key=lambda u: u.region)
        problems = [(p, u) for u in regions if (p := _unit_problem(u)) is not None]
        not_known = [
            f"{account}/{u.region} ({why})" for u in regions if (why := _unit_unknown(u, gpu_unread)) is not None
        ]
        unknowns += not_known
        if problems:
            worst = "fail" if any(status == "fail" for (status, _), _ in problems) else "warn"
            fixes = dict.fromkeys(fix for _, u in problems for fix in _unit_fixes(u))
            out.append(
                Finding(
                    check="members.account",
                    status=worst,
                    subjects=(account,),
                    message=f"member account {_member_label(regions[0])}: "
                    + "; ".join(text for (_, text), _ in problems),
                    fix="; ".join(fixes),
                )
            )
        elif not not_known:
            healthy += 1
    if skipped:
        out.append(
            Finding(
                check="members.suspended",
                status="warn",
                subjects=tuple(skipped),
                message=f"{len(skipped)} account(s) under the targets are suspended or closed, not swept: "
                f"{listed(list(skipped))}",
                fix=MEMBER_FIXES["suspended"],
            )
        )
    if unknowns:
        out.append(
            Finding(
                check="members.unknown",
                status="unknown",
                subjects=tuple(unknowns),
                message=f"could not check {len(unknowns)} member account-region(s): {listed(unknowns)}",
                fix="run the doctor again; a member account not checked is not known to be healthy",
            )
        )
    if not by_account and not listing_error:  # with a listing error: unknown, said above
        out.append(
            Finding(
                check="members",
                status="warn",
                message="no member account is enrolled under the target OUs",
                fix="check the targets in the `organization` context, and that the accounts are ACTIVE",
            )
        )
    elif healthy:
        # Say only what was checked: where no GPU metrics were read (the CLI), the role as the sweep last saw it.
        seen = (
            "in every region: member role assumed (as the sweep last saw it)"
            if gpu_unread
            else "healthy in every region: the member role assumed, its GPU machines publishing GPU metrics"
        )
        out.append(
            Finding(check="members", status="ok", message=f"{healthy} of {len(by_account)} member account(s) {seen}")
        )
    return out
