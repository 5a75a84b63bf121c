"""The hub's machine shards: which machines each shard sweeps (every machine in exactly one), and its manifest in
the state table, in items DynamoDB keeps (400 KB at most each), however large the fleet or one of its groups."""

from __future__ import annotations

import heapq
import json
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from idle_reaper.aws.limits import LOOKUP_VALUE_MAX_BYTES
from idle_reaper.core.reports import OWNER_PART, GroupPart, part_key
from idle_reaper.core.signals import Machine
from idle_reaper.sweep.adapters import SweepCannotRun

OWNER_UNIT_MAX = 100  # an owner's standalone machines kept in one shard, at most
_GROUP = "asg:"  # how part_key begins for an Auto Scaling group's members


@dataclass
class ShardManifest:
    """One machine shard's work: its instance ids, and the Auto Scaling groups it holds a part of (a group too
    large for one shard: GroupPart says which parts, and so its share of the group's termination headroom)."""

    ids: list[str] = field(default_factory=list)
    groups: dict[str, GroupPart] = field(default_factory=dict)


def plan_shards(
    machines: Sequence[Machine], shards: int, *, group_max: int | None = None, turn: str = ""
) -> list[ShardManifest]:
    """Instance ids per shard: every machine in exactly one, an Auto Scaling group's members together (its
    termination limit is counted in one place), an owner's other machines together (up to OWNER_UNIT_MAX), the
    shards as even as these units allow (the largest unit first, each to the shard with the fewest machines so
    far). A group of more than `group_max` members (None: none) is cut into even parts of about a shard's share of
    the fleet, each a unit of its own, which share the group's termination headroom (GroupPart); the parts are
    labelled afresh by `turn` (the sweep's id), so that the share left over goes round from sweep to sweep."""
    units: dict[str, list[str]] = defaultdict(list)
    by_owner: dict[str, list[str]] = defaultdict(list)
    for m in machines:  # what keeps machines together, as when a member account-region is cut into parts
        key = part_key(m.instance_id, m.asg_name, m.owner)
        (by_owner if key.startswith(OWNER_PART) else units)[key].append(m.instance_id)
    # An owner's standalone machines share a shard, so one sweep's warnings to them share one message
    # (sweep.owner_messages.post_owner_messages); an owner with very many is split in bounded chunks, to keep
    # shards even.
    for owner, ids in by_owner.items():
        ids.sort()
        for start in range(0, len(ids), OWNER_UNIT_MAX):
            units[f"{owner}#{start}"] = ids[start : start + OWNER_UNIT_MAX]
    part_of: dict[str, tuple[str, int, int]] = {}  # a group's part's unit -> (group, its label, the group's parts)
    if group_max is not None:
        share = max(1, -(-len(machines) // max(1, shards)))  # machines a shard holds, evenly spread
        for key in [k for k, ids in units.items() if k.startswith(_GROUP) and len(ids) > group_max]:
            ids = sorted(units.pop(key))
            parts = max(-(-len(ids) // share), -(-len(ids) // max(1, group_max)))
            turned = zlib.crc32(f"{turn}#{key}".encode()) % parts
            for j in range(parts):
                unit = f"{key}#part{j}"
                units[unit] = ids[j * len(ids) // parts : (j + 1) * len(ids) // parts]
                part_of[unit] = (key.removeprefix(_GROUP), (j + turned) % parts, parts)
    loads = [(0, index) for index in range(shards)]
    manifests = [ShardManifest() for _ in range(shards)]
    for unit, ids in sorted(units.items(), key=lambda unit: (-len(unit[1]), unit[0])):
        size, index = heapq.heappop(loads)
        manifests[index].ids.extend(ids)
        if unit in part_of:
            group, label, parts = part_of[unit]
            held = manifests[index].groups.get(group)
            manifests[index].groups[group] = GroupPart(parts, (*(held.held if held else ()), label))
        heapq.heappush(loads, (size + len(ids), index))
    return manifests


def split_into_shards(machines: Sequence[Machine], shards: int, *, group_max: int | None = None) -> list[list[str]]:
    """The instance ids of each shard plan_shards makes (no group cut unless `group_max` says so)."""
    return [m.ids for m in plan_shards(machines, shards, group_max=group_max)]


# ---------------------------------------------------------------------------------------------
# Manifests in the state table: one item a shard while it fits (a JSON list of ids, as always); else (or when the
# shard holds part of a group) a first item saying so, and the rest of the ids in pages of their own.


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parts: int = Field(ge=1, le=100_000)
    held: list[int] = Field(min_length=1)


class _FirstPage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[str]
    groups: dict[str, _Part] = Field(default_factory=dict)
    pages: int = Field(default=1, ge=1, le=10_000)
    machines: int = Field(ge=0)


def manifest_pages(manifest: ShardManifest, most: int = LOOKUP_VALUE_MAX_BYTES) -> list[str]:
    """The values of a shard's manifest items, each at most `most` bytes: one JSON list of its ids when that fits
    and it holds no group's part (as before); else a first page (the groups' parts, how many pages and machines,
    the first ids) and pages of ids."""
    whole = json.dumps(manifest.ids)
    if not manifest.groups and len(whole.encode()) <= most:
        return [whole]
    groups = {name: _Part(parts=p.parts, held=list(p.held)) for name, p in manifest.groups.items()}
    head = _FirstPage(ids=[], groups=groups, pages=10_000, machines=len(manifest.ids)).model_dump_json()
    pages: list[list[str]] = [[]]
    room = most - len(head.encode())
    for instance_id in manifest.ids:
        size = len(json.dumps(instance_id).encode()) + 2  # with its separator
        if size > room:
            pages.append([])
            room = most - 2
        pages[-1].append(instance_id)
        room -= size
    first = _FirstPage(ids=pages[0], groups=groups, pages=len(pages), machines=len(manifest.ids))
    return [first.model_dump_json(), *(json.dumps(ids) for ids in pages[1:])]


def read_manifest(value: object, page: Callable[[int], str | None], where: str) -> ShardManifest:
    """A machine shard's manifest from its first item's JSON `value`, the other pages read with `page(n)` (their
    stored text, None when missing). SweepCannotRun when it is neither form, or a page is missing or malformed:
    nothing is swept from a manifest read in part."""
    if isinstance(value, list) and all(isinstance(i, str) for i in value):
        return ShardManifest(list(value))
    try:
        first = _FirstPage.model_validate(value)
    except ValidationError:
        raise SweepCannotRun(
            f"{where} is neither a list of instance ids nor member units; nothing was changed"
        ) from None
    ids = list(first.ids)
    for n in range(1, first.pages):
        text = page(n)
        try:
            more = json.loads(text) if text is not None else None
        except ValueError:
            more = None
        if not isinstance(more, list) or not all(isinstance(i, str) for i in more):
            raise SweepCannotRun(f"{where}: page {n + 1} of {first.pages} is missing or malformed; nothing was changed")
        ids += more
    if len(ids) != first.machines:
        planned = f"{len(ids)} machines in its pages, {first.machines} planned"
        raise SweepCannotRun(f"{where}: {planned}; nothing was changed")
    groups = {name: GroupPart(p.parts, tuple(p.held)) for name, p in first.groups.items()}
    return ShardManifest(ids, groups)


def manifest_machines(value: object) -> int | None:
    """How many machines a stored machine shard's manifest (its first item's JSON) plans; None: not one."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict) and "ids" in value and isinstance(value.get("machines"), int):
        return int(value["machines"])
    return None
