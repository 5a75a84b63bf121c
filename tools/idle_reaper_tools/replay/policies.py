"""The policies a replay runs under: the built-in default, or a policy file with per-team overrides."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from idle_reaper.policy import (
    DEFAULT_GPU_FAMILIES,
    PolicyError,
    TeamPolicy,
    TeamPolicyRef,
    parse_team_policy,
)


@dataclass(frozen=True)
class PolicySet:
    """The policy of every team in the replay: a default plus per-team overrides."""

    default: TeamPolicy = field(default_factory=TeamPolicy)
    teams: Mapping[str, TeamPolicy] = field(default_factory=dict)
    source: str = "default policy"
    gpu_families: tuple[str, ...] = DEFAULT_GPU_FAMILIES

    def for_team(self, team: str) -> TeamPolicy:
        return self.teams.get(team, self.default)

    def ref(self, team: str) -> TeamPolicyRef:
        return TeamPolicyRef(team=team, policy=self.for_team(team), source=self.source, version=None)

    def describe(self, team: str | None = None) -> str:
        p = self.default if team is None else self.for_team(team)
        net = (
            f", network < {p.network_threshold_bytes_per_second:,.0f} B/s"
            if p.network_threshold_bytes_per_second
            else ""
        )
        return (
            f"idle {p.idle_minutes} min, warn {p.warn_minutes} min before, CPU < {p.cpu_threshold_percent:g}%, "
            f"GPU < {p.gpu_threshold_percent:g}%{net}, max gap {p.max_gap_minutes} min"
        )


def load_policies(path: str | Path | None) -> PolicySet:
    """Either one team policy (JSON, a partial override of the defaults, as in SSM), applied to every
    team, or {"default_policy": {...}, "teams": {"name": {...}}, "gpu_instance_families": [...]}.
    Raises PolicyError naming the file and every bad field."""
    if path is None:
        return PolicySet()
    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolicyError(name, [f"cannot read: {exc.strerror or exc}"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # parse_team_policy reports the JSON error with its position
    structured = isinstance(data, dict) and bool({"default_policy", "teams", "gpu_instance_families"} & data.keys())
    if not structured or not isinstance(data, dict):
        return PolicySet(default=parse_team_policy(name, text, TeamPolicy()), source=name)
    unknown = sorted(set(data) - {"default_policy", "teams", "gpu_instance_families"})
    if unknown:
        raise PolicyError(name, [f"{key}: unknown key" for key in unknown])
    default = parse_team_policy(f"{name} default_policy", json.dumps(data.get("default_policy", {})), TeamPolicy())
    teams_data = data.get("teams", {})
    if not isinstance(teams_data, dict):
        raise PolicyError(name, ["teams: expected an object of team name to policy"])
    teams = {
        str(team): parse_team_policy(f"{name} teams.{team}", json.dumps(value), default)
        for team, value in teams_data.items()
    }
    families = data.get("gpu_instance_families", list(DEFAULT_GPU_FAMILIES))
    if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
        raise PolicyError(name, ["gpu_instance_families: expected a list of instance families"])
    return PolicySet(default=default, teams=teams, source=name, gpu_families=tuple(families))
