"""Slack messages that always fit Block Kit's limits, and delivery failures sorted into those that pass
(retried) and those that will not (PermanentDeliveryFailure with what to fix). No network: a recording
client stands in for slack-sdk's WebClient."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from slack_sdk.errors import SlackApiError, SlackObjectFormationError
from slack_sdk.web import SlackResponse

from idle_reaper.aws import InMemoryStateStore
from idle_reaper.core import Action, Assessment, Decision, Machine, MachineRecord, State
from idle_reaper.notify import Delivery, DeliveryUnknown, PermanentDeliveryFailure
from idle_reaper.policy import TeamPolicy, TeamPolicyRef
from idle_reaper.slack import (
    FALLBACK_CHARS,
    SlackNotifier,
    blocks_json,
    classify,
    escape,
    fit,
    machine_label,
    owner_warning_line,
    status_blocks,
    warning_blocks,
)
from idle_reaper.slack import notifier as slack_notifier_module
from idle_reaper.slack.blocks import warning_text

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
# EC2's longest Name tag: 256 characters, here CJK, astral emoji, combining accents and ZWJ sequences.
UNICODE_NAME = ("训练节点-😀-e\u0301-👩\u200d💻-" * 40)[:256]
INJECTION = "<!channel> <https://evil.example|click> & more"


def units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


# ---------------------------------------------------------------------------------------------
# fit: one helper, character boundaries, an ellipsis when cut


def test_short_text_is_left_alone():
    assert fit("Keep 2 h", 75) == "Keep 2 h"
    assert fit("x" * 150, 150) == "x" * 150


def test_long_text_is_cut_with_an_ellipsis():
    assert fit("x" * 151, 150) == "x" * 149 + "…"


def test_astral_emoji_count_two_and_are_never_split():
    cut = fit("😀" * 200, 150)
    assert cut == "😀" * 74 + "…" and units(cut) == 149


def test_combining_marks_stay_with_their_letter():
    cut = fit("e\u0301" * 200, 151)
    assert cut.endswith("e\u0301…") and units(cut) <= 151
    assert fit("a" + "\u0301" * 500, 100) == "…", "a letter with more marks than room is dropped whole"


def test_zwj_emoji_sequences_are_kept_whole_or_dropped():
    coder = "👩\u200d💻"  # 5 UTF-16 units
    for limit in range(3, 40):
        cut = fit(coder * 10, limit)
        assert units(cut) <= limit
        assert cut[:-1] == coder * (len(cut[:-1]) // len(coder)), f"a broken sequence at limit {limit}"


def test_mrkdwn_cuts_never_split_an_escape_or_a_token():
    text = escape("a&b" * 100)
    for limit in range(2, 60):
        cut = fit(text, limit, mrkdwn=True)
        assert cut.rfind("&") < cut.rfind(";") or "&" not in cut, cut
    token = "see <!date^1700000000^{time}|2023-11-14 22:13 UTC> now"
    assert fit(token, 20, mrkdwn=True) == "see …"


@given(st.text(), st.integers(min_value=2, max_value=400), st.booleans())
def test_fit_always_fits_and_keeps_a_prefix(text, limit, mrkdwn):
    cut = fit(text, limit, mrkdwn=mrkdwn)
    assert units(cut) <= limit and len(cut) <= limit
    if cut != text:
        assert cut.endswith("…") and text.startswith(cut[:-1])


def test_escape_makes_mentions_and_links_inert():
    assert escape(INJECTION) == "&lt;!channel&gt; &lt;https://evil.example|click&gt; &amp; more"


def test_labels_cut_the_name_and_escape_it_for_mrkdwn_only():
    label = machine_label("<!here> " + "n" * 300, "i-0abc")
    assert label.startswith("&lt;!here&gt; n") and label.endswith("… (i-0abc)") and units(label) < 130
    assert machine_label("a<b", "i-1", mrkdwn=False) == "a<b (i-1)"
    assert machine_label(None, "i-1") == "i-1"


# ---------------------------------------------------------------------------------------------
# Every message builds (slack-sdk validates its models) and stays within the limits

LIMITS = {"header": 150, "field": 2000, "section": 3000, "context": 2000, "button": 75, "option": 75}


def machine(**kw: Any) -> Machine:
    base: dict[str, Any] = dict(
        instance_id="i-0123456789abcdef0",
        instance_type="g5.xlarge",
        team="ml",
        launch_time=NOW - timedelta(hours=8),
        name="notebook",
        owner="U0BOB",
    )
    return Machine(**{**base, **kw})


def decision(m: Machine | None = None, *, reason: str = "quiet", policy: TeamPolicy | None = None, **kw: Any):
    m = m or machine()
    assessment = Assessment(
        "idle", reason, quiet_since=NOW - timedelta(minutes=75), max_cpu=1.0, quiet_summary=kw.pop("summary", "")
    )
    ref = TeamPolicyRef(
        team=m.team, policy=policy or TeamPolicy(slack_channel="C0TEAM"), source="/idle-reaper/teams/ml", version=3
    )
    ref = ref.model_copy(update={"schedule": kw.pop("schedule", None)})
    record = MachineRecord(m.instance_id, m.team, state=State.WARNED, updated_at=NOW, name=m.name, **kw)
    return Decision(m, State.WARNED, Action.WARN, reason, "idle", record, assessment=assessment, policy=ref)


def texts(blocks: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, text type, text) of every text in Block Kit JSON."""
    found = []
    for block in blocks:
        if block["type"] == "header":
            found.append(("header", block["text"]["type"], block["text"]["text"]))
        elif block["type"] == "section":
            if "text" in block:
                found.append(("section", block["text"]["type"], block["text"]["text"]))
            found += [("field", f["type"], f["text"]) for f in block.get("fields", [])]
        elif block["type"] == "context":
            found += [("context", e["type"], e["text"]) for e in block["elements"]]
        elif block["type"] == "actions":
            for element in block["elements"]:
                if element["type"] == "button":
                    found.append(("button", element["text"]["type"], element["text"]["text"]))
                    if "confirm" in element:
                        found.append(
                            ("confirm", element["confirm"]["text"]["type"], element["confirm"]["text"]["text"])
                        )
                else:
                    found += [("option", o["text"]["type"], o["text"]["text"]) for o in element["options"]]
    return found


