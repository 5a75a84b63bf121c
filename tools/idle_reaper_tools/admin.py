"""Admin commands: `idle-reaper policy {validate,put,plan,show,list,schema}` and `idle-reaper status`.

Wiring around the policy models (policy), the SSM store (aws.PolicyStore) and a dry-run sweep (sweep).
Nothing here decides about a machine: `plan` asks the same core the sweep uses.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from idle_reaper import aws
from idle_reaper.aws.accounts import MemberCheck, MemberSweep, last_member_check, last_member_sweep
from idle_reaper.aws.limits import SSM_STANDARD_CHARS, TooLargeToStore, ssm_tier
from idle_reaper.core import REAP_ACTIONS, Decision, Machine, MachineRecord, State, describe_human_signal
from idle_reaper.core.dollars import dollars, of_record
from idle_reaper.core.endpoints import endpoint_policy, is_endpoint_id
from idle_reaper.core.kinds import NEVER_STOPPED, NOTEBOOK_GAPS, TERMINABLE, Kind
from idle_reaper.core.reading import parse_next_read
from idle_reaper.core.records import machine_key
from idle_reaper.core.sections import MACHINES, grouped, kinds_said, section_of, state_words
from idle_reaper.core.studio import StudioFinding
from idle_reaper.notify import LoggingNotifier
from idle_reaper.organization import OrganizationSettings
from idle_reaper.policy import (
    PolicyError,
    Settings,
    TeamPolicy,
    TeamPolicyRef,
    active_schedules,
    default_source,
    effective_policy,
    json_schema,
    parse_settings,
    parse_team_policy,
    schedule_zone,
)
from idle_reaper.pricing import hourly_price
from idle_reaper.sweep import Adapters, SweepCannotRun, logger, run_sweep
from idle_reaper.sweep.studio import studio_findings

EXIT_INVALID = 1  # invalid input, refused, or nothing written
EXIT_ERROR = 2  # could not run (unreadable file, AWS unreachable)

# A team is one segment of an SSM parameter name.
_TEAM = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
BUILT_IN = "built-in default"


class NotInteractive(Exception):
    """No terminal to ask on."""


class _Fail(Exception):
    def __init__(self, message: str, code: int = EXIT_INVALID) -> None:
        super().__init__(message)
        self.code = code


def confirm(prompt: str) -> bool:
    """Ask the person at the terminal. Module-level so tests can stand in for them."""
    if not sys.stdin.isatty():
        raise NotInteractive
    return input(prompt).strip().lower() in ("y", "yes")


def _err(message: str) -> None:
    print(f"idle-reaper: {message}", file=sys.stderr)


def _run(body: Callable[[], int]) -> int:
    try:
        return body()
    except _Fail as exc:
        _err(str(exc))
        return exc.code


def _policy_store() -> aws.PolicyStore:
    return aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _Fail(f"cannot read {path}: {exc}", EXIT_ERROR) from None


def _check_team(team: str) -> None:
    if not _TEAM.fullmatch(team):
        raise _Fail(f"team {team!r}: use letters, digits, '_', '.' and '-' only (it becomes an SSM parameter name)")


def _print_problems(exc: PolicyError) -> None:
    # One line per problem, each naming the file or parameter and the field: easy to read and to grep.
    for problem in exc.problems:
        print(f"{exc.parameter}: {problem}", file=sys.stderr)
    count = len(exc.problems)
    print(f"{exc.parameter}: {count} problem{'s' if count != 1 else ''}", file=sys.stderr)


@dataclass(frozen=True)
class StoredSettings:
    settings: Settings
    parameter: aws.StoredParameter | None

    @property
    def label(self) -> str:
        p = self.parameter
        return f"{p.name}@v{p.version}" if p else "(no settings parameter)"


def load_settings(store: aws.PolicyStore) -> StoredSettings:
    """The stored settings with their version; a PolicyError when they are invalid."""
    param = store.read(store.settings_name)
    settings = parse_settings(param.name, param.value) if param else Settings()
    return StoredSettings(settings, param)


def _settings_or_default(store: aws.PolicyStore, instead: str) -> Settings:
    """The stored settings, or the defaults (saying so, and why) when they are invalid: for read-only views."""
    try:
        return load_settings(store).settings
    except PolicyError as exc:
        _err(f"{exc}; {instead}")
        return Settings()


def _settings_or_fail(store: aws.PolicyStore) -> StoredSettings:
    try:
        return load_settings(store)
    except PolicyError as exc:
        _print_problems(exc)
        raise _Fail(f"the stored settings {exc.parameter} are invalid; fix them first") from None


def policy_document(policy: TeamPolicy) -> dict[str, Any]:
    """A policy as JSON with every default filled in; unset schedule fields left out for readability."""
    doc = policy.model_dump(mode="json")
    doc["schedules"] = [{k: v for k, v in s.items() if v is not None} for s in doc["schedules"]]
    return doc


def _pretty(doc: Any) -> str:
    return json.dumps(doc, indent=2) + "\n"


def _fmt_time(when: datetime | None) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M") if when else "-"


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the last column (reasons) runs free."""
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in rows
    )


