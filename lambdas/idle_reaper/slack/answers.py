"""What a person's answer in Slack does once routing has found the record and authorized the person
(routing.py): keep, stop now, start again, and what `status` and `keep` say. The effect on the lifecycle
is decided in core; this module writes conditionally (so a double click or a Slack retry acts once),
acts, and updates the original message in place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from idle_reaper.aws.accounts import MemberSweep
from idle_reaper.aws.endpoints import NOT_CREATED
from idle_reaper.aws.fleet import Fleet
from idle_reaper.aws.state import StateStore
from idle_reaper.aws.studio import NOT_CREATED as APP_NOT_CREATED
from idle_reaper.core.answers import snooze, started_by_person, stopped_by_person, terminated_by_person
from idle_reaper.core.digest import KEEP, answer_entry, running_again_entry
from idle_reaper.core.doctor import Finding, tally
from idle_reaper.core.dollars import of_record
from idle_reaper.core.endpoints import Restore, is_endpoint_id, is_studio_id, words_for
from idle_reaper.core.kinds import NEVER_STOPPED, TERMINABLE
from idle_reaper.core.records import Action, MachineRecord, State
from idle_reaper.core.sections import grouped, section_of, state_words
from idle_reaper.core.signals import describe_human_signal
from idle_reaper.core.studio import AppRestore
from idle_reaper.policy import TeamPolicy
from idle_reaper.pricing import hourly_price
from idle_reaper.slack.blocks import date_token, escape, fit, machine_label, money, utf16_len
from idle_reaper.slack.notifier import SlackNotifier, endpoint_recreate

HELP = (
    "*idle-reaper* keeps idle machines from running up the bill.\n"
    "• `{cmd} status`: your machines, endpoints and Studio apps, their state and why\n"
    "• `{cmd} keep <instance-id-or-name> <duration>`: keep a machine, an endpoint or a Studio app, e.g. "
    "`keep i-0abc 2h` or `keep notebook 90m` (someone else's, if you may answer for it: a machine by its instance "
    "id; an endpoint by `endpoint:<name>`)\n"
    "• `{cmd} help`: this message\n"
    "• `{cmd} doctor` (admins): what would make idle-reaper quietly useless here, with the fix of each"
)
DOCTOR_REPLY_CHARS = 12000  # an ephemeral reply: Slack truncates text past 40,000; the CLI lists everything
# What EC2 means when a machine does not start again, in words (StartInstances error codes).
NOT_STARTED = {
    "InsufficientInstanceCapacity": "EC2 has no {type} capacity in its Availability Zone right now",
    "InsufficientCapacityOnHost": "its Dedicated Host has no room for it right now",
    "Unsupported": "EC2 does not offer {type} in its Availability Zone right now",
}
ANSWERED_ALREADY = (
    "Someone else answered first, or idle-reaper is acting on it right now; nothing changed. Try again in a minute."
)


@dataclass(frozen=True)
class Reply:
    """An ephemeral answer to the person who clicked or typed (None: the message itself was updated)."""

    text: str


@dataclass
class Effects:
    """One region's effects of an authorized answer on one machine."""

    store: StateStore
    fleet: Fleet
    slack: SlackNotifier
    clock: Callable[[], datetime]

    def _audit(self, record: MachineRecord, at: datetime, entry: dict[str, object]) -> None:
        """What a person did, for the weekly digest; a lost entry never undoes or fails the answer."""
        with contextlib.suppress(Exception):
            self.store.audit(record.key, at, entry)

    def _audit_answer(self, record: MachineRecord, action: str, user: str, at: datetime) -> None:
        self._audit(record, at, answer_entry(record, action, user, hourly_price(record.instance_type or "")))

    def keep(self, user: str, record: MachineRecord, policy: TeamPolicy, until: datetime) -> Reply | None:
        now = self.clock()
        kept = snooze(record, policy, user, until, now)
        if isinstance(kept, str):
            return Reply(f"Not kept: {kept}.")
        if not self.store.save(kept):
            return Reply(ANSWERED_ALREADY)
        self._audit_answer(kept, KEEP, user, now)
        label = machine_label(record.name, record.instance_id)
        detail = f"<@{user}> kept {label} until {date_token(kept.snoozed_until or now)}."
        self.slack.update(kept, "Kept", detail)
        return None

    def keep_all(self, user: str, chosen: list[tuple[MachineRecord, TeamPolicy, datetime]]) -> tuple[int, list[str]]:
        """ "Keep all" on a shared message: keep each machine (core.snooze, a conditional write each), then
        edit the message once. Returns how many were kept, and why each other one was not, by name."""
        now = self.clock()
        problems: list[str] = []
        last: MachineRecord | None = None
        for record, policy, until in chosen:
            label = machine_label(record.name, record.instance_id)
            kept = snooze(record, policy, user, until, now)
            if isinstance(kept, str):
                problems.append(f"{label}: {kept}")
            elif not self.store.save(kept):
                problems.append(f"{label}: someone else answered first, or idle-reaper is acting on it")
            else:
                self._audit_answer(kept, KEEP, user, now)
                self.slack.note_listed(
                    kept, "Kept", f"<@{user}> kept {label} until {date_token(kept.snoozed_until or now)}."
                )
                last = kept
        if last is not None:
            self.slack.render_listed(last)
        return len(chosen) - len(problems), problems

    def keep_command(self, user: str, record: MachineRecord, policy: TeamPolicy, until: datetime) -> Reply:
        """`/idle-reaper keep`: like the button, and says until when (the command has no message to update)."""
        refused = self.keep(user, record, policy, until)
        if refused:
            return refused
        kept = self.store.load([record.key]).get(record.key, record)
        when = date_token(kept.snoozed_until or until)
        return Reply(f"Kept {machine_label(record.name, record.instance_id)} until {when}.")

    def stop_now(self, user: str, record: MachineRecord) -> Reply | None:
        if record.machine_kind in NEVER_STOPPED:
            # EC2 would refuse, or something would launch a replacement: never asked.
            label = machine_label(record.name, record.instance_id)
            verb = words_for(record.instance_id).stop_button.removesuffix(" now").lower()  # stop, delete
            return Reply(f"idle-reaper cannot {verb} {label}: {escape(record.kind_note)}. Nothing changed.")
        now = self.clock()
        action = Action.UNPROTECT if record.asg_name else Action.STOP
        # A stopped machine's message offers "Start it again"; a released group member's does not.
        start_ref = None if record.asg_name else self.slack.new_ref(record.key, now)
        stopped = stopped_by_person(record, user, action, now, start_ref)
        if not self.store.save(stopped):
            return Reply(ANSWERED_ALREADY)
        if record.asg_name:
            outcome = self.fleet.set_protection(record.asg_name, [record.instance_id], protected=False)[0]
        else:
            outcome = self.fleet.stop([record.instance_id], hibernate=False)[0]
        label = machine_label(record.name, record.instance_id)
        if outcome.error:
            return Reply(f"Could not {action.value} {label} ({_code(outcome.error)}).")
        self._audit_answer(stopped, action.value, user, now)
        if record.asg_name:
            self.slack.update(
                stopped, "Released", f"<@{user}> released {label} to {record.asg_name} at {date_token(now)}."
            )
            return None
        saving = of_record(record, hourly_price(record.instance_type or "")).stop
        words = words_for(record.instance_id)
        detail = f"<@{user}> {words.stopped} {label} at {date_token(now)}"
        if saving.hourly is not None:
            detail += f"; it saves {saving.text()} while {words.stopped}"
        detail += "." + (" " + escape(endpoint_recreate(record)) if words.deletes else "")
        ref, start = stopped.warning_ref, words.start_button
        self.slack.update(stopped, words.stop_title, detail, ref=ref, start_button=True, start_label=start)
        return None

    def start_again(self, user: str, record: MachineRecord) -> Reply | None:
        now = self.clock()
        if record.state is not State.REAPED or record.last_action not in ("stop", "hibernate"):
            words = words_for(record.instance_id)
            return Reply(f"That {words.noun} is not {words.stopped} by idle-reaper; nothing changed.")
        if is_endpoint_id(record.instance_id) or is_studio_id(record.instance_id):
            return self._bring_back(user, record, now)
        # Start first: StartInstances is idempotent, and a failed start must leave the button usable.
        label = machine_label(record.name, record.instance_id)
        outcome = self.fleet.start(record.instance_id)
        if outcome.error:
            code = _code(outcome.error)
            if code in NOT_STARTED:
                # Capacity, not a fault: say what happened where the button was, and offer it again.
                what = NOT_STARTED[code].format(type=escape(record.instance_type or "this instance type"))
                detail = (
                    f"<@{user}> tried to start {label} at {date_token(now)}, but it did not start: {what} ({code}). "
                    "It is still stopped, and nothing else changed. Capacity of large GPU types can take hours "
                    "to return; try again later."
                )
                self.slack.update(
                    record, "Not started", detail, ref=record.warning_ref, start_button=True, start_label="Try again"
                )
                return Reply(f"{label} did not start: {what} ({code}). It is still stopped; try again later.")
            return Reply(f"Could not start {label} ({code}); nothing changed, try again.")
        started = started_by_person(record, user, now)
        if not self.store.save(started):
            return Reply(ANSWERED_ALREADY)
        m = record
        self._audit(record, now, running_again_entry(m.instance_id, m.team, m.owner, m.instance_type, now, by=user))
        detail = f"<@{user}> started {label} again at {date_token(now)}."
        stopped_at = record.last_action_at
        saving = of_record(record, hourly_price(record.instance_type or "")).saved_by(record.last_action or "")
        if stopped_at and saving.hourly is not None:
            hours = (now - stopped_at).total_seconds() / 3600
            saved = f"${hours * saving.hourly:,.2f}"
            detail += f" It was stopped for {hours:.1f} h and saved {'at most ' if saving.upper_bound else '~'}{saved}."
        self.slack.update(started, "Started again", detail)
        return None

    def _bring_back(self, user: str, record: MachineRecord, now: datetime) -> Reply | None:
        """ "Bring it back": CreateEndpoint from the configuration and tags its record kept (for a Studio app, "Start it
        again": CreateApp in its space, core/studio.AppRestore), then the record says who asked (pending_by) until a
        sweep finds it InService and says so in this message (sweep/endpoints.py): creating either takes minutes. A
        configuration or model that is gone is said, and nothing changes; a quota that is reached is said, with Try
        again."""
        label = machine_label(record.name, record.instance_id)
        studio = is_studio_id(record.instance_id)
        restore = AppRestore.parse(record.endpoint) if studio else Restore.parse(record.endpoint)
        again, refusals = (f"start {label} again", APP_NOT_CREATED) if studio else (f"bring {label} back", NOT_CREATED)
        done = "started again" if studio else "brought back"
        outcome = self.fleet.start(record.instance_id, restore)
        if outcome.error:
            code = _code(outcome.error)
            if code == "Gone":
                why = escape(outcome.error.split(": ", 1)[-1])
                detail = (
                    f"<@{user}> tried to {again} at {date_token(now)}, but it cannot be: {why}. Nothing was "
                    "created or changed."
                )
                self.slack.update(record, f"Cannot be {done}", detail)
                return Reply(f"{label} cannot be {done}: {why}. Nothing changed.")
            if code in refusals:
                what = refusals[code].format(type=escape(record.instance_type or "its instance type"))
                detail = (
                    f"<@{user}> tried to {again} at {date_token(now)}, but SageMaker did not create it: "
                    f"{what} ({code}). It is still deleted, and nothing else changed."
                )
                ref, title = record.warning_ref, f"Not {done}"
                self.slack.update(record, title, detail, ref=ref, start_button=True, start_label="Try again")
                return Reply(f"{label} was not {done}: {what} ({code}). It is still deleted.")
            return Reply(f"Could not {again} ({code}); nothing changed, try again.")
        pending = restore.brought_back_by(user, now) if restore else None
        started = replace(started_by_person(record, user, now), endpoint=pending.to_json() if pending else None)
        if not self.store.save(started):
            return Reply(ANSWERED_ALREADY)
        m = record
        self._audit(record, now, running_again_entry(m.instance_id, m.team, m.owner, m.instance_type, now, by=user))
        words = words_for(record.instance_id)
        detail = (
            f"<@{user}> asked to {again} at {date_token(now)}: {words.recreating}. This message says when it is "
            "InService."
        )
        self.slack.update(started, words.back_title, detail)
        return None

    def terminate_now(self, user: str, record: MachineRecord) -> Reply | None:
        """A machine EC2 cannot stop, terminated at its owner's confirmed click (the button asks to confirm and
        says what is lost). Only its owner: termination cannot be undone."""
        label = machine_label(record.name, record.instance_id)
        if record.machine_kind not in TERMINABLE:
            return Reply(f"idle-reaper does not terminate {label}; nothing changed.")
        if not record.owner_slack_id or user != record.owner_slack_id:
            return Reply(f"Only the owner of {label} can terminate it; nothing changed.")
        now = self.clock()
        terminated = terminated_by_person(record, user, now)
        if not self.store.save(terminated):
            return Reply(ANSWERED_ALREADY)
        outcome = self.fleet.terminate([record.instance_id])[0]
        if outcome.error:
            # Put the record back as it was: the machine still runs, and its buttons still apply.
            self.store.save(replace(record, version=terminated.version + 1))
            return Reply(f"Could not terminate {label} ({_code(outcome.error)}); nothing changed.")
        self._audit_answer(terminated, "terminate_instance", user, now)
        self.slack.update(
            terminated, "Terminated", f"<@{user}> terminated {label} at {date_token(now)}; it cannot be started again."
        )
        return None


