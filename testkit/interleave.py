"""Deterministic interleavings of two sweeps, not races that a test hopes to hit.

Each sweep runs with its adapters wrapped so that it passes named steps. Sweep A runs in a thread
until it reaches its pause step and waits there; sweep B then runs until its own pause step (or to the
end); A resumes and finishes; then B finishes. Only one sweep runs at any moment, so the in-memory fakes
need no locking and every run is the same.

    result = interleave(lambda gate: run_sweep(stepped(adapters_a, gate), now=now),
                        lambda gate: run_sweep(stepped(adapters_b, gate), now=now),
                        pause_a="claimed", pause_b="loaded")

Steps, in the order a sweep passes them:
    listed     the machines are discovered (by a sweep, or by the planner of a sharded one; a shard
               worker's own listing passes it too)
    loaded     their records are read
    claimed    a record was written together with this sweep's claim (the intent: warn, stop, ...)
    acted      a machine action call returned (stop, hibernate, protection, terminate)
    posted     a notifier call returned (warning, resolved, reaped update)
    recording  about to write the outcome of a claimed machine (and release the claim)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from idle_reaper.aws import ActionOutcome, Concurrency, Fleet, StateStore
from idle_reaper.core import Decision, Machine, MachineRecord
from idle_reaper.notify import Delivery, Notifier
from idle_reaper.policy import TagKeys
from idle_reaper.sweep import Adapters, SweepReport

STEPS = ("listed", "loaded", "claimed", "acted", "posted", "recording")


@dataclass
class Gate:
    """Holds one sweep the first time it reaches `step`, until `resume()`."""

    step: str | None
    timeout: float = 10.0
    passed: list[str] = field(default_factory=list)
    reached: threading.Event = field(default_factory=threading.Event)
    _go: threading.Event = field(default_factory=threading.Event)

    def at(self, step: str) -> None:
        assert step in STEPS, step
        self.passed.append(step)
        if step == self.step and not self.reached.is_set():
            self.reached.set()
            if not self._go.wait(self.timeout):
                raise TimeoutError(f"sweep held at {step} was never resumed")

    def resume(self) -> None:
        self._go.set()


class SteppedStore:
    def __init__(self, inner: StateStore, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.claimed: set[str] = set()

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        records = self.inner.load(instance_ids)
        self.gate.at("loaded")
        return records

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        if holder is not None and not hold and record.instance_id in self.claimed:
            self.gate.at("recording")
        saved = self.inner.save(record, holder, hold=hold)
        if saved and hold:
            self.claimed.add(record.instance_id)
            self.gate.at("claimed")
        return saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SteppedFleet(Fleet):
    def __init__(self, inner: Fleet, gate: Gate) -> None:
        super().__init__(inner.ec2, inner.autoscaling)
        self.inner, self.gate = inner, gate

    def discover(
        self, tags: TagKeys, *, notebooks: bool = True, endpoints: bool = True, studio: bool = False
    ) -> list[Machine]:
        machines = self.inner.discover(tags, notebooks=notebooks, endpoints=endpoints, studio=studio)
        self.gate.at("listed")
        return machines

    def describe_ids(self, instance_ids: Sequence[str], tags: TagKeys) -> list[Machine]:
        machines = self.inner.describe_ids(instance_ids, tags)  # a shard worker's listing
        self.gate.at("listed")
        return machines

    def still_as_listed(self, machines: Sequence[Machine], tags: TagKeys) -> set[str]:
        return self.inner.still_as_listed(machines, tags)

    def stop(self, instance_ids: Sequence[str], *, hibernate: bool) -> list[ActionOutcome]:
        outcomes = self.inner.stop(instance_ids, hibernate=hibernate)
        if instance_ids:
            self.gate.at("acted")
        return outcomes

    def set_protection(self, group: str, instance_ids: Sequence[str], *, protected: bool) -> list[ActionOutcome]:
        outcomes = self.inner.set_protection(group, instance_ids, protected=protected)
        self.gate.at("acted")
        return outcomes

    def terminate_in_group(self, instance_id: str) -> ActionOutcome:
        outcome = self.inner.terminate_in_group(instance_id)
        self.gate.at("acted")
        return outcome


class SteppedNotifier:
    def __init__(self, inner: Notifier, gate: Gate) -> None:
        self.inner, self.gate = inner, gate

    def warn(self, decision: Decision) -> Delivery | None:
        try:
            return self.inner.warn(decision)
        finally:
            self.gate.at("posted")

    def resolved(self, decision: Decision) -> None:
        try:
            self.inner.resolved(decision)
        finally:
            self.gate.at("posted")

    def reaped(self, decision: Decision) -> Delivery | None:
        try:
            return self.inner.reaped(decision)
        finally:
            self.gate.at("posted")

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        self.inner.admin_alert(text, admins, channel)


def stepped(adapters: Adapters, gate: Gate) -> Adapters:
    """The same adapters, passing `gate` at every step."""
    return Adapters(
        policies=adapters.policies,
        fleet=SteppedFleet(adapters.fleet, gate),
        metrics=adapters.metrics,
        store=SteppedStore(adapters.store, gate),  # type: ignore[arg-type]
        notifier=SteppedNotifier(adapters.notifier, gate),
    )


@dataclass
class Interleaving:
    a: SweepReport
    b: SweepReport
    gate_a: Gate
    gate_b: Gate


def interleave(
    sweep_a: Callable[[Gate], SweepReport],
    sweep_b: Callable[[Gate], SweepReport],
    *,
    pause_a: str,
    pause_b: str | None = None,
    timeout: float = 10.0,
) -> Interleaving:
    """A runs to `pause_a`; B runs to `pause_b` (None: to the end); A finishes; B finishes. Each sweep's
    thread pools run their tasks one after another meanwhile, so a paused sweep is wholly paused."""
    saved = Concurrency.runner
    Concurrency.runner = _one_after_another  # type: ignore[assignment]
    try:
        return _interleave(sweep_a, sweep_b, pause_a=pause_a, pause_b=pause_b, timeout=timeout)
    finally:
        Concurrency.runner = saved


def _one_after_another(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    return [fn(item) for item in items]


def _interleave(
    sweep_a: Callable[[Gate], SweepReport],
    sweep_b: Callable[[Gate], SweepReport],
    *,
    pause_a: str,
    pause_b: str | None,
    timeout: float,
) -> Interleaving:
    gate_a, gate_b = Gate(pause_a, timeout), Gate(pause_b, timeout)
    reports: dict[str, SweepReport] = {}
    failures: dict[str, BaseException] = {}
    done = {"a": threading.Event(), "b": threading.Event()}

    def run(name: str, sweep: Callable[[Gate], SweepReport], gate: Gate) -> None:
        try:
            reports[name] = sweep(gate)
        except BaseException as exc:  # re-raised in the test's thread
            failures[name] = exc
        finally:
            done[name].set()

    def until_paused_or_done(name: str, gate: Gate) -> None:
        for _ in range(int(timeout * 100)):
            if gate.reached.is_set() or done[name].is_set():
                return
            done[name].wait(0.01)
        raise TimeoutError(f"sweep {name} neither paused nor finished")

    threads = {
        "a": threading.Thread(target=run, args=("a", sweep_a, gate_a), daemon=True),
        "b": threading.Thread(target=run, args=("b", sweep_b, gate_b), daemon=True),
    }
    threads["a"].start()
    until_paused_or_done("a", gate_a)
    threads["b"].start()
    until_paused_or_done("b", gate_b)
    for name, gate in (("a", gate_a), ("b", gate_b)):
        gate.resume()
        threads[name].join(timeout)
        if name in failures:
            raise failures[name]
        if name not in reports:
            raise TimeoutError(f"sweep {name} did not finish")
    return Interleaving(reports["a"], reports["b"], gate_a, gate_b)


def counts_by_machine(requests: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many of `requests` (boto3 keyword arguments) name each instance id."""
    named: dict[str, int] = {}
    for request in requests:
        for instance_id in request.get("InstanceIds") or [request.get("InstanceId")]:
            named[instance_id] = named.get(instance_id, 0) + 1
    return named