# ---------------------------------------------------------------------------------------------
# policy schema / validate


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(Settings if args.settings else TeamPolicy), indent=2))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    def body() -> int:
        text = _read_file(args.file)
        try:
            if args.settings:
                parse_settings(args.file, text)
            else:
                # Offline by default (editors, CI): merged on the built-in defaults. `put` always merges
                # on the stored settings' default_policy; --stored-defaults checks exactly that.
                default = _settings_or_fail(_policy_store()).settings.default_policy if args.stored_defaults else None
                parse_team_policy(args.file, text, default or TeamPolicy())
        except PolicyError as exc:
            _print_problems(exc)
            return EXIT_INVALID
        if args.settings and ssm_tier(text, args.file) == "Advanced":  # stored as it is, by hand
            print(
                f"{args.file}: valid; {len(text):,} characters, over the {SSM_STANDARD_CHARS:,} of SSM's Standard "
                "tier: store it in the Advanced tier (aws ssm put-parameter --tier Advanced; $0.05 a month)"
            )
            return 0
        print(f"{args.file}: valid")
        return 0

    return _run(body)


# ---------------------------------------------------------------------------------------------
# policy plan


def outcome(d: Decision) -> str:
    """What a dry-run decision amounts to for a person: stopped, warned or nothing."""
    policy = d.policy.policy if d.policy else None
    notify_only = policy is not None and policy.action == "notify_only" and not d.machine.asg_name
    if d.action in REAP_ACTIONS and not notify_only:
        return "stopped" if d.action.value in ("stop", "hibernate") else d.action.value
    if d.state is State.WARNED:
        return "warned"
    return "none"


_SEVERITY = {"none": 0, "warned": 1}


@dataclass(frozen=True)
class PlanChange:
    machine: Machine
    before: str
    after: str
    reason: str  # why, under the proposed policy

    @property
    def more(self) -> bool:
        return _SEVERITY.get(self.after, 2) > _SEVERITY.get(self.before, 2)


@dataclass(frozen=True)
class Plan:
    team: str
    now: datetime
    current: str
    proposed: str
    changes: list[PlanChange]
    unchanged: int


def plan_change(adapters: Adapters, team: str, proposed: TeamPolicyRef, now: datetime) -> Plan:
    """Two dry-run sweeps at `now`, with the stored and with the proposed policy: the same core, signals
    and state table, nothing written. Returns the team's machines whose outcome differs."""
    before = {d.machine.instance_id: d for d in run_sweep(adapters, now=now, dry_run=True).decisions}
    after_report = run_sweep(adapters, now=now, dry_run=True, policy_overrides={team: proposed})
    changes: list[PlanChange] = []
    unchanged = 0
    current = "settings.default_policy"
    for d in after_report.decisions:
        if d.machine.team != team:
            continue
        old = before.get(d.machine.instance_id)
        if old is not None and old.policy is not None:
            current = old.policy.label
        was, now_is = (outcome(old) if old else "none"), outcome(d)
        if was == now_is:
            unchanged += 1
        else:
            changes.append(PlanChange(d.machine, was, now_is, d.reason))
    changes.sort(key=lambda c: (not c.more, c.machine.instance_id))
    return Plan(team, now, current, proposed.label, changes, unchanged)


def format_plan(plan: Plan) -> str:
    lines = [f"plan for team {plan.team} at {plan.now.isoformat()} (dry run, nothing is changed)"]
    lines.append(f"  current: {plan.current}\n  proposed: {plan.proposed}")
    if not plan.changes and not plan.unchanged:
        return "\n".join([*lines, f"no running machine carries team {plan.team}"])
    if plan.changes:
        rows = [
            (
                c.machine.instance_id,
                c.machine.name or "-",
                c.machine.owner or "-",
                c.before,
                c.after,
                ("MORE: " if c.more else "less: ") + c.reason,
            )
            for c in plan.changes
        ]
        lines.append(_table(("INSTANCE", "NAME", "OWNER", "BEFORE", "AFTER", "WHY (PROPOSED POLICY)"), rows))
    more = sum(c.more for c in plan.changes)
    nouns, done = kinds_said(c.machine.instance_id for c in plan.changes)  # endpoints and Studio apps: "deleted"
    lines.append(
        f"{more} {nouns} would be warned or {done} that were not before, {len(plan.changes) - more} the "
        f"reverse, {plan.unchanged} unchanged. '{done}' assumes nobody answers the warning."
    )
    return "\n".join(lines)


def _plan_adapters() -> Adapters:
    # A dry run sends nothing, so no Slack client (and no Secrets Manager read) is needed.
    return Adapters.from_environment(notifier=LoggingNotifier(logger))


def _print_plan(team: str, proposed: TeamPolicyRef, now: datetime) -> None:
    try:
        print(format_plan(plan_change(_plan_adapters(), team, proposed, now)))
    except SweepCannotRun as exc:
        raise _Fail(f"cannot plan: {exc}", EXIT_ERROR) from None


def _proposal(store: aws.PolicyStore, team: str, path: str) -> tuple[StoredSettings, TeamPolicy, str]:
    _check_team(team)
    text = _read_file(path)
    stored_settings = _settings_or_fail(store)
    try:
        policy = parse_team_policy(path, text, stored_settings.settings.default_policy)
    except PolicyError as exc:
        _print_problems(exc)
        raise _Fail(f"{path} is invalid; nothing was written") from None
    return stored_settings, policy, text


