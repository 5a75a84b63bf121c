"""Talking to Slack: the client and its secrets, posting and updating messages, classifying failures.

Every post is recorded by the sweep as a Delivery; a failure that will not heal is a PermanentDeliveryFailure."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError, SlackObjectFormationError

from idle_reaper.aws.clients import AwsError
from idle_reaper.aws.state import StateStore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import Action, MachineRecord
from idle_reaper.core.signals import Machine
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
from idle_reaper.slack.notices import NOTICE_EDITS_PER_MINUTE, EditPace, StopNotice, Told
from idle_reaper.slack.shared import REF_TTL as REF_TTL  # re-exported
from idle_reaper.slack.shared import WARNING_EVENT, SharedMessages, warning_metadata

POST_SECONDS_PER_CHANNEL = 1.0  # chat.postMessage: about one message a second in a channel


# ---------------------------------------------------------------------------------------------
# Delivery
#
# A failure is either transient (Slack down, 5xx, 429 beyond the time budget, a timeout: the warning
# stays pending and the next sweep tries again) or permanent: it fails the same way until a person
# changes something, so it is raised as PermanentDeliveryFailure with what an admin must do, instead of
# being retried in silence. A rejected token or a missing scope is a configuration fault: transient for
# the warning (every pending warning goes out once the admin fixes the secret, so none is given up), but
# logged as an ERROR, since an admin alert through Slack would fail the same way.

# Error code -> what an admin must do; {target} is the channel or user.
_TARGET_FAULTS = {
    "not_in_channel": "the bot is not in channel {target}: invite it there (/invite @idle-reaper). A private "
    "channel always needs the invite; a public one the bot joins by itself unless the app lacks the channels:join "
    "scope (reinstall it from slack/manifest.yml)",
    "method_not_supported_for_channel_type": "channel {target} is private: the bot cannot join it, invite it there "
    "(/invite @idle-reaper)",
    "channel_not_found": "channel {target} does not exist or the bot cannot see it (a private channel needs "
    "an invite): check the channel id (slack_channel in the team policy, admin_channel in settings)",
    "is_archived": "channel {target} is archived: unarchive it or set another channel in the policy",
    "is_inactive": "channel {target} is archived or frozen: its messages cannot be edited",
    "restricted_action": "the workspace does not let the bot post in {target}: ask a Slack admin",
    "user_not_found": "Slack user {target} does not exist: fix the machine's Owner tag",
    "user_disabled": "Slack user {target} is deactivated: fix the machine's Owner tag",
    "cannot_dm_bot": "Slack user {target} is a bot and cannot get a DM: fix the machine's Owner tag",
    "message_not_found": "the message in {target} was deleted; it cannot be updated",
    "cant_update_message": "the message in {target} cannot be updated by the bot",
    "edit_window_closed": "the message in {target} is too old to be edited",
}
# Slack refused the message itself: fitting should make this impossible, so it is a bug to report.
_MESSAGE_FAULTS = frozenset(
    {"msg_too_long", "invalid_blocks", "invalid_blocks_format", "no_text", "too_many_attachments", "invalid_arguments"}
)
_CONFIG_FAULTS = frozenset(
    {
        "invalid_auth",
        "not_authed",
        "token_revoked",
        "token_expired",
        "account_inactive",
        "missing_scope",
        "not_allowed_token_type",
        "team_access_not_granted",
        "ekm_access_denied",
    }
)


@dataclass(frozen=True)
class SlackFault:
    """Why a Slack call failed, and whether retrying can help. `answered`: Slack answered with a refusal (HTTP 200,
    ok false), so the call did nothing. `lost`: the call may have been carried out and its answer lost (a timeout,
    a dropped connection, an HTTP 5xx): a post is looked for before it is made again."""

    code: str
    permanent: bool
    advice: str
    answered: bool = False
    lost: bool = False
    target: str = ""  # the channel or user the call was for


def classify(exc: Exception, target: str) -> SlackFault:
    """Sort a failed Slack call (to `target`, a channel or user id) into permanent or transient."""
    return replace(_classify(exc, target), target=target)


def _classify(exc: Exception, target: str) -> SlackFault:
    if isinstance(exc, SlackObjectFormationError | ValueError):
        return SlackFault(
            "unbuildable", True, f"the message could not be built ({fit(str(exc), 300)}): a bug in idle-reaper"
        )
    if not isinstance(exc, SlackApiError):
        name = type(exc).__name__
        return SlackFault(name, False, f"Slack unreachable or its answer lost ({name}); retried", lost=True)
    status = int(getattr(exc.response, "status_code", 200))
    code = str(exc.response.get("error") or f"http_{status}")
    answered = status == 200
    if code in _TARGET_FAULTS:
        return SlackFault(code, True, _TARGET_FAULTS[code].format(target=target), answered=answered)
    if code in _MESSAGE_FAULTS:
        advice = f"Slack refused the message for {target} ({code}): a bug in idle-reaper"
        return SlackFault(code, True, advice, answered=answered)
    if code in _CONFIG_FAULTS:
        advice = f"Slack rejects the bot token ({code}): fix the Slack secret or reinstall the app"
        if code == "missing_scope":
            needed = exc.response.get("needed")
            advice = f"the app lacks the Slack scope {needed or 'a call needs'} ({code}): reinstall it"
        return SlackFault(code, False, advice + " (with the scopes of slack/manifest.yml)", answered=answered)
    # 5xx, 429 beyond the time budget, ratelimited, internal_error, and codes we do not know: retrying is
    # the safe side, and the stop waits for the warning (up to undelivered_warning_max_minutes). A 5xx may
    # have done what it was asked (Slack posted, then failed to answer): lost.
    return SlackFault(code, False, f"Slack answered {code}; retried", answered=answered, lost=status >= 500)


class SlackDelivery(SharedMessages):
    """Slack plumbing: who an owner is, posting to each target on its own, editing messages in place
    (shared ones line by line), admin alerts, and what a failure means."""

    def __init__(self, client: WebClient, store: StateStore, clock: Any = None) -> None:
        self.client = client
        self.store = store
        self.clock = clock or (lambda: datetime.now(UTC))
        self.logger = logger
        self._joined: dict[str, str | None] = {}  # channel -> None once a member, else why it could not join
        self._next_post: dict[str, float] = {}  # channel -> when it may take the next post (time.monotonic())
        self._pace_lock = threading.Lock()

    def _pace_post(self, channel: str) -> None:
        """chat.postMessage "will generally allow an app to post 1 message per second to a specific channel": the
        sweep's lanes (one an owner) that post into one team channel at once get their posts a second apart
        here, rather than as 429s and Retry-After waits. A DM is one owner's lane: posted as it comes."""
        if channel[:1] not in ("C", "G"):
            return
        with self._pace_lock:
            now = time.monotonic()
            at = max(now, self._next_post.get(channel, 0.0))
            self._next_post[channel] = at + POST_SECONDS_PER_CHANNEL
        if at > now:
            time.sleep(at - now)

    def join(self, channel: str) -> str | None:
        """Be a member of public channel `channel` before posting there (once per notifier: a sweep's, a handler's).
        Slack lets a bot post to a public channel it is not in (chat:write.public), but read its history only as
        a member ("Any conversation the relevant bot is a member of", conversations.history): a post whose answer
        was lost could not be looked for there. conversations.join (channels:join, Tier 3) answers at once for a
        channel the bot is in already. None: a member; else why not (a private channel needs an invite)."""
        if not channel.startswith("C"):
            return None  # a DM (the bot is in its own) or a private channel (G...: membership by invite)
        if channel not in self._joined:
            try:
                self.client.conversations_join(channel=channel)
                self._joined[channel] = None
            except (SlackApiError, SlackClientError, OSError) as exc:
                fault = classify(exc, channel)
                if fault.code not in ("method_not_supported_for_channel_type", "is_archived"):
                    self.logger.warning("slack channel not joined", extra={"channel": channel, "error": fault.code})
                self._joined[channel] = fault.code
        return self._joined[channel]

    def find_warning(self, decision: Decision) -> Delivery | None:
        """A warning whose post was attempted and whose outcome was lost, looked for where it would be: in
        each target conversation since the attempt, by the message metadata every warning carries. The
        Delivery found (when posted in any target), or None when every target shows it was never posted.
        Raises DeliveryUnknown when a target cannot be read (answered=True when Slack answered and refused:
        a conversation the bot is not in, a DM it cannot open), PermanentDeliveryFailure when nobody can be
        warned. A found post counts as delivered from when the sweep began posting it."""
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
        if found:  # a copy reached a person: delivered, whatever another target says
            return Delivery(messages=tuple(found), ref=ref, owner_slack_id=owner_id, group_ref=group_ref)
        if unread:  # not seen where it was read, and not readable somewhere else: it may be there
            reason = "; ".join(f.advice for f in unread)
            raise DeliveryUnknown(reason, answered=all(f.answered for f in unread))
        return None

    def _warning_in(self, channel: str, since: datetime, ref: str) -> dict[str, Any] | None:
        """The message in `channel` since `since` whose metadata carries the warning reference `ref`. A public
        channel the bot is not in is joined first (a post made before the bot joined is there all the same)."""
        try:
            messages = self._history_since(channel, since)
        except SlackApiError as exc:
            if classify(exc, channel).code != "not_in_channel" or self.join(channel) is not None:
                raise
            messages = self._history_since(channel, since)
        for message in messages:
            metadata = message.get("metadata") or {}
            if metadata.get("event_type") == WARNING_EVENT and ref in (
                (metadata.get("event_payload") or {}).get("refs") or ()
            ):
                return message
        return None

    def _history_since(self, channel: str, since: datetime) -> list[dict[str, Any]]:
        """The conversation's messages since `since` (a minute of clock skew allowed), with their metadata."""
        messages: list[dict[str, Any]] = []
        cursor = None
        for _ in range(10):  # a warning is recent: ten pages of 200 reach far enough back
            page = self.client.conversations_history(
                channel=channel,
                oldest=f"{since.timestamp() - 60:.6f}",
                include_all_metadata=True,
                limit=200,
                cursor=cursor,
            )
            messages += page.get("messages") or []
            cursor = (page.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                break
        return messages

    def _post_to(
        self,
        targets: list[str],
        text: str,
        blocks: list[dict[str, Any]],
        faults: list[SlackFault],
        subject: str,
        metadata: dict[str, Any] | None = None,
    ) -> list[str]:
        """Post to each target on its own: "channel|ts" of each copy delivered; each failure joins `faults`.
        `metadata` (Slack message metadata) lets a later sweep find a post whose outcome it lost."""
        messages: list[str] = []
        for channel in targets:
            self.join(channel)  # so a lost answer can be looked for here (a refusal shows in the post below)
            self._pace_post(channel)
            try:
                out = self.client.chat_postMessage(channel=channel, text=text, blocks=blocks, metadata=metadata)
                messages.append(f"{out['channel']}|{out['ts']}")
            except (SlackApiError, SlackClientError, OSError) as exc:
                faults.append(self._failed("warning", subject, exc, channel))
        return messages

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

    def _found_lost(self, faults: list[SlackFault], ref: str, since: datetime) -> list[str]:
        """The copies of a delivered warning whose post lost its answer, looked for at once: found, they are kept
        (so later answers and the stop edit them too); not found, not posted again (a copy reached someone)."""
        found: list[str] = []
        for fault in faults:
            if not fault.lost or not fault.target:
                continue
            try:
                channel = fault.target
                if channel[:1] in ("U", "W"):
                    channel = str(self.client.conversations_open(users=channel)["channel"]["id"])
                message = self._warning_in(channel, since, ref)
            except (SlackApiError, SlackClientError, OSError):
                continue
            if message is not None:
                found.append(f"{channel}|{message['ts']}")
        return found

    def _raise_if_permanent(self, m: Machine, faults: list[SlackFault]) -> None:
        """Nobody got the warning: give up on it only when every failure is permanent."""
        given_up = self._given_up(m, faults)
        if given_up:
            raise given_up

    def _given_up(self, m: Machine, faults: list[SlackFault]) -> PermanentDeliveryFailure | None:
        if faults and all(f.permanent for f in faults):
            return PermanentDeliveryFailure("; ".join(self._reason(m, f) for f in faults))
        return None

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

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        """DM every admin and post to the admin channel. Raises when nobody received it, so the caller
        keeps the alert pending. `text` is plain: it quotes policies and tags, so it is escaped here."""
        body = fit(f"idle-reaper admin alert: {escape(text)}", FALLBACK_CHARS, mrkdwn=True)
        delivered = 0
        targets = [("admin", admin) for admin in admins] + ([("channel", channel)] if channel else [])
        for kind, target in targets:
            try:
                where = self.client.conversations_open(users=target)["channel"]["id"] if kind == "admin" else target
                self.client.chat_postMessage(channel=where, text=body)
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

    def _failed(self, what: str, subject: str, exc: Exception, target: str) -> SlackFault:
        fault = classify(exc, target)
        extra = {"subject": subject, "target": target, "error": fault.code, "advice": fault.advice}
        if fault.permanent or fault.code in _CONFIG_FAULTS:
            self.logger.error(f"slack {what} failed and will fail again until fixed", extra=extra)
        else:
            # WARNING, not ERROR: Slack being down is expected now and then; the warning stays pending.
            self.logger.warning(f"slack {what} failed", extra=extra)
        return fault


class SlackNotifier(SlackDelivery):
    """What the sweep tells people: warnings to the owner (DM) and/or the team channel, one message per
    owner, stop notices and quiet-hours summaries; later updates edit them in place."""

    def warn(self, decision: Decision) -> Delivery | None:
        """Post the warning to each target on its own. Delivered when any target got it (the others'
        permanent faults ride along in Delivery.undelivered); None when a failure may pass (retried
        next sweep); PermanentDeliveryFailure when every target failed for a reason that will not pass."""
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
        text = self._warning_text(decision)
        metadata = warning_metadata([m.key], [ref])
        messages = self._post_to(targets, text, blocks, faults, m.instance_id, metadata)
        if not messages:
            self._raise_if_permanent(m, faults)
            lost = [f for f in faults if f.lost]
            if lost:  # it may have been posted: the next sweep looks for it before posting again
                raise DeliveryUnknown("; ".join(f.advice for f in lost))
            return None  # a failure that may pass: the next sweep tries again
        messages += self._found_lost(faults, ref, now)
        undelivered = tuple(self._reason(m, f) for f in faults if f.permanent)
        return Delivery(messages=tuple(messages), ref=ref, owner_slack_id=owner_id, undelivered=undelivered)

    @staticmethod
    def _warning_text(decision: Decision) -> str:
        m = decision.machine
        label = machine_label(m.name, m.instance_id)
        mode = decision.handling.mode if decision.handling else "stop"
        will = {
            "notify": "is idle; idle-reaper will not stop it",
            "terminate": "will be terminated unless someone keeps it",
        }
        return fit(
            f"Idle machine {label} {will.get(mode, 'will be stopped unless someone keeps it')}",
            FALLBACK_CHARS,
            mrkdwn=True,
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
            title = "Stopped"
            detail = (
                f"{label} was {PAST_TENSE[decision.action]} at {date_token(now)}; it saves {saving} while stopped. "
            )
            detail += reason
        elif decision.action is Action.TERMINATE_INSTANCE:
            title = "Terminated"
            detail = f"{label} was terminated at {date_token(now)}: it cannot be started again. {reason}"
        else:  # a group member: its protection released, or terminated with the group shrunk (the reason says)
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
            blocks = blocks_json(status_blocks(notice.title, notice.detail, ref=notice.ref, start_button=notice.start))
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
        text = fit(
            f"{len(part)} idle machines of yours will be stopped unless kept: {labels}", FALLBACK_CHARS, mrkdwn=True
        )
        if lone:
            text = self._warning_text(part[0])
        metadata = warning_metadata(list(listed.ids), [listed.refs[i] for i in listed.ids], group_ref)
        messages = self._post_to(targets, text, blocks, faults, ",".join(listed.ids), metadata)
        if not messages:
            lost = [f for f in faults if f.lost]
            if lost and not self._given_up(part[0].machine, faults):  # it may have been posted: looked for first
                return [DeliveryUnknown("; ".join(f.advice for f in lost)) for _ in part]
            return [self._given_up(d.machine, faults) for d in part]  # None: a failure that may pass
        return [
            Delivery(
                messages=tuple(messages),
                ref=listed.refs[d.machine.key],
                owner_slack_id=owner_id,
                undelivered=tuple(self._reason(d.machine, f) for f in faults if f.permanent),
                group_ref=group_ref,
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
            listed = ListedGroup(
                ids=tuple(r.key for r in shown),
                refs={r.key: self.new_ref(r.key, now) for r in shown},
                lines={r.key: quiet_stop_line(r) for r in shown},
                title=fit(f"During quiet hours, idle-reaper stopped {len(stopped)} of your machines", HEADER_CHARS),
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
            out = self.client.chat_postMessage(
                channel=channel, text=fit(summary, FALLBACK_CHARS, mrkdwn=True), blocks=blocks
            )
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
