"""The sweep: one sweep (run.py), carrying out its decisions (delivery.py), quiet hours, the daily
region count, and a large fleet's fan-out (fanout.py). This package re-exports their public names.
"""

from idle_reaper.aws.metrics import metric_workers
from idle_reaper.notify import logger
from idle_reaper.sweep.adapters import (
    DEFERRED,
    Adapters,
    SweepCannotRun,
    SweepReport,
)
from idle_reaper.sweep.delivery import (
    CHANGED_SINCE_LISTED,
    FINISH_RESERVE,
    REFRESH_EVERY,
    WATCHED_REFRESH_SHARE,
    record_changed,
)
from idle_reaper.sweep.fanout import (
    FAILED_SHARDS_ALERT_AFTER,
    MANIFEST_TTL,
    MIN_SHARD_SIZE,
    OWNER_UNIT_MAX,
    PLANNER_MEMORY_MB,
    PLANNER_VCPUS,
    SHARD_SIZE,
    SHARDS_AT_ONCE,
    Gathered,
    GatherTask,
    Plan,
    ShardDone,
    ShardedReport,
    ShardTask,
    SweepTotals,
    gather_sweep,
    manifest_key,
    note_failed_shards,
    plan_sweep,
    result_key,
    run_shard,
    run_sharded,
    shard_count,
    split_into_shards,
)
from idle_reaper.sweep.quiet_hours import (
    QUIET_INDEX,
    QUIET_INDEX_ATTEMPTS,
    QUIET_INDEX_TTL,
    QuietStop,
    quiet_stops,
)
from idle_reaper.sweep.regions import (
    report_unwatched_regions,
)
from idle_reaper.sweep.run import (
    decision_row,
    run_sweep,
)

__all__ = [
    "CHANGED_SINCE_LISTED",
    "DEFERRED",
    "FAILED_SHARDS_ALERT_AFTER",
    "FINISH_RESERVE",
    "MANIFEST_TTL",
    "MIN_SHARD_SIZE",
    "OWNER_UNIT_MAX",
    "PLANNER_MEMORY_MB",
    "PLANNER_VCPUS",
    "QUIET_INDEX",
    "QUIET_INDEX_ATTEMPTS",
    "QUIET_INDEX_TTL",
    "REFRESH_EVERY",
    "SHARDS_AT_ONCE",
    "SHARD_SIZE",
    "WATCHED_REFRESH_SHARE",
    "Adapters",
    "GatherTask",
    "Gathered",
    "Plan",
    "QuietStop",
    "ShardDone",
    "ShardTask",
    "ShardedReport",
    "SweepCannotRun",
    "SweepReport",
    "SweepTotals",
    "decision_row",
    "gather_sweep",
    "logger",
    "manifest_key",
    "metric_workers",
    "note_failed_shards",
    "plan_sweep",
    "quiet_stops",
    "record_changed",
    "report_unwatched_regions",
    "result_key",
    "run_shard",
    "run_sharded",
    "run_sweep",
    "shard_count",
    "split_into_shards",
]
