"""What knowing each machine's kind costs a sweep: the same 10,000-machine fleet as benchmarks/sweep_cost.py,
once as it is and once with a tenth of its standalone machines Spot (half one-time, half persistent) and a
twentieth in capacity reservations (four machines a reservation). The real `run_sweep` over the counting
fakes, every call charged its in-region latency (testkit/aws/clients.py LATENCY) on the modelled thread pools
of benchmarks/sweep_latency.py. Prints the look-up calls, what they charged and the steady sweep's modelled
wall both ways.

    python benchmarks/kind_lookups.py [--size 10000]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from sweep_cost import PREFIX, T0, build_fleet  # noqa: E402
from sweep_latency import Segments  # noqa: E402

from idle_reaper import sweep as sweep_module  # noqa: E402
from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.sweep import run_sweep  # noqa: E402
from testkit.aws import CountingStateStore, FakeAws, LatencyModel  # noqa: E402
from testkit.ec2_answers import capacity_reservation  # noqa: E402

LOOKUPS = ("ec2:DescribeSpotInstanceRequests", "ec2:DescribeCapacityReservations")


def with_kinds(aws: FakeAws) -> tuple[int, int]:
    """Make every 10th standalone machine Spot and every 20th (another) one reserved: (spot, reservations)."""
    standalone = [i for i, inst in aws.ec2.instances.items() if "aws:autoscaling:groupName" not in inst.tags]
    spot = standalone[::10]
    reserved = standalone[5::20]
    for n, instance_id in enumerate(spot):
        if n % 2:
            aws.ec2.make_spot(instance_id, request_type="persistent", interruption="stop")
        else:
            aws.ec2.make_spot(instance_id)
    for n, instance_id in enumerate(reserved):
        reservation = f"cr-{n // 4:05d}"
        aws.ec2.make_kind(instance_id, reservation_id=reservation)
        itype = aws.ec2.instances[instance_id].instance_type
        aws.ec2.reservations.setdefault(reservation, capacity_reservation(reservation, itype, total=4))
    return len(spot), len(aws.ec2.reservations)


def steady_sweep(size: int, kinds: bool) -> tuple[dict[str, int], dict[str, float], float, tuple[int, int]]:
    """Calls and charged latency of the look-ups, and the modelled wall, of the steady sweep (+5 min)."""
    aws = build_fleet(size, 7).aws
    counts = with_kinds(aws) if kinds else (0, 0)
    model = LatencyModel()
    aws.set_latency(model)
    adapters = aws.adapters(
        store=CountingStateStore(model), notifier=LoggingNotifier(sweep_module.logger, delivers=True), prefix=PREFIX
    )
    segments = Segments(model, aws, sleep=False)
    model.install()
    try:
        run_sweep(adapters, now=T0)  # the first look
        before = dict(model.charged)
        _, wall, _ = segments.time(lambda: run_sweep(adapters, now=T0 + timedelta(minutes=5)))
    finally:
        model.uninstall()
    calls = {op: model.charged[op] - before.get(op, 0) for op in LOOKUPS}
    return calls, {op: n * model.latency[op] for op, n in calls.items()}, wall, counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10_000)
    args = parser.parse_args(argv)
    _, _, plain_wall, _ = steady_sweep(args.size, kinds=False)
    calls, charged, wall, (spot, reservations) = steady_sweep(args.size, kinds=True)
    print(f"{args.size:,} machines, {spot:,} of them Spot (half one-time), {reservations} capacity reservations")
    for op in LOOKUPS:
        print(f"  {op:<36} {calls[op]:>3} calls a sweep, {charged[op]:.2f} s of latency")
    print(f"  steady sweep, modelled wall: {plain_wall:.2f} s without kinds, {wall:.2f} s with them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
