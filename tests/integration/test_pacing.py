"""The product's pacing against AWS's rates, as the rules in front of moto keep them (aws_rules.py): a paced call
never finds AWS's bucket empty. The pacers and the rules read one virtual clock here, so a wait costs no real time;
unpaced, the same calls are throttled until botocore's retries run out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper import aws as adapters
from idle_reaper.policy import MetricSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def virtual_clock(aws: Any, virtual_pacing: list[float]) -> list[float]:
    """One clock for the product's pacers and AWS's buckets: a pacer's wait moves it, nothing sleeps."""
    aws.rules.clock = lambda: virtual_pacing[0]
    return virtual_pacing


def test_metric_reads_keep_to_getmetricdata_datapoints_a_second(aws, virtual_clock):
    """Issue 43 (3): GetMetricData allows 180,000 datapoints a second besides its 50 calls. 3,000 machines' CPU
    (22 five-minute points) and activity (110 one-minute points) over 110 minutes ask for 396,000: read on 20
    threads at once, unpaced, most calls were throttled past their retries and their machines left unknown.
    Paced, every call waits for its datapoints and every machine is read."""
    ids = [f"i-{n:017x}" for n in range(3000)]
    end = datetime.now(UTC).replace(second=0, microsecond=0)
    reader = adapters.MetricsReader(adapters.client("cloudwatch"))
    found = reader.fetch(ids, MetricSettings(), start=end - timedelta(minutes=110), end=end, gpu=False)
    assert aws.rules.throttles("GetMetricData") == 0
    assert all(s.complete for s in found.values()) and reader.stats.failed_calls == 0
    assert virtual_clock[0] - 1000.0 >= (396_000 - 180_000) / 180_000 - 1e-3, "it waited for the datapoints"
