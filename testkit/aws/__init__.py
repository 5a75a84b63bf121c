"""In-memory fakes of the boto3 clients idle-reaper's adapters use, fast enough for 50,000 machines.

They answer like the real APIs where the adapters care: the same request and response shapes, the
documented per-call limits (raised as botocore ClientError with the real error codes), pagination
with NextToken, and the failure modes the sweep must survive. Every fake counts its calls per API
operation (`calls`, a Counter) and keeps the request arguments (`requests`) so tests can assert how
the adapters batched their work.

A fake raises what botocore would raise once its own retries are exhausted: an injected Throttling
error is "throttled even after the standard retry mode gave up".

    aws = FakeAws()
    aws.launch("g5.xlarge", team="ml", profile=steady(2.0, 90.0), launch_time=...)
    adapters = aws.adapters()           # the real PolicyStore, Fleet, MetricsReader over the fakes
    run_sweep(adapters, now=...)
    aws.calls()                         # Counter({"cloudwatch:GetMetricData": 2, ...})
"""

from testkit.aws.clients import (
    ACCOUNT,
    LATENCY,
    REGION,
    FakeClient,
    LatencyModel,
    RequestCpu,
    api,
    client_error,
)
from testkit.aws.fleet import (
    FakeAutoScaling,
    FakeEC2,
    FakeGroup,
    FakeInstance,
)
from testkit.aws.metrics import (
    DEFAULT_METRICS,
    FakeCloudWatch,
    Profile,
    quiet_after,
    steady,
)
from testkit.aws.policies import (
    FakeSSM,
)
from testkit.aws.state import (
    CountingStateStore,
)
from testkit.aws.world import (
    WRITE_OPERATIONS,
    FakeAws,
)

__all__ = [
    "ACCOUNT",
    "DEFAULT_METRICS",
    "LATENCY",
    "REGION",
    "WRITE_OPERATIONS",
    "CountingStateStore",
    "FakeAutoScaling",
    "FakeAws",
    "FakeClient",
    "FakeCloudWatch",
    "FakeEC2",
    "FakeGroup",
    "FakeInstance",
    "FakeSSM",
    "LatencyModel",
    "Profile",
    "RequestCpu",
    "api",
    "client_error",
    "quiet_after",
    "steady",
]
