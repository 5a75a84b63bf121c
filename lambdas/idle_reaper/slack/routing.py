"""Who may answer, which region and which record an answer is about: the routing and authorization of
a validated Slack request (payloads.py) before answers.py applies it.

One Slack app serves several regions: every region's sweep posts with the same app, so any click or
command may reach any region's handler. A button's opaque reference says which region's table holds
it; a command is answered from every listed region, the local one first. A region's clients are built
only when that region is consulted, and an owner's machines are found through the `owner-index` of the
state table, never by a scan."""

from __future__ import annotations

import functools
import hmac
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime
from functools import cached_property
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.aws.accounts import AccountFailure, MemberAccess, MemberSweep, last_member_sweep
from idle_reaper.aws.clients import AwsError
from idle_reaper.aws.endpoints import sagemaker_fleet
from idle_reaper.aws.fleet import Fleet
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.regions import members_unwatched, members_unwatched_lines
from idle_reaper.aws.state import DynamoStateStore, StateStore
from idle_reaper.core.answers import keep_until, may_answer, parse_duration
from idle_reaper.core.doctor import Finding
from idle_reaper.core.endpoints import is_endpoint_id, is_studio_id
from idle_reaper.core.records import MachineId, MachineRecord, parse_machine_key
from idle_reaper.core.sections import kinds_said
from idle_reaper.notify import logger
from idle_reaper.policy import PolicyError, Settings, TeamPolicy, parse_team_policy
from idle_reaper.slack.answers import Effects, Reply, doctor_reply, help_reply, status_reply
from idle_reaper.slack.blocks import machine_label
from idle_reaper.slack.doctor import SlackReader
from idle_reaper.slack.notifier import SlackNotifier
from idle_reaper.slack.requests import ButtonWork, CommandWork, chosen_action

# `/idle-reaper doctor` runs in the endpoint's asynchronous invocation (30 s timeout): this long at most.
DOCTOR_SECONDS = 20.0
DEPLOY_STAGE_SECONDS = 6.0  # of which the deploy checks (about ten in-region Describe/Get calls) take at most this
SWEEP_MINUTES_ENV = "IDLE_REAPER_SWEEP_MINUTES"  # the stack's sweep interval, for deploy.last_sweep
DEFAULT_SWEEP_MINUTES = 5
MEMBER_GRACE_SECONDS = 2.0  # the member accounts' checks end at the deadline; their findings are awaited this long
NOT_CURRENT = "This message is no longer current (it was answered already, or replaced); nothing changed."


def member_results(pending: Future[list[Finding]], deadline: float) -> list[Finding]:
    """The member accounts' findings, waited for until just past `deadline` (the checks stop themselves there);
    not back by then: unknown, never ok."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from idle_reaper.core.doctor import unknown

    try:
        return pending.result(timeout=max(0.0, deadline - time.monotonic()) + MEMBER_GRACE_SECONDS)
    except FutureTimeout:
        return [unknown("members", "out of time")]


def parse_machine_key_or_none(text: str) -> MachineId | None:
    """A member machine's key (`account/region/id`) typed in a command, else None."""
    try:
        found = parse_machine_key(text)
    except ValueError:
        return None
    return found if found.account else None


@functools.cache
def answer_access() -> MemberAccess | None:
    """Organization mode's credentials for answers (the answer role's sessions), kept while the function is warm;
    None in single-account mode."""
    return MemberAccess.from_environment("answer")


