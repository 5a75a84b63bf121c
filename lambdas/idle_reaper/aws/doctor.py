"""The doctor's AWS facts (core/doctor.py decides on them): policies as the sweep loads them, the last hour of
metrics in the sweep's own GetMetricData batches, and the opt-in tags of Auto Scaling groups. Read-only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from idle_reaper.aws.clients import AwsError
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore, policy_for
from idle_reaper.core.doctor import SIGNAL_WINDOW_MINUTES, MachineSignals, PolicyFacts
from idle_reaper.core.signals import Machine, Signals, has_no_gpu, is_gpu_type
from idle_reaper.policy import PolicyError, Settings, TeamPolicyRef

GROUP_FILTER_VALUES = 1000  # DescribeTags: at most 1000 values per filter type; 100 tags a page


def gather_policy(store: PolicyStore) -> tuple[Settings, PolicyFacts, dict[str, TeamPolicyRef]]:
    """The settings (the default when invalid: their problems are the finding) and every team's policy."""
    try:
        settings, _ = store.load_settings()
        problems: tuple[str, ...] = ()
    except PolicyError as exc:
        settings, problems = Settings(), tuple(exc.problems)
    refs = store.load_teams(settings)
    facts = PolicyFacts(
        settings_parameter=store.settings_name, settings_problems=problems, teams=refs, machine_teams=None
    )
    return settings, facts, refs


def gather_signals(
    metrics: MetricsReader,
    machines: Sequence[Machine],
    settings: Settings,
    refs: Mapping[str, TeamPolicyRef],
    now: datetime,
    *,
    read: Mapping[str, Signals] | None = None,
    gpu_only: bool = False,
) -> list[MachineSignals]:
    """The last hour of every opted-in machine's CPU, GPU (types that can have one) and collector metrics, in
    the sweep's own GetMetricData batches (500 queries a call). `read`: what a sweep has just read, not read
    again. `gpu_only`: only the GPU types, their CPU and GPU alone (the sweep's daily check)."""
    read = read or {}
    if gpu_only:
        machines = [m for m in machines if is_gpu_type(m.instance_type, settings.gpu_instance_families)]
    start = now - timedelta(minutes=SIGNAL_WINDOW_MINUTES)
    can_have_gpu = {m.instance_id for m in machines if not has_no_gpu(m.instance_type, settings.gpu_instance_families)}
    fetched: dict[str, Signals] = dict(read)
    for gpu in (True, False):
        ids = [m.instance_id for m in machines if (m.instance_id in can_have_gpu) == gpu and m.instance_id not in read]
        if ids:
            fetched.update(metrics.fetch(ids, settings.metrics, start=start, end=now, human=not gpu_only, gpu=gpu))
    out: list[MachineSignals] = []
    for m in machines:
        policy = policy_for(m.team, refs, settings).policy or settings.default_policy
        signals = fetched.get(m.instance_id, Signals(complete=False))
        out.append(
            MachineSignals(
                instance_id=m.instance_id,
                team=m.team,
                gpu_expected=m.instance_id in can_have_gpu
                and is_gpu_type(m.instance_type, settings.gpu_instance_families),
                collector_expected=policy.human_active_minutes is not None,
                max_gap_minutes=policy.max_gap_minutes,
                complete=signals.complete,
                cpu=[t for t, _ in signals.cpu],
                gpu=len(signals.gpu),
                user=len(signals.user),
            )
        )
    return out


def gather_group_tags(autoscaling: Any, groups: set[str], tag: str) -> set[str] | None:
    """The groups (of `groups`) whose opt-in tag is `true`; None when they could not be read."""
    tagged: set[str] = set()
    names = sorted(groups)
    try:
        for i in range(0, len(names), GROUP_FILTER_VALUES):
            filters = [
                {"Name": "auto-scaling-group", "Values": names[i : i + GROUP_FILTER_VALUES]},
                {"Name": "key", "Values": [tag]},
            ]
            for page in autoscaling.get_paginator("describe_tags").paginate(
                Filters=filters, PaginationConfig={"PageSize": 100}
            ):
                tagged |= {t["ResourceId"] for t in page["Tags"] if str(t.get("Value", "")).lower() == "true"}
    except AwsError:
        return None
    return tagged
