"""benchmarks/sweep_latency.py: the schedule's minutes pass between the modelled sweeps, so the EC2 buckets the
product paces its stops to refill between them as AWS's do. Before, the model's clock moved only by each sweep's
own modelled seconds: at 10,000 machines the reaping's 519 hibernations, held back for EC2's StopInstances rate
(RateHeld, left to the next sweep), were held back at every later sweep too, and read again at each (the bill's
steady hour: 5,837 metrics a sweep, not 4,778)."""

from __future__ import annotations

from datetime import timedelta

from benchmarks import sweep_latency
from idle_reaper.aws import fleet
from idle_reaper.aws.limits import EC2_STOP_CALLS, Quota

SWEEPS = (*sweep_latency.SWEEPS, *(sweep_latency.T0 + timedelta(minutes=m) for m in (35, 40)))


def test_stops_held_back_for_ec2s_rate_are_sent_by_the_next_sweeps(monkeypatch):
    # 200 machines: the reaping (+30 min) stops 20 and hibernates 8. EC2's instance bucket scaled down to 30 at
    # once and 0.2 a second (a full bucket in the schedule's 5 minutes, a few instances within a sweep, as EC2's
    # 1,000 and 20 a second are to 10,000 machines): the stops take most of it, the hibernations are held back.
    unpaced = sweep_latency.run_size(200, 7, sleep=False, sweeps=SWEEPS)
    monkeypatch.setattr(fleet, "EC2_STOP_QUOTAS", (Quota(*EC2_STOP_CALLS), Quota(30.0, 0.2)))
    paced = sweep_latency.run_size(200, 7, sleep=False, sweeps=SWEEPS)

    assert paced[2].calls["ec2:StopInstances"] < unpaced[2].calls["ec2:StopInstances"]  # some held back
    assert paced[3].calls["ec2:StopInstances"] > 0  # before: none, the bucket as the reaping left it
    # By +40 min the same machines run and are read as when nothing was held back (before: 97 metrics, not 79).
    assert paced[4].metrics_requested == unpaced[4].metrics_requested
    assert paced[4].calls["ec2:StopInstances"] == 0


def test_the_organization_benchmark_sweeps_every_member_unit():
    # Its fleet is EC2 alone; with SageMaker endpoints swept by default its members had no SageMaker client and
    # every unit failed ('NoneType' has no get_paginator): the benchmark printed MISSED with nothing measured.
    from benchmarks import organization_sweep

    runs = organization_sweep.run_organization(
        2, organization_sweep.REGIONS[:1], 3, seed=7, cpu=None, clients=dict.fromkeys(organization_sweep.CLIENTS, 0.0)
    )
    assert [(r.units_swept, r.units_failed) for r in runs] == [(2, 0), (2, 0)]
    assert [r.machines for r in runs] == [6, 6]
