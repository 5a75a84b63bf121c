"""The suite's time budget: a run fails when one test or one module takes longer than its limit, and names them.

`make test` is the gate every change passes, on two cores, in under four minutes (tests/README.md has where the
time goes). A test that grows past TEST_LIMIT_S, or a module past MODULE_LIMIT_S, fails the run here, so the
suite cannot drift back one slow test at a time.

- A test's time is its setup, call and teardown, less the set-up of fixtures it shares with other tests (module
  or session scope: the demo's run, a moto server, a Jupyter server): what one more such test would add.
- A module's time is everything its tests took, shared set-ups included.

Both are wall-clock seconds measured where the test ran (an xdist worker reports them to the controller, which
judges). The limits are several times what any test or module takes on a quiet two-core machine, so a loaded one
passes; a test that needs more belongs in benchmarks/."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

TEST_LIMIT_S = 20.0
MODULE_LIMIT_S = 60.0

_SHARED_SETUP = "budget_shared_setup_s"
_shared_key = pytest.StashKey[float]()
_current: list[pytest.Item] = []  # the item whose setup is running (this process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_shared_key] = 0.0
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Generator[None]:
    started = time.perf_counter()
    yield
    if fixturedef.scope != "function" and _current:
        item = _current[-1]
        item.stash[_shared_key] = item.stash.get(_shared_key, 0.0) + time.perf_counter() - started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "setup":
        report.user_properties.append((_SHARED_SETUP, item.stash.get(_shared_key, 0.0)))


class Budget:
    """Sums what the reports say, on the process that judges (xdist's controller, or the only one)."""

    def __init__(self) -> None:
        self.tests: dict[str, float] = defaultdict(float)
        self.modules: dict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        shared = sum(float(v) for k, v in report.user_properties if k == _SHARED_SETUP) if report.when == "setup" else 0
        self.tests[report.nodeid] += report.duration - shared
        self.modules[report.nodeid.split("::", 1)[0]] += report.duration

    def offenders(self) -> list[str]:
        slow_tests = sorted(((t, n) for n, t in self.tests.items() if t > TEST_LIMIT_S), reverse=True)
        slow_modules = sorted(((t, m) for m, t in self.modules.items() if t > MODULE_LIMIT_S), reverse=True)
        return [f"{t:6.1f} s  test    {n}  (limit {TEST_LIMIT_S:g} s)" for t, n in slow_tests] + [
            f"{t:6.1f} s  module  {m}  (limit {MODULE_LIMIT_S:g} s)" for t, m in slow_modules
        ]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.offenders() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        offenders = self.offenders()
        if offenders:
            terminalreporter.section("over the time budget (tests/budget.py)", red=True)
            for line in offenders:
                terminalreporter.line(line)
            terminalreporter.line("Make it cheaper (tests/README.md says how), or move fleet-scale work to benchmarks.")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # xdist's workers only measure; their controller judges
        config.pluginmanager.register(Budget(), "idle-reaper-budget")
