"""What a person's answer in Slack does: a button ("Keep 2 h", "Stop now", "Start it again") or the
slash command. Authorization and the effect on the lifecycle are decided in core; this module loads,
checks the opaque reference, writes conditionally (so a double click or a Slack retry acts once), acts,
and updates the original message in place."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.aws import AwsError, Fleet, PolicyStore, StateStore, policy_for
from idle_reaper.core import (
    KEEP_HOURS,
    Action,
    MachineRecord,
    State,
    keep_until,
    may_answer,
    parse_duration,
    snooze,
    started_by_person,
    stopped_by_person,
)
from idle_reaper.policy import PolicyError, Settings, TeamPolicy
from idle_reaper.pricing import hourly_price
from idle_reaper.slack import SlackNotifier, date_token, machine_label

KEEP_ACTIONS = {*KEEP_HOURS, "keep_morning"}
HELP = (
    "*idle-reaper* keeps idle machines from running up the bill.\n"
    "• `{cmd} status`: your machines, their state and why\n"
    "• `{cmd} keep <instance-id-or-name> <duration>`: keep a machine, e.g. `keep i-0abc 2h` or `keep notebook 90m`\n"
    "• `{cmd} help`: this message"
)


@dataclass(frozen=True)
class Reply:
    """An ephemeral answer to the person who clicked or typed (None: the message itself was updated)."""

    text: str


@dataclass
class Answers:
    store: StateStore
    policies: PolicyStore
    fleet: Fleet
    slack: SlackNotifier
    clock: Callable[[], datetime]

    # -----------------------------------------------------------------------------------------
    # Context

    def _settings(self) -> Settings:
        try:
            return self.policies.load_settings()[0]
        except (PolicyError, *AwsError):
            return Settings()  # admins unknown: only owners and team members may answer

    def _policy(self, team: str, settings: Settings) -> TeamPolicy | None:
        try:
            return policy_for(team, self.policies.load_teams(settings), settings).policy
        except AwsError:
            return None

    def _group_members(self, policy: TeamPolicy | None) -> set[str]:
        members: set[str] = set()
        for group in (m for m in (policy.members if policy else ()) if m.startswith("S")):
            try:
                members.update(self.slack.client.usergroups_users_list(usergroup=group)["users"])
            except (SlackApiError, SlackClientError):
                continue  # an unreadable group grants nothing
        return members

    def _authorize(self, user: str, record: MachineRecord) -> tuple[TeamPolicy | None, str | None]:
        settings = self._settings()
        policy = self._policy(record.team, settings)
        if not may_answer(user, record, policy, settings.admins, self._group_members(policy)):
            return policy, (
                f"You can't change {machine_label(record.name, record.instance_id)}: only its owner, "
                f"the {record.team} team's members and idle-reaper admins can."
            )
        return policy, None

    # -----------------------------------------------------------------------------------------
    # Buttons

    def button(self, user: str, action_id: str, value: str) -> Reply | None:
        ref, _, choice = value.partition("|")  # the overflow menu carries "ref|keep_4h"
        if action_id == "keep_other":
            action_id = choice
        if action_id not in KEEP_ACTIONS | {"stop_now", "start_again"}:
            return Reply("That is not an idle-reaper action; nothing was changed.")
        instance_id = self.store.get_lookup(f"ref#{ref}", self.clock()) if ref else None
        record = self.store.load([instance_id]).get(instance_id) if instance_id else None
        if record is None or not hmac.compare_digest(record.warning_ref or "", ref):
            return Reply("This message is no longer current (it was answered already, or replaced); nothing changed.")
        policy, refusal = self._authorize(user, record)
        if refusal:
            return Reply(refusal)
        if action_id in KEEP_ACTIONS:
            until = keep_until(action_id, policy or Settings().default_policy, self.clock())
            assert until is not None
            return self._keep(user, record, policy or Settings().default_policy, until)
        if action_id == "stop_now":
            return self._stop_now(user, record)
        return self._start_again(user, record)

    def _keep(self, user: str, record: MachineRecord, policy: TeamPolicy, until: datetime) -> Reply | None:
        now = self.clock()
        kept = snooze(record, policy, user, until, now)
        if isinstance(kept, str):
            return Reply(f"Not kept: {kept}.")
        if not self.store.save(kept):
            return Reply("Someone else answered first; nothing changed.")
        label = machine_label(record.name, record.instance_id)
        detail = f"<@{user}> kept {label} until {date_token(kept.snoozed_until or now)}."
        self.slack.update(kept, "Kept", detail)
        return None

    def _stop_now(self, user: str, record: MachineRecord) -> Reply | None:
        now = self.clock()
        action = Action.UNPROTECT if record.asg_name else Action.STOP
        # A stopped machine's message offers "Start it again"; a released group member's does not.
        start_ref = None if record.asg_name else self.slack.new_ref(record.instance_id, now)
        stopped = stopped_by_person(record, user, action, now, start_ref)
        if not self.store.save(stopped):
            return Reply("Someone else answered first; nothing changed.")
        if record.asg_name:
            outcome = self.fleet.set_protection(record.asg_name, [record.instance_id], protected=False)[0]
        else:
            outcome = self.fleet.stop([record.instance_id], hibernate=False)[0]
        label = machine_label(record.name, record.instance_id)
        if outcome.error:
            return Reply(f"Could not {action.value} {label} ({_code(outcome.error)}).")
        if record.asg_name:
            self.slack.update(
                stopped, "Released", f"<@{user}> released {label} to {record.asg_name} at {date_token(now)}."
            )
            return None
        cost = hourly_price(record.instance_type or "")
        detail = f"<@{user}> stopped {label} at {date_token(now)}"
        if cost is not None:
            detail += f"; it saves ~${cost:,.2f} per hour while stopped"
        self.slack.update(stopped, "Stopped", detail + ".", ref=stopped.warning_ref, start_button=True)
        return None

    def _start_again(self, user: str, record: MachineRecord) -> Reply | None:
        now = self.clock()
        if record.state is not State.REAPED or record.last_action not in ("stop", "hibernate"):
            return Reply("That machine is not stopped by idle-reaper; nothing changed.")
        # Start first: StartInstances is idempotent, and a failed start must leave the button usable.
        label = machine_label(record.name, record.instance_id)
        outcome = self.fleet.start(record.instance_id)
        if outcome.error:
            return Reply(f"Could not start {label} ({_code(outcome.error)}); nothing changed, try again.")
        started = started_by_person(record, user, now)
        if not self.store.save(started):
            return Reply("Someone else answered first; nothing changed.")
        detail = f"<@{user}> started {label} again at {date_token(now)}."
        stopped_at, cost = record.last_action_at, hourly_price(record.instance_type or "")
        if stopped_at and cost is not None:
            hours = (now - stopped_at).total_seconds() / 3600
            detail += f" It was stopped for {hours:.1f} h and saved ~${hours * cost:,.2f}."
        self.slack.update(started, "Started again", detail)
        return None

    # -----------------------------------------------------------------------------------------
    # Slash command

    def command(self, user: str, command: str, text: str) -> Reply:
        words = text.split()
        verb = words[0].lower() if words else "help"
        if verb == "status":
            return self._status(user)
        if verb == "keep":
            if len(words) != 3:
                return Reply(
                    f"Usage: `{command} keep <instance-id-or-name> <duration>`, e.g. `{command} keep i-0abc 2h`"
                )
            return self._keep_command(user, words[1], words[2])
        if verb == "help":
            return Reply(HELP.format(cmd=command))
        return Reply(f"Unknown command `{verb}`.\n" + HELP.format(cmd=command))

    def _status(self, user: str) -> Reply:
        mine = [r for r in self.store.all_records() if r.owner_slack_id == user]
        if not mine:
            return Reply("You own no machines idle-reaper knows of (owners come from the `Owner` tag).")
        lines = [
            f"• {machine_label(r.name, r.instance_id)} · {r.team} · *{r.state.value}*: {r.reason}"
            for r in sorted(mine, key=lambda r: (r.team, r.name or r.instance_id))
        ]
        return Reply("Your machines:\n" + "\n".join(lines))

    def _keep_command(self, user: str, target: str, duration_text: str) -> Reply:
        duration = parse_duration(duration_text)
        if duration is None:
            return Reply(f"Not a duration: `{duration_text}` (try `2h`, `90m` or `1h30m`).")
        matches = [r for r in self.store.all_records() if target in (r.instance_id, r.name)]
        if len(matches) != 1:
            what = "No machine" if not matches else f"{len(matches)} machines"
            return Reply(f"{what} named `{target}`; use the instance id.")
        record = matches[0]
        policy, refusal = self._authorize(user, record)
        if refusal:
            return Reply(refusal)
        now = self.clock()
        reply = self._keep(user, record, policy or Settings().default_policy, now + duration)
        if reply:
            return reply
        kept = self.store.load([record.instance_id])[record.instance_id]
        return Reply(
            f"Kept {machine_label(record.name, record.instance_id)} until {date_token(kept.snoozed_until or now)}."
        )


@dataclass
class RegionalAnswers:
    """One Slack app for several regions: every region's sweep posts with the same app, so any click
    or command may reach any region's handler. The button's reference says which region's table it
    lives in; a command is answered from every region. The local region comes first."""

    regions: list[Answers]

    def button(self, user: str, action_id: str, value: str) -> Reply | None:
        ref = value.partition("|")[0]
        for answers in self.regions:
            if ref and answers.store.get_lookup(f"ref#{ref}", answers.clock()):
                return answers.button(user, action_id, value)
        return self.regions[0].button(user, action_id, value)  # explains that it is no longer current

    def command(self, user: str, command: str, text: str) -> Reply:
        words = text.split()
        verb = words[0].lower() if words else "help"
        if verb == "status" and len(self.regions) > 1:
            replies = [a.command(user, command, text).text for a in self.regions]
            mine = [r.split("\n", 1)[1] for r in replies if r.startswith("Your machines:")]
            return Reply("Your machines:\n" + "\n".join(mine)) if mine else Reply(replies[0])
        if verb == "keep" and len(words) == 3:
            for answers in self.regions:
                if any(words[1] in (r.instance_id, r.name) for r in answers.store.all_records()):
                    return answers.command(user, command, text)
        return self.regions[0].command(user, command, text)


def _code(error: str) -> str:
    """Only the AWS error code reaches Slack: messages may carry ARNs or encoded authorization details."""
    return error.split(":", 1)[0]
