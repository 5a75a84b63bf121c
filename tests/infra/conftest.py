"""Infra tests import the CDK app (`infra`, at the repository root) and start jsii."""

from __future__ import annotations

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


# `make test` synthesizes the app with the infra tests' context (the Makefile's TEST_SYNTH_CONTEXT) just before
# pytest and names its output here: the tests read that synth instead of making their own.
MADE_SYNTH = "IDLE_REAPER_TEST_SYNTH"


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """Two regions and an alarm email; everything else at its default."""
    made = os.environ.get(MADE_SYNTH)
    if made:
        from synthesis import made_synth  # reads files: no jsii

        return made_synth(Path(made))
    from synthesis import ALARM_EMAIL, REGIONS, shared_synth  # starts jsii: only when a test needs it

    return shared_synth(tmp_path_factory, "infra", regions=list(REGIONS), alarmEmail=ALARM_EMAIL)
