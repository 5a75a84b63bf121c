"""Fixtures the doctor's test modules share: the stack deployed in moto, with AWS's real answers in front."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_doctor import healthy  # noqa: F401 (a healthy deploy, for test_doctor_deploy.py too)

from testkit.deploy_answers import DeployAnswers, deploy_stack, real_deploy_answers


@pytest.fixture
def real_answers(aws: Any) -> Iterator[DeployAnswers]:
    """AWS's real answers where moto has none (testkit/deploy_answers.py), us-east-1 enabled. The answers sit
    on the session, which a client copies when it is made: the Slack handler's clients are made afresh in each
    test (the `aws` fixture drops its kept ones), so they have the answers in front of moto too."""
    with real_deploy_answers() as answers:
        yield answers


@pytest.fixture
def deployed(real_answers: DeployAnswers) -> DeployAnswers:
    """The stack in moto as a healthy deploy leaves it."""
    deploy_stack(real_answers)
    return real_answers


@pytest.fixture
def aws_on_a_virtual_clock(aws: Any, virtual_pacing: list[float]) -> list[float]:
    """One clock for the product's pacers and AWS's buckets in front of moto (aws_rules.py), as test_pacing.py
    has it: every wait is computed and every bucket kept as on the wall clock, but a wait moves the clock instead
    of sleeping. The next test's `aws` puts the buckets back on the wall clock."""
    aws.rules.clock = lambda: virtual_pacing[0]
    return virtual_pacing
