"""Seeded generator of realistic ML-fleet utilization traces, in the replay format.

    python -m testkit.generate_trace                      # the shipped sample: testkit/sample-trace.csv.gz
    python -m testkit.generate_trace --machines 1000 --days 7 -o /tmp/fleet.csv.gz
    python -m testkit.generate_trace --people              # testkit/sample-trace-people.csv.gz

Columns: timestamp (ISO-8601 UTC, on the 5-minute grid), instance_id, cpu, gpu (empty for CPU machines
and where the GPU metric is missing), team, instance_type. CPU and GPU are the period's Maximum in
percent, as CloudWatch reports them. A machine has no rows while it is stopped. Same arguments, same
bytes (the gzip header carries no name or timestamp).

The fleet mixes the patterns an ML team's bill is made of (each machine's name says which it is):

- research-notebook: office hours in the owner's time zone, bursts of cells (CPU 20-60 %, GPU 30-95 %)
  between reading and meetings, a lunch break shorter than the idle window; in the evening the owner
  stops it about half the time and leaves it running idle the rest, weekends included.
- training-trainer: back-to-back training runs: a data-loading phase (CPU 60-95 %, GPU 0 %, 15 min to
  2.5 h), then 3-14 h of training at low CPU (1.5-4 %) and high GPU (85-99 %) with periodic evaluation;
  between runs it idles for minutes (a sweep), hours, or a whole weekend.
- data-etl: CPU-only boxes with a nightly batch job and a few ad-hoc daytime jobs, idle in between.
- platform-dev: CPU dev boxes used in office hours, idle nights and weekends; one in five runs an
  hourly cron job that lifts CPU over 5 % for one period (it is never idle for a whole window).
- *-forgotten: used for a day, then left idle until the end of the trace.
- platform-serving: inference, GPU 8-60 % on a daily cycle, CPU 1-4 %: always busy, but not on CPU.
- a few GPU machines (name ending in -gpugaps) whose CloudWatch agent drops the GPU metric for hours.

Idle machines are not flat zero: background CPU wanders between 0.2 % and 3 % with rare blips to 4.5 %.

With --people (testkit/sample-trace-people.csv.gz) two more columns come from a second random stream,
so the machines' CPU and GPU stay those of the plain sample except where noted:
- user: minutes since the last human input, as the activity collector publishes it (Minimum per
  period; 10080 = none seen). People type during work bursts and short pauses (reading, writing code),
  not in meetings (pauses of 45 min or more), lunch, evenings or weekends. On some afternoons a
  notebook's owner writes for 1.5-2.5 h without running anything: CPU at idle level, a person at the
  keyboard (these afternoons replace the notebook's samples: the one change to CPU). One machine in
  six has no collector: its user cells are empty (unknown).
- owner: an email; owners hold one or two machines of their team.
"""

from __future__ import annotations

import argparse
import gzip
import io
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

PERIOD = timedelta(minutes=5)
PER_HOUR = 12
PER_DAY = 24 * PER_HOUR
DEFAULT_START = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday
DEFAULT_OUT = Path(__file__).with_name("sample-trace.csv.gz")
PEOPLE_OUT = Path(__file__).with_name("sample-trace-people.csv.gz")

Sample = tuple[float, float | None] | None  # (cpu, gpu or None), or None: stopped, no row


@dataclass
class Machine:
    instance_id: str
    team: str
    instance_type: str
    kind: str
    tz_hours: int  # the owner's offset from UTC: office hours are local
    gpu: bool
    samples: list[Sample] = field(default_factory=list)
    typing: list[tuple[int, int]] = field(default_factory=list)  # periods [start, end) a person is at the keyboard
    user: list[float | None] = field(default_factory=list)  # minutes since input per period (--people)
    owner: str = ""


# ---------------------------------------------------------------------------------------------
# Per-period values


def idle(rng: random.Random, gpu: bool) -> Sample:
    cpu = min(3.0, max(0.2, rng.lognormvariate(0.0, 0.45)))
    if rng.random() < 0.01:
        cpu = rng.uniform(3.0, 4.5)  # a blip, still under a 5 % threshold
    return (round(cpu, 1), 0.0 if gpu else None)


def interactive(rng: random.Random, gpu: bool) -> Sample:
    if rng.random() < 0.35:  # a cell (or a build) running
        return (round(rng.uniform(20, 60), 1), round(rng.uniform(30, 95), 1) if gpu else None)
    return (round(rng.uniform(2, 9), 1), round(rng.uniform(0, 3), 1) if gpu else None)


