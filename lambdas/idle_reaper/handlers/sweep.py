"""Scheduled Lambda: one sweep. Wiring only."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from idle_reaper.core import State
from idle_reaper.sweep import Adapters, SweepCannotRun, SweepReport, logger, run_sweep

metrics = Metrics(namespace="IdleReaper", service="idle-reaper")


def emit_team_metrics(report: SweepReport) -> None:
    """One EMF blob per team, so dashboards can split every count by team."""
    for team, totals in sorted(report.summary.teams.items()):
        team_metrics = EphemeralMetrics(namespace="IdleReaper")
        team_metrics.add_dimension("team", team)
        team_metrics.add_metric("MachinesScanned", MetricUnit.Count, totals.scanned)
        team_metrics.add_metric("MachinesIdle", MetricUnit.Count, totals.idle)
        team_metrics.add_metric("WarningsSent", MetricUnit.Count, totals.warned)
        team_metrics.add_metric("MachinesReaped", MetricUnit.Count, totals.reaped)
        team_metrics.add_metric("MachinesProtected", MetricUnit.Count, totals.protected)
        team_metrics.add_metric("MachinesUnknown", MetricUnit.Count, totals.unknown)
        team_metrics.add_metric("Snoozes", MetricUnit.Count, totals.snoozed)  # machines kept by someone now
        team_metrics.add_metric("EstimatedHourlySavings", MetricUnit.NoUnit, round(totals.hourly_savings, 4))
        team_metrics.flush_metrics()


@logger.inject_lambda_context(log_event=False)
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    now = datetime.now(UTC)
    try:
        report = run_sweep(
            Adapters.from_environment(), now=now, time_left=lambda: context.get_remaining_time_in_millis() / 1000
        )
    except SweepCannotRun as exc:
        metrics.add_metric("SweepErrors", MetricUnit.Count, 1)
        logger.error("sweep could not run", extra={"error": str(exc)})
        raise  # a failed invocation is alarmed (and sent to the dead-letter destination)
    emit_team_metrics(report)
    metrics.add_metric("SweepDurationMs", MetricUnit.Milliseconds, report.duration_ms)
    metrics.add_metric("SweepErrors", MetricUnit.Count, len(report.errors))
    # Machines the sweep ran out of time for (left untouched to the next sweep): the fleet outgrows one sweep.
    metrics.add_metric("MachinesDeferred", MetricUnit.Count, len(report.deferred))
    if report.deferred:
        logger.warning(
            "sweep ran short of time; machines left to the next sweep", extra={"machines": len(report.deferred)}
        )
    # Every sweep, zero included, so an alarm on it sees a steady series (a team left in safe mode is loud).
    metrics.add_metric("TeamsInSafeMode", MetricUnit.Count, len(report.teams_in_safe_mode))
    # Warnings nobody has received yet (Slack down, token revoked, undeliverable): their stops are held.
    undelivered = [d for d in report.decisions if d.state is State.WARNED and d.record.warning_delivered_at is None]
    metrics.add_metric("WarningsUndelivered", MetricUnit.Count, len(undelivered))
    if report.teams_in_safe_mode:
        logger.warning("teams in safe mode: nothing is stopped for them", extra={"teams": report.teams_in_safe_mode})
    for warning in report.warnings:
        logger.warning(warning)
    return {"machines": len(report.decisions), "errors": len(report.errors), "dry_run": report.dry_run}
