"""The suite's time budget (tests/budget.py) fails a run that passes a limit, names the offenders, and charges a
shared set-up to the module, not to the test that happened to run first."""

from __future__ import annotations

import budget
import pytest

SUITE = """
import time
import pytest

@pytest.fixture(scope="module")
def shared():
    time.sleep(0.3)  # a module's shared set-up: the first test's setup pays it

def test_quick(shared):
    pass

def test_quick_too(shared):
    pass

def test_slow():
    time.sleep(0.2)
"""


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "TEST_LIMIT_S", 0.15)
    monkeypatch.setattr(budget, "MODULE_LIMIT_S", 5.0)


def test_a_test_over_its_limit_fails_the_run_and_is_named(pytester: pytest.Pytester, limits: None) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "budget")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3)  # every test passed: the budget alone fails the run
    result.stdout.fnmatch_lines(["*over the time budget*", "*test    test_suite.py::test_slow*(limit 0.15 s)"])
    # The module fixture's 0.3 s is the module's, not test_quick's: it is not named.
    assert "test_suite.py::test_quick " not in result.stdout.str()


def test_a_module_over_its_limit_fails_the_run(
    pytester: pytest.Pytester, limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budget, "TEST_LIMIT_S", 5.0)
    monkeypatch.setattr(budget, "MODULE_LIMIT_S", 0.4)  # 0.3 shared + 0.2 slow
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "budget")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*module  test_suite.py*"])


def test_a_run_within_its_limits_passes(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "TEST_LIMIT_S", 5.0)
    monkeypatch.setattr(budget, "MODULE_LIMIT_S", 5.0)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "budget")
    assert result.ret == pytest.ExitCode.OK
    assert "over the time budget" not in result.stdout.str()
