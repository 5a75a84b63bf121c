"""The client-side buckets (aws/limits.py Pace) the product waits on, on the test's virtual clock: shared out between
workers that call under one AWS quota at once, they keep to it together."""

from __future__ import annotations

import threading
import time

import pytest

from idle_reaper.aws import Fleet
from idle_reaper.aws.limits import EC2_DESCRIBE_QUOTA, Pace, Quota
from testkit.aws import FakeAws


def test_paces_handed_out_to_child_processes_share_what_is_left_and_leave_it_spent(virtual_pacing: list[float]):
    """The planner lists in forked children, each with its copy of the pace: each gets its share of the quota and
    of the tokens left, and the parent counts the bucket spent after them."""
    pace = Pace(Quota(100, 20))
    pace.take(40)
    with pace.handed_out(4) as parts:
        assert [p.quota for p in parts] == [Quota(25, 5)] * 4
        for p in parts:
            p.take(15)  # the 60 left, 15 each: no wait
        assert virtual_pacing[0] == 1000.0
        parts[0].take(5)  # its share spent: 5 tokens at 5 a second
        assert virtual_pacing[0] == pytest.approx(1001.0)
    pace.take(1)  # spent: one token of the refill, 1/20 s
    assert virtual_pacing[0] == pytest.approx(1001.05)


def test_a_fleet_shared_by_shards_paces_its_describes_on_its_share(virtual_pacing: list[float]):
    fleet = Fleet(FakeAws().ec2, None)
    assert fleet.describe_pace.quota == EC2_DESCRIBE_QUOTA == Quota(100, 20)
    shared = fleet.shared_by(30, after_listing=True)
    assert type(shared) is Fleet and shared.ec2 is fleet.ec2 and fleet.describe_pace.quota == EC2_DESCRIBE_QUOTA
    assert shared.describe_pace.quota == Quota(100 / 30, 20 / 30)
    shared.describe_pace.take()  # after the planner's listing: none of the burst counted on, one token's refill
    assert virtual_pacing[0] == pytest.approx(1000 + 30 / 20)


@pytest.mark.wall_clock
def test_a_pace_shared_by_threads_keeps_its_rate_on_the_wall_clock():
    """Eight threads taking from one Pace (the metric reader's threads share one): on the real clock, what they
    took by any time is never more than the burst and the refill since the start, and no tighter window holds more
    than its share (a little room for the threads' scheduling). A pace that lost a take between threads (a
    refill counted twice, a read outside the lock) lets them through faster."""
    pace, granted, lock = Pace(Quota(5.0, 50.0)), [], threading.Lock()

    def worker() -> None:
        for _ in range(10):
            pace.take()
            with lock:
                granted.append(time.monotonic())

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 80
    assert granted[-1] - start >= (80 - 5) / 50 - 0.01, "80 takes need 1.5 s of refill after the burst of 5"
    granted.sort()
    worst = max(sum(1 for t in granted if g <= t < g + 0.2) for g in granted)
    assert worst <= 5 + 50 * 0.2 + 3, worst