STATUS_LINE_CHARS = 600  # one resource's line: a Name tag and a reason quoting tags can each be long


def _status_line(r: MachineRecord, now: datetime) -> str:
    """One resource in `status`: what it is (and where, in a member account), its team, its instances and what
    they cost an hour, where it stands in words (core/sections.py) and why, and what its collector says."""
    words = state_words(r, now)
    price = hourly_price(r.instance_type or "")
    hardware = escape(r.instance_type or "unknown instances")
    cost = f"{hardware}, {money(price)}/h" if price is not None else f"{hardware}, no known price"
    said = r.state in (State.UNKNOWN, State.SAFE_MODE) or not r.reason  # its words hold its reason
    why = "" if said else f": {escape(r.reason)}"
    line = (
        f"• {machine_label(r.name, r.instance_id)}"
        + (f" · account {r.account} ({r.region})" if r.account else "")
        + f" · {escape(r.team)} · {cost} · *{escape(words)}*{why}"
        + (f" · {human}" if (human := describe_human_signal(r.human_signal)) else "")
    )
    return fit(line, STATUS_LINE_CHARS, mrkdwn=True)


def _status_sections(mine: Iterable[MachineRecord], now: datetime, budget: int) -> str:
    """The caller's resources by kind, as the CLI's `status` groups them (core/sections.py): machines, then
    endpoints, Studio apps, each under its label. The reply's room is shared out so every kind is shown: each
    section gets an even share of what is left (a short one leaves the rest to the next), and the lines past its
    share are counted ("and 12 more endpoints"), never cut mid-line."""
    ordered = sorted(mine, key=lambda r: (r.team, r.name or r.instance_id))
    sections = grouped(ordered, lambda r: section_of(r.key))
    parts: list[str] = []
    for i, (label, records) in enumerate(sections):
        share = (budget - sum(map(utf16_len, parts))) // (len(sections) - i)
        head = f"*{label[:1].upper() + label[1:]}* ({len(records)}):"
        lines: list[str] = []
        used = utf16_len(head) + 40  # room for the "and N more" line
        for r in records:
            line = _status_line(r, now)
            if used + utf16_len(line) + 1 > share:
                break
            lines.append(line)
            used += utf16_len(line) + 1
        if len(lines) < len(records):
            lines.append(f"… and {len(records) - len(lines)} more {label}")
        parts.append("\n".join([head, *lines]))
    return "\n\n".join(parts)


