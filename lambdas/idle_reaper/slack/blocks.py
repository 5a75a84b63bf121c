"""What people read in Slack: Block Kit messages fitted to Slack's limits (warnings, owner messages, notes)."""

from __future__ import annotations

import json
import re
import secrets
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ConfirmObject,
    ContextBlock,
    HeaderBlock,
    MarkdownTextObject,
    Option,
    OverflowMenuElement,
    SectionBlock,
)

from idle_reaper.core.answers import KEEP_HOURS, keep_choices, next_morning
from idle_reaper.core.endpoints import Restore, is_studio_id, words_for
from idle_reaper.core.kinds import TERMINABLE, caveats, warning_sentence
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import Action, MachineRecord
from idle_reaper.core.sections import kinds_said
from idle_reaper.notify import logger as logger  # re-exported for the Slack handler
from idle_reaper.policy import TeamPolicy

PAST_TENSE = {Action.STOP: "stopped", Action.HIBERNATE: "hibernated"}


def date_token(when: datetime, fmt: str = "{time} on {date_short_pretty}") -> str:
    """A Slack date token: every reader sees it in their own time zone."""
    ts = int(when.timestamp())
    return f"<!date^{ts}^{fmt}|{when.astimezone(UTC):%Y-%m-%d %H:%M} UTC>"


def money(value: float | None) -> str:
    return f"${value:,.2f}" if value is not None else "unknown"


# ---------------------------------------------------------------------------------------------
# Block Kit limits, in characters, of the elements idle-reaper builds. slack-sdk's block models check
# the same numbers and refuse to build a message over them (SlackObjectFormationError).
HEADER_CHARS = 150  # header plain_text
SECTION_CHARS = 3000  # section text
FIELD_CHARS = 2000  # each section field (at most 10 fields)
CONTEXT_CHARS = 2000  # each context element (at most 10 elements)
BUTTON_CHARS = 75  # button text; its value may be 2000, ours is a 24-character reference
OPTION_CHARS = 75  # overflow option text
CONFIRM_TITLE_CHARS = 100
CONFIRM_TEXT_CHARS = 300
FALLBACK_CHARS = 3000  # top-level `text`: notifications and screen readers; Slack truncates at 40,000
NAME_CHARS = 100  # a Name tag in a label (EC2 allows 256); the element's own limit applies after
_JOINERS = ("\u200d",)  # zero-width joiner: the emoji on either side are one character to a reader


def _utf16_units(char: str) -> int:
    return 2 if ord(char) > 0xFFFF else 1


def utf16_len(text: str) -> int:
    """`text`'s length as Slack counts it (UTF-16 code units), as `fit` counts it."""
    return sum(map(_utf16_units, text))


def _attaches(char: str) -> bool:
    """Whether `char` belongs to the character before it: a combining mark, a variation selector, an
    emoji skin tone, or a zero-width joiner."""
    code = ord(char)
    return (
        unicodedata.category(char) in ("Mn", "Mc", "Me")
        or char in _JOINERS
        or 0xFE00 <= code <= 0xFE0F
        or 0x1F3FB <= code <= 0x1F3FF
        or 0xE0100 <= code <= 0xE01EF
    )


def fit(text: str, limit: int, *, mrkdwn: bool = False) -> str:
    """`text` cut to at most `limit` characters, ending in "…" when cut.

    Counts UTF-16 code units (an emoji counts two), never fewer than slack-sdk's count of code points,
    so the result fits however Slack counts. Never cuts inside a character or between a letter and its
    combining marks or an emoji sequence. With `mrkdwn`, never cuts inside an escape (`&amp;`) or a
    `<...>` token (a mention or date), which would otherwise render as garbage."""
    if sum(map(_utf16_units, text)) <= limit:
        return text
    cut, used = 0, 0
    for char in text:
        used += _utf16_units(char)
        if used > limit - 1:  # room for the ellipsis
            break
        cut += 1
    while cut > 0 and (_attaches(text[cut]) or text[cut - 1] in _JOINERS):
        cut -= 1
    kept = text[:cut]
    if mrkdwn:
        opened = kept.rfind("<")
        if opened > kept.rfind(">"):
            kept = kept[:opened]
        entity = kept.rfind("&")
        if entity > kept.rfind(";"):
            kept = kept[:entity]
    return kept + "…"