class Region:
    """One region's state table, policies, fleet and effects, each built on first use."""

    def __init__(
        self,
        connect: Callable[[str], Any],
        table: str,
        ssm_prefix: str,
        slack_client: WebClient,
        clock: Callable[[], datetime],
        members: Callable[[], MemberAccess | None] | None = None,
    ) -> None:
        self.connect, self.table, self.ssm_prefix = connect, table, ssm_prefix
        self.slack_client, self.clock = slack_client, clock
        self.members = members  # None: answer_access, the function's own

    @cached_property
    def store(self) -> StateStore:
        return DynamoStateStore(self.connect("dynamodb"), self.table)

    @cached_property
    def policies(self) -> PolicyStore:
        return PolicyStore(self.connect("ssm"), self.ssm_prefix)

    @cached_property
    def fleet(self) -> Fleet:
        return sagemaker_fleet(
            self.connect("ec2"),
            self.connect("autoscaling"),
            self.connect("sagemaker"),
            self.connect("application-autoscaling"),
        )

    @cached_property
    def effects(self) -> Effects:
        return Effects(self.store, self.fleet, SlackNotifier(self.slack_client, self.store, self.clock), self.clock)

    def effects_on(self, record: MachineRecord) -> Effects | Reply:
        """Where an answer that acts on the machine (stop, start, terminate) acts: this region's account, or, for
        a member account's machine, that account and region through the member role (organization mode). A
        Reply, and nothing done, when that account cannot be reached (it left the organization, its role is
        missing, ...) or this deployment no longer works in other accounts."""
        if record.account is None or record.region is None:
            return self.effects
        label = machine_label(record.name, record.instance_id)
        members = (self.members or answer_access)()
        if members is None:
            return Reply(
                f"{label} runs in account {record.account}, and this deployment no longer works in other accounts; "
                "nothing changed."
            )
        # Asked afresh (one DescribeAccount): credentials held from before would still work for up to an hour in
        # an account that has left the organization or been suspended since.
        gone = members.directory.status_of(record.account)
        if gone is not None:
            members.sessions.forget(record.account, record.region)
            failure = AccountFailure(record.account, record.region, gone, "AWS Organizations, asked now")
            return Reply(f"idle-reaper cannot act on {label}: {failure.describe()}. Nothing changed.")
        held = members.sessions.credentials(record.account, record.region)
        if isinstance(held, AccountFailure):
            return Reply(f"idle-reaper cannot act on {label} right now: {held.describe()}. Nothing changed.")
        fleet = sagemaker_fleet(
            held.client("ec2"),
            held.client("autoscaling"),
            held.client("sagemaker"),
            held.client("application-autoscaling"),
        )
        return replace(self.effects, fleet=fleet)

    # -----------------------------------------------------------------------------------------
    # Records

    def record_of_ref(self, ref: str) -> MachineRecord | None:
        """The record a button's reference names, if it is still this record's current reference."""
        instance_id = self.store.get_lookup(f"ref#{ref}", self.clock()) if ref else None
        record = self.store.load([instance_id]).get(instance_id) if instance_id else None
        if record is None or not hmac.compare_digest(record.warning_ref or "", ref):
            return None
        return record

    def records_of_owner(self, user: str) -> list[MachineRecord]:
        return self.store.records_of_owner(user)

    def find(self, user: str, target: str) -> list[MachineRecord]:
        """`keep <target>`: the caller's own machines by name, instance id or machine key (`account/region/id`,
        for one of the same id in two accounts); anyone's by instance id (an endpoint's: endpoint:<name>; a Studio
        app's: studio:<domain>:<space>:<type>:<name>) or machine key. A machine's full key
        wins over names and instance ids: the hub's `i-0abc` is its key, so with the same id in a member account
        (`account/region/i-0abc`) each key still selects exactly one machine."""
        mine = [r for r in self.records_of_owner(user) if target in (r.instance_id, r.name, r.key)]
        exact = [r for r in mine if r.key == target]
        by_id = target.startswith("i-") or is_endpoint_id(target) or is_studio_id(target)
        if mine or not (by_id or parse_machine_key_or_none(target)):
            return exact or mine
        return list(self.store.load([target]).values())

    def in_organization(self) -> bool:
        """Whether this deployment works in member accounts (organization mode)."""
        return (self.members or answer_access)() is not None

    # -----------------------------------------------------------------------------------------
    # Authorization

    @property
    def name(self) -> str:
        return str(getattr(getattr(self.connect("ssm"), "meta", None), "region_name", "this region"))

    def doctor(self, deadline: float) -> list[Finding]:
        """Every check of this region: its own stack's deploy checks first (aws/deploy.py, at most
        DEPLOY_STAGE_SECONDS), then the rest (sweep/doctor.py). Imported here: a click's cold start never loads
        them. What is not reached by `deadline` is unknown."""
        from concurrent.futures import ThreadPoolExecutor

        from idle_reaper.core.deploy_checks import with_association
        from idle_reaper.sweep.doctor import Account, member_findings, run_checks, stack_checks

        # Organization mode: every member account and region, beside this region's checks, by the same deadline.
        members = (self.members or answer_access)()
        pool = ThreadPoolExecutor(1)  # no thread until something is submitted
        fleet_wide = (
            pool.submit(member_findings, members, self.policies, self.clock(), deadline, store=self.store)
            if members is not None
            else None
        )
        deploy, association = stack_checks(
            self.connect, self.name, min(deadline, time.monotonic() + DEPLOY_STAGE_SECONDS)
        )
        account = Account(self.policies, self.fleet, MetricsReader(self.connect("cloudwatch")), self.store)
        minutes = int(os.environ.get(SWEEP_MINUTES_ENV) or DEFAULT_SWEEP_MINUTES)
        reader = SlackReader(self.slack_client, deadline)
        findings = run_checks(
            account, reader, signing_secret=True, now=self.clock(), sweep_minutes=minutes, deadline=deadline
        )
        found = [*deploy, *with_association(findings, association)]
        if fleet_wide is not None:
            found += member_results(fleet_wide, deadline)
        pool.shutdown(wait=False)
        return found

    def _settings(self) -> Settings:
        try:
            return self.policies.load_settings()[0]
        except (PolicyError, *AwsError):
            return Settings()  # admins unknown: only owners and team members may answer

    def _policy(self, team: str, settings: Settings) -> TeamPolicy | None:
        """This team's policy alone (one GetParameter, however many teams there are); the default policy
        when the team has none. None: unreadable or invalid (safe mode), so only the owner and admins may
        answer."""
        try:
            stored = self.policies.read(self.policies.team_name(team))
            return (
                parse_team_policy(stored.name, stored.value, settings.default_policy)
                if stored
                else settings.default_policy
            )
        except (PolicyError, *AwsError):
            return None

    def _group_members(self, policy: TeamPolicy | None) -> set[str]:
        members: set[str] = set()
        for group in (m for m in (policy.members if policy else ()) if m.startswith("S")):
            try:
                members.update(self.slack_client.usergroups_users_list(usergroup=group)["users"])
            except (SlackApiError, SlackClientError):
                continue  # an unreadable group grants nothing
        return members

    def _in_account(self, settings: Settings, record: MachineRecord) -> Settings:
        """The settings a member account's machine is swept with: the account's own default policy (its entry
        in `{prefix}/organization`, by its id or an OU it sits in, as the directory lists it), as the sweep
        applies it. The hub's when the organization settings cannot be read (the sweep then touches no member
        machine) or this deployment no longer works in other accounts."""
        members = (self.members or answer_access)() if record.account else None
        if members is None or record.account is None:
            return settings
        try:
            org = self.policies.load_organization()
        except (PolicyError, *AwsError):
            return settings
        parents = members.directory.current().parents_of(record.account) if org.defaults else ()
        return org.settings_in(settings, record.account, parents)

    def authorize(self, user: str, record: MachineRecord) -> tuple[TeamPolicy, str | None]:
        """The policy that governs the answer (a member account's machine: with that account's default
        policy), and a refusal when `user` may not answer for `record`."""
        settings = self._in_account(self._settings(), record)
        policy = self._policy(record.team, settings)
        # User groups cost a Slack call each: asked only when the owner, members and admins did not match.
        if may_answer(user, record, policy, settings.admins) or may_answer(
            user, record, policy, settings.admins, self._group_members(policy)
        ):
            return policy or settings.default_policy, None
        return policy or settings.default_policy, (
            f"You can't change {machine_label(record.name, record.instance_id)}: only its owner, "
            f"the {record.team} team's members and idle-reaper admins can."
        )


