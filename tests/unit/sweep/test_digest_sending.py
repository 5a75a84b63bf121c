"""Sending the weekly digest (sweep/digest.py): due per team in its own zone, exactly once per destination per
week however many invocations overlap, a team without a channel in the admin channel (marked), and a post
that fails released for the next hour."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from slack_sdk.errors import SlackApiError

from idle_reaper.aws import InMemoryStateStore, PolicyStore
from idle_reaper.core import MachineRecord
from idle_reaper.core.digest import running_again_entry
from idle_reaper.policy import Settings
from idle_reaper.slack.digest import DigestSender
from idle_reaper.sweep.digest import send_due_digests
from testkit.aws.policies import FakeSSM

PREFIX = "/idle-reaper"
MONDAY_9 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)  # W48 begins: the W47 digests are due
W47 = datetime(2026, 11, 16, tzinfo=UTC)


class RecordingSlack:
    """What DigestSender calls on a WebClient, recorded; `upload_error`: files_upload_v2 fails."""

    def __init__(self, upload_error: str | None = None, post_error: str | None = None) -> None:
        self.uploads: list[dict[str, Any]] = []
        self.posts: list[dict[str, Any]] = []
        self.upload_error, self.post_error = upload_error, post_error
        self.lock = threading.Lock()

    def _answer(self, calls: list[dict[str, Any]], error: str | None, kw: dict[str, Any]) -> dict[str, Any]:
        if error:
            raise SlackApiError(error, {"ok": False, "error": error})
        with self.lock:
            calls.append(kw)
        return {"ok": True}

    def conversations_join(self, **kw: Any) -> dict[str, Any]:
        return {"ok": True}

    def files_upload_v2(self, **kw: Any) -> dict[str, Any]:
        return self._answer(self.uploads, self.upload_error, kw)

    def chat_postMessage(self, **kw: Any) -> dict[str, Any]:
        return self._answer(self.posts, self.post_error, kw)

    def texts(self) -> list[str]:
        return [str(kw.get("initial_comment") or kw.get("text")) for kw in self.uploads + self.posts]

    def channels(self) -> list[str]:
        return sorted(kw["channel"] for kw in self.uploads + self.posts)


def world() -> tuple[InMemoryStateStore, PolicyStore]:
    ssm = FakeSSM()
    ssm.store(f"{PREFIX}/settings", Settings(admin_channel="C0ADMIN").model_dump_json())
    ssm.store(f"{PREFIX}/teams/ml", '{"slack_channel": "C0ML"}')
    ssm.store(f"{PREFIX}/teams/cv", "{}")  # no channel: the admin channel, marked
    ssm.store(f"{PREFIX}/teams/tokyo", '{"slack_channel": "C0TOKYO", "timezone": "Asia/Tokyo", "digest_day": "sun"}')
    store = InMemoryStateStore()
    for team, hourly in (("ml", 1.0), ("cv", 2.0), ("data", 0.5)):  # data: no parameter, the default policy
        at = W47 + timedelta(days=1, hours=10)
        store.audit(f"i-{team}", at, {"action": "stop", "team": team, "hourly_savings": hourly, "error": None})
        back = at + timedelta(hours=4)
        store.audit(f"i-{team}", back, running_again_entry(f"i-{team}", team, "ada", "g5.xlarge", back))
        store.records[f"i-{team}"] = MachineRecord(f"i-{team}", team, name=f"{team}-box")
    return store, PolicyStore(ssm, PREFIX)


def no_chart(*_: Any) -> bytes:
    return b"\x89PNG fake"


def test_each_destination_gets_one_digest_even_when_invocations_overlap() -> None:
    store, policies = world()
    slack = RecordingSlack()
    sender = DigestSender(slack)  # type: ignore[arg-type]
    assert send_due_digests(store, policies, sender, MONDAY_9 - timedelta(minutes=1), render=no_chart) == []
    barrier = threading.Barrier(6)
    outcomes: list[Any] = []

    def invocation() -> None:
        barrier.wait()
        outcomes.extend(send_due_digests(store, policies, sender, MONDAY_9, render=no_chart))

    threads = [threading.Thread(target=invocation) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # ml, cv (in the admin channel), data (no parameter: with the admins), admins; tokyo's is due on Sunday.
    assert sorted(o.destination for o in outcomes) == ["admins", "cv", "data", "ml"]
    assert slack.channels() == ["C0ADMIN", "C0ADMIN", "C0ADMIN", "C0ML"]
    texts = {kw["filename"]: kw["initial_comment"] for kw in slack.uploads}
    assert "has no slack_channel" in texts["idle-reaper-cv-2026-W47.png"]
    assert "*$8.00*" in texts["idle-reaper-cv-2026-W47.png"]  # 4 h at $2
    assert "*$14.00*" in texts["idle-reaper-admins-2026-W47.png"]  # every team once: 4 + 8 + 2
    assert "has no slack_channel" not in texts["idle-reaper-ml-2026-W47.png"]
    # Later hours of the week send nothing more; Tokyo's comes on its own Sunday 09:00.
    assert send_due_digests(store, policies, sender, MONDAY_9 + timedelta(hours=30), render=no_chart) == []
    sunday_tokyo = datetime(2026, 11, 29, 0, 0, tzinfo=UTC)  # 09:00 in Tokyo
    [tokyo] = send_due_digests(store, policies, sender, sunday_tokyo, render=no_chart)
    assert (tokyo.destination, tokyo.week, tokyo.channel) == ("tokyo", "2026-W47", "C0TOKYO")


def test_a_failed_upload_sends_the_text_and_says_so_and_a_failed_post_is_tried_next_hour() -> None:
    store, policies = world()
    slack = RecordingSlack(upload_error="ratelimited")
    outcomes = send_due_digests(store, policies, DigestSender(slack), MONDAY_9, render=no_chart)  # type: ignore[arg-type]
    assert {o.with_chart for o in outcomes} == {False} and not slack.uploads
    assert all("without its chart: the chart could not be uploaded (ratelimited)" in p["text"] for p in slack.posts)
    assert len(slack.posts) == 4

    store, policies = world()
    down = RecordingSlack(upload_error="fatal_error", post_error="fatal_error")
    outcomes = send_due_digests(store, policies, DigestSender(down), MONDAY_9, render=no_chart)  # type: ignore[arg-type]
    assert all(o.error for o in outcomes) and not down.posts
    later = RecordingSlack()
    again = send_due_digests(store, policies, DigestSender(later), MONDAY_9 + timedelta(hours=1), render=no_chart)  # type: ignore[arg-type]
    assert sorted(o.destination for o in again) == ["admins", "cv", "data", "ml"] and len(later.uploads) == 4


def test_a_chart_that_cannot_be_drawn_still_sends_the_figures() -> None:
    store, policies = world()
    slack = RecordingSlack()

    def broken(*_: Any) -> bytes:
        raise OSError("no font")

    outcomes = send_due_digests(store, policies, DigestSender(slack), MONDAY_9, render=broken)  # type: ignore[arg-type]
    assert len(outcomes) == 4 and not slack.uploads
    assert all("the chart could not be drawn" in p["text"] for p in slack.posts)


def test_without_slack_nothing_is_sent_and_every_digest_waits_for_it_without_a_channel_it_is_logged() -> None:
    store, policies = world()
    waiting = send_due_digests(store, policies, None, MONDAY_9, render=no_chart)
    assert {o.error for o in waiting} == {"no Slack"}
    slack = RecordingSlack()
    sent = send_due_digests(store, policies, DigestSender(slack), MONDAY_9 + timedelta(hours=1), render=no_chart)  # type: ignore[arg-type]
    assert len(sent) == 4 and len(slack.uploads) == 4

    ssm = FakeSSM()
    ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())  # no admin channel
    ssm.store(f"{PREFIX}/teams/cv", "{}")  # and no team channel
    lonely = send_due_digests(InMemoryStateStore(), PolicyStore(ssm, PREFIX), DigestSender(slack), MONDAY_9)  # type: ignore[arg-type]
    assert {(o.destination, o.channel) for o in lonely} == {("admins", None), ("cv", None)}
    assert all("set the team's slack_channel or settings.admin_channel" in o.error for o in lonely)


def test_exempt_machines_are_read_for_the_week_and_their_idle_hours_counted_as_still_wasted() -> None:
    from idle_reaper.aws.metrics import MetricsReader
    from idle_reaper.core import State
    from testkit.aws.metrics import FakeCloudWatch

    store, policies = world()
    cloudwatch = FakeCloudWatch()
    # Idle all week but busy on Wednesday 10:00-12:00 (two hours), busy on its GPU, a GPU box without its agent.
    wednesday = W47 + timedelta(days=2, hours=10)
    machines = {
        "i-lazy": ("m5.large", lambda t: (80.0 if wednesday <= t < wednesday + timedelta(hours=2) else 1.0, None)),
        "i-train": ("g5.xlarge", lambda t: (1.0, 95.0)),
        "i-blind": ("g5.xlarge", lambda t: (1.0, None)),
    }
    for instance_id, (itype, profile) in machines.items():
        cloudwatch.add(instance_id, profile, W47 - timedelta(days=1))
        store.records[instance_id] = MachineRecord(
            instance_id, "ml", name=instance_id[2:], state=State.EXEMPT, instance_type=itype, updated_at=MONDAY_9
        )
    slack = RecordingSlack()
    sent = send_due_digests(
        store, policies, DigestSender(slack), MONDAY_9, render=no_chart, metrics=MetricsReader(cloudwatch)
    )  # type: ignore[arg-type]
    assert {o.destination for o in sent} >= {"ml", "admins"}
    ml = next(t for t in slack.texts() if "team ml" in t)
    # 168 hours of the week, less Wednesday's two busy ones: 166 idle hours at $0.096.
    assert f"Still wasted, exempt and idle: ${166 * 0.096:,.2f} (166 h): lazy 166 h; no data for 1." in ml
    assert "train" not in ml.split("exempt and idle")[1].split("\n")[0]
    # What was read: CPU of all three, GPU only of the GPU types; never the person's metric.
    names = {q["MetricStat"]["Metric"]["MetricName"] for _, kw in cloudwatch.requests for q in kw["MetricDataQueries"]}
    assert "idle_reaper_minutes_since_input" not in names


def test_without_metrics_exempt_machines_say_nothing_of_idle_time_and_a_failed_read_says_no_data() -> None:
    from idle_reaper.aws.metrics import MetricsReader
    from idle_reaper.core import State
    from testkit.aws.metrics import FakeCloudWatch

    store, policies = world()
    store.records["i-lazy"] = MachineRecord(
        "i-lazy", "ml", name="lazy", state=State.EXEMPT, instance_type="m5.large", updated_at=MONDAY_9
    )
    cloudwatch = FakeCloudWatch()
    cloudwatch.inject("GetMetricData", "AccessDenied")
    slack = RecordingSlack()
    send_due_digests(store, policies, DigestSender(slack), MONDAY_9, render=no_chart, metrics=MetricsReader(cloudwatch))  # type: ignore[arg-type]
    ml = next(t for t in slack.texts() if "team ml" in t)
    assert "Exempt and idle: nothing (0 exempt machine(s) read; no data for 1)." in ml


def test_a_member_machines_exempt_week_is_read_in_its_own_account_never_the_hubs() -> None:
    from idle_reaper.aws.metrics import MetricsReader
    from idle_reaper.core import State
    from idle_reaper.sweep.digest import DigestAccounts
    from testkit.aws.metrics import FakeCloudWatch

    a, b, region = "111111111111", "222222222222", "eu-west-1"
    store, policies = world()
    hub, in_a = FakeCloudWatch(), FakeCloudWatch()
    # The same instance id: busy all week in the hub, idle all week in A. B cannot be reached.
    hub.add("i-same", lambda t: (80.0, None), W47 - timedelta(days=1))
    in_a.add("i-same", lambda t: (1.0, None), W47 - timedelta(days=1))
    for account, name in ((None, "hub-box"), (a, "a-box"), (b, "b-box")):
        record = MachineRecord(
            "i-same",
            "ml",
            name=name,
            state=State.EXEMPT,
            instance_type="m5.large",
            updated_at=MONDAY_9,
            account=account,
            region=region if account else None,
        )
        store.records[record.key] = record
    asked: list[tuple[str, str]] = []

    def metrics_in(account: str, where: str) -> MetricsReader | None:
        asked.append((account, where))
        return MetricsReader(in_a) if account == a else None  # B: its member role cannot be assumed

    slack = RecordingSlack()
    send_due_digests(
        store,
        policies,
        DigestSender(slack),  # type: ignore[arg-type]
        MONDAY_9,
        render=no_chart,
        metrics=MetricsReader(hub),  # type: ignore[arg-type]
        accounts=lambda: DigestAccounts({a: "sandbox-a"}, metrics_in),
    )
    assert sorted(asked) == [(a, region), (b, region)]
    ml = next(t for t in slack.texts() if "team ml" in t)
    # A's machine idle all week (168 h at $0.096), the hub's busy, B's unknown: never the hub's data for them.
    assert f"Still wasted, exempt and idle: ${168 * 0.096:,.2f} (168 h): a-box 168 h; no data for 1." in ml
    assert "a-box (sandbox-a, exempt, $0.10/h)" in ml and "b-box (222222222222, exempt" in ml
    # Each CloudWatch was asked once per kind of read, for its own machine only.
    assert len(hub.requests) == 1 and len(in_a.requests) == 1
    assert "By account: the hub's account saved" in ml


def test_a_single_account_digest_has_no_account_section() -> None:
    store, policies = world()
    slack = RecordingSlack()
    send_due_digests(store, policies, DigestSender(slack), MONDAY_9, render=no_chart)  # type: ignore[arg-type]
    assert slack.texts() and not any("By account" in t or "the hub's account" in t for t in slack.texts())
