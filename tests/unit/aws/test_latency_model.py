"""The benchmarks' latency model (testkit/aws/ LatencyModel): work in child processes is timed as CPU lanes,
one per vCPU, not as CPU spent one task after another."""

from __future__ import annotations

import pytest

from idle_reaper.aws.clients import run_in_processes
from testkit.aws import LatencyModel
from testkit.aws.clients import PROCESS_START_S


def listing(model: LatencyModel, vcpus: int, tasks: int) -> tuple[float, float]:
    """`tasks` zone listers, each one page: 1 s of latency and 0.5 s of botocore CPU. The parent's modelled
    time, and the CPU the lanes took on."""
    model.vcpus = vcpus
    model.install()
    try:
        run_in_processes(lambda _: model.charge_cpu("ec2:DescribeInstances", {}, {}) or model.charge("x"), range(tasks))
    finally:
        model.uninstall()
    return model.virtual, model.lanes_cpu_s


@pytest.mark.parametrize(("vcpus", "lanes"), [(3, 1), (2, 2), (1, 3)])
def test_processes_overlap_their_latency_and_cpu_up_to_the_vcpus(vcpus, lanes):
    model = LatencyModel(latency={"x": 1.0}, cpu=lambda *_: 0.5)
    virtual, in_lanes = listing(model, vcpus, tasks=3)
    # Each lane runs its tasks one after another: 1.5 s each (plus the start of a process and a little own CPU).
    assert (1.5 + PROCESS_START_S) * lanes <= virtual < (1.5 + PROCESS_START_S + 0.05) * lanes
    assert 1.5 <= in_lanes < 1.6  # the three tasks' botocore CPU (and their own), not to be counted again
    assert model.charged["x"] == 3 and model.cpu_s == pytest.approx(1.5)
