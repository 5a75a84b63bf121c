"""Organization mode's shapes (issue 30): the ids AWS Organizations uses, what an admin chooses at deploy time
(CDK context `organization`), what admins tune later (SSM `{prefix}/organization`), and the member role's name.

One hub account runs the sweep and the Slack endpoint; a service-managed StackSet puts a small member stack
(a role the hub assumes, the GPU agent and activity collector associations) into every account of the target
OUs, in every listed region. Where each choice lives:

- deploy time (CDK context, `OrganizationContext`): whether the hub is on, the organization's id (for the
  member role's `aws:PrincipalOrgID` condition), the OUs or roots the StackSet targets and the member regions.
  These are what CloudFormation must know; changing them is a deploy.
- run time (SSM `{prefix}/organization`, `OrganizationSettings`): accounts or OUs that are excluded (their
  machines are never touched, only counted) or get another default policy. Policy, like the team policies:
  tuned without a deploy, validated the same way (an error names the parameter and the field). An excluded
  account keeps its member stack on purpose: the hub still counts its opted-in machines for `status`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from idle_reaper.policy import (
    PolicyError,
    Settings,
    TeamPolicy,
    _describe,
    _identifier,
    _parse_object,
    _validated,
    with_source,
)

# The shapes AWS documents for each id (Organizations API reference, "Id" and "ParentId" patterns).
AccountId = Annotated[str, _identifier("an AWS account id (12 digits, e.g. 123456789012)", r"^\d{12}$", 12)]
OuId = Annotated[
    str,
    _identifier("an organizational unit id (ou-xxxx-yyyyyyyy)", r"^ou-[0-9a-z]{4,32}-[0-9a-z]{8,32}$", 68),
]
RootId = Annotated[str, _identifier("an organization root id (r-xxxx)", r"^r-[0-9a-z]{4,32}$", 34)]
OrganizationId = Annotated[str, _identifier("an organization id (o-xxxxxxxxxx)", r"^o-[a-z0-9]{10,32}$", 34)]
# A StackSet deploys to OUs and roots; an account moves between them without a deploy.
TargetId = Annotated[
    str,
    _identifier(
        "an organizational unit id (ou-xxxx-yyyyyyyy) or root id (r-xxxx)",
        r"^(ou-[0-9a-z]{4,32}-[0-9a-z]{8,32}|r-[0-9a-z]{4,32})$",
        68,
    ),
]
# Exclusions and other defaults name an account or an OU.
AccountOrOuId = Annotated[
    str,
    _identifier(
        "an AWS account id (12 digits) or organizational unit id (ou-xxxx-yyyyyyyy)",
        r"^(\d{12}|ou-[0-9a-z]{4,32}-[0-9a-z]{8,32})$",
        68,
    ),
]
# us-east-1, eu-central-2, us-gov-west-1, cn-northwest-1, ap-southeast-7, ...
RegionName = Annotated[str, _identifier("an AWS region name (e.g. us-east-1)", r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$", 25)]

MEMBER_ROLE_SUFFIX = "member"
# The member stack's second role: read-only (cloudwatch:GetMetricData), trusted by the weekly digest alone. Not
# named like the member role (`{prefix}-member-*`), so the sweep's and the Slack endpoint's permission to assume
# member roles does not cover it, and the digest's permission covers nothing else.
READ_ROLE_SUFFIX = "digest-read"
# Which member role each hub purpose assumes: the sweep (and its shard workers) and a Slack answer act on
# machines; the digest only reads their metrics.
ROLE_OF_PURPOSE = {"sweep": MEMBER_ROLE_SUFFIX, "answer": MEMBER_ROLE_SUFFIX, "digest": READ_ROLE_SUFFIX}
ROLE_NAME_LIMIT = 64  # IAM's limit on a role name
ORGANIZATION_PARAMETER = "organization"  # {ssm_prefix}/organization


def member_role_name(prefix: str, region: str, suffix: str = MEMBER_ROLE_SUFFIX) -> str:
    """A role the hub assumes in a member account, one per region (each region's member stack owns its own;
    IAM names are account-wide): the member role, or with `suffix` READ_ROLE_SUFFIX the digest's read role.
    Nothing the hub stack creates is named like them, so a hub that sits in a target OU gets its member stack
    beside its own stack without a clash."""
    return f"{prefix}-{suffix}-{region}"


def member_read_role_name(prefix: str, region: str) -> str:
    """The read-only role the weekly digest assumes in a member account (cloudwatch:GetMetricData only)."""
    return member_role_name(prefix, region, READ_ROLE_SUFFIX)


def role_suffix_for(purpose: str) -> str:
    """The member role a hub purpose assumes (ROLE_OF_PURPOSE); an unknown purpose is refused, never given the
    role that acts on machines by default."""
    try:
        return ROLE_OF_PURPOSE[purpose]
    except KeyError:
        raise ValueError(f"no member role for purpose {purpose!r} (one of: {', '.join(ROLE_OF_PURPOSE)})") from None


def member_role_arn(partition: str, account: str, prefix: str, region: str, suffix: str = MEMBER_ROLE_SUFFIX) -> str:
    return f"arn:{partition}:iam::{account}:role/{member_role_name(prefix, region, suffix)}"


def role_names_too_long(prefix: str, regions: list[str]) -> list[str]:
    """`organization.regions[i]` problems: a member stack's role name there over IAM's 64 characters (a
    deploy prefix of 32 and a long region name), which CloudFormation would refuse in every member account."""
    problems = []
    for index, region in enumerate(regions):
        for suffix in (MEMBER_ROLE_SUFFIX, READ_ROLE_SUFFIX):
            name = member_role_name(prefix, region, suffix)
            if len(name) > ROLE_NAME_LIMIT:
                problems.append(
                    f"organization.regions[{index}]: the role name {name!r} is {len(name)} characters, over IAM's "
                    f"{ROLE_NAME_LIMIT} (choose a shorter prefix)"
                )
    return problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _unique(values: list[str], what: str) -> list[str]:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} listed more than once: {', '.join(repeated)}")
    return values


class OrganizationContext(_Strict):
    """CDK context `organization` (cdk.json, or `-c organization='{...}'`): the hub and where its members are.

    Absent: single-account mode, exactly as before."""

    enabled: bool = Field(True, description="false keeps the block in cdk.json but deploys single-account mode.")
    organization_id: OrganizationId = Field(alias="organizationId")
    targets: list[TargetId] = Field(min_length=1, max_length=100)
    regions: list[RegionName] = Field(min_length=1, max_length=40)
    # The hub is the management account (SELF) or a delegated administrator for StackSets (DELEGATED_ADMIN).
    delegated_admin: bool = Field(False, alias="delegatedAdmin")

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, value: list[str]) -> list[str]:
        return _unique(value, "target")

    @field_validator("regions")
    @classmethod
    def _unique_regions(cls, value: list[str]) -> list[str]:
        return _unique(value, "region")


class ContextError(ValueError):
    """An invalid `organization` context: `cdk synth` fails with every bad key named."""


def organization_from_context(value: Any) -> OrganizationContext | None:
    """The context value as cdk.json holds it (an object) or as `-c organization=...` passes it (JSON text).
    None (absent, or enabled false): single-account mode."""
    if value is None or value == "":
        return None
    try:
        data = _parse_object("organization", value) if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise PolicyError("organization", [f"(top level): expected a JSON object, got {type(data).__name__}"])
        parsed = OrganizationContext.model_validate(data)
    except PolicyError as exc:
        raise ContextError(f"CDK context {exc}") from None
    except ValidationError as exc:
        problems = [f"organization.{p}" for p in _describe(exc)]
        raise ContextError("CDK context: " + "; ".join(problems)) from None
    return parsed if parsed.enabled else None


class AccountDefault(_Strict):
    """Another default policy for the machines of some accounts (say, stricter sandboxes), used instead of
    `settings.default_policy` for teams without a policy of their own. Fields left out take the product's
    defaults, as in `settings.default_policy`."""

    accounts: list[AccountOrOuId] = Field(min_length=1, max_length=200)
    default_policy: TeamPolicy


class OrganizationSettings(_Strict):
    """SSM `{prefix}/organization`: tuned by admins without a deploy."""

    exclude: list[AccountOrOuId] = Field(
        default_factory=list,
        max_length=500,
        description="Accounts or OUs whose machines are never touched, even with the opt-in tag (counted in status).",
    )
    defaults: list[AccountDefault] = Field(default_factory=list, max_length=50)

    @field_validator("exclude")
    @classmethod
    def _unique_exclusions(cls, value: list[str]) -> list[str]:
        return _unique(value, "account or OU")

    def excludes(self, account: str, parents: tuple[str, ...] = ()) -> bool:
        """Whether an account is excluded by its id or by any OU it sits in (`parents`, nearest first)."""
        return account in self.exclude or any(p in self.exclude for p in parents)

    def default_for(self, account: str, parents: tuple[str, ...], base: TeamPolicy) -> TeamPolicy:
        """The default policy in an account: the entry naming the account itself, else the one naming its
        nearest OU, else `base` (settings.default_policy). The policy returned says which entry it came from
        (policy.default_source: explanations, `status` and `policy show` name it, not settings.default_policy)."""
        for key in (account, *parents):
            for index, entry in enumerate(self.defaults):
                if key in entry.accounts:
                    return with_source(entry.default_policy, default_label(index, account, key))
        return base

    def settings_in(self, settings: Settings, account: str, parents: tuple[str, ...]) -> Settings:
        """The hub's settings as one member account's machines get them: the account's own default policy
        (default_for) for teams without a policy, and as the base of the team policies' unset fields, as the
        sweep applies it (sweep/members.py). `settings` itself when no entry names the account or its OUs."""
        default = self.default_for(account, parents, settings.default_policy)
        if default is settings.default_policy:
            return settings
        return settings.model_copy(update={"default_policy": default})


def default_label(index: int, account: str, key: str) -> str:
    """How an explanation names an account's own default: the field of `{prefix}/organization` it is, and
    whether it applies to the account by its id or through an OU it sits in."""
    field = f"{ORGANIZATION_PARAMETER}.defaults[{index}].default_policy"
    return f"{field} (account {account})" if key == account else f"{field} (account {account} via {key})"


def parse_organization_settings(parameter: str, text: str) -> OrganizationSettings:
    """The parameter's JSON validated whole; a PolicyError names the parameter and every bad field."""
    return _validated(parameter, OrganizationSettings, _parse_object(parameter, text))