def cmd_plan(args: argparse.Namespace) -> int:
    def body() -> int:
        _, policy, _ = _proposal(_policy_store(), args.team, args.file)
        proposed = TeamPolicyRef(team=args.team, policy=policy, source=f"{args.file} (proposed)", version=None)
        _print_plan(args.team, proposed, args.now or datetime.now(UTC))
        return 0

    return _run(body)


# ---------------------------------------------------------------------------------------------
# policy put


def stored_text(document: Any, name: str) -> tuple[str, str | None]:
    """What `policy put` writes for a policy document, and what to say of its SSM tier: indented for a reader
    while that fits the Standard tier (4,096 characters), else compact, so the Advanced tier (8,192 characters,
    $0.05 a month) is used only by a policy that needs it; a document that fits neither is refused here, naming
    the limit, before anything is written (_Fail)."""
    text = json.dumps(document, indent=2)
    if len(text) > SSM_STANDARD_CHARS:
        text = json.dumps(document, separators=(",", ":"))
    try:
        tier = ssm_tier(text, name)
    except TooLargeToStore as exc:
        raise _Fail(str(exc)) from None
    if tier == "Standard":
        return text, None
    return text, (
        f"{name} is {len(text):,} characters, over the {SSM_STANDARD_CHARS:,} of SSM's Standard tier: it is stored "
        "in the Advanced tier, which AWS charges $0.05 a month for (and which SSM never moves back to Standard)"
    )


def cmd_put(args: argparse.Namespace) -> int:
    def body() -> int:
        store = _policy_store()
        stored_settings, policy, text = _proposal(store, args.team, args.file)
        # What is written is the file's own fields (a partial override), so fields it leaves out keep
        # following settings.default_policy; normalised so a re-put of the same file is a no-op.
        name = store.team_name(args.team)
        new_text, tier_note = stored_text(json.loads(text), name)
        stored = store.read(name)
        if stored is not None and stored.value == new_text:
            print(f"{name} v{stored.version} already holds this policy; nothing to write")
            return 0

        if stored is None:
            before, before_label = (
                _pretty(policy_document(stored_settings.settings.default_policy)),
                (f"{name} (absent: the team follows settings.default_policy)"),
            )
        else:
            before_label = f"{name} v{stored.version} (effective)"
            try:
                current = parse_team_policy(name, stored.value, stored_settings.settings.default_policy)
                before = _pretty(policy_document(current))
            except PolicyError:
                before, before_label = stored.value + "\n", f"{name} v{stored.version} (stored text, invalid)"
        after = _pretty(policy_document(policy))
        diff = list(difflib.unified_diff(before.splitlines(True), after.splitlines(True), before_label, args.file))
        if diff:
            print("".join(diff), end="")
        else:
            print("the effective policy does not change; only the stored text does")

        if args.plan:
            proposed = TeamPolicyRef(team=args.team, policy=policy, source=f"{args.file} (proposed)", version=None)
            _print_plan(args.team, proposed, args.now or datetime.now(UTC))

        expected = stored.version if stored else None
        if tier_note:
            print(tier_note)
        if not args.yes:
            prompt = f"write {name} ({f'v{expected} -> v{expected + 1}' if expected else 'new'})? [y/N] "
            try:
                if not confirm(prompt):
                    print("nothing written")
                    return EXIT_INVALID
            except NotInteractive:
                raise _Fail("stdin is not a terminal: pass --yes to write without asking; nothing written") from None
            except EOFError:
                raise _Fail("no answer; nothing written") from None

        try:
            version = store.put_if_version(name, new_text, expected)
        except aws.VersionConflict as exc:
            raise _Fail(f"{exc}. Run the command again to see the diff against the new version.") from None
        except aws.LostUpdate as exc:
            raise _Fail(f"written, but: {exc}") from None
        print(f"wrote {name} v{version}; the next sweep applies it")
        return 0

    return _run(body)


# ---------------------------------------------------------------------------------------------
# policy show


def _sources(
    policy: TeamPolicy,
    team_fields: Iterable[str],
    team_label: str | None,
    stored: StoredSettings,
    account_default: tuple[TeamPolicy, str] | None = None,
) -> dict[str, str]:
    team_set = set(team_fields)
    settings_set = stored.settings.default_policy.model_fields_set if stored.parameter else set()
    settings_label = f"settings.default_policy ({stored.label})"
    if account_default is not None:  # the account's own default stands in for settings.default_policy
        settings_set, settings_label = account_default[0].model_fields_set, account_default[1]
    return {
        name: team_label if team_label and name in team_set else settings_label if name in settings_set else BUILT_IN
        for name in type(policy).model_fields
    }


def _parents(account: str) -> tuple[str, ...]:
    """The OUs an account sits in, nearest first (AWS Organizations ListParents); () when they cannot be read,
    said on stderr (then only an entry naming the account itself applies)."""
    organizations, parents, child = aws.client("organizations"), [], account
    try:
        while found := organizations.list_parents(ChildId=child)["Parents"]:
            if found[0]["Type"] != "ORGANIZATIONAL_UNIT":
                break
            child = found[0]["Id"]
            parents.append(child)
    except aws.AwsError as exc:
        print(
            f"idle-reaper: the OUs of {account} could not be read ({aws.error_code(exc)}); entries naming an OU are "
            "not applied",
            file=sys.stderr,
        )
        return ()
    return tuple(parents)