def loading(rng: random.Random, gpu: bool) -> Sample:
    return (round(rng.uniform(60, 95), 1), 0.0 if gpu else None)


def training(rng: random.Random, gpu: bool) -> Sample:
    return (round(rng.uniform(1.5, 4.0), 1), round(rng.uniform(85, 99), 1))


def evaluating(rng: random.Random, gpu: bool) -> Sample:
    return (round(rng.uniform(8, 15), 1), round(rng.uniform(30, 50), 1))


def cpu_job(rng: random.Random, gpu: bool) -> Sample:
    return (round(rng.uniform(55, 95), 1), 0.0 if gpu else None)


Fill = Callable[[random.Random, bool], Sample]


# ---------------------------------------------------------------------------------------------
# Schedules: each writes a machine's samples for the whole span


class Timeline:
    """A machine's samples over the span; starts stopped (no rows)."""

    def __init__(self, machine: Machine, periods: int, rng: random.Random) -> None:
        self.m = machine
        self.n = periods
        self.rng = rng
        machine.samples = [None] * periods

    def fill(self, start: int, end: int, how: Fill) -> None:
        for i in range(max(0, start), min(self.n, end)):
            self.m.samples[i] = how(self.rng, self.m.gpu)

    def local(self, day: int, hour: float) -> int:
        """Period index of a local wall-clock time on a day of the span."""
        return round((day * 24 + hour - self.m.tz_hours) * PER_HOUR)


def weekday(day: int) -> bool:
    return day % 7 < 5  # the span starts on a Monday


def office_session(t: Timeline, start: int, end: int) -> None:
    """Work between start and end: activity with pauses (reading, meetings) of 10-80 minutes."""
    rng = t.rng
    i = start
    while i < end:
        burst = rng.randint(3, 12)
        t.fill(i, min(end, i + burst), interactive)
        pause = rng.choice([2, 3, 4, 6, 9, 12, 16])
        # At the keyboard during the burst and a short pause (reading, writing); away in a meeting.
        t.m.typing.append((i, min(end, i + burst + (pause if pause < 9 else 0))))
        i += burst
        t.fill(i, min(end, i + pause), idle)
        i += pause


def notebook(t: Timeline, days: int) -> None:
    rng = t.rng
    running, last_leave = False, 0
    for day in range(days + 1):
        if not weekday(day):
            continue
        arrive = t.local(day, rng.uniform(8.5, 10.5))
        if running:  # left running since the last working day
            t.fill(last_leave, arrive, idle)
        lunch = t.local(day, rng.uniform(11.8, 12.5))
        leave = t.local(day, rng.uniform(17.0, 19.5))
        office_session(t, arrive, lunch)
        t.fill(lunch, lunch + rng.randint(6, 12), idle)  # 30-60 min: shorter than the idle window
        office_session(t, lunch + 12, leave)
        last_leave = leave
        running = rng.random() < (0.35 if day % 7 == 4 else 0.5)  # Friday: less often left over the weekend
    if running:
        t.fill(last_leave, t.n, idle)


def trainer(t: Timeline, days: int) -> None:
    rng = t.rng
    t.fill(0, t.n, idle)  # the team's box: always on
    i = t.local(0, rng.uniform(9, 20))
    while i < t.n:
        load = rng.randint(3, 9) if rng.random() < 0.8 else rng.randint(12, 30)  # 15-45 min, or 1-2.5 h
        t.fill(i, i + load, loading)
        i += load
        end = i + rng.randint(3 * PER_HOUR, 14 * PER_HOUR)
        while i < end:
            step = min(end - i, 2 * PER_HOUR)
            t.fill(i, i + step, training)
            i += step
            if i < end:
                t.fill(i, i + 2, evaluating)  # evaluation / checkpoint every 2 h
                i += 2
        # Then idle: a hyper-parameter sweep starts the next run in minutes; otherwise hours, or the
        # next weekday evening (over a weekend, usually).
        day = i // PER_DAY
        r = rng.random()
        if r < 0.3:
            i += rng.randint(2, 8)
        elif r < 0.65 and weekday(day):
            i += rng.randint(PER_HOUR, 5 * PER_HOUR)
        else:
            nxt = day + 1
            while not weekday(nxt):
                nxt += 1
            i = max(i + PER_HOUR, t.local(nxt, rng.uniform(17, 22)))


def etl(t: Timeline, days: int) -> None:
    rng = t.rng
    t.fill(0, t.n, idle)
    for day in range(days + 1):
        if weekday(day) or rng.random() < 0.85:
            start = t.local(day, rng.uniform(0.9, 1.3))
            t.fill(start, start + rng.randint(18, 42), cpu_job)  # nightly batch, 1.5-3.5 h
        if weekday(day):
            for _ in range(rng.randint(0, 3)):
                start = t.local(day, rng.uniform(9, 18))
                t.fill(start, start + rng.randint(4, 24), cpu_job)


