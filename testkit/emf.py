"""Reading the CloudWatch embedded-metric-format documents a handler printed (Powertools Metrics), with the rules
CloudWatch applies to their dimensions: a dimension value that is not ASCII, blank, or longer than 1,024
characters is not a dimension CloudWatch keeps (it extracts the metric without it, or not at all: the series a
dashboard or alarm reads is missing). Reading such a document fails the test with CloudWatch's own words.
https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_Dimension.html"""

from __future__ import annotations

import json
from typing import Any

from testkit.aws_rules import dimension_problems


def emf_blobs(text: str) -> list[dict[str, Any]]:
    """EMF documents on stdout, with single values unwrapped from Powertools' lists."""
    blobs = []
    for line in text.splitlines():
        if line.startswith("{") and '"_aws"' in line:
            blob = json.loads(line)
            _check_dimensions(blob)
            blobs.append({k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in blob.items()})
    return blobs


def _check_dimensions(blob: dict[str, Any]) -> None:
    for directive in blob["_aws"]["CloudWatchMetrics"]:
        names = {name for dimension_set in directive.get("Dimensions", []) for name in dimension_set}
        dimensions = [{"Name": name, "Value": blob.get(name, "")} for name in sorted(names)]
        problems = dimension_problems(dimensions, "Dimensions")
        assert not problems, f"CloudWatch would refuse this EMF document's dimensions: {problems}: {blob}"