def _account_default(store: aws.PolicyStore, account: str, settings: Settings) -> tuple[TeamPolicy, str]:
    """The default policy in a member account, and where it comes from (organization.defaults[i], or
    settings.default_policy when no entry names the account or its OUs)."""
    try:
        org = store.load_organization()
    except PolicyError as exc:
        _print_problems(exc)
        raise _Fail("the organization settings are invalid: the sweep touches no member account") from None
    policy = org.default_for(account, _parents(account), settings.default_policy)
    return policy, default_source(settings.model_copy(update={"default_policy": policy}))


def cmd_show(args: argparse.Namespace) -> int:
    def body() -> int:
        store = _policy_store()
        stored_settings = _settings_or_fail(store)
        now: datetime = args.now or datetime.now(UTC)
        team_label: str | None = None
        team_fields: list[str] = []
        policy = stored_settings.settings.default_policy
        account_default = None
        if args.account:
            account_default = _account_default(store, args.account, stored_settings.settings)
            if account_default[0] is policy:
                account_default = None  # no entry names it: settings.default_policy, as everywhere
            else:
                policy = account_default[0]
        if args.team:
            _check_team(args.team)
            param = store.read(store.team_name(args.team))
            if param is None:
                header = f"team {args.team}: no parameter {store.team_name(args.team)}; it follows the default policy"
            else:
                try:
                    policy = parse_team_policy(param.name, param.value, policy)
                except PolicyError as exc:
                    _print_problems(exc)
                    raise _Fail(f"team {args.team} is in safe mode: the sweep changes none of its machines") from None
                team_label = f"team parameter {param.name}@v{param.version}"
                team_fields = list(json.loads(param.value))
                header = f"team {args.team}: {param.name} v{param.version}, modified {_fmt_time(param.last_modified)}"
        elif account_default is not None:
            header = f"default policy in account {args.account}: {account_default[1]}"
        else:
            header = f"default policy: settings.default_policy in {stored_settings.label}"
        if args.account:
            header += f" (in account {args.account})" if args.team else ""
        sources = _sources(policy, team_fields, team_label, stored_settings, account_default)
        doc = policy_document(policy)
        active = active_schedules(policy, now)
        effective = policy_document(effective_policy(policy, now))
        if args.json:
            print(
                json.dumps(
                    {
                        "team": args.team,
                        "account": args.account,
                        "policy": doc,
                        "sources": sources,
                        "now": now.isoformat(),
                        "active_schedules": [s.label(i) for i, s in active],
                        "effective_now": effective,
                    },
                    indent=2,
                )
            )
            return 0
        rows = [
            (name, f"{len(value)} (below)" if name == "schedules" else json.dumps(value), sources[name])
            for name, value in doc.items()
        ]
        print(header)
        print(_table(("FIELD", "VALUE", "SOURCE"), rows))
        for i, schedule in enumerate(policy.schedules):
            print(f"  {schedule.label(i)}: {json.dumps(doc['schedules'][i])}")
        if active:
            local = now.astimezone(schedule_zone(policy, active[0][1]))
            overrides = {k: v for _, s in active for k, v in s.overrides().items()}
            print(
                f"in force at {now.isoformat()} ({local:%a %H:%M %Z}): "
                + " + ".join(s.label(i) for i, s in active)
                + " -> "
                + ", ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
            )
        elif policy.schedules:
            print(f"no schedule in force at {now.isoformat()}")
        return 0

    return _run(body)


# ---------------------------------------------------------------------------------------------
# policy list


def cmd_list(args: argparse.Namespace) -> int:
    def body() -> int:
        store = _policy_store()
        settings = _settings_or_default(store, "counting machines with the default tag keys")
        params = store.stored_teams()
        fleet = aws.Fleet(aws.client("ec2"), aws.client("autoscaling"))
        counts = Counter(m.team for m in fleet.discover(settings.tags))
        rows: list[dict[str, Any]] = []
        for param in params:
            team = param.name.rsplit("/", 1)[-1]
            try:
                parse_team_policy(param.name, param.value, settings.default_policy)
                status = "ok"
            except PolicyError as exc:
                status = f"INVALID ({len(exc.problems)} problem(s)): safe mode"
            rows.append(
                {
                    "team": team,
                    "parameter": param.name,
                    "version": param.version,
                    "last_modified": param.last_modified.isoformat() if param.last_modified else None,
                    "machines": counts.get(team, 0),
                    "status": status,
                }
            )
        stored = {row["team"] for row in rows}
        for team in sorted(set(counts) - stored):
            rows.append(
                {
                    "team": team,
                    "parameter": None,
                    "version": None,
                    "last_modified": None,
                    "machines": counts[team],
                    "status": "no parameter: default policy",
                }
            )
        rows.sort(key=lambda r: str(r["team"]))
        if args.json:
            for row in rows:
                print(json.dumps(row, sort_keys=True))
            return 0
        print(
            _table(
                ("TEAM", "VERSION", "LAST MODIFIED (UTC)", "MACHINES", "STATUS"),
                (
                    (
                        r["team"],
                        f"v{r['version']}" if r["version"] else "-",
                        _fmt_time(datetime.fromisoformat(r["last_modified"])) if r["last_modified"] else "-",
                        str(r["machines"]),
                        r["status"],
                    )
                    for r in rows
                ),
            )
        )
        return 0

    return _run(body)


