"""What the trace itself says per bucket (busy, quiet, unknown) and what a clairvoyant reaper would save:
the yardsticks every replay is scored against."""

from __future__ import annotations

import math
from array import array

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import Series, classify, ideal_buckets
from idle_reaper_tools.replay.truth import Truth

N = math.nan
PERIOD = 300
FAMILIES = ("g5", "p4d")


def series(
    cpu: list[float], gpu: list[float] | None = None, network: list[float] | None = None, itype: str = ""
) -> Series:
    blank = [N] * len(cpu)
    return Series("i-1", "ml", itype, 0, array("d", cpu), array("d", gpu or blank), array("d", network or blank))


def test_a_hole_is_quiet_for_max_gap_then_unknown_and_never_busy() -> None:
    # max gap 15 min = 3 buckets: of a 5-bucket hole after quiet samples, the first 3 count as covered
    # (the lag the core accepts), the last 2 are unknown. NaN is never at or above a threshold.
    truth = classify(series([1, 1, N, N, N, N, N, 1, 9]), TeamPolicy(), PERIOD, FAMILIES)
    assert list(truth.quiet) == [1, 1, 1, 1, 1, 0, 0, 1, 0]
    assert list(truth.busy) == [0, 0, 0, 0, 0, 0, 0, 0, 1]


def test_gpu_activity_is_busy_and_a_late_gpu_track_is_covered_only_max_gap_back() -> None:
    # CPU quiet throughout. GPU reports from bucket 5: the 3 buckets before its first sample are covered
    # (a leading hole up to max gap), the 2 before those are not; GPU 50 % at bucket 7 is busy.
    truth = classify(series([1] * 9, gpu=[N] * 5 + [0, 0, 50, 0]), TeamPolicy(), PERIOD, FAMILIES)
    assert list(truth.quiet) == [0, 0, 1, 1, 1, 1, 1, 0, 1]
    assert list(truth.busy) == [0, 0, 0, 0, 0, 0, 0, 1, 0]


def test_a_gpu_type_without_gpu_metrics_is_never_quiet_unless_the_policy_says_cpu_only() -> None:
    blind = series([1] * 6, itype="g5.xlarge")
    assert sum(classify(blind, TeamPolicy(), PERIOD, FAMILIES).quiet) == 0
    assert sum(classify(blind, TeamPolicy(missing_gpu_metrics="cpu_only"), PERIOD, FAMILIES).quiet) == 6
    assert sum(classify(series([1] * 6, itype="m5.large"), TeamPolicy(), PERIOD, FAMILIES).quiet) == 6


def test_network_counts_only_when_the_policy_judges_it() -> None:
    s = series([1, 1, 1, 1], network=[10, 5000, N, N])
    assert list(classify(s, TeamPolicy(), PERIOD, FAMILIES).busy) == [0, 0, 0, 0]
    judged = classify(s, TeamPolicy(network_threshold_bytes_per_second=1000), PERIOD, FAMILIES)
    assert (list(judged.busy), list(judged.quiet)) == ([0, 1, 0, 0], [1, 0, 1, 1])


def truth_of(marks: str) -> Truth:
    """'b' busy, '.' quiet, '?' unknown."""
    busy = bytearray(m == "b" for m in marks)
    prefix = [0]
    for b in busy:
        prefix.append(prefix[-1] + b)
    return Truth(busy=busy, quiet=bytearray(m == "." for m in marks), prefix_busy=prefix)


def test_the_ideal_stops_each_quiet_stretch_one_window_in_until_activity() -> None:
    # window 6: stretch of 10 saves 4, of 3 saves nothing, of 8 saves 2 = sum(max(0, length - window)).
    assert ideal_buckets(truth_of("bb" + "." * 10 + "b" + "..." + "b" + "." * 8), 6) == 4 + 0 + 2
    # Once stopped it stays stopped through unknown buckets (not counted) until activity.
    assert ideal_buckets(truth_of("." * 6 + "..??.." + "b" + "..."), 6) == 4
    # An unknown bucket breaks a stretch before the stop: 5 + 5 quiet is never a window of 6.
    assert ideal_buckets(truth_of("." * 5 + "?" + "." * 5), 6) == 0


def test_busy_between_is_half_open_and_clipped_at_zero() -> None:
    truth = truth_of("..b...")
    assert truth.busy_between(-4, 3) and truth.busy_between(2, 3)
    assert not truth.busy_between(3, 6) and not truth.busy_between(0, 2) and not truth.busy_between(4, 4)
