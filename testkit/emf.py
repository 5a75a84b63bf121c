"""Reading the CloudWatch embedded-metric-format documents a handler printed (Powertools Metrics)."""

from __future__ import annotations

import json
from typing import Any


def emf_blobs(text: str) -> list[dict[str, Any]]:
    """EMF documents on stdout, with single values unwrapped from Powertools' lists."""
    blobs = []
    for line in text.splitlines():
        if line.startswith("{") and '"_aws"' in line:
            blob = json.loads(line)
            blobs.append({k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in blob.items()})
    return blobs