def assert_within_limits(blocks: list[dict[str, Any]]) -> None:
    for kind, text_type, text in texts(blocks):
        assert units(text) <= LIMITS.get(kind, 300), (kind, units(text))
        if text_type == "mrkdwn":
            assert "<!channel>" not in text and "<https://evil" not in text, f"injected into {kind}: {text}"


def test_a_256_character_unicode_name_tag_builds_a_warning_within_limits():
    d = decision(machine(name=UNICODE_NAME, asg_name="workers"))
    blocks = blocks_json(warning_blocks(d, "r" * 24, NOW))
    assert_within_limits(blocks)
    header = blocks[0]["text"]["text"]
    assert header.startswith("Idle machine: 训练节点-😀") and header.endswith("… (i-0123456789abcdef0)")


def test_injected_text_from_tags_policies_and_reasons_is_inert_and_fitted():
    huge = (INJECTION + " ") * 400
    d = decision(
        machine(name=INJECTION, team=INJECTION * 6),
        reason=huge,
        summary=huge,
        schedule="schedules[0] '" + INJECTION + "'",
    )
    blocks = blocks_json(warning_blocks(d, "r" * 24, NOW))
    assert_within_limits(blocks)
    team_field = next(t for k, _, t in texts(blocks) if k == "field" and t.startswith("*Team*"))
    assert "&lt;!channel&gt;" in team_field
    assert any(k == "section" and t.endswith("…") for k, _, t in texts(blocks)), "the huge reason was cut"


@pytest.mark.parametrize(("asg_action", "verb"), [("unprotect", "released"), ("terminate", "terminated")])
def test_a_group_members_warning_says_what_its_groups_policy_does_to_it(asg_action: str, verb: str) -> None:
    # Before: a member terminated under asg_action: terminate was warned it would be "released to its Auto Scaling
    # group", and its fallback text said "stopped".
    policy = TeamPolicy(slack_channel="C0TEAM", asg_action=asg_action)  # type: ignore[arg-type]
    d = decision(machine(asg_name="workers"), policy=policy)
    other = "terminated" if verb == "released" else "released"
    sentence = texts(blocks_json(warning_blocks(d, "r" * 24, NOW)))[1][2]
    assert f"*{verb}" in sentence and other not in sentence, sentence
    line = owner_warning_line(d, NOW)
    assert f"*{verb.capitalize()}" in line and other not in line.lower(), line
    assert f"will be {verb}" in warning_text(d)
    confirm = [t for kind, _, t in texts(blocks_json(warning_blocks(d, "r" * 24, NOW))) if kind == "confirm"]
    assert confirm == ["notebook (i-0123456789abcdef0) will be released to its Auto Scaling group."], "as Stop now does"


def test_status_messages_fit_a_huge_detail():
    detail = machine_label(UNICODE_NAME, "i-1") + " " + escape(INJECTION) * 500
    blocks = blocks_json(status_blocks("Stopped", detail, ref="r" * 24, start_button=True))
    assert_within_limits(blocks)
    assert blocks[0]["text"]["text"].endswith("…")


