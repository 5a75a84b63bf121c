"""Talking to Slack: the client and its secrets, warnings and stop notices, updating messages in place.

Every post is recorded by the sweep as a Delivery; a failure that will not heal is a PermanentDeliveryFailure (how a
failure is classified: slack/faults.py; posting within Slack's limits: slack/posting.py; the copies a delivered
warning still owes: slack/copies.py)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from slack_sdk.errors import SlackApiError, SlackClientError, SlackObjectFormationError

from idle_reaper.aws.clients import AwsError
from idle_reaper.core.endpoints import Restore, is_studio_id, words_for
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MAYBE_POSTED, Action, MachineRecord
from idle_reaper.core.sections import kinds_said
from idle_reaper.core.studio import AppRestore, recreate_sentence
from idle_reaper.notify import Delivery, DeliveryUnknown, PermanentDeliveryFailure, PostOutcome
from idle_reaper.notify import logger as logger  # re-exported for the Slack handler
from idle_reaper.slack.blocks import (
    FALLBACK_CHARS,
    HEADER_CHARS,
    OWNER_MESSAGE_MACHINES,
    PAST_TENSE,
    ListedGroup,
    blocks_json,
    date_token,
    escape,
    fit,
    machine_label,
    money,
    owner_message_blocks,
    owner_warning_line,
    quiet_stop_line,
    status_blocks,
    warning_blocks,
    warning_text,
)
from idle_reaper.slack.client import DEFAULT_API_URL as DEFAULT_API_URL  # re-exported
from idle_reaper.slack.client import (
    BudgetedRateLimitRetryHandler as BudgetedRateLimitRetryHandler,
)
from idle_reaper.slack.client import SlackNotConfigured as SlackNotConfigured
from idle_reaper.slack.client import SlackSecrets as SlackSecrets
from idle_reaper.slack.client import SlackUndelivered as SlackUndelivered
from idle_reaper.slack.client import load_secrets as load_secrets
from idle_reaper.slack.client import make_client as make_client
from idle_reaper.slack.copies import OwedCopies
from idle_reaper.slack.faults import SlackFault as SlackFault  # re-exported
from idle_reaper.slack.faults import classify as classify  # re-exported
from idle_reaper.slack.notices import NOTICE_EDITS_PER_MINUTE, EditPace, StopNotice, Told
from idle_reaper.slack.posting import POST_SECONDS_PER_CHANNEL as POST_SECONDS_PER_CHANNEL  # re-exported
from idle_reaper.slack.shared import REF_TTL as REF_TTL  # re-exported
from idle_reaper.slack.shared import listed_metadata, warning_metadata


class SlackDelivery(OwedCopies):
    """Slack plumbing: who an owner is, where a warning goes and whether a lost one went out, editing messages in
    place (shared ones line by line), admin alerts."""

    def find_warning(self, decision: Decision) -> Delivery | None:
        """A warning whose post was attempted and whose outcome was lost, looked for where it would be: in
        each target conversation since the attempt, by the message metadata every warning carries. The
        Delivery found (when posted in any target), or None when every target shows it was never posted.
        Raises DeliveryUnknown when a target cannot be read (answered=True when Slack answered and refused:
        a conversation the bot is not in, a DM it cannot open), PermanentDeliveryFailure when nobody can be
        warned. A found post counts as delivered from when the sweep began posting it; the targets it was not
        found in are owed their copy (Delivery.owed: MAYBE_POSTED where they could not be read)."""
        record, m = decision.record, decision.machine
        ref, since = record.warning_ref, record.warning_post_started_at
        if not ref or since is None:
            return None
        try:
            owner_id, targets, unread = self._warning_targets(decision, open_dm=True)
        except (SlackApiError, SlackClientError, OSError) as exc:
            fault = self._failed("delivery check", m.instance_id, exc, m.owner or "owner")
            raise DeliveryUnknown(fault.advice, answered=fault.answered) from None
        found: list[str] = []
        missing: list[str] = []  # read, and not there
        group_ref: str | None = None
        for channel in targets:
            try:
                message = self._warning_in(channel, since, ref)
            except (SlackApiError, SlackClientError, OSError) as exc:
                unread.append(self._failed("delivery check", m.instance_id, exc, channel))
                continue
            if message is not None:
                found.append(f"{channel}|{message['ts']}")
                payload = (message.get("metadata") or {}).get("event_payload") or {}
                group_ref = payload.get("group_ref") or group_ref
            else:
                missing.append(channel)
        if found:  # a copy reached a person: delivered, and the conversations without one are owed it
            dm = targets[0] if owner_id and targets and targets[0][:1] == "D" else None

            def owed_as(target: str) -> str:  # the owner's DM is posted to (and owed) by their user id
                return owner_id if target == dm and owner_id else target

            owed = [owed_as(t) for t in missing] + [owed_as(f.target) + MAYBE_POSTED for f in unread if not f.permanent]
            return Delivery(
                messages=tuple(found),
                ref=ref,
                owner_slack_id=owner_id,
                group_ref=group_ref,
                owed=tuple(dict.fromkeys(owed)),
            )
        if unread:  # not seen where it was read, and not readable somewhere else: it may be there
            reason = "; ".join(f.advice for f in unread)
            raise DeliveryUnknown(reason, answered=all(f.answered for f in unread))
        return None

    def _warning_targets(
        self, decision: Decision, owner_id: str | None = None, *, open_dm: bool = False
    ) -> tuple[str | None, list[str], list[SlackFault]]:
        """(owner's user id, channels to post to, faults of targets that could not be opened). `owner_id`:
        the machine's owner as already resolved from its own tag. A post to the owner names the user itself:
        Slack puts it in the app's DM with them and answers with that DM's channel id, so no
        conversations.open (Tier 3, about 50 a minute) is spent per owner; `open_dm` opens the DM instead,
        for reading its history."""
        m, policy = decision.machine, decision.policy.policy if decision.policy else None
        notify = policy.notify if policy else "owner"
        owner_id = (owner_id or self.resolve_owner(m.owner)) if notify != "channel" else None
        targets: list[str] = []
        faults: list[SlackFault] = []
        if owner_id and not open_dm:
            targets.append(owner_id)
        elif owner_id:
            try:
                targets.append(str(self.client.conversations_open(users=owner_id)["channel"]["id"]))
            except (SlackApiError, SlackClientError, OSError) as exc:
                faults.append(self._failed("warning", m.instance_id, exc, owner_id))
        if policy and policy.slack_channel and notify in ("channel", "both"):
            targets.append(policy.slack_channel)
            if notify == "both" and not owner_id and not open_dm:
                # The channel alone gets it: it counts as delivered, and the admins hear who was not told.
                owner = f"the Owner tag {fit(m.owner, 80)!r} is not a Slack user" if m.owner else "it has no Owner tag"
                advice = f"{owner}: only the channel was warned; tag its Owner with a Slack user id or email"
                faults.append(SlackFault("owner_unknown", True, advice, answered=True))
        if not targets and not faults:
            owner = f"the Owner tag {fit(m.owner, 80)!r} is not a Slack user" if m.owner else "it has no Owner tag"
            channel = "the team policy names no slack_channel" if notify != "owner" else "notify is 'owner'"
            raise PermanentDeliveryFailure(
                f"nobody to warn about {m.instance_id} (team {fit(m.team, 80)}): {owner}, and {channel}. Tag its "
                "Owner with a Slack user id or email, or set slack_channel in the team policy"
            )
        return owner_id, targets, faults

    def update(
        self,
        record: MachineRecord,
        title: str,
        detail: str,
        *,
        ref: str | None = None,
        start_button: bool = False,
        start_label: str = "Start it again",
    ) -> bool:
        """Rewrite every copy of the machine's message in place. True if all copies were updated.

        `detail` is mrkdwn (see status_blocks). An update is best effort and never retried, so it does not
        raise: a permanent failure (a deleted message, an archived channel) is logged as an ERROR with
        what to do, a transient one as a WARNING."""
        if record.group_ref:
            try:
                if self.note_listed(record, title, detail, start_ref=ref if start_button else None):
                    return self.render_listed(record)
            except AwsError as exc:  # best effort, like every update: the table is down, the message stays
                self.logger.warning(
                    "shared message not updated", extra={"subject": record.instance_id, "error": str(exc)}
                )
                return False
        text = fit(f"{escape(title)}: {detail}", FALLBACK_CHARS, mrkdwn=True)
        try:
            blocks = blocks_json(
                status_blocks(title, detail, ref=ref, start_button=start_button, start_label=start_label)
            )
        except (SlackObjectFormationError, ValueError) as exc:
            self._failed("update", record.instance_id, exc, record.instance_id)
            return False
        return not self.edit_copies(record.messages, text, blocks, record.instance_id)

    def back_in_service(self, record: MachineRecord, by: str, since: datetime) -> bool:
        """An endpoint brought back is InService (sweep/endpoints.py): its message says so, and since when."""
        label = machine_label(record.name, record.instance_id)
        now = record.updated_at or self.clock()
        if is_studio_id(record.instance_id):  # a Studio app started again
            detail = (
                f"{label}, started again by <@{by}> at {date_token(since)}, is InService since {date_token(now)}: "
                "open it from its space in Studio."
            )
            return self.update(record, "Running again", detail)
        detail = (
            f"{label}, brought back by <@{by}> at {date_token(since)}, is InService again since "
            f"{date_token(now)}: requests reach it as before."
        )
        return self.update(record, "Back in service", detail)

    def not_brought_back(self, record: MachineRecord, by: str, since: datetime, left: str | None) -> bool:
        """An endpoint brought back that SageMaker could not create (sweep/endpoints.py): its message says so, with
        SageMaker's reason, and offers "Try again" (`record.warning_ref`). `left`: why the failed endpoint could not
        be deleted (then the next try is refused until it is)."""
        label = machine_label(record.name, record.instance_id)
        if is_studio_id(record.instance_id):  # a Studio app started again (core/studio.py)
            app = AppRestore.parse(record.endpoint)
            why = (app.failed if app else None) or "SageMaker gave no reason"
            detail = (
                f"<@{by}> asked to start {label} again at {date_token(since)}, but SageMaker could not start it: it "
                f"reached Failed ({escape(why)}). It is deleted again and costs nothing; its space and the space's "
                "storage are kept. Try again once the cause has passed (capacity often returns within hours)."
            )
            kept, title = "app", "Not started again"
        else:
            why = (Restore.parse(record.endpoint) or Restore("")).failed or "SageMaker gave no reason"
            detail = (
                f"<@{by}> asked to bring {label} back at {date_token(since)}, but SageMaker could not create it: it "
                f"reached Failed ({escape(why)}). It is deleted again and costs nothing; its endpoint configuration, "
                "model and tags are kept. Try again once the cause has passed (capacity often returns within hours)."
            )
            kept, title = "endpoint", "Not brought back"
        if left:
            detail += f" SageMaker kept the failed {kept} ({escape(left.split(':', 1)[0])}): delete it first."
        ref = record.warning_ref
        return self.update(record, title, detail, ref=ref, start_button=ref is not None, start_label="Try again")

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        """DM every admin and post to the admin channel. Raises when nobody received it, so the caller
        keeps the alert pending. `text` is plain: it quotes policies and tags, so it is escaped here."""
        body = fit(f"idle-reaper admin alert: {escape(text)}", FALLBACK_CHARS, mrkdwn=True)
        delivered = 0
        targets = [("admin", admin) for admin in admins] + ([("channel", channel)] if channel else [])
        for kind, target in targets:
            try:
                where = self.client.conversations_open(users=target)["channel"]["id"] if kind == "admin" else target
                self.post_message(where, text=body)
                delivered += 1
            except (SlackApiError, SlackClientError, OSError) as exc:
                self._failed("admin alert", target, exc, target)
        if targets and not delivered:
            raise SlackUndelivered(f"no admin received the alert ({len(targets)} tried)")

    def _note(self, record: MachineRecord, notice: StopNotice | None) -> bool:
        """The notice as the machine's line in its shared message; False when that message's listing is gone."""
        if notice is None:
            return False
        return self.note_listed(record, notice.title, notice.detail, start_ref=notice.ref if notice.start else None)


def endpoint_recreate(record: MachineRecord) -> str:
    """What a deleted endpoint's (Studio app's) notice says of bringing it back (plain text: the caller escapes)."""
    if is_studio_id(record.instance_id):
        return recreate_sentence(record.endpoint)
    restore = Restore.parse(record.endpoint)
    if restore is None:
        return "Its endpoint configuration, model and tags are kept."
    by_hand = restore.recreate_command(record.name or record.instance_id)
    return (
        f"Its endpoint configuration {restore.config}, model and tags are kept: Bring it back recreates it (by hand: "
        f"{by_hand})."
    )


class SlackNotifier(SlackDelivery):
    """What the sweep tells people: warnings to the owner (DM) and/or the team channel, one message per
    owner, stop notices and quiet-hours summaries; later updates edit them in place."""

    def warn(self, decision: Decision) -> Delivery | None:
        """Post the warning to each target on its own. Delivered when any target got it (the others' permanent
        faults ride along in Delivery.undelivered, the ones that may pass in Delivery.owed: posted there by a later
        sweep); None when a failure may pass (retried next sweep); PermanentDeliveryFailure when every target
        failed for a reason that will not pass."""
        m = decision.machine
        now = decision.record.updated_at or self.clock()  # the sweep's (possibly simulated) clock
        try:
            owner_id, targets, faults = self._warning_targets(decision)
            if not targets:
                self._raise_if_permanent(m, faults)
                return None
            ref = self.new_ref(m.key, now, decision.record.warning_ref)
        except (SlackApiError, SlackClientError, OSError, *AwsError) as exc:
            self._failed("warning", m.instance_id, exc, m.owner or "owner")
            return None
        try:
            blocks = blocks_json(warning_blocks(decision, ref, now))
        except (SlackObjectFormationError, ValueError) as exc:
            raise PermanentDeliveryFailure(self._failed("warning", m.instance_id, exc, m.instance_id).advice) from None
        text = warning_text(decision)
        metadata = warning_metadata([m.key], [ref])
        messages = self._post_to(targets, text, blocks, faults, m.instance_id, metadata)
        if not messages:
            self._raise_if_permanent(m, faults)
            lost = [f for f in faults if f.lost]
            if lost:  # it may have been posted: the next sweep looks for it before posting again
                raise DeliveryUnknown("; ".join(f.advice for f in lost))
            return None  # a failure that may pass: the next sweep tries again
        found, owed = self._copies_owed(faults, ref, now)
        undelivered = tuple(self._reason(m, f) for f in faults if f.permanent)
        return Delivery(
            messages=tuple(messages + found), ref=ref, owner_slack_id=owner_id, undelivered=undelivered, owed=owed
        )

    def resolved(self, decision: Decision) -> None:
        m = decision.machine
        label = machine_label(m.name, m.instance_id)  # in a shared message the note takes the machine's line
        detail = f"{label} is busy again ({escape(decision.reason)}). Nothing will happen to it."
        self.update(decision.record, "Warning withdrawn", detail)

    # Stop notices (sweep/notices.py): drafted when a machine is stopped, sent (coalesced, paced) until Slack takes
    # them ------------------------------------------------------------------------------------------------------

    def stop_notice(self, decision: Decision) -> StopNotice | None:
        """What the owner is told of a machine stopped, hibernated, terminated or released, and where: a draft
        kept on its record until Slack takes it (None: nothing to tell)."""
        record, m = decision.record, decision.machine
        now = record.updated_at or self.clock()
        reason = escape(decision.reason)
        label = machine_label(m.name, m.instance_id)
        ref: str | None = None
        if decision.action in (Action.STOP, Action.HIBERNATE):
            ref = self.new_ref(m.key, now)
            saving = decision.saving.text() if decision.saving else f"~{money(decision.hourly_cost)}/h"
            if decision.kind.reservation is not None:
                saving = f"nothing (its {decision.kind.reservation.label} is billed either way)"
            words = words_for(m.instance_id)
            title = words.stop_title
            done = words.stopped if m.deleted_by_stop else PAST_TENSE[decision.action]
            detail = f"{label} was {done} at {date_token(now)}; it saves {saving} while {words.stopped}. "
            if m.deleted_by_stop:
                detail += escape(endpoint_recreate(record)) + " "
            detail += reason
        elif decision.action is Action.TERMINATE_INSTANCE:
            title = "Terminated"
            detail = f"{label} was terminated at {date_token(now)}: it cannot be started again. {reason}"
        elif decision.action is Action.TERMINATE:  # a group member under asg_action: terminate
            title = "Terminated"
            detail = f"{label} was terminated at {date_token(now)}, its Auto Scaling group shrunk by one. {reason}"
        else:  # a group member: its scale-in protection released
            title, detail = "Released to its group", f"{label} at {date_token(now)}: {reason}"
        targets: list[str] = []  # where a message of its own goes: nothing to edit, or what it edits is gone
        try:
            _, targets, _ = self._warning_targets(decision, record.owner_slack_id)
        except PermanentDeliveryFailure as exc:
            self.logger.warning("stop not told: nobody to tell", extra={"subject": m.instance_id, "why": exc.reason})
            return None
        except (SlackApiError, SlackClientError, OSError) as exc:
            self._failed("stop notice", m.instance_id, exc, m.owner or "owner")
            targets = [t for t in (record.owner_slack_id,) if t]
        return StopNotice(title, detail, ref, start=ref is not None, targets=tuple(targets), at=now)

    def send_notices(self, records: Sequence[MachineRecord], pace: EditPace) -> dict[str, Told]:
        """Tell each record's pending notice (MachineRecord.notice) where its warning went: the machines of one
        shared message in one edit of it, a machine's own message edited, a message of its own where there was
        none (or the one to edit is gone). chat.update is paced (`pace`, under Slack's Tier 3) and nothing is
        sent past its deadline. By machine key: "sent" (Slack took it), "retry" (not now: rate, time, an
        outage), or "gone" (nowhere it can be told), with the copies of a message of its own it went out in."""
        drafts = {r.key: StopNotice.parse(r.notice) for r in records}
        out: dict[str, Told] = {r.key: ("retry", ()) for r in records}
        groups: dict[str, list[MachineRecord]] = {}
        for r in records:
            notice = drafts[r.key]
            if notice is None:
                out[r.key] = ("gone", ())
            elif r.group_ref:
                groups.setdefault(r.group_ref, []).append(r)
        for group_ref, listed in groups.items():
            copies = len(listed[0].messages) or 1
            if not pace.take(copies):
                continue
            try:
                noted = [r for r in listed if self._note(r, drafts[r.key])]
            except AwsError as exc:
                self._failed("stop notice", group_ref, exc, "state table")
                continue
            if len(noted) < len(listed):  # the listing is gone (its references expired): each told on its own
                for r in listed:
                    if r not in noted:
                        out[r.key] = self._send_own(replace(r, group_ref=None), drafts[r.key], pace)
            if noted:
                sent = self.render_listed(noted[0])
                for r in noted:
                    out[r.key] = ("sent" if sent else "retry", ())
        for r in records:
            notice = drafts[r.key]
            if notice is not None and not r.group_ref:
                out[r.key] = self._send_own(r, notice, pace)
        return out

    def _send_own(self, record: MachineRecord, notice: StopNotice | None, pace: EditPace) -> Told:
        """A machine's notice in its own message (edited), or in a message of its own."""
        if notice is None:
            return ("gone", ())
        text = fit(f"{escape(notice.title)}: {notice.detail}", FALLBACK_CHARS, mrkdwn=True)
        try:
            label = words_for(record.instance_id).start_button
            blocks = blocks_json(
                status_blocks(notice.title, notice.detail, ref=notice.ref, start_button=notice.start, start_label=label)
            )
        except (SlackObjectFormationError, ValueError) as exc:
            self._failed("stop notice", record.instance_id, exc, record.instance_id)
            return ("gone", ())
        if record.messages:
            if not pace.take(len(record.messages)):
                return ("retry", ())
            refused = self.edit_copies(record.messages, text, blocks, record.instance_id)
            if len(refused) < len(record.messages):
                return ("sent", ())
            if not all(f.permanent for f in refused):
                return ("retry", ())
        # Nothing to edit, or every copy is gone (deleted, archived): a message of its own where warnings go.
        targets = list(notice.targets) or [t for t in (record.owner_slack_id,) if t]
        if not targets:
            return ("gone", ())
        if not pace.in_time():
            return ("retry", ())
        faults: list[SlackFault] = []
        posted = self._post_to(targets, text, blocks, faults, record.instance_id)
        if posted:
            return ("sent", tuple(posted))
        return ("gone" if faults and all(f.permanent for f in faults) else "retry", ())

    def reaped(self, decision: Decision) -> Delivery | None:
        """Notifier.reaped, for a caller without a notice pass (sweep/notices.py): drafted and sent at once."""
        notice = self.stop_notice(decision)
        if notice is None:
            return None
        record = replace(decision.record, notice=notice.to_json())
        _, posted = self.send_notices([record], EditPace(NOTICE_EDITS_PER_MINUTE, time.monotonic() + 30))[record.key]
        return Delivery(messages=posted, ref=notice.ref)

    # One message per owner ------------------------------------------------------------------

    def warn_owner(
        self, decisions: Sequence[Decision], owner_id: str | None = None, *, lone_layout: bool = False
    ) -> list[PostOutcome]:
        """One message listing every machine of `decisions` (one owner, the same targets: see
        core.owner_message_groups), split past OWNER_MESSAGE_MACHINES. Each machine gets its own buttons'
        reference and its message's "Keep all" reference (Delivery.group_ref). What each machine gets is what
        `warn` would return for it alone: a part no target received leaves its machines undelivered.
        `lone_layout`: a message of one machine looks like `warn`'s (all its buttons) until others join it
        (join_owner_message) or it is edited; it is listed and carries its group reference all the same."""
        first = decisions[0]
        now = first.record.updated_at or self.clock()
        try:
            owner_id, targets, faults = self._warning_targets(first, owner_id)
        except PermanentDeliveryFailure as exc:
            return [exc] * len(decisions)
        except (SlackApiError, SlackClientError, OSError) as exc:
            self._failed("warning", first.machine.instance_id, exc, first.machine.owner or "owner")
            return [None] * len(decisions)
        parts = [decisions[i : i + OWNER_MESSAGE_MACHINES] for i in range(0, len(decisions), OWNER_MESSAGE_MACHINES)]
        outcomes: list[PostOutcome] = []
        for number, part in enumerate(parts, 1):
            numbering = (number, len(parts))
            outcomes += self._post_listed(part, owner_id, targets, list(faults), now, numbering, lone_layout)
        return outcomes

    def _post_listed(
        self,
        part: Sequence[Decision],
        owner_id: str | None,
        targets: list[str],
        faults: list[SlackFault],
        now: datetime,
        numbering: tuple[int, int],
        lone_layout: bool = False,
    ) -> list[PostOutcome]:
        if not targets:
            return [self._given_up(d.machine, faults) for d in part]
        try:
            listed = ListedGroup(
                ids=tuple(d.machine.key for d in part),
                refs={d.machine.key: self.new_ref(d.machine.key, now, d.record.warning_ref) for d in part},
                lines={d.machine.key: owner_warning_line(d, now) for d in part},
            )
            group_ref = secrets.token_urlsafe(18)
            self.store.put_lookup(f"group#{group_ref}", listed.to_json(), now + REF_TTL)
        except (SlackApiError, SlackClientError, OSError, *AwsError) as exc:
            self._failed("warning", part[0].machine.instance_id, exc, "state table")
            return [None] * len(part)
        lone = lone_layout and len(part) == 1
        try:
            if lone:
                blocks = blocks_json(warning_blocks(part[0], listed.refs[listed.ids[0]], now))
            else:
                entries = listed.entries({}, current=set(listed.ids))
                blocks = blocks_json(owner_message_blocks(entries, group_ref, *numbering))
        except (SlackObjectFormationError, ValueError) as exc:
            fault = self._failed("warning", part[0].machine.instance_id, exc, part[0].machine.instance_id)
            return [self._given_up(d.machine, [fault]) for d in part]
        labels = ", ".join(machine_label(d.machine.name, d.machine.instance_id) for d in part)
        nouns, done = kinds_said(d.machine.key for d in part)
        text = fit(
            f"{len(part)} idle {nouns} of yours will be {done} unless kept: {labels}", FALLBACK_CHARS, mrkdwn=True
        )
        if lone:
            text = warning_text(part[0])
        metadata = listed_metadata(listed, group_ref)
        messages = self._post_to(targets, text, blocks, faults, ",".join(listed.ids), metadata)
        if not messages:
            lost = [f for f in faults if f.lost]
            if lost and not self._given_up(part[0].machine, faults):  # it may have been posted: looked for first
                return [DeliveryUnknown("; ".join(f.advice for f in lost)) for _ in part]
            return [self._given_up(d.machine, faults) for d in part]  # None: a failure that may pass
        found, owed = self._copies_owed(faults, listed.refs[listed.ids[0]], now)  # posted again by a later sweep
        return [
            Delivery(
                messages=tuple(messages + found),
                ref=listed.refs[d.machine.key],
                owner_slack_id=owner_id,
                undelivered=tuple(self._reason(d.machine, f) for f in faults if f.permanent),
                group_ref=group_ref,
                owed=owed,
            )
            for d in part
        ]

    def quiet_summary(self, stopped: Sequence[MachineRecord]) -> list[Delivery] | None:
        """One DM to the owner after quiet hours: each machine stopped meanwhile, when and why, and its own
        "Start it again" (the start-again answer path). Later answers edit this message like a shared
        warning. Past OWNER_MESSAGE_MACHINES machines only the oldest are listed (the rest are in `status`)."""
        first = stopped[0]
        now = self.clock()
        try:
            owner_id = first.owner_slack_id or self.resolve_owner(first.owner)
            if not owner_id:
                raise PermanentDeliveryFailure(f"nobody to tell: {first.instance_id} has no Slack owner")
            channel = str(self.client.conversations_open(users=owner_id)["channel"]["id"])
            shown = list(stopped[:OWNER_MESSAGE_MACHINES])
            nouns, done = kinds_said(r.key for r in stopped)
            listed = ListedGroup(
                ids=tuple(r.key for r in shown),
                refs={r.key: self.new_ref(r.key, now) for r in shown},
                lines={r.key: quiet_stop_line(r) for r in shown},
                title=fit(f"During quiet hours, idle-reaper {done} {len(stopped)} of your {nouns}", HEADER_CHARS),
            )
            group_ref = secrets.token_urlsafe(18)
            self.store.put_lookup(f"group#{group_ref}", listed.to_json(), now + REF_TTL)
            notes = {i: (listed.lines[i], listed.refs[i]) for i in listed.ids}
            for i, (text, start_ref) in notes.items():
                note = json.dumps({"text": text, "start": start_ref})
                self.store.put_lookup(f"groupline#{group_ref}#{i}", note, now + REF_TTL)
            blocks = blocks_json(
                owner_message_blocks(listed.entries(notes, current=set()), group_ref, title=listed.title)
            )
            summary = f"{listed.title}: " + ", ".join(machine_label(r.name, r.instance_id) for r in stopped)
            out = self.post_message(channel, text=fit(summary, FALLBACK_CHARS, mrkdwn=True), blocks=blocks)
        except (SlackApiError, SlackClientError, OSError, SlackObjectFormationError, ValueError) as exc:
            fault = self._failed("quiet hours summary", first.instance_id, exc, first.owner or "owner")
            if fault.permanent:
                raise PermanentDeliveryFailure(fault.advice) from None
            return None
        message = (f"{out['channel']}|{out['ts']}",)
        return [
            Delivery(messages=message, ref=listed.refs.get(r.key), owner_slack_id=owner_id, group_ref=group_ref)
            for r in stopped
        ]