def status_reply(
    mine: Iterable[MachineRecord],
    members: MemberSweep | None = None,
    member_regions: Sequence[str] = (),
    *,
    now: datetime,
) -> Reply:
    """`/idle-reaper status`: the caller's machines, endpoints and Studio apps, each kind apart with its state in
    words, hourly cost and why (team and reason quote tags: escaped); `members` (organization mode, shown to
    admins): the last sweep's excluded accounts and failed units; `member_regions` (the same): the member
    accounts' daily count of their regions outside the organization's. One text reply within DOCTOR_REPLY_CHARS
    (no blocks: a reply of any length stays one message, under Slack's 40,000-character truncation)."""
    mine = list(mine)
    admin = [*(members.lines() if members is not None else []), *member_regions]
    admin_text = fit("\n".join(escape(line) for line in admin), DOCTOR_REPLY_CHARS // 3) if admin else ""
    room = DOCTOR_REPLY_CHARS - utf16_len(admin_text) - 2
    text = (
        _status_sections(mine, now, room)
        if mine
        else "You own no machines, endpoints or Studio apps idle-reaper knows of (owners come from the `Owner` tag)."
    )
    return Reply(fit(text + ("\n\n" + admin_text if admin_text else ""), DOCTOR_REPLY_CHARS, mrkdwn=True))


def doctor_reply(findings: list[Finding], where: str) -> Reply:
    """`/idle-reaper doctor`: the lines that are not ok, each with its fix, or "all N checks ok". Messages
    quote tags and policies: escaped."""
    shown = [f for f in findings if f.status != "ok"]
    if not shown:
        return Reply(f"idle-reaper doctor ({where}): all {len(findings)} checks ok.")
    lines = [
        f"• *{f.status.upper()}* `{f.check}`: {escape(f.message)}" + (f"\n    fix: {escape(f.fix)}" if f.fix else "")
        for f in shown
    ]
    text = f"idle-reaper doctor ({where}): {tally(findings)}\n" + "\n".join(lines)
    return Reply(fit(text, DOCTOR_REPLY_CHARS, mrkdwn=True))


def help_reply(command: str, unknown_verb: str | None = None) -> Reply:
    text = HELP.format(cmd=command)
    return Reply(f"Unknown command `{unknown_verb}`.\n{text}" if unknown_verb else text)


def _code(error: str) -> str:
    """Only the AWS error code reaches Slack: messages may carry ARNs or encoded authorization details."""
    return error.split(":", 1)[0]