def escape(text: str) -> str:
    """User text (a tag, a policy value, a reason quoting them) made inert in mrkdwn: no links,
    mentions (`<!channel>`) or dates can be injected. Slack asks for exactly these three."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def machine_label(name: str | None, instance_id: str, *, mrkdwn: bool = True) -> str:
    """ "name (i-0123...)" for a message: the Name tag cut to NAME_CHARS, and escaped for mrkdwn (every
    caller's text is mrkdwn except plain_text elements: the header)."""
    if not name:
        return instance_id
    shown = fit(name, NAME_CHARS)
    return f"{escape(shown) if mrkdwn else shown} ({instance_id})"


# ---------------------------------------------------------------------------------------------
# Messages


def planned_stop(decision: Decision, now: datetime) -> datetime:
    """What the message announces; the lifecycle never stops before it (record.stop_not_before)."""
    policy = decision.policy.policy if decision.policy else None
    assessment = decision.assessment
    if policy is None or assessment is None or assessment.quiet_since is None:
        return decision.record.stop_not_before or now
    return max(
        now + timedelta(minutes=policy.warn_minutes),
        assessment.quiet_since + timedelta(minutes=policy.idle_minutes),
        decision.record.stop_not_before or now,
    )


# What the end of the window does to a machine, as a warning says it.
_RELEASED = "released to its Auto Scaling group"
_TERMINATED_IN_GROUP = "terminated (its Auto Scaling group shrinks by one)"


def reaped_verb(decision: Decision) -> str:
    """What the stop will do: a group member is released to its group, or terminated with the group shrunk
    (asg_action: terminate); an endpoint is deleted; any other machine is stopped (a warning's sentence may say
    more: kinds)."""
    if not decision.machine.asg_name:
        return words_for(decision.machine.instance_id).stopped
    policy = decision.policy.policy if decision.policy else None
    return _TERMINATED_IN_GROUP if policy is not None and policy.asg_action == "terminate" else _RELEASED


def warning_text(decision: Decision) -> str:
    """A warning's fallback text (notifications, screen readers): which machine, and what happens to it."""
    m = decision.machine
    label = machine_label(m.name, m.instance_id)
    mode = decision.handling.mode if decision.handling else "stop"
    verb = reaped_verb(decision)
    if mode == "terminate" or verb == _TERMINATED_IN_GROUP:
        will = "will be terminated unless someone keeps it"
    elif mode == "notify":
        will = "is idle; idle-reaper will not " + ("delete" if m.deleted_by_stop else "stop") + " it"
    else:
        will = f"will be {verb} unless someone keeps it"
    return fit(f"Idle {words_for(m.instance_id).noun} {label} {will}", FALLBACK_CHARS, mrkdwn=True)


def _choice_label(choice: str, policy: TeamPolicy, now: datetime) -> str:
    if choice == "keep_morning":
        morning = next_morning(policy, now)
        if morning - now > timedelta(hours=policy.max_snooze_hours):
            return f"Keep {policy.max_snooze_hours} h (max)"
        return "Keep until tomorrow morning"
    return f"Keep {KEEP_HOURS[choice]} h"


def warning_blocks(decision: Decision, ref: str, now: datetime) -> list[Block]:
    m, a = decision.machine, decision.assessment
    policy = decision.policy.policy if decision.policy and decision.policy.policy else TeamPolicy()
    stop_at = planned_stop(decision, now)
    verb = reaped_verb(decision)
    idle_minutes = a.quiet_minutes(now) if a else 0
    thresholds = f"CPU < {policy.cpu_threshold_percent:g}%"
    if a and a.uses_gpu:
        thresholds += f", GPU < {policy.gpu_threshold_percent:g}%"
    busy = f"busy means {thresholds.replace('<', '≥')}"
    if m.is_endpoint:
        busy = "busy means one request or more to any variant (AWS/SageMaker Invocations)"
    why = decision.why_warned
    morning_capped = next_morning(policy, now) - now > timedelta(hours=policy.max_snooze_hours)
    longest = f"keep_{policy.max_snooze_hours}h" if morning_capped else None  # already the morning button
    others = [c for c in keep_choices(policy) if c not in ("keep_2h", longest)]
    # Every text that carries a tag, a policy value or a reason is escaped and fitted to its element.
    label = machine_label(m.name, m.instance_id)
    kind, how = decision.kind, decision.handling
    mode = how.mode if how else "stop"
    buttons: list[Any] = [
        _button("Keep 2 h", "keep_2h", ref, style="primary"),
        _button(_choice_label("keep_morning", policy, now), "keep_morning", ref),
    ]
    words = words_for(m.instance_id)
    if mode == "stop":
        now_verb = _RELEASED if m.asg_name else words.stopped  # what Stop now does (answers: a member is released)
        question = f"{words.stop_button.removesuffix(' now')} it now?"
        buttons.append(_confirmed(words.stop_button, "stop_now", ref, question, f"{label} will be {now_verb}."))
    elif kind.kind in TERMINABLE:
        # Only its owner may (answers.Effects.terminate_now), and only after confirming what is lost.
        lost = f"{label} will be terminated: this {kind.loses}."
        buttons.append(_confirmed("Terminate now", "terminate_now", ref, "Terminate it now?", lost))
    if how is not None:
        # Escaped before the date token goes in: the token is Slack markup, not text from outside.
        mark = "\x00"
        sentence = escape(warning_sentence(kind, how, m.instance_type, mark, reaped_verb=verb))
        sentence = sentence.replace(mark, date_token(stop_at))
    else:
        sentence = f"It will be *{verb}* at {date_token(stop_at)} unless someone keeps it."
    if m.deleted_by_stop and mode == "stop":
        sentence += " " + escape(endpoint_kept(decision.record))
    if others:
        buttons.append(
            OverflowMenuElement(
                action_id="keep_other",
                options=[
                    Option(value=f"{ref}|{c}", text=fit(_choice_label(c, policy, now), OPTION_CHARS)) for c in others
                ],
            )
        )
    policy_label = escape(decision.policy.label) if decision.policy else "?"
    header = f"Idle {words.noun}: {machine_label(m.name, m.instance_id, mrkdwn=False)}"
    saves = "Deleting it saves" if m.deleted_by_stop else "A stop saves"
    return [
        HeaderBlock(text=fit(header, HEADER_CHARS)),
        SectionBlock(
            text=_mrkdwn(sentence, SECTION_CHARS),
            fields=[
                _field(words.noun.capitalize(), f"`{m.instance_id}`{m.where} · {escape(m.instance_type)}"),
                _field("Team", escape(m.team)),
                _field("Cost", f"{money(decision.hourly_cost)} per hour"),
                _field("Idle for", f"{idle_minutes:.0f} min"),
                *([_field(saves, decision.saving.text())] if decision.saving and mode == "stop" else []),
            ],
        ),
        SectionBlock(text=_mrkdwn(f"*Why it counts as idle:* {escape(why)} ({busy})", SECTION_CHARS)),
        ActionsBlock(block_id="idle_reaper_answer", elements=buttons),
        ContextBlock(
            elements=[
                _mrkdwn(
                    f"{answerers(decision, policy)} · idle-reaper · policy {policy_label} · "
                    f"keep at most {policy.max_snooze_hours} h, {policy.max_snoozes_per_day} times a day",
                    CONTEXT_CHARS,
                )
            ]
        ),
    ]


def endpoint_kept(record: MachineRecord) -> str:
    """What deleting an endpoint (a Studio app) keeps, and how it comes back (plain text: the caller escapes)."""
    if is_studio_id(record.instance_id):
        return "Its space and the space's storage are kept: Start it again recreates the app as it was."
    restore = Restore.parse(record.endpoint)
    config = f"endpoint configuration {restore.config}" if restore else "endpoint configuration"
    return f"Its {config}, model and tags are kept: Bring it back recreates it as it was."


def answerers(decision: Decision, policy: TeamPolicy) -> str:
    """Who may press the buttons (core.answers.may_answer), said without mentioning anyone: the owner, the team's
    listed members, the admins. A warning whose Owner tag matches no Slack user says that its owner cannot."""
    members = len(policy.members)
    listed = f"the team's {members} listed member{'s' if members != 1 else ''}" if members else ""
    if decision.record.owner_slack_id:
        who = ["its owner", *([listed] if listed else []), "the idle-reaper admins"]
        return "Can answer: " + (", ".join(who[:-1]) + " and " + who[-1])
    tag = decision.machine.owner
    owner = f"Its Owner tag ({escape(fit(tag, 60))}) is no Slack user" if tag else "It has no Owner tag"
    return f"{owner}: only {listed + ' and ' if listed else ''}the idle-reaper admins can answer"


def _confirmed(text: str, action_id: str, ref: str, title: str, question: str) -> ButtonElement:
    """A danger button that asks first (`question` is mrkdwn its caller escaped)."""
    confirm = ConfirmObject(title=fit(title, CONFIRM_TITLE_CHARS), text=fit(question, CONFIRM_TEXT_CHARS, mrkdwn=True))
    return _button(text, action_id, ref, style="danger", confirm=confirm)


def _mrkdwn(text: str, limit: int) -> MarkdownTextObject:
    return MarkdownTextObject(text=fit(text, limit, mrkdwn=True))


def _field(title: str, value: str) -> MarkdownTextObject:
    return _mrkdwn(f"*{title}*\n{value}", FIELD_CHARS)


def _button(text: str, action_id: str, ref: str, **kw: Any) -> ButtonElement:
    return ButtonElement(text=fit(text, BUTTON_CHARS), action_id=action_id, value=ref, **kw)


def status_blocks(
    title: str, detail: str, *, ref: str | None = None, start_button: bool = False, start_label: str = "Start it again"
) -> list[Block]:
    """`detail` is mrkdwn its caller composed (labels from machine_label, reasons through escape)."""
    blocks: list[Block] = [SectionBlock(text=_mrkdwn(f"*{escape(title)}*\n{detail}", SECTION_CHARS))]
    if start_button and ref:
        blocks.append(
            ActionsBlock(
                block_id="idle_reaper_start",
                elements=[_button(start_label, "start_again", ref)],
            )
        )
    return blocks


def blocks_json(blocks: Sequence[Block]) -> list[dict[str, Any]]:
    return [b.to_dict() for b in blocks]


def blocks_text(blocks: Sequence[dict[str, Any]]) -> str:
    """A plain rendering of Block Kit JSON, for the demo's timeline and for tests."""
    lines: list[str] = []
    for block in blocks:
        if block["type"] == "header":
            lines.append(block["text"]["text"])
        elif block["type"] == "section":
            if "text" in block:
                lines.append(block["text"]["text"])
            lines += [f["text"].replace("\n", ": ") for f in block.get("fields", [])]
        elif block["type"] == "actions":
            labels = []
            for element in block["elements"]:
                if element["type"] == "button":
                    labels.append(f"[{element['text']['text']}]")
                elif element["type"] == "overflow":
                    labels.append("[... " + ", ".join(o["text"]["text"] for o in element["options"]) + "]")
            lines.append(" ".join(labels))
        elif block["type"] == "context":
            lines.append(" ".join(e.get("text", "") for e in block["elements"]))
    text = "\n".join(re.sub(r"<!date\^\d+\^[^|]*\|([^>]*)>", r"\1", line) for line in lines)
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


# ---------------------------------------------------------------------------------------------
# One message per owner: several machines, one message, edited in place as each one is answered

MESSAGE_BLOCKS = 50  # Slack's limit of blocks per message
ACTIONS_ELEMENTS = 25  # Slack's limit of elements per actions block
# A header, the "Keep all" actions block and a context, then per machine a section and an actions block
# (each machine has its own actions block of at most 2 buttons, so ACTIONS_ELEMENTS never binds).
OWNER_MESSAGE_MACHINES = (MESSAGE_BLOCKS - 3) // 2


@dataclass(frozen=True)
class Listed:
    """One machine's lines in a shared message."""

    instance_id: str
    text: str  # mrkdwn: its warning, or what happened since
    ref: str | None = None  # its buttons' reference while its warning stands
    start_ref: str | None = None  # "Start it again" after a stop


@dataclass(frozen=True)
class ListedGroup:
    """What a shared message listed when it was posted (kept under its "Keep all" reference)."""

    ids: tuple[str, ...]
    refs: dict[str, str]
    lines: dict[str, str]
    title: str = ""  # the header, when not the warning's

    def to_json(self) -> str:
        return json.dumps({"ids": list(self.ids), "refs": self.refs, "lines": self.lines, "title": self.title})

    @classmethod
    def from_json(cls, raw: str | None) -> ListedGroup | None:
        data = json_object(raw)
        if data is None:
            return None
        ids, refs, lines = data.get("ids"), data.get("refs"), data.get("lines")
        if not (isinstance(ids, list) and isinstance(refs, dict) and isinstance(lines, dict)):
            return None
        if not all(isinstance(i, str) and isinstance(refs.get(i), str) and isinstance(lines.get(i), str) for i in ids):
            return None
        title = data.get("title")
        return cls(
            tuple(ids), {i: refs[i] for i in ids}, {i: lines[i] for i in ids}, title if isinstance(title, str) else ""
        )

    def is_current(self, record: MachineRecord | None) -> bool:
        """Whether the machine's warning from this message still stands (its buttons would act)."""
        if record is None or not record.warning_ref or record.key not in self.refs:
            return False
        return secrets.compare_digest(record.warning_ref, self.refs[record.key])

    def entries(self, notes: Mapping[str, tuple[str, str | None]], *, current: set[str]) -> list[Listed]:
        out = []
        for i in self.ids:
            if i in notes:
                out.append(Listed(i, notes[i][0], start_ref=notes[i][1]))
            else:
                out.append(Listed(i, self.lines[i], ref=self.refs[i] if i in current else None))
        return out


def json_object(raw: str | None) -> dict[str, Any] | None:
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def owner_warning_line(decision: Decision, now: datetime) -> str:
    """A machine's line in its owner's shared message: name, id, team, why it counts as idle, and when it
    will be stopped."""
    m = decision.machine
    name = f"*{escape(fit(m.name, NAME_CHARS))}* · " if m.name else ""
    verb = reaped_verb(decision)
    why = decision.why_warned
    # What its kind adds (scarce capacity, a reservation a stop does not save): only stops share a message.
    more = caveats(decision.kind, decision.handling, m.instance_type) if decision.handling else []
    joined = escape("; ".join(more))
    note = f" {joined[:1].upper()}{joined[1:]}." if more else ""
    return fit(
        f"{name}`{m.instance_id}`{m.where} · {escape(m.instance_type)} · team {escape(m.team)}\n"
        f"*{verb[:1].upper()}{verb[1:]} at {date_token(planned_stop(decision, now))}* unless kept.{note} {escape(why)}",
        SECTION_CHARS,
        mrkdwn=True,
    )


def owner_message_blocks(
    listed: Sequence[Listed], group_ref: str, part: int = 1, parts: int = 1, *, title: str = ""
) -> list[Block]:
    """The shared message: a line and buttons per machine still waiting, what happened to the others, and
    "Keep all 2 h" while any waits. At most OWNER_MESSAGE_MACHINES machines (the caller splits)."""
    if not 0 < len(listed) <= OWNER_MESSAGE_MACHINES:
        raise ValueError(f"a shared message lists 1 to {OWNER_MESSAGE_MACHINES} machines, not {len(listed)}")
    waiting = [x for x in listed if x.ref]
    nouns, done = kinds_said(x.instance_id for x in listed)  # an endpoint or a Studio app is never a machine
    if not title:
        title = f"Idle {nouns}: {len(waiting)} of yours will be {done} unless kept" if waiting else f"Your idle {nouns}"
    blocks: list[Block] = [HeaderBlock(text=fit(title, HEADER_CHARS))]
    for n, x in enumerate(listed):
        blocks.append(SectionBlock(block_id=f"machine_{n}", text=_mrkdwn(x.text, SECTION_CHARS)))
        words = words_for(x.instance_id)
        if x.ref:
            done = "deleted" if words.stopped == "deleted" else "stopped or released to its group"
            stop = ConfirmObject(
                title=fit(f"{words.stop_button.removesuffix(' now')} it now?", CONFIRM_TITLE_CHARS),
                text=fit(f"{x.instance_id} will be {done}.", CONFIRM_TEXT_CHARS),
            )
            buttons = [
                _button("Keep 2 h", "keep_2h", x.ref, style="primary"),
                _button(words.stop_button, "stop_now", x.ref, style="danger", confirm=stop),
            ]
            blocks.append(ActionsBlock(block_id=f"answer_{n}", elements=buttons))
        elif x.start_ref:
            start = _button(words.start_button, "start_again", x.start_ref)
            blocks.append(ActionsBlock(block_id=f"start_{n}", elements=[start]))
    if waiting:
        keep_all = _button(f"Keep all {len(waiting)} for 2 h", "keep_all", group_ref, style="primary")
        blocks.append(ActionsBlock(block_id="idle_reaper_keep_all", elements=[keep_all]))
    note = f"idle-reaper · your {nouns} that became idle together, in one message"
    if parts > 1:
        note += f" · part {part} of {parts}: Slack allows {OWNER_MESSAGE_MACHINES} of them per message"
    blocks.append(ContextBlock(elements=[_mrkdwn(note, CONTEXT_CHARS)]))
    return blocks


def quiet_stop_line(record: MachineRecord) -> str:
    """A machine's line in the quiet hours summary: which, when it was stopped, and why."""
    name = f"*{escape(fit(record.name, NAME_CHARS))}* · " if record.name else ""
    what = (
        PAST_TENSE.get(Action(record.last_action or "stop"), "stopped")
        if record.last_action in ("stop", "hibernate")
        else "stopped"
    )
    if words_for(record.instance_id).deletes:  # an endpoint's or a Studio app's stop is its deletion
        what = words_for(record.instance_id).stopped
    when = date_token(record.last_action_at or record.quiet_stop_at or datetime.now(UTC))
    kind = f" · {escape(record.instance_type)}" if record.instance_type else ""
    return fit(
        f"{name}`{record.instance_id}`{kind} · team {escape(record.team)}\n*{what.capitalize()} at {when}*. "
        f"{escape(record.reason)}",
        SECTION_CHARS,
        mrkdwn=True,
    )
