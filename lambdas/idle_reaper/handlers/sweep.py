"""Scheduled Lambda: the sweep's planner. A fleet that fits one shard is swept right here; a larger one
is handed to the fan-out state machine (handlers/fanout.py runs its shards and gathers them). Wiring only."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext
from botocore.exceptions import ClientError

from idle_reaper.aws.accounts import MemberAccess
from idle_reaper.aws.clients import AwsError, client, error_code
from idle_reaper.aws.deploy import RELAY_ALARM_ENV
from idle_reaper.aws.limits import cloudwatch_dimension
from idle_reaper.aws.regions import current_region
from idle_reaper.core.reports import TeamTotals
from idle_reaper.notify import logger
from idle_reaper.sweep.adapters import Adapters, SweepCannotRun, SweepReport
from idle_reaper.sweep.delivery import FINISH_RESERVE
from idle_reaper.sweep.doctor import report_failing_relay
from idle_reaper.sweep.doctor_daily import claim_daily_doctor, daily_claim_key, run_daily_doctor
from idle_reaper.sweep.fanout import (
    SHARD_SIZE,
    Plan,
    SweepTotals,
    member_totals,
    note_member_sweep,
    plan_sweep,
    sum_totals,
)
from idle_reaper.sweep.members import check_member_accounts, sweep_member_accounts
from idle_reaper.sweep.notices import send_sweep_notices
from idle_reaper.sweep.regions import report_unwatched_regions
from idle_reaper.sweep.run import run_sweep

metrics = Metrics(namespace="IdleReaper", service="idle-reaper")
FANOUT_ENV = "IDLE_REAPER_FANOUT_ARN"  # the state machine that sweeps a fleet shard by shard


def _emit_counts(dimension: str, value: str, t: TeamTotals, *, all_counts: bool = True) -> None:
    """One EMF blob of counts under one dimension; `all_counts` False: the four an account is split by."""
    blob = EphemeralMetrics(namespace="IdleReaper")
    blob.add_dimension(dimension, cloudwatch_dimension(value))  # a team is a tag's value: any Unicode
    blob.add_metric("MachinesScanned", MetricUnit.Count, t.scanned)
    blob.add_metric("MachinesIdle", MetricUnit.Count, t.idle)
    if all_counts:
        blob.add_metric("WarningsSent", MetricUnit.Count, t.warned)
    blob.add_metric("MachinesReaped", MetricUnit.Count, t.reaped)
    if all_counts:
        blob.add_metric("MachinesProtected", MetricUnit.Count, t.protected)
    blob.add_metric("MachinesUnknown", MetricUnit.Count, t.unknown)
    if all_counts:
        blob.add_metric("Snoozes", MetricUnit.Count, t.snoozed)  # machines kept by someone now
        blob.add_metric("EstimatedHourlySavings", MetricUnit.NoUnit, round(t.hourly_savings, 4))
    blob.flush_metrics()


def emit_team_metrics(totals: SweepTotals) -> None:
    """One EMF blob per team, so dashboards can split every count by team."""
    for team, team_totals in sorted(totals.teams.items()):
        _emit_counts("team", team, team_totals)


def emit_account_metrics(totals: SweepTotals) -> None:
    """Organization mode: one EMF blob per account (the hub's own under its account id), the team metrics'
    names under an `account` dimension, so dashboards can split the organization by account."""
    for account, account_totals in sorted(totals.accounts.items()):
        _emit_counts("account", account, account_totals, all_counts=False)


def emit_sweep_metrics(metrics: Metrics, totals: SweepTotals, shards_failed: int = 0) -> None:
    """The metrics of one sweep, swept in place or gathered from its shards: the same names either way."""
    emit_team_metrics(totals)
    emit_account_metrics(totals)
    metrics.add_metric("SweepDurationMs", MetricUnit.Milliseconds, totals.duration_ms)
    metrics.add_metric("SweepErrors", MetricUnit.Count, totals.errors)
    # Machines the sweep ran out of time for (left untouched to the next sweep): the fleet outgrows a shard.
    metrics.add_metric("MachinesDeferred", MetricUnit.Count, totals.deferred)
    if totals.deferred:
        logger.warning("sweep ran short of time; machines left to the next sweep", extra={"machines": totals.deferred})
    # Every sweep, zero included, so the alarm sees a steady series.
    metrics.add_metric("ShardsFailed", MetricUnit.Count, shards_failed)
    # Every sweep, zero included, so an alarm on it sees a steady series (a team left in safe mode is loud).
    metrics.add_metric("TeamsInSafeMode", MetricUnit.Count, len(totals.teams_in_safe_mode))
    # Warnings nobody has received yet (Slack down, token revoked, undeliverable): their stops are held.
    metrics.add_metric("WarningsUndelivered", MetricUnit.Count, totals.undelivered)
    if totals.teams_in_safe_mode:
        logger.warning("teams in safe mode: nothing is stopped for them", extra={"teams": totals.teams_in_safe_mode})
    for warning in totals.warnings:
        logger.warning(warning)


UNWATCHED_COUNT_SECONDS = 60.0  # the daily count of regions without a stack runs only with this much time left


def count_unwatched_regions(adapters: Adapters, now: datetime, context: LambdaContext) -> None:
    """Once a day, from the first listed region, after the sweep is started or done (a side job: it never
    delays or fails the sweep): instances in regions no stack watches (see `status`). In organization mode the
    regions where the hub's account is swept as a member account are watched too."""
    if context.get_remaining_time_in_millis() / 1000 < UNWATCHED_COUNT_SECONDS:
        return  # tried again by the next sweep
    members = member_access()
    also = members.hub_member_regions() if members is not None else ()
    ec2_in = lambda region: client("ec2", region)  # noqa: E731
    for line in report_unwatched_regions(adapters, ec2_in, current_region(), now, also_watched=also):
        logger.warning(line)


def check_daily(
    adapters: Adapters, now: datetime, context: LambdaContext, report: SweepReport | None, plan: Plan
) -> None:
    """The doctor's daily subset, on the day's first sweep, after its work (sweep/doctor_daily.py: bounded,
    never raises), on what the sweep read."""
    read = report.read if report is not None else None
    run_daily_doctor(adapters, now, read, lambda: context.get_remaining_time_in_millis() / 1000, plan.listed)


def check_daily_fanned_out(adapters: Adapters, now: datetime, context: LambdaContext, plan: Plan) -> None:
    """The planner's part of the day's doctor it claimed before starting the execution: the checks of the
    machines it listed (the fleet is listed once), no metric read. The GPU check is the execution's: each
    machine shard reads its own GPU machines, the gather step tells it (sweep/doctor_daily.py)."""
    time_left = lambda: context.get_remaining_time_in_millis() / 1000  # noqa: E731
    run_daily_doctor(adapters, now, None, time_left, plan.listed, claimed=True, gpu=False)


def start_fanout(adapters: Adapters, state_machine: str, plan: Plan, now: datetime, context: LambdaContext) -> bool:
    """Start the fan-out's execution for the plan; True when it asks its shards for the day's doctor (the planner
    claimed the day first). Step Functions refuses a second execution of one name (ExecutionAlreadyExists, for 90
    days): the sweep is running already, and that is not a failure; the day's doctor is then left to the next
    sweep, as it is when the execution cannot be started."""
    doctor = claim_daily_doctor(adapters, now, lambda: context.get_remaining_time_in_millis() / 1000)
    started = False
    try:
        client("stepfunctions").start_execution(
            stateMachineArn=state_machine, name=plan.sweep_id, input=json.dumps(plan.execution_input(doctor=doctor))
        )
        started = True
    except ClientError as exc:
        if error_code(exc) != "ExecutionAlreadyExists":
            raise
        logger.info("the sweep's execution was started already", extra={"sweep_id": plan.sweep_id})
    finally:
        if doctor and not started:
            with contextlib.suppress(Exception):
                adapters.store.release_claim(daily_claim_key(now))
    return doctor and started


def check_alarm_relay(adapters: Adapters, now: datetime) -> None:
    """Whether the Slack relay of the alarms is failing (its own alarm cannot reach Slack through it): the admins
    hear it from the sweep (sweep/doctor.py report_failing_relay)."""
    alarm = os.environ.get(RELAY_ALARM_ENV)
    if alarm:
        report_failing_relay(adapters, lambda: client("cloudwatch"), alarm, now)


@functools.cache
def member_access() -> MemberAccess | None:
    """Organization mode's listing and credentials, kept while the Lambda process is warm (None: one account)."""
    return MemberAccess.from_environment("sweep")


def slack_budget(context: LambdaContext) -> float:
    """How long Slack's Retry-After may be waited out: the invocation's time, less what finishing it needs."""
    return max(5.0, context.get_remaining_time_in_millis() / 1000 - FINISH_RESERVE)


def check_members(
    adapters: Adapters, now: datetime, context: LambdaContext, *, sweep: str | None = None
) -> SweepTotals | None:
    """Organization mode, after the sweep is started or done: credentials in every member account and region,
    failures kept for `status` and told to the admins once a day per account (a side job, like the count).
    `sweep` (no state machine: a local run; the sweep's id): then each member (account, region) is swept right
    here, through the credentials the check holds, an owner's warnings sharing the message of the hub's own
    sweep, and its totals returned (the fan-out sweeps them in member shards)."""
    members = member_access()
    if members is None or context.get_remaining_time_in_millis() / 1000 < UNWATCHED_COUNT_SECONDS:
        return None
    for line in check_member_accounts(adapters, members, now):
        logger.info(line)
    if not sweep:
        return None
    time_left = lambda: context.get_remaining_time_in_millis() / 1000  # noqa: E731
    outcomes = sweep_member_accounts(adapters, members, now, time_left=time_left, message_scope=sweep)
    send_sweep_notices(adapters, now, time_left)  # the member units' stop notices (they queue, the hub tells)
    for outcome in outcomes:
        logger.info(outcome.describe())
    totals = member_totals(outcomes)
    if totals.units:
        note_member_sweep(adapters, totals.units, now)
    return totals


def scheduled_sweep_id(event: dict[str, Any]) -> str | None:
    """The sweep a scheduled event asks for, named after the schedule's time: EventBridge delivers an event at
    least once (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-rule-dlq.html), and a delivery
    again carries the same time, so it names the same sweep. None for any other event (an invocation by hand,
    `SweepFunctionName`: a sweep of its own)."""
    if event.get("detail-type") != "Scheduled Event" or not isinstance(event.get("time"), str):
        return None
    try:
        when = datetime.fromisoformat(event["time"].replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None
    return f"sweep-{when:%Y%m%dT%H%M%SZ}"


def started_once(adapters: Adapters, sweep_id: str, now: datetime) -> bool:
    """Claim the sweep (a conditional write): False when a delivery of the same event claimed it first."""
    return adapters.store.claim_once(f"sweep-started#{sweep_id}", now)


@logger.inject_lambda_context(log_event=False)
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    now = datetime.now(UTC)
    # A 429's Retry-After is waited out while the invocation has time for it, not a fixed minute.
    adapters = Adapters.from_environment(slack_budget_seconds=slack_budget(context))
    fanout = os.environ.get(FANOUT_ENV)
    sweep_id = scheduled_sweep_id(event)
    if sweep_id is not None and not started_once(adapters, sweep_id, now):
        logger.info(
            "this scheduled event was delivered again: its sweep is started already", extra={"sweep_id": sweep_id}
        )
        metrics.add_metric("SweepsDeliveredAgain", MetricUnit.Count, 1)
        return {"sweep_id": sweep_id, "duplicate": True}
    try:
        # Without the state machine (a local run), one invocation sweeps everything, time-aware.
        # Organization mode with the state machine: member (account, region) units are shards of their own.
        members = member_access() if fanout else None
        plan = plan_sweep(
            adapters,
            now=now,
            sweep_id=sweep_id,
            in_place=True,
            shard_size=SHARD_SIZE if fanout else sys.maxsize,
            members=members,
        )
        if fanout and not plan.in_place:
            # The execution is named after the sweep, and so after the schedule's time: a scheduled event
            # delivered twice is claimed once (above), and could not start a second execution of that name.
            doctor = start_fanout(adapters, fanout, plan, now, context)
            metrics.add_metric("SweepShards", MetricUnit.Count, plan.all_shards)
            logger.info(
                "sweep fanned out",
                extra={"shards": plan.all_shards, "machines": plan.machines, "member_units": plan.member_units},
            )
            count_unwatched_regions(adapters, now, context)
            if doctor:
                check_daily_fanned_out(adapters, now, context, plan)
            check_members(adapters, now, context)
            check_alarm_relay(adapters, now)
            return {"machines": plan.machines, "shards": plan.all_shards, "dry_run": plan.dry_run}
        hub = member_access()
        report = run_sweep(
            adapters,
            now=now,
            sweep_id=plan.sweep_id,
            listed=plan.listed,
            time_left=lambda: context.get_remaining_time_in_millis() / 1000,
            message_scope=plan.sweep_id if hub is not None else None,  # shared with the member accounts'
        )
        count_unwatched_regions(adapters, now, context)
        check_daily(adapters, now, context, report, plan)
        in_members = check_members(adapters, now, context, sweep=plan.sweep_id)
        check_alarm_relay(adapters, now)
    except SweepCannotRun as exc:
        metrics.add_metric("SweepErrors", MetricUnit.Count, 1)
        logger.error("sweep could not run", extra={"error": str(exc)})
        if sweep_id is not None:  # a delivery again may try it (nothing was changed)
            with contextlib.suppress(*AwsError):
                adapters.store.release_claim(f"sweep-started#{sweep_id}")
        raise  # a failed invocation is alarmed (and sent to the dead-letter destination)
    totals = SweepTotals.of(report, hub.config.hub_account if hub is not None else None)
    if in_members is not None:
        totals = SweepTotals(**sum_totals([totals, in_members]))
    emit_sweep_metrics(metrics, totals)
    return {"machines": totals.machines, "errors": totals.errors, "dry_run": totals.dry_run}
