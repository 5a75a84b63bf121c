"""The sweep reads the activity collector's metric in the same GetMetricData calls as CPU and GPU, over the
in-memory fakes: a person at 1 % CPU keeps a machine busy, a machine without the collector is judged on
CPU/GPU alone and says so, garbage is ignored; what the signal said is kept for `status`."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from idle_reaper.core import (
    HUMAN_NONE,
    Action,
    Assessment,
    MachineRecord,
    State,
    describe_human_signal,
    human_signal_note,
)
from idle_reaper.policy import Settings
from idle_reaper.sweep import run_sweep
from idle_reaper_tools.admin import format_status, status_rows
from testkit.aws import CountingStateStore, FakeAws

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"


def account() -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 60, "warn_minutes": 20, "human_active_minutes": 30}')
    return aws


def profile(user: float | None):
    """1 % CPU all along, the collector (when `user` is not None) publishing `user` minutes since input."""
    return lambda t: (1.0, None, None, None, user)


def test_the_signal_decides_busy_missing_and_ignores_garbage_in_one_call() -> None:
    aws = account()
    launched = NOW - timedelta(days=1)
    ids = {
        kind: aws.launch("m5.large", team="ml", profile=profile(user), launch_time=launched, name=kind)
        for kind, user in (("person", 3.0), ("nobody", HUMAN_NONE), ("no_collector", None), ("garbage", -7.0))
    }
    store = CountingStateStore()
    report = run_sweep(aws.adapters(store=store), now=NOW)
    by_id = {d.machine.instance_id: d for d in report.decisions}

    # One GetMetricData call for 4 machines x 2 queries (CPU and the person; an m5 has no GPU to read), each
    # asking the machine's own InstanceId only.
    (request,) = aws.cloudwatch.requests_of("GetMetricData")
    user_queries = [
        q
        for q in request["MetricDataQueries"]
        if q["MetricStat"]["Metric"]["MetricName"] == "idle_reaper_minutes_since_input"
    ]
    assert len(request["MetricDataQueries"]) == 8 and len(user_queries) == 4
    for q in user_queries:
        assert q["MetricStat"]["Stat"] == "Minimum"
        (dimension,) = q["MetricStat"]["Metric"]["Dimensions"]
        assert dimension["Name"] == "InstanceId" and dimension["Value"] in ids.values()

    person = by_id[ids["person"]]
    assert person.signal == "busy" and person.action is Action.NONE and "a person was active" in person.reason
    assert person.assessment and person.assessment.human_signal == "active"
    for kind in ("nobody", "no_collector", "garbage"):
        assert by_id[ids[kind]].action is Action.WARN, kind
    assert by_id[ids["no_collector"]].assessment.human_signal == "missing"  # type: ignore[union-attr]
    assert by_id[ids["nobody"]].assessment.human_signal == "quiet"  # type: ignore[union-attr]
    garbage = by_id[ids["garbage"]]
    assert garbage.assessment.human_signal == "missing"  # type: ignore[union-attr]
    assert "unusable human-activity value" in garbage.reason

    # What the signal said is on the records, and `status` shows it.
    records = store.load(list(ids.values()))
    assert records[ids["person"]].human_signal.startswith("active 2026-11-20T14:")
    assert records[ids["no_collector"]].human_signal == "missing"
    rows = {r["instance_id"]: r for r in status_rows(records.values(), {}, None, Settings(), NOW)}
    assert rows[ids["no_collector"]]["human_signal"] == "no collector (no activity data: judged on CPU/GPU alone)"
    assert rows[ids["person"]]["human_signal"].startswith("person active 14:")
    assert rows[ids["nobody"]]["human_signal"] == "no person active"
    text = format_status(list(rows.values()), NOW)
    assert "PERSON" in text.splitlines()[1] and "no collector" in text


def test_a_policy_that_ignores_the_signal_keeps_nothing_for_status() -> None:
    aws = account()
    aws.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 60, "warn_minutes": 20, "human_active_minutes": 0}')
    box = aws.launch("m5.large", team="ml", profile=profile(None), launch_time=NOW - timedelta(days=1))
    store = CountingStateStore()
    (d,) = run_sweep(aws.adapters(store=store), now=NOW).decisions
    assert d.action is Action.WARN and store.load([box])[box].human_signal == ""


def test_note_and_description_round_trip_and_tolerate_corruption() -> None:
    input_at = NOW - timedelta(minutes=12)
    active = Assessment("busy", "x", human_signal="active", human_last_input=input_at)
    note = human_signal_note(active)
    assert note == f"active {input_at:%Y-%m-%dT%H:%M}Z"
    assert describe_human_signal(note) == "person active 14:48 UTC"
    assert human_signal_note(Assessment("idle", "x", human_signal="off", human_last_input=input_at)) == ""
    assert human_signal_note(None) == ""
    assert human_signal_note(Assessment("idle", "x", human_signal="quiet")) == "quiet"
    assert describe_human_signal("quiet 2026-11-20T09:10Z") == "no person active (last input 09:10 UTC)"
    for corrupted in ("active not-a-time", "sideways 2026", "", "x" * 500):
        assert len(describe_human_signal(corrupted)) < 40
    assert describe_human_signal("active not-a-time") == "person active"
    # A record written before the field existed reads as "nothing to say".
    assert MachineRecord("i-1", "ml", State.ACTIVE).human_signal == ""
    assert not math.isnan(HUMAN_NONE)


def test_the_slack_status_reply_says_the_signal_is_missing() -> None:
    from idle_reaper.slack.answers import status_reply

    reply = status_reply(
        [
            MachineRecord("i-1", "ml", State.WARNED, name="nb", reason="quiet", human_signal="missing"),
            MachineRecord(
                "i-2", "ml", State.ACTIVE, name="dev", reason="busy", human_signal="active 2026-11-20T12:03Z"
            ),
            MachineRecord("i-3", "ml", State.ACTIVE, name="old", reason="busy"),
        ],
        now=NOW,
    )
    lines = reply.text.splitlines()
    unpriced = "unknown instances, no known price"
    assert lines[1] == f"• dev (i-2) · ml · {unpriced} · *watched*: busy · person active 12:03 UTC"
    assert lines[2] == (
        f"• nb (i-1) · ml · {unpriced} · *warned: stopped unless someone keeps it*: quiet · no collector (no activity "
        "data: judged on CPU/GPU alone)"
    )
    assert lines[3] == f"• old (i-3) · ml · {unpriced} · *watched*: busy"  # the policy ignores the signal


def test_the_slack_status_reply_makes_tag_text_inert() -> None:
    """Team and reason quote tags a machine's user may set: no mention or link may reach Slack from them."""
    from idle_reaper.slack.answers import status_reply

    record = MachineRecord("i-1", "<!channel>", State.WARNED, name="<!here>", reason="quiet on <https://x|tag>")
    (line,) = status_reply([record], now=NOW).text.splitlines()[1:]
    assert "<" not in line and ">" not in line
    assert "&lt;!channel&gt;" in line and "&lt;https://x|tag&gt;" in line
