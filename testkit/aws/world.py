"""A whole fake account: every fake client, machines launched into it, and the real adapters over them."""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from idle_reaper.aws import (
    Fleet,
    InMemoryStateStore,
    MetricsReader,
    PolicyStore,
)
from idle_reaper.notify import LoggingNotifier, Notifier
from idle_reaper.sweep import Adapters, logger
from testkit.aws.clients import FakeClient, LatencyModel
from testkit.aws.fleet import FakeAutoScaling, FakeEC2
from testkit.aws.metrics import FakeCloudWatch, Profile
from testkit.aws.policies import FakeSSM
from testkit.aws.state import CountingStateStore

# ---------------------------------------------------------------------------------------------
# The account: all fakes together, plus the real adapters over them

WRITE_OPERATIONS = frozenset(
    {
        "ec2:StopInstances",
        "ec2:TerminateInstances",
        "autoscaling:SetInstanceProtection",
        "autoscaling:TerminateInstanceInAutoScalingGroup",
        "ssm:PutParameter",
    }
)


class FakeAws:
    def __init__(
        self, *, points_per_call: int = FakeCloudWatch.MAX_DATAPOINTS, latency: LatencyModel | None = None
    ) -> None:
        self.ec2 = FakeEC2()
        self.autoscaling = FakeAutoScaling(self.ec2)
        self.cloudwatch = FakeCloudWatch(points_per_call=points_per_call)
        self.ssm = FakeSSM()
        self.set_latency(latency)

    def set_latency(self, latency: LatencyModel | None) -> None:
        for c in self.clients:
            c.latency = latency
        if latency is not None:
            latency.fake_seconds = self.seconds

    @property
    def clients(self) -> tuple[FakeClient, ...]:
        return (self.ec2, self.autoscaling, self.cloudwatch, self.ssm)

    def launch(
        self,
        instance_type: str,
        *,
        team: str | None,
        profile: Profile,
        launch_time: datetime,
        name: str | None = None,
        owner: str | None = None,
        tags: dict[str, str] | None = None,
        hibernation: bool = False,
        group: str | None = None,
        protected: bool = False,
        state: str = "running",
        managed: bool = True,
    ) -> str:
        """A machine with its metrics; `group` makes it a member of that (existing) Auto Scaling group.
        `managed`: it carries the reaper's opt-in tag."""
        all_tags = {
            **({"Name": name} if name else {}),
            **({"Team": team} if team else {}),
            **({"idle-reaper:managed": "true"} if managed else {}),
            **({"Owner": owner} if owner else {}),
            **(tags or {}),
        }
        if group:
            all_tags["aws:autoscaling:groupName"] = group
        inst = self.ec2.add(instance_type, launch_time=launch_time, tags=all_tags, hibernation=hibernation, state=state)
        if group:
            self.autoscaling.attach(group, inst.instance_id, protected=protected)
        self.cloudwatch.add(inst.instance_id, profile, launch_time)
        return inst.instance_id

    def calls(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update({f"{c.service}:{op}": n for op, n in c.calls.items()})
        return total

    def seconds(self) -> float:
        return sum(c.seconds for c in self.clients)

    def errors(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update({f"{c.service}:{op} {code}": n for (op, code), n in c.errors.items()})
        return total

    def write_calls(self) -> int:
        return sum(n for op, n in self.calls().items() if op in WRITE_OPERATIONS)

    def adapters(
        self,
        store: InMemoryStateStore | None = None,
        notifier: Notifier | None = None,
        prefix: str = "/idle-reaper",
        *,
        listing_processes: int = 1,
    ) -> Adapters:
        """The real adapters (idle_reaper.aws) over these fakes, as a sweep.Adapters. The default notifier
        logs and reports every warning as delivered (a Slack that always answers). `listing_processes`: as
        the planner's Lambda lists the zones (forked children, each with its copy of these fakes)."""
        return Adapters(
            policies=PolicyStore(self.ssm, prefix),
            fleet=Fleet(self.ec2, self.autoscaling, listing_processes=listing_processes),
            metrics=MetricsReader(self.cloudwatch),
            store=store if store is not None else CountingStateStore(),
            notifier=notifier if notifier is not None else LoggingNotifier(logger, delivers=True),
        )