def dev_box(t: Timeline, days: int) -> None:
    rng = t.rng
    t.fill(0, t.n, idle)
    for day in range(days):
        if weekday(day):
            office_session(t, t.local(day, rng.uniform(8.5, 10)), t.local(day, rng.uniform(16.5, 19)))
    if t.m.instance_id.endswith("-cron"):
        minute = rng.randint(0, PER_HOUR - 1)
        for i in range(minute, t.n, PER_HOUR):
            cpu, gpu = t.m.samples[i] or (0.0, None)
            t.m.samples[i] = (max(cpu, round(rng.uniform(7, 12), 1)), gpu)


def forgotten(t: Timeline, days: int) -> None:
    rng = t.rng
    day = rng.randint(0, min(2, days - 1))
    start = t.local(day, rng.uniform(8.5, 10.5))
    end = t.local(day, rng.uniform(16, 19))
    office_session(t, start, end)
    t.fill(end, t.n, idle)  # nobody comes back


def serving(t: Timeline, days: int) -> None:
    rng = t.rng
    for i in range(t.n):
        hour = (i / PER_HOUR + t.m.tz_hours) % 24
        load = 0.5 - 0.5 * math.cos((hour - 3) / 24 * 2 * math.pi)  # quiet at 03:00 local, peak at 15:00
        gpu = 8 + 45 * load + rng.uniform(-3, 7)
        t.m.samples[i] = (round(rng.uniform(1.0, 4.0), 1), round(max(6.0, gpu), 1))


def gpu_gaps(t: Timeline) -> None:
    """The CloudWatch agent stops sending the GPU metric for 1-6 h, a few times."""
    rng = t.rng
    for _ in range(rng.randint(2, 4)):
        start = rng.randrange(t.n)
        for i in range(start, min(t.n, start + rng.randint(PER_HOUR, 6 * PER_HOUR))):
            s = t.m.samples[i]
            if s is not None:
                t.m.samples[i] = (s[0], None)


# ---------------------------------------------------------------------------------------------
# The fleet

# kind: (share of the fleet, team, instance types, schedule, has a GPU)
KINDS: dict[str, tuple[float, str, tuple[str, ...], Callable[[Timeline, int], None], bool]] = {
    "notebook": (0.28, "research", ("g4dn.xlarge", "g5.xlarge", "g5.2xlarge"), notebook, True),
    "trainer": (0.20, "training", ("p3.2xlarge", "g5.12xlarge", "g6.12xlarge", "p3.8xlarge"), trainer, True),
    "etl": (0.15, "data", ("c5.4xlarge", "m5.2xlarge", "r5.2xlarge", "c6i.4xlarge"), etl, False),
    "dev": (0.15, "platform", ("m5.xlarge", "t3.large", "m6i.xlarge"), dev_box, False),
    "forgotten": (0.12, "research", ("g5.2xlarge", "p3.2xlarge", "g4dn.xlarge"), forgotten, True),
    "serving": (0.10, "platform", ("g5.xlarge", "g6.xlarge"), serving, True),
}
TIME_ZONES = (-8, -5, 0, 1, 2, 8)


def fleet(machines: int, days: int, seed: int, always_on: bool = False, people: bool = False) -> list[Machine]:
    """Deterministic: the same (machines, days, seed) gives the same fleet, machine by machine.
    always_on: nobody stops a machine by hand, so every machine reports every period from the start
    (the periods it would have been stopped are idle): the densest trace, for timing the replay."""
    rng = random.Random(seed)
    counts = {kind: math.floor(share * machines) for kind, (share, *_) in KINDS.items()}
    for kind in list(KINDS)[: machines - sum(counts.values())]:  # hand out the remainder
        counts[kind] += 1
    periods = days * PER_DAY
    out: list[Machine] = []
    gpu_seen = 0
    for kind, count in counts.items():
        _, team, types, schedule, has_gpu = KINDS[kind]
        for n in range(1, count + 1):
            name = f"{team}-{kind}-{n:03d}" if kind != "forgotten" else f"{team}-{n:03d}-forgotten"
            if kind == "dev" and n % 5 == 2:
                name += "-cron"
            if has_gpu:
                gpu_seen += 1
                if gpu_seen % 16 == 5:  # a few GPU machines lose their GPU metric now and then
                    name += "-gpugaps"
            m = Machine(name, team, rng.choice(types), kind, rng.choice(TIME_ZONES), has_gpu)
            t = Timeline(m, periods, random.Random(f"{seed}/{name}"))
            schedule(t, days)
            if always_on:
                m.samples = [s if s is not None else idle(t.rng, has_gpu) for s in m.samples]
            if name.endswith("-gpugaps"):
                gpu_gaps(t)
            for i in range(periods):  # a rare lost datapoint: a short gap, not an error
                if m.samples[i] is not None and t.rng.random() < 0.002:
                    m.samples[i] = None
            if people:
                add_people(m, n, random.Random(f"{seed}/{name}/people"))
            out.append(m)
    return out


