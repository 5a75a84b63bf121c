"""AWS's documented limits in front of moto, for the tests: the rules live with the local world the demo runs
(tools/idle_reaper_tools/aws_rules.py: the installed `idle-reaper` command carries tools/, not testkit/), and
every integration test meets them through the `aws` fixture's moto server (tests/conftest.py)."""

from idle_reaper_tools.aws_rules import (
    BATCH_GET_MAX,
    BATCH_WRITE_MAX,
    EC2_THROTTLED,
    GET_METRIC_DATA_DPS,
    GET_METRIC_DATA_TPS,
    ITEM_MAX_BYTES,
    ITEM_TOO_LARGE,
    SSM_NO_DOWNGRADE,
    SSM_TIER_CHARS,
    SSM_TOO_LONG,
    AwsRules,
    Refusal,
    TokenBucket,
    attribute_size,
    dimension_problems,
    item_size,
    requested_datapoints,
)

__all__ = [
    "BATCH_GET_MAX",
    "BATCH_WRITE_MAX",
    "EC2_THROTTLED",
    "GET_METRIC_DATA_DPS",
    "GET_METRIC_DATA_TPS",
    "ITEM_MAX_BYTES",
    "ITEM_TOO_LARGE",
    "SSM_NO_DOWNGRADE",
    "SSM_TIER_CHARS",
    "SSM_TOO_LONG",
    "AwsRules",
    "Refusal",
    "TokenBucket",
    "attribute_size",
    "dimension_problems",
    "item_size",
    "requested_datapoints",
]
