"""A fake SSM Parameter Store: the calls PolicyStore makes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from testkit.aws.clients import ACCOUNT, REGION, FakeClient, api

# ---------------------------------------------------------------------------------------------
# SSM Parameter Store


class FakeSSM(FakeClient):
    service = "ssm"
    paginators: ClassVar[dict[str, tuple[str, str]]] = {
        "get_parameters_by_path": ("get_parameters_by_path", "MaxResults")
    }
    _invalid_token_code = "ValidationException"

    def __init__(self) -> None:
        super().__init__()
        self.parameters: dict[str, dict[str, Any]] = {}

    @api
    def get_parameter(self, Name: str, WithDecryption: bool = False) -> dict[str, Any]:
        self._call("GetParameter", {"Name": Name})
        if Name not in self.parameters:
            raise self._error("GetParameter", "ParameterNotFound", f"Parameter {Name} not found.")
        return {"Parameter": dict(self.parameters[Name])}

    @api
    def get_parameters_by_path(
        self,
        Path: str,
        Recursive: bool = False,
        MaxResults: int | None = None,
        NextToken: str | None = None,
        WithDecryption: bool = False,
    ) -> dict[str, Any]:
        op = "GetParametersByPath"
        self._call(op, {"Path": Path, "Recursive": Recursive, "MaxResults": MaxResults})
        if MaxResults is not None and not 1 <= MaxResults <= 10:
            raise self._error(
                op, "ValidationException", "1 validation error detected: Value at 'maxResults' must be <= 10"
            )
        if not Path.startswith("/"):
            raise self._error(op, "ValidationException", "The parameter doesn't meet the parameter name requirements.")
        base = Path.rstrip("/") + "/"

        def everything() -> list[dict[str, Any]]:
            under = [n for n in sorted(self.parameters) if n.startswith(base)]
            if not Recursive:
                under = [n for n in under if "/" not in n[len(base) :]]
            return [dict(self.parameters[n]) for n in under]

        page, token = self._page(op, NextToken, MaxResults or 10, everything)
        return {"Parameters": page, **({"NextToken": token} if token else {})}

    @api
    def put_parameter(
        self,
        Name: str,
        Value: str,
        Type: str = "String",
        Overwrite: bool = False,
        **_: Any,
    ) -> dict[str, Any]:
        op = "PutParameter"
        self._call(op, {"Name": Name, "Value": Value, "Type": Type, "Overwrite": Overwrite})
        if len(Value.encode()) > 4096:
            raise self._error(op, "ValidationException", "Standard tier parameters support a maximum of 4 KB")
        if Name in self.parameters and not Overwrite:
            raise self._error(op, "ParameterAlreadyExists", "The parameter already exists.")
        return {"Version": self.store(Name, Value, Type), "Tier": "Standard"}

    def store(self, name: str, value: str, type_: str = "String") -> int:
        """Set a parameter directly (seeding; not counted as a call). Returns its new version."""
        existing = self.parameters.get(name)
        version = int(existing["Version"]) + 1 if existing else 1
        self.parameters[name] = {
            "Name": name,
            "Type": type_,
            "Value": value,
            "Version": version,
            "LastModifiedDate": datetime.now(UTC),
            "ARN": f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter{name}",
            "DataType": "text",
        }
        return version
