"""Shared fixtures. Integration tests talk to moto in server mode on 127.0.0.1 through AWS_ENDPOINT_URL."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# The suite's time budget (tests/budget.py): a test or module over its limit fails the run. pytester: the budget's
# own tests run small suites with it.
pytest_plugins = ["budget", "pytester"]


def pytest_configure(config: pytest.Config) -> None:
    # Here, not in pyproject.toml, whose bytes are part of the Lambda layers' asset hash (infra/bundling.py).
    config.addinivalue_line(
        "markers", "wall_clock: a unit test whose pacers wait on the real clock (tests/unit/conftest.py)"
    )


# Never reach a real AWS account from the tests, whatever the machine's environment holds.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ["POWERTOOLS_METRICS_NAMESPACE"] = "IdleReaper"
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")


@pytest.fixture(autouse=True)
def _no_metrics_left_over() -> Iterator[None]:
    """Powertools' Metrics instances share one buffer in a process: a metric a test added without a handler's flush
    was printed by the next handler's flush in the same pytest worker, into another test's output."""
    yield
    handler = sys.modules.get("idle_reaper.handlers.sweep")
    if handler is not None:
        handler.metrics.clear_metrics()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[object]:
    from idle_reaper_tools import local

    local.quiet_server_logs()
    with local.local_aws() as server:
        yield server


@pytest.fixture
def aws(moto_server: object) -> Iterator[object]:
    """A clean emulated account for each test. The Slack handler keeps its boto3 clients for a container's life:
    they are dropped before and after, so a test's are made against its own account (and any answers it puts in
    front of moto, which a client copies from the session when it is made)."""
    from idle_reaper.handlers import slack as slack_handler

    moto_server.reset()  # type: ignore[attr-defined]
    slack_handler.reset_clients()
    yield moto_server
    slack_handler.reset_clients()


@pytest.fixture(scope="session")
def slack_server() -> Iterator[object]:
    from idle_reaper_tools.fake_slack import fake_slack, slack_environment

    with fake_slack() as fake, slack_environment(fake):
        yield fake


@pytest.fixture
def slack(slack_server: object) -> Iterator[object]:
    """The local Slack Web API fake, emptied for each test; SLACK_* point at it."""
    slack_server.reset()  # type: ignore[attr-defined]
    yield slack_server


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The Slack handler's clock, set by the test (`clock["t"] = ...`); it starts at the demo's 14:00."""
    from idle_reaper.handlers import slack as slack_handler
    from idle_reaper_tools.demo import at

    now: dict[str, object] = {"t": at(14)}
    monkeypatch.setattr(slack_handler, "clock", lambda: now["t"])
    return now


@pytest.fixture
def virtual_pacing() -> Iterator[list[float]]:
    """The product's pacers (aws/limits.py Pacing) on a clock of the test's: a wait moves it, nothing sleeps.
    `virtual_pacing[0]` is the time; what a test waited is how far it moved. Threads that wait at once wait side
    by side, as real threads do (testkit/virtual_clock.py says how)."""
    from testkit.virtual_clock import virtual_pacing as on_a_virtual_clock

    with on_a_virtual_clock() as now:
        yield now