# ---------------------------------------------------------------------------------------------
# Delivery against a recording client


def slack_error(code: str, status: int = 200) -> SlackApiError:
    response = SlackResponse(
        client=None,
        http_verb="POST",
        api_url="https://slack.test/api/x",
        req_args={},
        data={"ok": False, "error": code},
        headers={},
        status_code=status,
    )
    return SlackApiError(f"The request to the Slack API failed: {code}", response)


@dataclass
class RecordingClient:
    """Answers like Slack, or with the error given for "method" or "method target"."""

    errors: dict[str, Exception] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _call(self, method: str, target: str, **params: Any) -> None:
        self.calls.append((method, params))
        error = self.errors.get(f"{method} {target}") or self.errors.get(method)
        if error:
            raise error

    @staticmethod
    def dm(channel: str) -> str:
        """Where a post lands: a user id is the app's DM with them (Slack answers with its channel id)."""
        return "D" + channel.lstrip("UW") if channel[:1] in ("U", "W") else channel

    def conversations_open(self, users: str) -> dict[str, Any]:
        self._call("conversations.open", users, users=users)
        return {"channel": {"id": "D" + users[1:]}}

    def conversations_join(self, channel: str) -> dict[str, Any]:
        self._call("conversations.join", channel, channel=channel)
        return {"ok": True, "channel": {"id": channel}}

    def chat_postMessage(self, channel: str, **params: Any) -> dict[str, Any]:
        self._call("chat.postMessage", self.dm(channel), channel=self.dm(channel), **params)
        return {"channel": self.dm(channel), "ts": f"{len(self.calls)}.0"}

    def chat_update(self, channel: str, ts: str, **params: Any) -> dict[str, Any]:
        self._call("chat.update", channel, channel=channel, ts=ts, **params)
        return {"ok": True}

    def users_lookupByEmail(self, email: str) -> dict[str, Any]:
        self._call("users.lookupByEmail", email, email=email)
        raise slack_error("users_not_found")


def notifier(errors: dict[str, Exception] | None = None) -> tuple[SlackNotifier, RecordingClient]:
    client = RecordingClient(errors or {})
    return SlackNotifier(client, InMemoryStateStore(), clock=lambda: NOW), client  # type: ignore[arg-type]


def posted(client: RecordingClient) -> list[dict[str, Any]]:
    return [params for method, params in client.calls if method == "chat.postMessage"]


def test_a_delivered_warning_goes_to_the_owner_and_the_channel():
    slack, client = notifier()
    delivery = slack.warn(decision())
    assert isinstance(delivery, Delivery) and delivery.undelivered == ()
    assert [p["channel"] for p in posted(client)] == ["D0BOB", "C0TEAM"]
    assert all(units(p["text"]) <= FALLBACK_CHARS for p in posted(client))


def test_the_bot_outside_the_only_channel_is_permanent_and_says_how_to_fix_it():
    slack, _ = notifier({"chat.postMessage": slack_error("not_in_channel")})
    policy = TeamPolicy(slack_channel="C0TEAM", notify="channel")
    with pytest.raises(PermanentDeliveryFailure) as err:
        slack.warn(decision(policy=policy))
    reason = err.value.reason
    assert "i-0123456789abcdef0 (team ml)" in reason and "not in channel C0TEAM" in reason
    assert "/invite @idle-reaper" in reason and "channels:join" in reason


@pytest.mark.parametrize(
    ("key", "code", "expected"),
    [
        ("chat.postMessage", "channel_not_found", "channel C0TEAM does not exist"),
        ("chat.postMessage", "is_archived", "channel C0TEAM is archived"),
        ("chat.postMessage", "msg_too_long", "Slack refused the message for C0TEAM (msg_too_long)"),
        ("chat.postMessage", "invalid_blocks", "(invalid_blocks): a bug in idle-reaper"),
    ],
)
def test_failures_that_will_not_pass_are_permanent(key, code, expected):
    slack, _ = notifier({key: slack_error(code)})
    with pytest.raises(PermanentDeliveryFailure, match=re.escape(expected)):
        slack.warn(decision(policy=TeamPolicy(slack_channel="C0TEAM", notify="channel")))


@pytest.mark.parametrize("code", ["user_not_found", "cannot_dm_bot", "user_disabled"])
def test_an_owner_who_cannot_get_a_dm_is_permanent(code):
    slack, _ = notifier({"chat.postMessage D0BOB": slack_error(code)})
    with pytest.raises(PermanentDeliveryFailure, match=r"Slack user U0BOB .*fix the Owner tag it comes from"):
        slack.warn(decision(policy=TeamPolicy(notify="owner")))


