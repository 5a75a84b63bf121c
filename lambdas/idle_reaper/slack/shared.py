"""Shared messages: one message listing several machines (an owner's warnings, a quiet-hours summary), kept
under its "Keep all" reference (`group#<ref>`, a ListedGroup), edited line by line as each machine's story goes
on, and (organization mode) joined by the warnings of other units of the same sweep."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Protocol

from slack_sdk.errors import SlackApiError, SlackClientError, SlackObjectFormationError

from idle_reaper.aws.clients import DDB_WORKERS, AwsError, run_concurrently
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord
from idle_reaper.core.sections import kinds_said
from idle_reaper.core.signals import Machine
from idle_reaper.notify import Delivery, PostOutcome
from idle_reaper.slack.blocks import (
    FALLBACK_CHARS,
    OWNER_MESSAGE_MACHINES,
    ListedGroup,
    blocks_json,
    escape,
    fit,
    json_object,
    owner_message_blocks,
    owner_warning_line,
)
from idle_reaper.slack.owners import OwnerDirectory

REF_TTL = timedelta(days=7)
WARNING_EVENT = "idle_reaper_warning"  # the metadata event type every warning carries
# A unit joining a shared message: conditional writes of the listing tried before posting alone (each loses only
# to another unit's join).
JOIN_ATTEMPTS = 8
# Edits of one shared message are made one at a time (a lease in the state table, `groupedit#<ref>`): two edits
# in flight at once can land in either order, and an older listing landing last would hide machines already
# reported delivered. Whoever holds the lease renders the listing as it stands and edits every copy; a joiner
# adds its machines, edits, and takes them out again if the edit failed, all while it holds the lease, so the
# message always shows what its last edit that landed listed, and that lists every machine reported delivered.
EDIT_LEASE = timedelta(seconds=60)  # a holder that dies frees the message this long after it took it
EDIT_WAIT_SECONDS = 20.0  # an edit takes well under a second; a 429 it waits out can take longer
EDIT_POLL_SECONDS = 0.05


def warning_metadata(instance_ids: list[str], refs: list[str], group_ref: str | None = None) -> dict[str, Any]:
    """Slack message metadata naming the machines and warnings a message carries (what find_warning reads)."""
    payload: dict[str, Any] = {"instance_ids": instance_ids, "refs": refs}
    if group_ref:
        payload["group_ref"] = group_ref
    return {"event_type": WARNING_EVENT, "event_payload": payload}


def listed_metadata(listed: ListedGroup, group_ref: str) -> dict[str, Any]:
    """warning_metadata of a shared message: every machine it lists, with its reference, in listing order."""
    return warning_metadata(list(listed.ids), [listed.refs[i] for i in listed.ids], group_ref)


class Fault(Protocol):
    """A failed Slack call, classified (notifier.SlackFault)."""

    @property
    def permanent(self) -> bool: ...

    @property
    def advice(self) -> str: ...


class SharedMessages(OwnerDirectory):
    """Button references, and the messages that list several machines (SlackDelivery's)."""

    def _failed(self, what: str, subject: str, exc: Exception, target: str) -> Fault:
        raise NotImplementedError  # SlackDelivery's: logs and classifies the failure

    @staticmethod
    def _reason(m: Machine, fault: Fault) -> str:
        """What an admin reads of a target that refused a machine's warning."""
        return f"warning for {m.instance_id} (team {fit(m.team, 80)}): {fault.advice}"

    def new_ref(self, key: str, now: datetime | None = None, ref: str | None = None) -> str:
        """A button reference that finds the machine: `ref` when the sweep made it already (it is on the
        machine's record from the claim on, so the buttons work the moment the message exists), else new."""
        ref = ref or secrets.token_urlsafe(18)
        self.store.put_lookup(f"ref#{ref}", key, (now or self.clock()) + REF_TTL)  # the machine key
        return ref

    def note_listed(self, record: MachineRecord, title: str, detail: str, *, start_ref: str | None = None) -> bool:
        """Remember what happened to a machine listed in a shared message (its line in later edits). False
        when the shared message is no longer known (its references expired): then it is edited alone."""
        if not record.group_ref:
            return False
        now = self.clock()
        if self.listed_group(record.group_ref) is None:
            return False
        line = {"text": f"*{escape(title)}*: {detail}", "start": start_ref}
        self.store.put_lookup(f"groupline#{record.group_ref}#{record.key}", json.dumps(line), now + REF_TTL)
        return True

    def listed_view(
        self, group_ref: str, record: MachineRecord | None = None
    ) -> tuple[str, list[dict[str, Any]], ListedGroup] | None:
        """A shared message as it stands now (fallback text, blocks, listing): every machine's line, with its
        warning and buttons while the warning is current (`record`: one machine's record as it is being
        written, over the stored one), else what happened; and "Keep all" while any waits. None: unknown."""
        listed = self.listed_group(group_ref)
        if listed is None:
            return None
        now = self.clock()
        notes: dict[str, tuple[str, str | None]] = {}

        def note_of(instance_id: str) -> str | None:
            return self.store.get_lookup(f"groupline#{group_ref}#{instance_id}", now)

        lines = run_concurrently(note_of, list(listed.ids), DDB_WORKERS)  # the lines' notes, read at once
        for instance_id, raw in zip(listed.ids, lines, strict=True):
            note = json_object(raw)
            if note and isinstance(note.get("text"), str):
                start = note.get("start")
                notes[instance_id] = (note["text"], start if isinstance(start, str) else None)
        records = self.store.load(list(listed.ids))
        if record is not None:
            records[record.key] = record
        current = {i for i, r in records.items() if listed.is_current(r)}
        blocks = owner_message_blocks(listed.entries(notes, current=current), group_ref, title=listed.title)
        waiting = len([i for i in listed.ids if i in current and i not in notes])
        text = fit(f"{waiting} of your idle {kinds_said(listed.ids)[0]} still wait for an answer", FALLBACK_CHARS)
        return text, blocks_json(blocks), listed

    def render_listed(self, record: MachineRecord) -> bool:
        """Edit the shared message `record` is listed in to how it stands now (listed_view), holding its lease."""
        with self.editing(record.group_ref or "") as held:
            if not held:
                return False
            view = self.listed_view(record.group_ref or "", record)
            if view is None:
                return False
            text, blocks, _ = view
            return not self.edit_copies(record.messages, text, blocks, record.instance_id)

    @contextmanager
    def editing(self, group_ref: str) -> Iterator[bool]:
        """Hold the shared message's edit lease (see EDIT_LEASE) while the block runs; False: another holder kept
        it past EDIT_WAIT_SECONDS (or the table failed): the caller edits nothing."""
        key, token = f"groupedit#{group_ref}", secrets.token_hex(8)
        deadline = time.monotonic() + EDIT_WAIT_SECONDS
        held = False
        try:
            while not held:
                now = self.clock()
                held = self.store.replace_lookup(key, token, now + EDIT_LEASE, expected=None, now=now)
                if held or time.monotonic() >= deadline:
                    break
                time.sleep(EDIT_POLL_SECONDS)
        except AwsError as exc:
            self._failed("update", group_ref, exc, "state table")
        try:
            yield held
        finally:
            if held:
                now = self.clock()
                with contextlib.suppress(*AwsError):  # else it lapses after EDIT_LEASE
                    self.store.replace_lookup(key, "", now - timedelta(seconds=1), expected=token, now=now)

    def edit_copies(
        self,
        messages: Sequence[str],
        text: str,
        blocks: list[dict[str, Any]],
        subject: str,
        metadata: dict[str, Any] | None = None,
    ) -> list[Fault]:
        """chat.update every copy ("channel|ts") of a message; the faults of those that failed (logged)."""
        faults = []
        for message in messages:
            channel, _, ts = message.partition("|")
            try:
                if metadata is None:
                    self.client.chat_update(channel=channel, ts=ts, text=text, blocks=blocks)
                else:
                    self.client.chat_update(channel=channel, ts=ts, text=text, blocks=blocks, metadata=metadata)
            except (SlackApiError, SlackClientError, OSError) as exc:
                faults.append(self._failed("update", subject, exc, channel))
        return faults

    def listed_group(self, group_ref: str) -> ListedGroup | None:
        """The machines a shared message lists, by its "Keep all" reference; None when unknown or unreadable."""
        if not group_ref:
            return None
        return ListedGroup.from_json(self.store.get_lookup(f"group#{group_ref}", self.clock()))

    # Joining another unit's message (organization mode) ---------------------------------------------------

    def join_owner_message(
        self, decisions: Sequence[Decision], owner_id: str | None, group_ref: str, messages: Sequence[str]
    ) -> list[PostOutcome] | None:
        """Add `decisions` (one owner's warnings, the same targets) to the shared message another unit of this
        sweep posted (`group_ref`, its copies `messages`): their lines and buttons join its listing (a conditional
        write: concurrent joiners never lose each other), then every copy is edited to the whole listing.

        For each machine, what `warn` would return: delivered when a copy was edited to list it; None (pending,
        retried next sweep) when no edit went through for a reason that may pass. None as a whole: not joined
        (the listing is unknown or would pass OWNER_MESSAGE_MACHINES, or its message can no longer be edited):
        the caller posts a message of its own."""
        first = decisions[0]
        now = first.record.updated_at or self.clock()
        subject = ",".join(d.machine.key for d in decisions)
        with self.editing(group_ref) as held:
            if not held:
                return [None] * len(decisions)  # the message is busy past the wait: pending, next sweep
            try:
                refs = {d.machine.key: self.new_ref(d.machine.key, now, d.record.warning_ref) for d in decisions}
                lines = {d.machine.key: owner_warning_line(d, now) for d in decisions}
                if not self._change_listing(group_ref, now, add=(refs, lines)):
                    return None
            except (*AwsError, ValueError) as exc:
                self._failed("warning", subject, exc, "state table")
                return None
            try:
                edited, faults = self._edit_to_listing(group_ref, messages, subject)
            except (*AwsError, SlackObjectFormationError, ValueError) as exc:
                edited, faults = False, [self._failed("update", subject, exc, "state table")]
            if not edited:
                try:  # the message shows what it showed before: they are not in it, and not in its listing
                    self._change_listing(group_ref, now, remove=set(refs))
                except AwsError as exc:
                    self._failed("update", subject, exc, "state table")
                if faults and all(f.permanent for f in faults):
                    return None  # the message is gone or cannot be edited: a message of their own
                return [None] * len(decisions)  # pending: the next sweep posts them again
        return [
            Delivery(
                messages=tuple(messages),
                ref=refs[d.machine.key],
                owner_slack_id=owner_id,
                undelivered=tuple(self._reason(d.machine, f) for f in faults if f.permanent),
                group_ref=group_ref,
            )
            for d in decisions
        ]

    def _change_listing(
        self,
        group_ref: str,
        now: datetime,
        *,
        add: tuple[dict[str, str], dict[str, str]] | None = None,
        remove: set[str] | frozenset[str] = frozenset(),
    ) -> bool:
        """Add machines (refs, lines) to a shared message's listing, or remove them, with a conditional write
        on the listing as read (retried when another unit wrote first). False: unknown, or it would be full."""
        refs, lines = add or ({}, {})
        for _ in range(JOIN_ATTEMPTS):
            raw = self.store.get_lookup(f"group#{group_ref}", now)
            listed = ListedGroup.from_json(raw)
            if listed is None or listed.title:  # unknown, or no warning's listing
                return False
            ids = tuple(i for i in listed.ids if i not in remove) + tuple(i for i in refs if i not in listed.ids)
            if len(ids) > OWNER_MESSAGE_MACHINES or not ids:
                return False
            changed = ListedGroup(
                ids=ids,
                refs={i: refs.get(i) or listed.refs[i] for i in ids},
                lines={i: lines.get(i) or listed.lines[i] for i in ids},
            )
            if self.store.replace_lookup(f"group#{group_ref}", changed.to_json(), now + REF_TTL, expected=raw, now=now):
                return True
        return False

    def _edit_to_listing(self, group_ref: str, messages: Sequence[str], subject: str) -> tuple[bool, list[Fault]]:
        """Edit every copy of a shared message to its listing as it stands (the caller holds its edit lease).
        (edited at all, the faults of the copies that were not)."""
        view = self.listed_view(group_ref)
        if view is None:
            return False, []
        text, blocks, listed = view
        metadata = listed_metadata(listed, group_ref)
        faults = self.edit_copies(messages, text, blocks, subject, metadata)
        return len(faults) < len(messages), faults
