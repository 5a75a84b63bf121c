"""The fan-out state machine's Lambdas: a shard worker per Map iteration, and the gather step that makes
one summary, one set of metrics and one savings figure of the shards. Wiring only (see sweep.py)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from idle_reaper.handlers.sweep import emit_sweep_metrics, member_access, slack_budget
from idle_reaper.notify import logger
from idle_reaper.sweep.adapters import Adapters
from idle_reaper.sweep.fanout import GatherTask, ShardTask, gather_sweep, run_shard

metrics = Metrics(namespace="IdleReaper", service="idle-reaper")


@logger.inject_lambda_context(log_event=False)
def shard_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    """Sweep one shard; a failure raises, and the Map records it for the gather step."""
    task = ShardTask.model_validate(event)  # a malformed event changes nothing
    logger.append_keys(sweep_id=task.sweep_id, shard=task.shard)
    _, totals = run_shard(
        Adapters.from_environment(slack_budget_seconds=slack_budget(context)),
        task,
        time_left=lambda: context.get_remaining_time_in_millis() / 1000,
        members=member_access(),  # organization mode: member units' credentials, kept while warm
    )
    return {"shard": task.shard, "machines": totals.machines, "errors": totals.errors}


@logger.inject_lambda_context(log_event=False)
@metrics.log_metrics
def gather_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    """Sum the shards' results, emit the sweep's metrics, count (and alert on) failed shards."""
    task = GatherTask.model_validate(event)
    gathered = gather_sweep(
        Adapters.from_environment(slack_budget_seconds=slack_budget(context)),
        task,
        time_left=lambda: context.get_remaining_time_in_millis() / 1000,
    )
    emit_sweep_metrics(metrics, gathered, shards_failed=len(gathered.failed))
    metrics.add_metric("SweepShards", MetricUnit.Count, gathered.shards)
    return {
        "sweep_id": gathered.sweep_id,
        "machines": gathered.machines,
        "errors": gathered.errors,
        "shards": gathered.shards,
        "shards_failed": sorted(gathered.failed),
        "machines_unswept": gathered.unswept,  # the failed shards' machines: unknown this sweep
        "hourly_savings": round(gathered.hourly_savings, 2),
        "dry_run": gathered.dry_run,
    }
