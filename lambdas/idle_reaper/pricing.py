"""On-demand hourly prices (USD, Linux, us-east-1) used to estimate savings. Estimates only: a price
table file can replace them (JSON object of instance type to hourly price)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PRICES: dict[str, float] = {
    "t3.medium": 0.0416,
    "t3.large": 0.0832,
    "t3.xlarge": 0.1664,
    "m5.large": 0.096,
    "m5.xlarge": 0.192,
    "m5.2xlarge": 0.384,
    "m5.4xlarge": 0.768,
    "m6i.large": 0.096,
    "m6i.xlarge": 0.192,
    "m6i.2xlarge": 0.384,
    "m7i.xlarge": 0.2016,
    "c5.xlarge": 0.17,
    "c5.2xlarge": 0.34,
    "c5.4xlarge": 0.68,
    "c6i.4xlarge": 0.68,
    "r5.xlarge": 0.252,
    "r5.2xlarge": 0.504,
    "r6i.2xlarge": 0.504,
    "g4dn.xlarge": 0.526,
    "g4dn.2xlarge": 0.752,
    "g4dn.12xlarge": 3.912,
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g5.4xlarge": 1.624,
    "g5.12xlarge": 5.672,
    "g5.48xlarge": 16.288,
    "g6.xlarge": 0.805,
    "g6.2xlarge": 0.978,
    "g6.12xlarge": 4.602,
    "g6e.xlarge": 1.861,
    "p3.2xlarge": 3.06,
    "p3.8xlarge": 12.24,
    "p3.16xlarge": 24.48,
    "p4d.24xlarge": 32.7726,
    "p5.48xlarge": 98.32,
    # SageMaker notebook instances (on-demand, us-east-1): SageMaker's own prices, above EC2's for the hardware.
    "ml.t3.medium": 0.05,
    "ml.t3.large": 0.1,
    "ml.t3.xlarge": 0.2,
    "ml.t3.2xlarge": 0.399,
    "ml.m5.xlarge": 0.23,
    "ml.m5.2xlarge": 0.461,
    "ml.m5.4xlarge": 0.922,
    "ml.c5.xlarge": 0.204,
    "ml.c5.2xlarge": 0.408,
    "ml.r5.xlarge": 0.302,
    "ml.g4dn.xlarge": 0.7364,
    "ml.g4dn.2xlarge": 1.0528,
    "ml.g5.xlarge": 1.408,
    "ml.g5.2xlarge": 1.515,
    "ml.g5.4xlarge": 2.03,
    "ml.g5.12xlarge": 7.09,
    "ml.p3.2xlarge": 3.825,
    "ml.p3.8xlarge": 14.688,
    "ml.p3.16xlarge": 28.152,
    "ml.p2.xlarge": 1.125,
    # SageMaker real-time endpoints are priced from the same ml.* rows (estimates, like every price here: an
    # ml.g5.2xlarge endpoint at $1.515 an hour is about $255 a week); two more of their usual small types.
    "ml.m5.large": 0.115,
    "ml.c5.large": 0.102,
}


def hourly_price(instance_type: str, prices: Mapping[str, float] = DEFAULT_PRICES) -> float | None:
    """The type's price an hour; for a SageMaker endpoint's hardware ("ml.g5.2xlarge x2 + ml.m5.large",
    core/endpoints.EndpointFacts.hardware) each variant's type times its count, added (a serverless variant bills
    per request: nothing an hour). None when any part's price is unknown."""
    if " x" not in instance_type and " + " not in instance_type and instance_type != "serverless":
        return prices.get(instance_type)
    total = 0.0
    for part in instance_type.split(" + "):
        kind, _, count = part.partition(" x")
        if kind == "serverless":
            continue
        price = prices.get(kind)
        if price is None or (count and not count.isdigit()):
            return None
        total += price * (int(count) if count else 1)
    return total


def load_price_table(path: str | Path) -> dict[str, float]:
    """Raises ValueError with a clear message for a missing or malformed file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"price table {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"price table {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
        for k, v in data.items()
    ):
        raise ValueError(f"price table {path}: expected an object of instance type to a non-negative price")
    return {k: float(v) for k, v in data.items()}
