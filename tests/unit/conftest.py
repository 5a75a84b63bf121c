"""The unit tests' pacers run on a virtual clock (the suite's `virtual_pacing`): the in-memory fakes (testkit/aws)
keep no time, so a pacer's real wait there proves nothing a virtual one does not, and cost the unit tests about a
minute of waiting a run (the Organizations pace of 5 calls a second alone, once per member sweep). A pacer still
computes every wait and every `within` refusal as on the wall clock; the clock moves by exactly the waits, so a
test can read them (`virtual_pacing[0]`). A test about the wall clock itself is marked `wall_clock` and waits for
real."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _pacers_on_a_virtual_clock(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("wall_clock") is None:
        request.getfixturevalue("virtual_pacing")  # the test's own, when it asks for it too