# ---------------------------------------------------------------------------------------------
# status


def _reap_word(asg_name: str | None, policy: TeamPolicy, kind: str = "") -> str:
    if kind in (Kind.ENDPOINT, Kind.STUDIO_APP):  # deleted whatever the team's action for machines (hibernate, ...)
        return "report (notify_only)" if policy.action == "notify_only" else "delete"
    if asg_name:
        return "terminate" if policy.asg_action == "terminate" else "release to its group"
    # What the kind a record keeps makes of the end of the window (core.kinds.handling, from the record).
    if kind in TERMINABLE and policy.terminate_unstoppable_after_minutes is not None:
        return "terminate" if policy.action != "notify_only" else "report (notify_only)"
    if kind in NEVER_STOPPED:
        return "none: told once, not stopped"
    if kind in (Kind.RESERVED, Kind.CAPACITY_BLOCK) and policy.reserved_capacity_action == "notify":
        return "none: owner and admins told, not stopped (reserved capacity)"
    return {"stop": "stop", "hibernate": "hibernate", "notify_only": "report (notify_only)"}[policy.action]


def next_step(
    record: MachineRecord, policy: TeamPolicy | None, machine: Machine | None, now: datetime
) -> tuple[str, datetime | None]:
    """What the next sweeps will do to this machine and from when, if nothing changes (no activity, no
    answer). Derived from the record and the policy in force at `now`; the sweep decides for real."""
    if record.state is State.REAPED:
        return "none", None
    if machine is None and record.account is None:
        return "none: not running", None
    action, when = _next_step_of_running(record, policy, machine, now)
    # A member account's machine is not listed by the CLI (its EC2 is in another account): what its record, as
    # the last sweep there wrote it, says. Never "not running" for a machine nobody here looked at.
    return (f"{action} (as its account's last sweep saw it)" if machine is None else action), when


def _next_step_of_running(
    record: MachineRecord, policy: TeamPolicy | None, machine: Machine | None, now: datetime
) -> tuple[str, datetime | None]:
    if record.state is State.EXEMPT:
        return "none: exempt", None
    if policy is None:
        return "none: team policy invalid (safe mode)", None
    if record.state in (State.SAFE_MODE, State.UNKNOWN):
        return "re-check at the next sweep", None
    if is_endpoint_id(record.instance_id):
        policy = endpoint_policy(policy)  # its own window (endpoint_idle_minutes), as the sweep gives it
    warn_at = timedelta(minutes=policy.idle_minutes - policy.warn_minutes)
    idle = timedelta(minutes=policy.idle_minutes)
    # A member account's machine: its group as its record names it.
    reap = _reap_word(machine.asg_name if machine else record.asg_name, policy, record.machine_kind)
    launched = machine.launch_time if machine else None
    cap_at = launched + timedelta(hours=policy.max_runtime_hours) if launched and policy.max_runtime_hours else None
    if record.state is State.SNOOZED and record.snoozed_until:
        if cap_at is not None and cap_at < record.snoozed_until:
            return "warn if quiet (max_runtime_hours overrides the keep)", max(cap_at, now)
        return "warn if still quiet (the keep ends)", record.snoozed_until
    if record.state is State.WARNED and record.warned_at:
        idle_end = (record.idle_since + idle) if record.idle_since else now
        if record.warning_delivered_at is None:
            # An undelivered warning holds the stop, at most undelivered_warning_max_minutes.
            held = record.warned_at + timedelta(minutes=policy.undelivered_warning_max_minutes)
            when = max(held, record.warned_at + timedelta(minutes=policy.warn_minutes), idle_end)
            return f"{reap} if still idle (warning not delivered yet)", when
        return f"{reap} if still idle", max(
            record.warning_delivered_at + timedelta(minutes=policy.warn_minutes), idle_end
        )
    if record.state is State.IDLE and record.idle_since:
        return "warn if still quiet", record.idle_since + warn_at
    return f"warn after {policy.idle_minutes - policy.warn_minutes} min quiet", None


def _human_signal(record: MachineRecord) -> str | None:
    """The human-activity signal in words; for a notebook instance without the collector, why and what to do
    (its lifecycle configuration fetches the collector: no admin installs it)."""
    said = describe_human_signal(record.human_signal)
    if said and record.human_signal == "missing" and (record.machine_kind or "").startswith(Kind.NOTEBOOK.value):
        said = f"{said}; {NOTEBOOK_GAPS['activity']}"
    return said or None


