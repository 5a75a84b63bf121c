"""Infra tests import the CDK app (`infra`, at the repository root) and start jsii."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from synthesis import Synth

REPO_ROOT = Path(__file__).resolve().parents[2]
# The CDK app (`infra`) and this directory's helpers (synthesis, iam_policy).
for path in (REPO_ROOT, Path(__file__).parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# jsii starts node when aws_cdk is first imported; keep its end-of-life banner out of test output.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """Two regions and an alarm email; everything else at its default.

    Under pytest-xdist every worker has its own session: the first one synthesizes, under a lock,
    into a directory all workers of this run share, and the others read what it wrote."""
    from synthesis import ALARM_EMAIL, REGIONS, Synth, synthesize  # starts jsii: only when a test needs it

    context = {"regions": list(REGIONS), "alarmEmail": ALARM_EMAIL}
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return synthesize(tmp_path_factory.mktemp("cdk.out"), **context)
    run_dir = tmp_path_factory.getbasetemp().parent  # pytest-N/, shared by this run's workers
    outdir, done = run_dir / "infra-cdk.out", run_dir / "infra-cdk.out.stacks.json"
    with open(run_dir / "infra-cdk.out.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(synthesize(outdir, **context).stack_names))
    return Synth(outdir=outdir, stack_names=tuple(json.loads(done.read_text())))
