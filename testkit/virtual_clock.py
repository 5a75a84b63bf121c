"""The product's pacers (aws/limits.py Pacing) on a clock of the caller's: a wait moves it, nothing sleeps. The
suite's `virtual_pacing` fixture (tests/conftest.py) is this for one test; a module's shared set-up (the demo's
run) takes it for its own length.

`clock[0]` is the time; what a caller waited is how far it moved. Threads that wait at once wait side by side, as
real threads do: a wait moves the clock to the time its thread last read plus the wait (never back), not on by the
wait. Moved on by every thread's wait in turn, the clock ran ahead of the requests still on their way, and AWS's
buckets (on the same clock) saw those requests arrive late and together."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from idle_reaper.aws.limits import Pacing


@contextmanager
def virtual_pacing(start: float = 1000.0) -> Iterator[list[float]]:
    now = [start]
    lock = threading.Lock()
    read = threading.local()  # the time this thread last read, which its wait counts from

    def clock() -> float:
        read.at = now[0]
        return now[0]

    def sleep(seconds: float) -> None:
        with lock:
            now[0] = max(now[0], (getattr(read, "at", None) or now[0]) + seconds)
        read.at = None  # a wait without a reading before it counts from the time it is made

    saved = (Pacing.clock, Pacing.sleep)
    Pacing.clock, Pacing.sleep = clock, sleep  # type: ignore[method-assign,assignment]
    try:
        yield now
    finally:
        Pacing.clock, Pacing.sleep = saved  # type: ignore[method-assign]