def status_rows(
    records: Iterable[MachineRecord],
    machines: Mapping[str, Machine],
    refs: Mapping[str, TeamPolicyRef] | None,
    settings: Settings,
    now: datetime,
    collector_gaps: Mapping[str, Sequence[str]] | None = None,
    in_account: Callable[[str], tuple[Settings, Mapping[str, TeamPolicyRef] | None]] | None = None,
) -> list[dict[str, Any]]:
    """One row per machine in the state table (and per running machine no sweep has seen yet).
    `refs` None: the team policies could not be read. `collector_gaps`: per machine, the sources its
    activity collector reports it cannot read (None: not asked). `in_account`: a member account's settings and
    team policies, with its own default policy as the sweep applies it (None: the hub's)."""
    gaps = collector_gaps or {}
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for record in records:
        # `machines` are the hub account's: a member account's record (organization mode) is not one of them.
        machine = machines.get(record.instance_id) if record.account is None else None
        seen.add(record.key)
        team = machine.team if machine else record.team
        # A member machine's policy, with its account's own default (read on the first member record).
        if in_account is not None and record.account is not None:
            here, here_refs = in_account(record.account)
        else:
            here, here_refs = settings, refs
        ref = aws.policy_for(team, here_refs, here).at(now) if here_refs is not None else None
        action, when = next_step(record, ref.policy if ref else None, machine, now)
        rows.append(
            {
                "instance_id": record.instance_id,
                **({"account": record.account, "region": record.region} if record.account else {}),
                "name": machine.name if machine else record.name,
                "team": team,
                "owner": machine.owner if machine else record.owner,
                "state": record.state.value,
                "idle_since": record.idle_since.isoformat() if record.idle_since else None,
                "snoozed_until": record.snoozed_until.isoformat()
                if record.snoozed_until and record.snoozed_until > now
                else None,
                "snoozed_by": record.snoozed_by if record.snoozed_until and record.snoozed_until > now else None,
                "next_action": action,
                "next_at": when.isoformat() if when else None,
                "reason": record.reason,
                "policy": record.policy_version,
                "updated_at": record.updated_at.isoformat() if record.updated_at else None,
                # Why the current warning was not (or may not have been) delivered; the sweep does not retry it.
                "delivery_error": record.delivery_error if record.state is State.WARNED else None,
                # The human-activity signal the last sweep saw, when the team's policy uses it.
                "human_signal": _human_signal(record),
                # Sources the machine's collector cannot read (a password-protected Jupyter, ...): a person
                # there may go unseen.
                "collector_cannot_read": (list(gaps.get(record.instance_id, [])) or None)
                if record.account is None
                else None,
                # What kind of machine it is, and what stopping it saves an hour (0 for reserved capacity, for
                # Spot the most it can be: the reaper does not read Spot prices).
                "kind": record.machine_kind or None,
                "kind_note": record.kind_note or None,
                "stop_saves": of_record(record, hourly_price(record.instance_type or "")).stop.text(),
                # When a sweep last read its metrics, and when the next one must (core/reading.py).
                "last_read": record.observed_at.isoformat() if record.observed_at else None,
                "next_read": next_read.isoformat() if (next_read := parse_next_read(record.next_read_at)) else None,
                "next_read_why": record.next_read_why if next_read else "read at every sweep",
                # Its kind's section (machines, endpoints, ...: core/sections.py), its instances and what they cost an
                # hour running, and where it stands in words.
                "section": section_of(record.key),
                "hardware": record.instance_type or (machine.instance_type if machine else None),
                "hourly_cost": hourly_price(record.instance_type or (machine.instance_type if machine else "")),
                "state_words": state_words(record, now),
            }
        )
    for machine in machines.values():
        if machine.instance_id not in seen:
            rows.append(
                {
                    "instance_id": machine.instance_id,
                    "name": machine.name,
                    "team": machine.team,
                    "owner": machine.owner,
                    "state": "new",
                    "idle_since": None,
                    "snoozed_until": None,
                    "snoozed_by": None,
                    "next_action": "first look at the next sweep",
                    "next_at": None,
                    "reason": "no sweep has seen this machine yet",
                    "policy": None,
                    "updated_at": None,
                    "delivery_error": None,
                    "human_signal": None,
                    "collector_cannot_read": list(gaps.get(machine.instance_id, [])) or None,
                    "kind": None,
                    "kind_note": None,
                    "stop_saves": dollars("", hourly_price(machine.instance_type)).stop.text(),
                    "last_read": None,
                    "next_read": None,
                    "next_read_why": "read at the next sweep",
                    "section": section_of(machine.instance_id),
                    "hardware": machine.instance_type,
                    "hourly_cost": hourly_price(machine.instance_type),
                    "state_words": "new: no sweep has seen it yet",
                }
            )
    return sorted(rows, key=lambda r: (r["team"], r["instance_id"]))


def _when(text: str | None, now: datetime) -> str:
    if text is None:
        return ""
    when = datetime.fromisoformat(text)
    return "next sweep" if when <= now else _fmt_time(when)


def _reads(row: dict[str, Any], now: datetime) -> str:
    last = _fmt_time(datetime.fromisoformat(row["last_read"])) if row["last_read"] else "never"
    return f"{last}, {_when(row['next_read'], now) if row['next_read'] else 'every sweep'}"


def _person(row: dict[str, Any]) -> str:
    gaps = row.get("collector_cannot_read")
    return (row["human_signal"] or "-") + (f"; COLLECTOR CANNOT READ {', '.join(gaps)}" if gaps else "")


def format_status(rows: list[dict[str, Any]], now: datetime) -> str:
    """The machines' table, then one table per other kind (endpoints, Studio apps: core/sections.py), each under
    its name, in the order Slack's `status` shows them."""
    kinds = grouped(rows, lambda r: str(r.get("section", MACHINES)))
    text = _machines_table(next((found for label, found in kinds if label == MACHINES), []), now)
    for label, found in kinds:
        if label != MACHINES:
            text += f"\n\n{label[:1].upper() + label[1:]} ({len(found)}):\n{_section_table(found, now)}"
    return text