@pytest.mark.parametrize(
    "error",
    [
        slack_error("ratelimited", 429),
        slack_error("invalid_auth"),
        slack_error("token_revoked"),
        slack_error("something_new"),
    ],
)
def test_failures_that_may_pass_leave_the_warning_pending(error):
    # Slack answered, and did not post: posted again next sweep.
    slack, _ = notifier({"chat.postMessage": error})
    assert slack.warn(decision()) is None


@pytest.mark.parametrize(
    "error",
    [slack_error("internal_error", 500), slack_error("service_unavailable", 503), TimeoutError("read timed out")],
)
def test_a_post_whose_answer_was_lost_is_not_taken_as_never_posted(error):
    # A 5xx or a timeout may come after Slack posted: the next sweep looks for it before posting again.
    slack, _ = notifier({"chat.postMessage": error})
    with pytest.raises(DeliveryUnknown):
        slack.warn(decision())


def test_a_rejected_token_is_logged_as_an_error_an_outage_as_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="idle-reaper")
    for code, level in (("invalid_auth", "ERROR"), ("internal_error", "WARNING")):
        caplog.clear()
        notifier({"chat.postMessage": slack_error(code)})[0].warn(decision())
        assert {r.levelname for r in caplog.records} == {level}


def test_one_target_failing_permanently_still_delivers_and_reports_it():
    slack, _ = notifier({"chat.postMessage C0TEAM": slack_error("not_in_channel")})
    delivery = slack.warn(decision())
    assert isinstance(delivery, Delivery) and delivery.messages == ("D0BOB|1.0",)
    (undelivered,) = delivery.undelivered
    assert "not in channel C0TEAM" in undelivered and "i-0123456789abcdef0" in undelivered


def test_a_permanent_and_a_passing_failure_leave_it_pending():
    slack, _ = notifier(
        {"chat.postMessage C0TEAM": slack_error("not_in_channel"), "chat.postMessage D0BOB": slack_error("fatal_error")}
    )
    assert slack.warn(decision()) is None


def test_a_message_that_cannot_be_built_is_permanent(monkeypatch):
    def broken(*_args: Any) -> list[Any]:
        raise SlackObjectFormationError("text attribute cannot exceed 3000 characters")

    monkeypatch.setattr(slack_notifier_module, "warning_blocks", broken)  # where the notifier looks it up
    slack, client = notifier()
    with pytest.raises(PermanentDeliveryFailure, match=r"could not be built .*3000 characters.*a bug in idle-reaper"):
        slack.warn(decision())
    assert posted(client) == []


def test_nobody_to_warn_is_permanent_and_names_the_fix():
    slack, client = notifier()
    m = machine(owner="nobody@example.com")
    with pytest.raises(PermanentDeliveryFailure) as err:
        slack.warn(decision(m, policy=TeamPolicy()))
    assert "nobody to warn about i-0123456789abcdef0 (team ml)" in err.value.reason
    assert "'nobody@example.com' is not a Slack user" in err.value.reason and "slack_channel" in err.value.reason
    assert posted(client) == []


def test_a_2000_character_owner_is_no_email_and_costs_no_lookup():
    slack, client = notifier()
    assert slack.resolve_owner("a" * 2000 + "@example.com") is None
    assert slack.resolve_owner("U" + "A" * 2000) is None
    assert client.calls == []


def test_updates_fit_and_report_permanent_failures_without_raising(caplog):
    caplog.set_level(logging.WARNING, logger="idle-reaper")
    slack, client = notifier({"chat.update C0GONE": slack_error("message_not_found")})
    record = MachineRecord("i-1", "ml", messages=("D0BOB|1.0", "C0GONE|2.0"))
    detail = machine_label(UNICODE_NAME, "i-1") + " " + escape(INJECTION) * 500
    assert slack.update(record, "Kept", detail) is False
    (update, _) = [params for method, params in client.calls if method == "chat.update"]
    assert units(update["text"]) <= FALLBACK_CHARS
    assert_within_limits(update["blocks"])
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "deleted" in error.advice  # type: ignore[attr-defined]


def test_admin_alerts_are_escaped_and_fitted():
    slack, client = notifier()
    slack.admin_alert("team x: " + INJECTION * 500, admins=["U0ADMIN"], channel="C0ADMINS")
    texts_sent = [p["text"] for p in posted(client)]
    assert len(texts_sent) == 2
    for text in texts_sent:
        assert units(text) <= FALLBACK_CHARS and "<!channel>" not in text and text.endswith("…")


def test_classify_names_the_target():
    fault = classify(slack_error("not_in_channel"), "C0123")
    assert fault.permanent and fault.code == "not_in_channel" and "C0123" in fault.advice
    assert not classify(slack_error("ratelimited", 429), "C0123").permanent
    assert classify(ValueError("bad"), "C0123").permanent