USER_NONE = 10080.0  # the collector's "no human input seen"


def add_people(m: Machine, n: int, rng: random.Random) -> None:
    """The owner, the writing afternoons of notebooks, and the user column (see the module docstring)."""
    m.owner = f"{m.team}-{(n + 1) // 2:02d}@example.com"
    periods = len(m.samples)
    if m.kind == "notebook":
        for day in range(periods // PER_DAY):
            if weekday(day) and rng.random() < 0.3:
                start = round((day * 24 + rng.uniform(14.0, 15.5) - m.tz_hours) * PER_HOUR)
                length = rng.randint(18, 30)  # 1.5-2.5 h of writing at idle-level CPU
                for i in range(max(0, start), min(periods, start + length)):
                    if m.samples[i] is not None:
                        m.samples[i] = idle(rng, m.gpu)
                m.typing.append((start, start + length))
    if rng.random() < 1 / 6:
        m.user = [None] * periods  # no collector on this machine
        return
    typing = bytearray(periods)
    for start, end in m.typing:
        for i in range(max(0, start), min(periods, end)):
            typing[i] = 1
    last: float | None = None  # minutes since the start of the span of the last input
    m.user = []
    for i in range(periods):
        if typing[i] and rng.random() < 0.8:
            last = i * 5 + rng.uniform(0, 5)
        m.user.append(
            None
            if m.samples[i] is None
            else (USER_NONE if last is None else min(USER_NONE, max(0.0, round(i * 5 + 5 - last, 1))))
        )


def write_trace(machines: list[Machine], start: datetime, out: io.TextIOBase | io.TextIOWrapper) -> int:
    """Rows in time order, machines interleaved, as a CloudWatch export would list them."""
    people = any(m.owner for m in machines)
    out.write("timestamp,instance_id,cpu,gpu,team,instance_type" + (",user,owner\n" if people else "\n"))
    periods = len(machines[0].samples) if machines else 0
    rows = 0
    for i in range(periods):
        ts = (start + PERIOD * i).strftime("%Y-%m-%dT%H:%M:%SZ")
        lines = []
        for m in machines:
            s = m.samples[i]
            if s is None:
                continue
            cpu, gpu = s
            row = f"{ts},{m.instance_id},{cpu:g},{'' if gpu is None else f'{gpu:g}'},{m.team},{m.instance_type}"
            if people:
                user = m.user[i] if m.user else None
                row += f",{'' if user is None else f'{user:g}'},{m.owner}"
            lines.append(row + "\n")
        out.write("".join(lines))
        rows += len(lines)
    return rows


def generate(
    path: Path,
    machines: int,
    days: int,
    seed: int,
    start: datetime = DEFAULT_START,
    always_on: bool = False,
    people: bool = False,
) -> int:
    fleet_ = fleet(machines, days, seed, always_on, people)
    if path.suffix == ".gz":
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz,
            io.TextIOWrapper(gz, encoding="utf-8", newline="") as text,
        ):
            return write_trace(fleet_, start, text)
    with open(path, "w", encoding="utf-8", newline="") as f:
        return write_trace(fleet_, start, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=48)
    parser.add_argument("--days", type=int, default=14)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--start", default=DEFAULT_START.date().isoformat(), help="first day (UTC), a Monday")
    parser.add_argument("-o", "--out", type=Path, help="a .csv or .csv.gz path (default: the shipped sample)")
    parser.add_argument("--people", action="store_true", help="add the user and owner columns")
    parser.add_argument("--always-on", action="store_true", help="no machine is ever stopped by hand (densest)")
    args = parser.parse_args(argv)
    start = datetime.fromisoformat(args.start).replace(tzinfo=UTC)
    out = args.out or (PEOPLE_OUT if args.people else DEFAULT_OUT)
    rows = generate(out, args.machines, args.days, args.seed, start, args.always_on, args.people)
    print(f"{out}: {rows:,} rows, {args.machines} machines x {args.days} days (seed {args.seed})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