def _section_table(rows: list[dict[str, Any]], now: datetime) -> str:
    """Resources that are not machines: what each is, what it costs an hour, where it stands, and what comes next."""
    return _table(
        ("NAME", "TEAM", "OWNER", "INSTANCES", "COST", "STATE", "NEXT", "REASON"),
        (
            (
                machine_key(r["instance_id"], r.get("account"), r.get("region")),
                r["team"],
                r["owner"] or "-",
                r["hardware"] or "-",
                f"${r['hourly_cost']:,.2f}/h" if r["hourly_cost"] is not None else "no known price",
                r["state_words"],
                f"{r['next_action']}" + (f" at {_when(r['next_at'], now)}" if r["next_at"] else ""),
                r["reason"],
            )
            for r in rows
        ),
    )


def _machines_table(rows: list[dict[str, Any]], now: datetime) -> str:
    table = _table(
        (
            "INSTANCE",
            "NAME",
            "TEAM",
            "OWNER",
            "STATE",
            "KIND",
            "STOP SAVES",
            "IDLE SINCE",
            "KEPT UNTIL (BY)",
            "NEXT",
            "PERSON",
            "READ (LAST, NEXT)",
            "REASON",
        ),
        (
            (
                machine_key(r["instance_id"], r.get("account"), r.get("region")),  # account/region/id in a member
                r["name"] or "-",
                r["team"],
                r["owner"] or "-",
                r["state"],
                r["kind"] or "-",
                r["stop_saves"],
                _fmt_time(datetime.fromisoformat(r["idle_since"])) if r["idle_since"] else "-",
                f"{_fmt_time(datetime.fromisoformat(r['snoozed_until']))} ({r['snoozed_by'] or '?'})"
                if r["snoozed_until"]
                else "-",
                f"{r['next_action']}" + (f" at {_when(r['next_at'], now)}" if r["next_at"] else ""),
                (r["human_signal"] or "-")
                + (
                    f"; COLLECTOR CANNOT READ {', '.join(r['collector_cannot_read'])}"
                    if r["collector_cannot_read"]
                    else ""
                ),
                _reads(r, now),
                f"WARNING UNDELIVERABLE: {r['delivery_error']}. {r['reason']}" if r["delivery_error"] else r["reason"],
            )
            for r in rows
        ),
    )
    return f"status at {_fmt_time(now)} UTC (times in UTC)\n{table}"


def format_unwatched(counted_at: datetime, counts: Sequence[aws.RegionCount], denied: Sequence[str] = ()) -> str:
    """Regions no stack watches: their running machines are never looked at."""
    skipped = (
        f"\n  not counted, this account may not look there (a service control policy?): {', '.join(denied)}"
        if denied
        else ""
    )
    if not counts:
        when = f"counted {counted_at:%Y-%m-%d %H:%M} UTC"
        return f"Every region with running machines has an idle-reaper stack ({when}).{skipped}"
    lines = [f"Regions without an idle-reaper stack (counted {counted_at:%Y-%m-%d %H:%M} UTC), never swept:"]
    lines += [f"  {c.region}: {c.running} running, {c.opted_in} tagged for idle-reaper" for c in counts]
    return "\n".join(lines) + skipped


def format_member_check(check: MemberCheck) -> str:
    """Organization mode: the member accounts the hub can work in, and those it cannot, with the reason."""
    lines = [
        f"Member accounts (checked {check.checked_at:%Y-%m-%d %H:%M} UTC): {check.accounts} accounts, "
        f"credentials in {check.units} account-regions"
    ]
    if check.listing_error:
        listed = f"{check.listed_at:%Y-%m-%d %H:%M} UTC" if check.listed_at else "never"
        lines.append(f"  not listed this time ({check.listing_error}); last listing: {listed}")
    lines += [f"  {f.describe()}" for f in check.failures]
    if check.failures_more:
        lines.append(
            f"  and {check.failures_more} more account-regions that failed, in {len(check.failed_more)} accounts "
            f"(their reasons are in the sweep's log and the admins' alerts): {', '.join(check.failed_more[:20])}"
            + (" ..." if len(check.failed_more) > 20 else "")
        )
    return "\n".join(lines)


def member_sweep_json(sweep: MemberSweep) -> dict[str, object]:
    """The last member sweep as `status --json` prints it."""
    return {
        "swept_at": sweep.swept_at.isoformat(),
        "units": sweep.units,
        "swept": sweep.swept,
        "machines": sweep.machines,
        "deferred": sweep.deferred,
        "excluded": [{"account": a, "name": n, "opted_in_machines": c} for a, n, c in sweep.excluded],
        "failed": [f.__dict__ for f in sweep.failed],
        "failed_more": sweep.failed_more,
    }


def _studio_findings(refs: Mapping[str, TeamPolicyRef] | None, settings: Settings) -> list[StudioFinding]:
    """Running Studio apps whose idle shutdown is off or longer than their team's window; none shown (said on
    stderr) when Studio cannot be read."""
    adapters = Adapters.from_environment(notifier=LoggingNotifier(logger))
    try:
        return studio_findings(adapters, refs or {}, settings)
    except aws.AwsError as exc:
        _err(f"cannot read SageMaker Studio apps ({aws.error_code(exc)}); not shown")
        return []


