"""What a stop, a termination, a keep and an exemption save or waste an hour, per kind of machine: the one rule
every dollar figure comes from (the sweep's audit, `status`, the Slack answers, the digest, the demo and the
replay). docs/policy.md ("What each action saves or wastes") is its table; tests/unit/test_dollars.py holds
every surface to it.

- A **stop** (stop, hibernate, a person's "Stop now", a group member's release or termination) saves what the
  machine bills while it runs: its on-demand price; for Spot at most the lower of the on-demand price and the
  request's maximum price (idle-reaper does not read Spot prices: an upper bound); nothing for a machine in a
  capacity reservation or Capacity Block (the reservation is billed either way) and nothing for a kind EC2
  cannot stop or a fleet would replace (it is never stopped). A group member's release saves nothing while its
  group keeps it running (its desired capacity or minimum size holds it): neither dollars nor machine-hours
  (`saves_while_running`), until the group scales it in.
- A **termination** of a machine EC2 cannot stop (one-time Spot, instance-store: the sweep's, after
  `terminate_unstoppable_after_minutes`, or its owner's "Terminate now") counts nothing: whatever replaces it
  gets a new instance id, so the hours it would have run cannot be told.
- A **keep** ("Keep it") and an **exempt** machine's idle hour waste what the machine bills while it runs,
  the same figure a stop would save, except that a machine EC2 cannot stop still bills while idle: its on-demand
  price (Spot: at most, as above). A reservation's machine wastes nothing more: the reservation is billed
  whether it runs or not.

Pure: a kind's name (core/kinds.Kind, as records keep it) and prices in, figures out.
"""

from __future__ import annotations

from dataclasses import dataclass

from idle_reaper.core.kinds import NEVER_STOPPED, Kind, MachineKind, Saving
from idle_reaper.core.records import Action

# Kinds billed at their Spot price: what they bill is at most their on-demand price (or the request's maximum).
SPOT_KINDS = frozenset({Kind.SPOT, Kind.SPOT_ONE_TIME, Kind.SPOT_RELAUNCHING, Kind.SPOT_REQUEST_GONE})
# Kinds whose reservation is billed whether or not the machine runs.
RESERVED_KINDS = frozenset({Kind.RESERVED, Kind.CAPACITY_BLOCK})
# Kinds idle-reaper never stops: EC2 refuses, a fleet or a persistent request would replace it, what EC2 would do
# is unknown, or a look-up failed.
NOT_STOPPED = NEVER_STOPPED | {Kind.UNKNOWN}


@dataclass(frozen=True)
class Dollars:
    """One machine's figures an hour, by what happens to it."""

    stop: Saving  # what a stop (or a group member's release or termination) saves
    terminate: Saving  # what terminating a machine EC2 cannot stop saves (counted: nothing)
    idle: Saving  # what an hour kept idle (a keep, an exemption) wastes

    def saved_by(self, action: str) -> Saving:
        """What the audited action `action` (a RECOVERING one) saves an hour."""
        return self.terminate if action == Action.TERMINATE_INSTANCE else self.stop


def billed(kind: str, on_demand_price: float | None, spot_max_price: float | None = None) -> Saving:
    """What the machine bills an hour while it runs, beyond a reservation that bills anyway."""
    if kind in RESERVED_KINDS:
        return Saving(0.0)
    if kind in SPOT_KINDS:
        bounds = [p for p in (on_demand_price, spot_max_price) if p is not None]
        return Saving(min(bounds), upper_bound=True) if bounds else Saving(None)
    return Saving(on_demand_price)


def dollars(kind: str, on_demand_price: float | None, spot_max_price: float | None = None) -> Dollars:
    """THE rule: what a stop, a termination and an idle hour (keep, exemption) are worth for a machine of `kind`
    (a Kind value; "" for a machine no sweep has classified yet: on-demand, the usual) at `on_demand_price`
    (None: unknown) and, for Spot, its request's `spot_max_price`."""
    runs = billed(kind, on_demand_price, spot_max_price)
    stop = Saving(0.0) if kind in NOT_STOPPED else runs
    return Dollars(stop=stop, terminate=Saving(0.0), idle=runs)


def saves_while_running(action: str) -> bool:
    """Whether the audited action `action` (a RECOVERING one) saves anything while the machine still runs: not a
    group member's release (scale-in protection removed, the machine not stopped), whose hours and dollars are
    saved only once its group scales it in. Every surface that counts a release (the digest's dollars and
    machine-hours, the demo's summary) asks this."""
    return action != Action.UNPROTECT


def of_kind(kind: MachineKind, on_demand_price: float | None) -> Dollars:
    """The rule for a machine the sweep has just classified (its Spot request's maximum price known)."""
    return dollars(kind.kind.value, on_demand_price, kind.spot_max_price)
