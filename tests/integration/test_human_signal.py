"""The human-activity signal end to end against moto: the collector's datapoints (put_metric_data, as the
CloudWatch agent publishes them) read in the sweep's GetMetricData calls, and `idle-reaper status`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from idle_reaper import aws
from idle_reaper.core import Action
from idle_reaper.notify import LoggingNotifier
from idle_reaper.sweep import Adapters, logger, run_sweep
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

NOW = at(15)


def put_minutes(instance_id: str, values: list[tuple[datetime, float]], extra_dimensions: list | None = None) -> None:
    dims = [{"Name": "InstanceId", "Value": instance_id}, *(extra_dimensions or [])]
    aws.client("cloudwatch").put_metric_data(
        Namespace="CWAgent",
        MetricData=[
            {"MetricName": "idle_reaper_minutes_since_input", "Dimensions": dims, "Timestamp": t, "Value": v}
            for t, v in values
        ],
    )


def test_person_at_one_percent_cpu_is_busy_missing_collector_is_judged_on_cpu(aws, capsys):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    ids = {name: local.launch(name, "m5.large", team="ml", launch_time=at(8)) for name in ("person", "none", "junk")}
    for instance_id in ids.values():
        local.write_metrics(instance_id, lambda _t: (1.0, None), at(12), NOW)
    recent = [NOW - timedelta(minutes=m) for m in (16, 6)]
    # Typing at 14:42 and 14:52; each sample's period ends a minute after it, so the sweep places them at
    # 14:43 and 14:53 (never earlier than they were).
    put_minutes(ids["person"], [(t, 2.0) for t in recent])
    put_minutes(ids["junk"], [(t, v) for t, v in zip(recent, (-5.0, 99999.0), strict=True)])
    # A hostile local user on another machine cannot name this one: a series with any other dimension set
    # (the agent's per-packet series, or a forged tag) is not the InstanceId rollup the sweep reads.
    put_minutes(ids["none"], [(t, 0.0) for t in recent], [{"Name": "metric_type", "Value": "gauge"}])

    adapters = Adapters.from_environment(notifier=LoggingNotifier(logger, delivers=True))
    report = run_sweep(adapters, now=NOW)
    by_name = {d.machine.name: d for d in report.decisions}
    assert report.metric_calls == 1
    assert by_name["person"].signal == "busy" and by_name["person"].action is Action.NONE
    assert "a person was active at 14:53 UTC" in by_name["person"].reason
    assert by_name["none"].action is Action.WARN and by_name["none"].assessment.human_signal == "missing"
    assert (
        by_name["junk"].action is Action.WARN and "ignored 2 unusable human-activity values" in by_name["junk"].reason
    )

    code = cli.main(["status", "--json", "--now", NOW.isoformat()])
    rows = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert code == 0
    assert rows["person"]["human_signal"] == "person active 14:53 UTC"
    assert (
        rows["none"]["human_signal"]
        == rows["junk"]["human_signal"]
        == ("no collector (no activity data: judged on CPU/GPU alone)")
    )


def test_an_input_late_in_a_five_minute_period_is_never_placed_before_it_happened(aws):
    """The agent publishes one value a minute; the sweep reads their five-minute Minimum (a fifth of the
    datapoints). Timed at the period's start, a person typing at 14:49 would be placed at 14:45 (four minutes
    early: the machine looks idle sooner); timed at the period's end it is placed at 14:50, a minute late."""
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    box = local.launch("box", "m5.large", team="ml", launch_time=at(8))
    local.write_metrics(box, lambda _t: (1.0, None), at(12), NOW)
    minute = NOW - timedelta(minutes=15)  # 14:45
    # Last input 14:25 seen at 14:45-14:48, then typing at 14:49; nothing since (the collector stopped).
    put_minutes(
        box, [(minute + timedelta(minutes=i), 20.0 + i) for i in range(4)] + [(minute + timedelta(minutes=4), 0)]
    )
    report = run_sweep(Adapters.from_environment(notifier=LoggingNotifier(logger, delivers=True)), now=NOW)
    [decision] = report.decisions
    assert decision.assessment.human_last_input == minute + timedelta(minutes=5)
    assert "a person was active at 14:50 UTC" in decision.reason


def put_unreadable(instance_id: str, t: datetime, bits: float) -> None:
    aws.client("cloudwatch").put_metric_data(
        Namespace="CWAgent",
        MetricData=[
            {
                "MetricName": "idle_reaper_unreadable_sources",
                "Dimensions": [{"Name": "InstanceId", "Value": instance_id}],
                "Timestamp": t,
                "Value": bits,
            }
        ],
    )


def test_status_names_a_machine_whose_collector_cannot_read_a_source(aws, capsys):
    """The collector's second gauge (a bit per source it could not read) reaches `idle-reaper status`."""
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    ids = {name: local.launch(name, "m5.large", team="ml", launch_time=at(8)) for name in ("guarded", "fine", "none")}
    for name, bits in (("guarded", 2.0), ("fine", 0.0)):
        put_unreadable(ids[name], NOW - timedelta(minutes=3), bits)
    assert cli.main(["status", "--json", "--now", NOW.isoformat()]) == 0
    rows = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["guarded"]["collector_cannot_read"] == ["jupyter"]
    assert rows["fine"]["collector_cannot_read"] is None and rows["none"]["collector_cannot_read"] is None
    assert cli.main(["status", "--now", NOW.isoformat()]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if ids["guarded"] in line]
    assert "COLLECTOR CANNOT READ jupyter" in line
