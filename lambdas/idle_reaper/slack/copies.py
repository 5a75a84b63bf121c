"""The copies a delivered warning still owes: a warning that reached one of its conversations (the owner's DM, the
team channel) and not the other, for a reason that may pass (a 429 past the client's retries, Slack down), keeps the
other on the machine's record (MachineRecord.warning_owed); each sweep posts the same warning there (sweep/copies.py)
until Slack takes it, a permanent failure gives it up, or the machine is stopped."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from slack_sdk.errors import SlackApiError, SlackClientError, SlackObjectFormationError

from idle_reaper.aws.clients import AwsError
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MAYBE_POSTED
from idle_reaper.notify import Delivery
from idle_reaper.slack.blocks import blocks_json, owner_warning_line, warning_blocks, warning_text
from idle_reaper.slack.faults import SlackFault
from idle_reaper.slack.posting import Posting
from idle_reaper.slack.shared import listed_metadata, warning_metadata


class OwedCopies(Posting):
    """Posting a copy a delivered warning still owes, once, in the conversation that is missing it."""

    def post_owed(self, decisions: Sequence[Decision], target: str, maybe_posted: bool) -> list[Delivery]:
        """notify.CopyNotifier.post_owed: the copy the machines of one message owe to `target` (the owner's user id
        for their DM, or a channel). The same warning as the copies already delivered, with the same buttons'
        references: a machine's own warning (its text and stop time as they stand now, never before the time it
        announced), or the shared message it is listed in, as the listing stands (its machines' lines announcing
        their stops as they now stand), with its "Keep all" reference. `maybe_posted`: an earlier post there may
        have gone out (its answer lost, or a sweep died after posting it): looked for first, never posted twice."""
        first = decisions[0]
        record = first.record
        now = record.updated_at or self.clock()
        subject = ",".join(d.machine.instance_id for d in decisions)
        if maybe_posted:
            since = record.warning_delivered_at or record.warned_at or now
            try:
                found = self.look_for(target, since, record.warning_ref or "")
            except (SlackApiError, SlackClientError, OSError) as exc:  # not readable now: still maybe there
                fault = self._failed("warning copy", subject, exc, target)
                return self._owed(decisions, target + MAYBE_POSTED, fault)
            if found is not None:
                return [Delivery(messages=(found,)) for _ in decisions]
        faults: list[SlackFault] = []
        if record.group_ref:
            posted = self._listing_copy(decisions, record.group_ref, target, faults, now)
        else:
            posted = self._own_copy(first, target, faults, now)
        if posted:
            return [Delivery(messages=tuple(posted)) for _ in decisions]
        failed = faults[0] if faults else None
        return self._owed(decisions, target + (MAYBE_POSTED if failed is not None and failed.lost else ""), failed)

    def _own_copy(self, d: Decision, target: str, faults: list[SlackFault], now: datetime) -> list[str]:
        ref = d.record.warning_ref
        if not ref:  # every delivered warning has its reference: nothing to post the buttons with
            faults.append(SlackFault("no_reference", True, "the warning's reference is gone", target=target))
            return []
        try:
            blocks = blocks_json(warning_blocks(d, ref, now))
        except (SlackObjectFormationError, ValueError) as exc:
            faults.append(self._failed("warning copy", d.machine.instance_id, exc, target))
            return []
        metadata = warning_metadata([d.machine.key], [ref])
        return self._post_to([target], warning_text(d), blocks, faults, d.machine.instance_id, metadata)

    def _listing_copy(
        self, decisions: Sequence[Decision], group_ref: str, target: str, faults: list[SlackFault], now: datetime
    ) -> list[str]:
        """The shared message as it stands, posted to `target`, under its edit lease (no edit lands meanwhile)."""
        subject = ",".join(d.machine.instance_id for d in decisions)
        with self.editing(group_ref) as held:
            if not held:
                faults.append(SlackFault("busy", False, "its shared message is being edited; retried", target=target))
                return []
            refs = {d.machine.key: ref for d in decisions if (ref := d.record.warning_ref)}
            lines = {d.machine.key: owner_warning_line(d, now) for d in decisions if d.machine.key in refs}
            try:
                self._change_listing(group_ref, now, add=(refs, lines))
                view = self.listed_view(group_ref)
            except (*AwsError, SlackObjectFormationError, ValueError) as exc:
                faults.append(self._failed("warning copy", subject, exc, "state table"))
                return []
            if view is None:
                advice = "the shared message it was listed in is no longer known (its references expired)"
                faults.append(SlackFault("listing_gone", True, advice, target=target))
                return []
            text, blocks, listed = view
            metadata = listed_metadata(listed, group_ref)
            return self._post_to([target], text, blocks, faults, subject, metadata)

    def _owed(self, decisions: Sequence[Decision], entry: str, fault: SlackFault | None) -> list[Delivery]:
        """Not posted: still owed (`entry`), or given up with what an admin must do (a permanent failure)."""
        if fault is not None and fault.permanent:
            return [Delivery(undelivered=(self._reason(d.machine, fault),)) for d in decisions]
        return [Delivery(owed=(entry,)) for _ in decisions]