class Router:
    """Runs one validated request against the region that holds its record."""

    def __init__(self, regions: list[Region]) -> None:
        if not regions:
            raise ValueError("at least one region")
        self.regions = regions

    def run(self, work: ButtonWork | CommandWork) -> Reply | None:
        if isinstance(work, ButtonWork):
            return self.button(work.user, work.action_id, work.value)
        return self.command(work.user, work.command, work.text)

    def button(self, user: str, action_id: str, value: str) -> Reply | None:
        action = chosen_action(action_id, value)
        if action is None:
            return Reply("That is not an idle-reaper action; nothing was changed.")
        ref = value.partition("|")[0]
        if action == "keep_all":
            return self.keep_all(user, ref)
        found = next(((r, rec) for r in self.regions if (rec := r.record_of_ref(ref))), None)
        if found is None:
            return Reply(NOT_CURRENT)
        region, record = found
        policy, refusal = region.authorize(user, record)
        if refusal:
            return Reply(refusal)
        if action in ("stop_now", "start_again", "terminate_now"):
            effects = region.effects_on(record)
            if isinstance(effects, Reply):
                return effects
            if action == "stop_now":
                return effects.stop_now(user, record)
            if action == "start_again":
                return effects.start_again(user, record)
            return effects.terminate_now(user, record)
        until = keep_until(action, policy, region.clock())
        assert until is not None  # every other action is a keep
        return region.effects.keep(user, record, policy, until)

    def keep_all(self, user: str, group_ref: str) -> Reply | None:
        """ "Keep all 2 h" on an owner's shared message: every listed machine whose warning still stands and
        that `user` may answer for is kept; the others are named. The machines come from the message's
        server-side record, never from the payload: an unknown, forged or fully answered reference changes
        nothing. A second click finds nothing current (a keep uses up each machine's reference)."""
        found = next(((r, g) for r in self.regions if (g := r.effects.slack.listed_group(group_ref))), None)
        if found is None:
            return Reply(NOT_CURRENT)
        region, listed = found
        records = region.store.load(list(listed.ids))
        current = [records[i] for i in listed.ids if listed.is_current(records.get(i))]
        if not current:
            return Reply(NOT_CURRENT)
        allowed, refused = [], []
        for record in current:
            policy, refusal = region.authorize(user, record)
            until = keep_until("keep_2h", policy, region.clock())
            if refusal or until is None:
                refused.append(machine_label(record.name, record.instance_id))
            else:
                allowed.append((record, policy, until))
        kept, problems = region.effects.keep_all(user, allowed) if allowed else (0, [])
        if refused:
            problems.append(
                f"you can't change {', '.join(refused)}: only the owner, the team's members and idle-reaper admins can"
            )
        if not problems:
            return None
        stale = len(listed.ids) - len(current)
        gone = f" ({stale} other listed machine{'s' if stale > 1 else ''} no longer waiting)" if stale else ""
        return Reply(f"Kept {kept} of {len(current)}{gone}. Not kept: {'; '.join(problems)}.")

    def command(self, user: str, command: str, text: str) -> Reply:
        words = text.split()
        verb = words[0].lower() if words else "help"
        if verb == "doctor":
            return self.doctor(user, command)
        if verb == "status":
            mine = [r for region in self.regions for r in region.records_of_owner(user)]
            return status_reply(mine, *self.member_status(user), now=self.regions[0].clock())
        if verb == "keep":
            if len(words) != 3:
                return Reply(
                    f"Usage: `{command} keep <instance-id-or-name> <duration>`, e.g. `{command} keep i-0abc 2h`"
                )
            return self._keep(user, words[1], words[2], command)
        return help_reply(command, None if verb == "help" else verb)

    def member_status(self, user: str) -> tuple[MemberSweep | None, list[str]]:
        """For an admin, organization mode (the settings read once): what the last sweep did in the member
        accounts (excluded accounts, failed units; None in single-account mode), and the lines of the member
        accounts whose daily count found running instances (or a denied region) outside the organization's
        regions. Nothing for anyone else; either left out when it cannot be read."""
        region = self.regions[0]
        unreadable = (*AwsError, ValueError, KeyError)
        try:
            if user not in region._settings().admins:
                return None, []
        except unreadable as exc:
            logger.warning("settings not read for status", extra={"error": str(exc)})
            return None, []
        now = region.clock()
        sweep: MemberSweep | None = None
        try:
            sweep = last_member_sweep(region.store, now)
        except unreadable as exc:
            logger.warning("member sweep not read for status", extra={"error": str(exc)})
        try:
            return sweep, members_unwatched_lines(members_unwatched(region.store, now))
        except unreadable as exc:
            logger.warning("member accounts' regions not read for status", extra={"error": str(exc)})
            return sweep, []

    def doctor(self, user: str, command: str) -> Reply:
        """`/idle-reaper doctor`: this region's checks, for its admins only (they list other teams' machines
        and owners). Read-only; bounded to DOCTOR_SECONDS, past which a check says it could not check."""
        region = self.regions[0]
        if user not in region._settings().admins:
            return Reply(f"Only idle-reaper admins (the settings' `admins`) can run `{command} doctor`.")
        return doctor_reply(region.doctor(time.monotonic() + DOCTOR_SECONDS), region.name)

    def _keep(self, user: str, target: str, duration_text: str, command: str = "/idle-reaper") -> Reply:
        duration = parse_duration(duration_text)
        if duration is None:
            return Reply(f"Not a duration: `{duration_text}` (try `2h`, `90m` or `1h30m`).")
        for region in self.regions:
            matches = region.find(user, target)
            if len(matches) > 1:  # one name twice, or one instance id in two accounts: which one?
                return Reply(which_one(target, matches))
            if matches:
                record = matches[0]
                policy, refusal = region.authorize(user, record)
                if refusal:
                    return Reply(refusal)
                return region.effects.keep_command(user, record, policy, region.clock() + duration)
        return Reply(not_found(target, self.regions[0].in_organization(), command))


