"""In-memory fakes of AWS Organizations and STS for organization mode at scale (benchmarks/organization_calls.py):
an organization of nested OUs and accounts, with the real APIs' page limits (ListAccountsForParent and
ListChildren answer at most 20 a page), and AssumeRole answering credentials that expire an hour later."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, ClassVar

from testkit.aws.clients import ACCOUNT, FakeClient, api

# Per-call latency (seconds) of the calls organization mode adds, beside testkit.aws.clients.LATENCY: STS
# regional AssumeRole, and Organizations (a global service with one endpoint in us-east-1, so a hub in another
# region pays a cross-region round trip on top).
ORGANIZATION_LATENCY: dict[str, float] = {
    "sts:AssumeRole": 0.05,
    "organizations:DescribeOrganization": 0.15,
    "organizations:ListAccountsForParent": 0.15,
    "organizations:ListChildren": 0.15,
    "organizations:DescribeAccount": 0.15,
}
PAGE = 20  # the most ListAccountsForParent and ListChildren return in one page


class FakeOrganizations(FakeClient):
    service = "organizations"
    paginators: ClassVar[dict[str, tuple[str, str]]] = {
        "list_accounts_for_parent": ("list_accounts_for_parent", "MaxResults"),
        "list_children": ("list_children", "MaxResults"),
    }
    _invalid_token_code = "InvalidInputException"

    def __init__(self, management: str = ACCOUNT) -> None:
        super().__init__()
        self.management = management
        self.root = "r-ab12"
        self.ous: dict[str, str] = {}  # ou id -> parent id
        self.accounts: dict[str, dict[str, Any]] = {}  # id -> {Name, Status, parent}
        self._ids = itertools.count(100000000000)

    def add_ou(self, parent: str) -> str:
        ou = f"ou-ab12-{len(self.ous):08d}"
        self.ous[ou] = parent
        return ou

    def add_account(self, parent: str, name: str = "", status: str = "ACTIVE") -> str:
        account = str(next(self._ids))
        self.accounts[account] = {"Name": name or f"account-{account}", "Status": status, "parent": parent}
        return account

    def _account(self, account: str) -> dict[str, Any]:
        found = self.accounts[account]
        return {"Id": account, "Name": found["Name"], "Status": found["Status"], "State": found["Status"]}

    @api
    def describe_organization(self) -> dict[str, Any]:
        self._call("DescribeOrganization", {})
        return {"Organization": {"Id": "o-a1b2c3d4e5", "MasterAccountId": self.management}}

    @api
    def list_accounts_for_parent(
        self, ParentId: str, MaxResults: int = PAGE, NextToken: str | None = None
    ) -> dict[str, Any]:
        self._call("ListAccountsForParent", {"ParentId": ParentId})
        page, token = self._page(
            "ListAccountsForParent",
            NextToken,
            min(MaxResults, PAGE),
            lambda: [self._account(a) for a, v in self.accounts.items() if v["parent"] == ParentId],
        )
        return {"Accounts": page, **({"NextToken": token} if token else {})}

    @api
    def list_children(
        self, ParentId: str, ChildType: str, MaxResults: int = PAGE, NextToken: str | None = None
    ) -> dict[str, Any]:
        self._call("ListChildren", {"ParentId": ParentId, "ChildType": ChildType})
        page, token = self._page(
            "ListChildren",
            NextToken,
            min(MaxResults, PAGE),
            lambda: [{"Id": ou, "Type": ChildType} for ou, parent in self.ous.items() if parent == ParentId],
        )
        return {"Children": page, **({"NextToken": token} if token else {})}

    @api
    def describe_account(self, AccountId: str) -> dict[str, Any]:
        self._call("DescribeAccount", {"AccountId": AccountId})
        if AccountId not in self.accounts:
            raise self._error(
                "DescribeAccount", "AccountNotFoundException", "You specified an account that doesn't exist."
            )
        return {"Account": self._account(AccountId)}


class FakeSts(FakeClient):
    service = "sts"

    def __init__(self, clock: Callable[[], datetime]) -> None:
        super().__init__()
        self.clock = clock
        self._keys = itertools.count(1)

    @api
    def assume_role(self, RoleArn: str, RoleSessionName: str, DurationSeconds: int = 3600) -> dict[str, Any]:
        self._call("AssumeRole", {"RoleArn": RoleArn, "RoleSessionName": RoleSessionName})
        key = next(self._keys)
        return {
            "Credentials": {
                "AccessKeyId": f"ASIAFAKE{key:012d}",
                "SecretAccessKey": "fake",
                "SessionToken": "fake",
                "Expiration": self.clock() + timedelta(seconds=DurationSeconds),
            },
            "AssumedRoleUser": {"Arn": f"{RoleArn}/{RoleSessionName}"},
        }