def _member_settings(
    store: aws.PolicyStore, settings: Settings, refs: Mapping[str, TeamPolicyRef] | None
) -> Callable[[str], tuple[Settings, Mapping[str, TeamPolicyRef] | None]]:
    """A member account's settings (its own default policy, OrganizationSettings.settings_in) and its team
    policies read with that default as their base, as the sweep reads them. Read on the first member record
    (a single-account status costs nothing more); each account's OUs and each default's team policies once.
    Organization settings that cannot be read: the hub's, said on stderr."""
    by_default: dict[str, Mapping[str, TeamPolicyRef] | None] = {settings.default_policy.model_dump_json(): refs}
    known: dict[str, tuple[Settings, Mapping[str, TeamPolicyRef] | None]] = {}
    org: list[OrganizationSettings | None] = []

    def in_account(account: str) -> tuple[Settings, Mapping[str, TeamPolicyRef] | None]:
        if not org:
            try:
                org.append(store.load_organization())
            except (PolicyError, *aws.AwsError) as exc:
                _err(f"cannot read the organization settings ({exc}); member machines shown with the hub's default")
                org.append(None)
        if org[0] is None:
            return settings, refs
        if account not in known:
            mine = org[0].settings_in(settings, account, _parents(account) if org[0].defaults else ())
            default = mine.default_policy.model_dump_json()
            if refs is not None and default not in by_default:
                try:
                    by_default[default] = store.load_teams(mine)
                except aws.AwsError as exc:
                    _err(f"cannot read team policies ({aws.error_code(exc)}); next actions in {account} not shown")
                    by_default[default] = None
            known[account] = mine, by_default.get(default)
        return known[account]

    return in_account


def cmd_status(args: argparse.Namespace) -> int:
    def body() -> int:
        now: datetime = args.now or datetime.now(UTC)
        store = _policy_store()
        settings = _settings_or_default(store, "using default settings to read the fleet")
        refs: Mapping[str, TeamPolicyRef] | None
        try:
            refs = store.load_teams(settings)
        except aws.AwsError as exc:
            _err(f"cannot read team policies ({aws.error_code(exc)}); next actions are not shown")
            refs = None
        state = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
        records = state.all_records()
        fleet = aws.sagemaker_fleet(
            aws.client("ec2"), aws.client("autoscaling"), aws.client("sagemaker"), aws.client("application-autoscaling")
        )
        listed = fleet.discover(
            settings.tags,
            notebooks=settings.sagemaker_notebooks,
            endpoints=settings.sagemaker_endpoints,
            studio=settings.sagemaker_notebooks,  # the apps a record names, as the sweep lists them
        )
        machines = {m.instance_id: m for m in listed}
        if fleet.notebooks_unlisted:
            _err(f"cannot list SageMaker notebook instances ({fleet.notebooks_unlisted}); not shown")
        if fleet.endpoints_unlisted:
            _err(f"cannot list SageMaker endpoints ({fleet.endpoints_unlisted}); not shown")
        try:
            gaps = aws.unreadable_sources(aws.client("cloudwatch"), sorted(machines), now)
        except aws.AwsError as exc:
            _err(f"cannot read what the activity collectors report ({aws.error_code(exc)}); not shown")
            gaps = {}
        rows = status_rows(records, machines, refs, settings, now, gaps, _member_settings(store, settings, refs))
        if args.team:
            rows = [r for r in rows if r["team"] == args.team]
        if args.owner:
            rows = [r for r in rows if (r["owner"] or "").lower() == args.owner.lower()]
        unwatched = aws.last_unwatched(state, now)
        member_regions = aws.members_unwatched(state, now)
        members = last_member_check(state, now)
        member_sweep = last_member_sweep(state, now)
        studio = _studio_findings(refs, settings) if settings.sagemaker_notebooks else []
        if args.json:
            for row in rows:
                print(json.dumps(row, sort_keys=True))
            for finding in studio:
                print(json.dumps({"studio_app": finding.app.__dict__, "why": finding.why, "hourly": finding.hourly}))
            if unwatched:
                counted_at, counts, denied = unwatched
                regions = [c.__dict__ for c in counts]
                print(
                    json.dumps(
                        {"unwatched_regions": regions, "denied_regions": denied, "counted_at": counted_at.isoformat()}
                    )
                )
            if member_regions:
                print(json.dumps({"member_unwatched_regions": [c.to_json() for c in member_regions]}))
            if members:
                failures = [{**f.__dict__, "reason": f.reason.value} for f in members.failures]
                print(
                    json.dumps(
                        {
                            "member_accounts": members.accounts,
                            "member_units": members.units,
                            "member_failures": failures,
                            "checked_at": members.checked_at.isoformat(),
                        }
                    )
                )
            if member_sweep:
                print(json.dumps({"member_sweep": member_sweep_json(member_sweep)}, sort_keys=True))
        else:
            print(format_status(rows, now))
            if unwatched:
                print(format_unwatched(*unwatched))
            if member_regions:
                print("\n".join(aws.members_unwatched_lines(member_regions)))
            if members:
                print(format_member_check(members))
            if member_sweep:
                print("\n".join(member_sweep.lines()))
            if studio:
                print("\nStudio apps that would outlast their team's idle window (reported, not stopped):")
                print("\n".join(f"  {f.line()}" for f in studio))
        return 0

    return _run(body)