def which_one(target: str, matches: list[MachineRecord]) -> str:
    """`keep <target>` matched several of the caller's machines: each by the key that selects it alone (Region.find:
    a full key wins), the hub account's named as such when some run in member accounts."""
    mixed = any(r.account for r in matches)

    def named(r: MachineRecord) -> str:
        return f"`{r.key}`" + (" (the hub's account)" if mixed and r.account is None else "")

    which = ", ".join(named(r) for r in sorted(matches, key=lambda r: (r.account is not None, r.key)))
    nouns, _ = kinds_said(r.key for r in matches)
    return f"{len(matches)} of your {nouns} are `{target}`: {which}. Keep one by naming it so."


def not_found(target: str, organization: bool, command: str) -> str:
    """`keep <target>` found nothing the caller may name: what does select a machine. Someone else's machine is
    found by its key only (an owner's machines come from the owner index, never from a scan): in the hub's account
    that is its instance id; in a member account `account/region/instance-id` (its warning names the account and
    region)."""
    text = f"No machine, endpoint or Studio app named `{target}` among yours"
    if not organization:
        return text + "; someone else's machine is kept by its instance id. An endpoint, by `endpoint:<name>`."
    if parse_machine_key_or_none(target):
        return text + " or in that account and region; nothing changed."
    instance = target if target.startswith("i-") else "i-0abc"
    return (
        text
        + (" or in the hub's account" if target.startswith("i-") else "")
        + "; nothing changed. Someone else's machine is kept by its instance id in the hub's account, and in a "
        "member account by `account/region/instance-id` (its warning names the account and region), e.g. "
        f"`{command} keep 123456789012/us-east-1/{instance} 2h`."
    )
