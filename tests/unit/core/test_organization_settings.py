"""Organization mode's run-time settings (SSM `{prefix}/organization`): exclusions and other default policies
per account or OU, validated like every other setting; and the member role's name."""

from __future__ import annotations

import fnmatch
import json

import pytest

from idle_reaper.organization import (
    READ_ROLE_SUFFIX,
    member_read_role_name,
    member_role_arn,
    member_role_name,
    parse_organization_settings,
    role_names_too_long,
    role_suffix_for,
)
from idle_reaper.policy import PolicyError, Settings, TeamPolicy, default_source

PARAMETER = "/idle-reaper/organization"
SANDBOX, PROD, OTHER = "111111111111", "222222222222", "333333333333"
SANDBOX_OU, PROD_OU = "ou-ab12-sandbox1", "ou-ab12-prodprod"


def parsed(value: object) -> object:
    return parse_organization_settings(PARAMETER, json.dumps(value))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"exclude": [PROD, "22222222222"]}, "exclude[1]: not an AWS account id (12 digits) or organizational unit id"),
        ({"exclude": ["r-ab12"]}, "exclude[0]: not an AWS account id"),
        ({"exclude": [PROD, PROD]}, "exclude: account or OU listed more than once: 222222222222"),
        (
            {"defaults": [{"accounts": [SANDBOX_OU], "default_policy": {"idle_minutes": -5}}]},
            "defaults[0].default_policy.idle_minutes:",
        ),
        ({"defaults": [{"accounts": [], "default_policy": {}}]}, "defaults[0].accounts: List should have at least 1"),
        ({"excluded": [PROD]}, "excluded: unknown field"),
    ],
)
def test_a_bad_organization_parameter_names_the_parameter_and_the_field(value: object, problem: str) -> None:
    with pytest.raises(PolicyError) as raised:
        parsed(value)
    assert raised.value.parameter == PARAMETER
    assert any(p.startswith(problem) or problem in p for p in raised.value.problems), raised.value.problems


def test_an_account_is_excluded_by_its_id_or_any_ou_above_it() -> None:
    settings = parse_organization_settings(PARAMETER, json.dumps({"exclude": [PROD, PROD_OU]}))
    assert settings.excludes(PROD)
    assert settings.excludes(OTHER, parents=("ou-ab12-team0001", PROD_OU))  # a nested OU under production
    assert not settings.excludes(SANDBOX, parents=(SANDBOX_OU,))
    assert not parse_organization_settings(PARAMETER, "{}").excludes(PROD)


def test_the_nearest_named_default_wins_and_unnamed_accounts_keep_the_settings_default() -> None:
    settings = parse_organization_settings(
        PARAMETER,
        json.dumps(
            {
                "defaults": [
                    {"accounts": [SANDBOX_OU], "default_policy": {"idle_minutes": 45}},
                    {"accounts": [SANDBOX], "default_policy": {"idle_minutes": 15, "warn_minutes": 5}},
                ]
            }
        ),
    )
    base = TeamPolicy(idle_minutes=120, warn_minutes=30)
    assert settings.default_for(SANDBOX, (SANDBOX_OU,), base).idle_minutes == 15  # the account itself first
    in_ou = settings.default_for(OTHER, ("ou-ab12-team0001", SANDBOX_OU), base)
    assert (in_ou.idle_minutes, in_ou.warn_minutes) == (45, TeamPolicy().warn_minutes)  # the rest: the defaults
    assert settings.default_for(PROD, (PROD_OU,), base) == base
    # Each says which entry of the organization settings it is, and how the account came by it.
    on_settings = Settings(default_policy=base)
    assert default_source(on_settings) == "settings.default_policy"
    own = on_settings.model_copy(update={"default_policy": settings.default_for(SANDBOX, (SANDBOX_OU,), base)})
    assert default_source(own) == f"organization.defaults[1].default_policy (account {SANDBOX})"
    via = on_settings.model_copy(update={"default_policy": in_ou})
    assert default_source(via) == f"organization.defaults[0].default_policy (account {OTHER} via {SANDBOX_OU})"
    assert in_ou.model_dump() == settings.defaults[0].default_policy.model_dump()  # the label is not a field
    assert (
        "_source" not in json.dumps(in_ou.model_dump()) and "source" not in TeamPolicy.model_json_schema()["properties"]
    )


def test_the_member_role_is_one_per_region_named_after_the_prefix() -> None:
    assert member_role_name("idle-reaper", "eu-west-1") == "idle-reaper-member-eu-west-1"
    assert member_role_arn("aws", SANDBOX, "ml-reaper", "us-east-2") == (
        f"arn:aws:iam::{SANDBOX}:role/ml-reaper-member-us-east-2"
    )
    # IAM's limit on a role name holds for the longest prefix and region name.
    assert len(member_role_name("p" * 32, "ap-southeast-5")) <= 64


def test_the_digest_has_a_read_role_per_region_that_the_member_role_pattern_does_not_cover() -> None:
    assert member_read_role_name("idle-reaper", "eu-west-1") == "idle-reaper-digest-read-eu-west-1"
    assert member_role_arn("aws", SANDBOX, "ml-reaper", "us-east-2", READ_ROLE_SUFFIX) == (
        f"arn:aws:iam::{SANDBOX}:role/ml-reaper-digest-read-us-east-2"
    )
    # The sweep's and the Slack endpoint's `{prefix}-member-*` never matches it, nor the digest's the member role.
    member_glob, read_glob = member_role_name("idle-reaper", "*"), member_read_role_name("idle-reaper", "*")
    assert not fnmatch.fnmatchcase(member_read_role_name("idle-reaper", "us-east-1"), member_glob)
    assert not fnmatch.fnmatchcase(member_role_name("idle-reaper", "us-east-1"), read_glob)
    assert len(member_read_role_name("p" * 32, "ap-southeast-5")) <= 64


def test_each_purpose_assumes_its_own_role_and_an_unknown_purpose_none() -> None:
    assert role_suffix_for("sweep") == role_suffix_for("answer") == "member"
    assert role_suffix_for("digest") == READ_ROLE_SUFFIX
    with pytest.raises(ValueError, match="no member role for purpose 'report'"):
        role_suffix_for("report")


def test_a_role_name_over_iams_limit_is_named_by_its_region() -> None:
    assert role_names_too_long("p" * 32, ["eu-west-1", "ap-southeast-5"]) == []
    long_region = "us-gov-northwestern-12"  # the context's pattern allows it; no real region is this long
    problems = role_names_too_long("p" * 32, ["eu-west-1", long_region])
    assert len(problems) == 1 and problems[0].startswith("organization.regions[1]: the role name ")
    assert "digest-read" in problems[0] and "over IAM's 64" in problems[0]
