"""Team policies and settings in SSM Parameter Store: read, validated, written with optimistic locking."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from idle_reaper.aws.clients import error_code
from idle_reaper.aws.limits import ssm_tier
from idle_reaper.organization import ORGANIZATION_PARAMETER, OrganizationSettings, parse_organization_settings
from idle_reaper.policy import (
    PolicyError,
    Settings,
    TeamPolicyRef,
    default_source,
    parse_settings,
    parse_team_policy,
)

# ---------------------------------------------------------------------------------------------
# Policies (SSM)


class PolicyStore:
    """Reads `{prefix}/settings` and every `{prefix}/teams/*` in as few calls as possible."""

    def __init__(self, ssm: Any, prefix: str) -> None:
        self.ssm = ssm
        self.prefix = prefix

    @property
    def settings_name(self) -> str:
        return f"{self.prefix}/settings"

    def team_name(self, team: str) -> str:
        return f"{self.prefix}/teams/{team}"

    def load_settings(self) -> tuple[Settings, int | None]:
        """Raises PolicyError when the parameter is invalid; defaults when it does not exist."""
        try:
            param = self.ssm.get_parameter(Name=self.settings_name)["Parameter"]
        except ClientError as exc:
            if error_code(exc) == "ParameterNotFound":
                return Settings(), None
            raise
        return parse_settings(self.settings_name, param["Value"]), int(param["Version"])

    @property
    def organization_name(self) -> str:
        return f"{self.prefix}/{ORGANIZATION_PARAMETER}"

    def load_organization(self) -> OrganizationSettings:
        """`{prefix}/organization` (organization mode's exclusions and per-account defaults); absent: nothing
        excluded, no other defaults. Raises PolicyError naming the parameter and each bad field when it is
        invalid, AwsError when it cannot be read. The one reader of it: the sweep, the doctor, `status`, `policy
        show`, the import and Slack answers all see the same settings."""
        stored = self.read(self.organization_name)
        return parse_organization_settings(stored.name, stored.value) if stored else OrganizationSettings()

    def load_teams(self, settings: Settings) -> dict[str, TeamPolicyRef]:
        refs: dict[str, TeamPolicyRef] = {}
        for param in self.stored_teams():
            team = param.name.rsplit("/", 1)[-1]
            # One team's bad parameter puts that team alone in safe mode; the rest of the fleet is swept.
            # parse_team_policy turns every failure into a PolicyError; the catch-all is a second net.
            try:
                policy = parse_team_policy(param.name, param.value, settings.default_policy)
                refs[team] = TeamPolicyRef(team=team, policy=policy, source=param.name, version=param.version)
            except Exception as exc:
                error = exc if isinstance(exc, PolicyError) else PolicyError(param.name, [f"{type(exc).__name__}"])
                refs[team] = TeamPolicyRef(
                    team=team, policy=None, source=param.name, version=param.version, error=str(error)
                )
        return refs

    # Plain boto3 rather than Powertools parameters: their providers return the value alone, and the
    # version is what decisions record and `policy put` compares. A sweep reads afresh each run (one
    # GetParameter plus one GetParametersByPath per 10 teams), so a change applies at the next sweep.

    def stored_teams(self) -> list[StoredParameter]:
        """Every team parameter with its version, 10 per call (GetParametersByPath's maximum)."""
        found: list[StoredParameter] = []
        pages = self.ssm.get_paginator("get_parameters_by_path").paginate(
            Path=f"{self.prefix}/teams/", Recursive=False, PaginationConfig={"PageSize": 10}
        )
        for page in pages:
            found += [StoredParameter.of(param) for param in page["Parameters"]]
        return found

    def read(self, name: str) -> StoredParameter | None:
        """One parameter with its version and last change; None when it does not exist."""
        try:
            return StoredParameter.of(self.ssm.get_parameter(Name=name)["Parameter"])
        except ClientError as exc:
            if error_code(exc) == "ParameterNotFound":
                return None
            raise

    def put(self, name: str, value: str, overwrite: bool = True) -> int:
        """Write `value` in the tier that holds it (aws/limits.py ssm_tier): no tier asked up to 4,096 characters
        (a new parameter is Standard, the account's default; one already Advanced stays so, as SSM cannot
        downgrade it), Advanced up to 8,192 ($0.05 a month). TooLargeToStore beyond, before anything is sent."""
        tier = ssm_tier(value, name)
        more = {"Tier": tier} if tier != "Standard" else {}
        out = self.ssm.put_parameter(Name=name, Value=value, Type="String", Overwrite=overwrite, **more)
        return int(out["Version"])

    def put_if_version(self, name: str, value: str, expected: int | None) -> int:
        """Write `value` only if the parameter is still at version `expected` (None: does not exist).

        SSM has no compare-and-swap. Creation is exact (Overwrite=False fails if someone created it
        first). An update re-reads the version right before PutParameter; a write landing between that
        read and ours (milliseconds) is not prevented, but it is detected afterwards: the new version is
        then not expected + 1 and LostUpdate says which versions were overwritten."""
        current = self.read(name)
        found = current.version if current else None
        if found != expected:
            raise VersionConflict(name, expected, found)
        try:
            version = self.put(name, value, overwrite=expected is not None)
        except ClientError as exc:
            if error_code(exc) == "ParameterAlreadyExists":
                raise VersionConflict(name, expected, None) from None
            raise
        if expected is not None and version != expected + 1:
            raise LostUpdate(name, expected, version)
        return version


@dataclass(frozen=True)
class StoredParameter:
    name: str
    value: str
    version: int
    last_modified: datetime | None

    @classmethod
    def of(cls, param: Mapping[str, Any]) -> StoredParameter:
        modified = param.get("LastModifiedDate")
        return cls(
            name=param["Name"],
            value=param["Value"],
            version=int(param["Version"]),
            last_modified=modified.astimezone(UTC) if isinstance(modified, datetime) else None,
        )


class VersionConflict(Exception):
    """The parameter changed since it was read: nothing was written."""

    def __init__(self, name: str, expected: int | None, found: int | None) -> None:
        self.name, self.expected, self.found = name, expected, found
        was = f"v{expected}" if expected is not None else "absent"
        now = f"v{found}" if found is not None else "created by someone else" if expected is None else "absent"
        super().__init__(f"{name} changed since it was read (was {was}, now {now}); nothing was written")


class LostUpdate(Exception):
    """Our write landed, but another write slipped in between the version check and it."""

    def __init__(self, name: str, expected: int, written: int) -> None:
        self.name, self.expected, self.written = name, expected, written
        others = ", ".join(f"v{v}" for v in range(expected + 1, written))
        super().__init__(
            f"{name} is now v{written} (ours), but {others} was written by someone else between our check and "
            f"our write and is now overwritten; review it with `aws ssm get-parameter-history --name {name}`"
        )


def policy_for(team: str, refs: Mapping[str, TeamPolicyRef], settings: Settings) -> TeamPolicyRef:
    return refs.get(team) or TeamPolicyRef(
        team=team, policy=settings.default_policy, source=default_source(settings), version=None
    )
