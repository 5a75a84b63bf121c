"""What the trace itself says, per machine and bucket: busy, quiet or unknown; and the ideal.

Scoring comes from the trace alone (see docs/replay.md):
- a bucket is *busy* when any value is at or above its threshold, *quiet* when it is below every
  threshold and covered the way the core requires (holes up to max_gap count as covered), else unknown;
- idle hours: all quiet time; ideal: a clairvoyant reaper with the same window stops every quiet
  stretch exactly one window in and, like the replay, keeps it stopped until activity;
- recovered hours: quiet time during which the replayed machine was stopped;
- a false stop: a stop with a busy bucket in the window before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from idle_reaper.core import is_gpu_type
from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay.trace import Series


def _covered(values: Sequence[float], gap: int) -> bytearray:
    """Buckets the core counts as covered: a sample, or a hole's first `gap` buckets (the lag the core
    accepts at the end of the data), or the last `gap` buckets before a track's first sample (the core
    allows a leading hole of max_gap, bounded by the launch time)."""
    n = len(values)
    covered = bytearray(n)
    first = next((i for i, v in enumerate(values) if v == v), None)
    if first is None:
        return covered
    for i in range(max(0, first - gap), first):
        covered[i] = 1
    hole = 0
    for i in range(first, n):
        v = values[i]
        if v == v:
            covered[i] = 1
            hole = 0
        else:
            covered[i] = hole < gap
            hole += 1
    return covered


@dataclass
class Truth:
    busy: bytearray  # any value at or above its threshold, or a person's input: what restarts a stopped machine
    quiet: bytearray  # below every threshold, no person's input, and covered: idle time
    prefix_busy: list[int]  # prefix_busy[i] = busy buckets before i, for "busy within the window" in O(1)
    track_busy: bytearray = field(default_factory=bytearray)  # busy on a metric track alone (not a person)

    def busy_between(self, lo: int, hi: int) -> bool:
        lo = max(lo, 0)
        return hi > lo and self.prefix_busy[hi] - self.prefix_busy[lo] > 0


def classify(series: Series, policy: TeamPolicy, period_seconds: int, gpu_families: Iterable[str]) -> Truth:
    n = len(series)
    gap = policy.max_gap_minutes * 60 // period_seconds
    has_gpu = series.has_gpu
    tracks: list[tuple[Sequence[float], float]] = [(series.cpu, policy.cpu_threshold_percent)]
    if has_gpu:
        tracks.append((series.gpu, policy.gpu_threshold_percent))
    if policy.network_threshold_bytes_per_second is not None:
        tracks.append((series.network, policy.network_threshold_bytes_per_second))
    busy = bytearray(n)
    covered = bytearray(b"\x01") * n
    for values, threshold in tracks:
        track_covered = _covered(values, gap)
        for i, v in enumerate(values):
            if v >= threshold:  # NaN compares False: a hole is never busy
                busy[i] = 1
            if not track_covered[i]:
                covered[i] = 0
    track_busy = bytearray(busy)
    # A person's input in the bucket (the policy's human_active_minutes on): activity, like a busy value.
    if policy.human_active_minutes and series.user:
        period_minutes = period_seconds / 60
        for i, v in enumerate(series.user):
            if v < period_minutes:  # NaN compares False: unknown is never activity
                busy[i] = 1
    # A GPU machine that never reports GPU metrics is never idle under missing_gpu_metrics=busy.
    blind = not has_gpu and policy.missing_gpu_metrics == "busy" and is_gpu_type(series.instance_type, gpu_families)
    quiet = bytearray(n) if blind else bytearray(c and not b for c, b in zip(covered, busy, strict=True))
    prefix = [0] * (n + 1)
    total = 0
    for i, b in enumerate(busy):
        total += b
        prefix[i + 1] = total
    return Truth(busy=busy, quiet=quiet, prefix_busy=prefix, track_busy=track_busy)


def ideal_buckets(truth: Truth, window: int, lo: int = 0, hi: int | None = None) -> int:
    """A clairvoyant reaper with the same window: each quiet stretch stopped exactly `window` buckets
    in, kept stopped (like the replay) until the trace shows activity. Quiet buckets it saves (of those
    in [lo, hi) only, when given: the judged span of --split time)."""
    end = len(truth.busy) if hi is None else hi
    saved = 0
    run = 0
    stopped = False
    for i, (busy, quiet) in enumerate(zip(truth.busy, truth.quiet, strict=True)):
        if stopped:
            if busy:
                stopped, run = False, 0
            else:
                saved += quiet and lo <= i < end
            continue
        run = run + 1 if quiet else 0
        stopped = run >= window
    return saved
