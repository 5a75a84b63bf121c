"""Just enough IAM to check the stack's policies: CloudFormation intrinsics resolved to realistic strings,
and an Allow/Deny evaluator for identity policies (wildcards, and the condition operators the stack uses).

Anything outside that subset (NotAction, an unknown operator or intrinsic) raises instead of guessing, so a
policy this module cannot judge fails its test rather than passing it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ACCOUNT = "123456789012"
STACK_NAME = "IdleReaper"  # every region's stack's CloudFormation name (IdleReaperProps.stack_name)
STACK_UUID = "4e2b8c10-7a3d-11ef-9f2e-0a1b2c3d4e5f"  # CloudFormation appends one to a stack's ARN
ASSOCIATION_ID = "5b1e0a7c-3d2f-4e8a-9c61-0f2b7d4e8a13"


@dataclass(frozen=True)
class Environment:
    """How the template's references look once deployed."""

    region: str
    template: Mapping[str, Any]
    partition: str = "aws"
    account: str = ACCOUNT

    def arn(self, service: str, resource: str, region: str | None = None) -> str:
        return f"arn:{self.partition}:{service}:{self.region if region is None else region}:{self.account}:{resource}"

    def _physical(self, logical_id: str) -> dict[str, str]:
        """Ref and Arn of a template resource, named as AWS names them."""
        resource = self.template["Resources"][logical_id]
        props, kind = resource.get("Properties", {}), resource["Type"]
        if kind == "AWS::S3::Bucket":  # S3 ARNs name no region and no account
            bucket = str(self.resolve(props["BucketName"])) if "BucketName" in props else logical_id.lower()
            return {"Ref": bucket, "Arn": f"arn:{self.partition}:s3:::{bucket}"}
        name = str(
            props.get("TableName")
            or props.get("FunctionName")
            or props.get("StateMachineName")
            or props.get("Name")
            or logical_id.lower()
        )
        if kind == "AWS::DynamoDB::Table":
            return {"Ref": name, "Arn": self.arn("dynamodb", f"table/{name}")}
        if kind == "AWS::SecretsManager::Secret":
            arn = self.arn("secretsmanager", f"secret:{name}-Ab12Cd")  # AWS appends six random characters
            return {"Ref": arn, "Arn": arn}
        if kind == "AWS::Lambda::Function":
            return {"Ref": name, "Arn": self.arn("lambda", f"function:{name}")}
        if kind == "AWS::Logs::LogGroup":
            group = str(props.get("LogGroupName") or f"/aws/lambda/{logical_id}")
            return {"Ref": group, "Arn": self.arn("logs", f"log-group:{group}:*")}
        if kind == "AWS::SQS::Queue":
            return {
                "Ref": f"https://sqs.{self.region}.amazonaws.com/{self.account}/{name}",
                "Arn": self.arn("sqs", name),
            }
        if kind == "AWS::SNS::Topic":
            arn = self.arn("sns", name)
            return {"Ref": arn, "Arn": arn}
        if kind == "AWS::StepFunctions::StateMachine":
            arn = self.arn("states", f"stateMachine:{name}")
            return {"Ref": arn, "Arn": arn}
        if kind == "AWS::Events::Rule":
            arn = self.arn("events", f"rule/{name}")
            return {"Ref": name, "Arn": arn}
        if kind == "AWS::CloudWatch::Alarm":
            alarm = str(props.get("AlarmName") or logical_id)
            return {"Ref": alarm, "Arn": self.arn("cloudwatch", f"alarm:{alarm}")}
        if kind == "AWS::SSM::Association":  # AWS makes up the association's id
            return {"Ref": ASSOCIATION_ID, "AssociationId": ASSOCIATION_ID}
        if kind == "AWS::IAM::Role":
            return {"Ref": name, "Arn": f"arn:{self.partition}:iam::{self.account}:role/{name}"}
        raise NotImplementedError(f"no realistic name for a {kind} ({logical_id})")

    def resolve(self, value: Any) -> Any:
        """The value with every intrinsic function replaced by what CloudFormation would put there."""
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1 or not next(iter(value)).startswith(("Fn::", "Ref")):
            return {k: self.resolve(v) for k, v in value.items()}
        [(function, args)] = value.items()
        if function == "Ref":
            pseudo = {
                "AWS::Partition": self.partition,
                "AWS::Region": self.region,
                "AWS::AccountId": self.account,
                "AWS::URLSuffix": "amazonaws.com",
                "AWS::StackName": STACK_NAME,
                "AWS::StackId": self.arn("cloudformation", f"stack/{STACK_NAME}/{STACK_UUID}"),
            }
            return pseudo[args] if args in pseudo else self._physical(args)["Ref"]
        if function == "Fn::GetAtt":
            logical_id, attribute = args if isinstance(args, list) else args.split(".", 1)
            return self._physical(logical_id)[attribute]
        if function == "Fn::Join":
            separator, parts = args
            return separator.join(str(self.resolve(p)) for p in parts)
        if function == "Fn::Sub":
            text, names = (args, {}) if isinstance(args, str) else (args[0], self.resolve(args[1]))

            def substitute(match: re.Match[str]) -> str:
                name = match.group(1)
                if name in names:
                    return str(names[name])
                ref = {"Ref": name} if "." not in name else {"Fn::GetAtt": name.split(".", 1)}
                return str(self.resolve(ref))

            return re.sub(r"\$\{([^}!]+)\}", substitute, text)
        if function == "Fn::Select":
            index, items = args
            return self.resolve(items)[int(index)]
        if function == "Fn::Split":
            separator, text = args
            return str(self.resolve(text)).split(separator)
        raise NotImplementedError(f"intrinsic {function}")


# -- evaluation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    effect: str
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    conditions: Mapping[str, Mapping[str, Any]]
    sid: str = ""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Statement:
        unsupported = {"NotAction", "NotResource", "NotPrincipal", "Principal"} & raw.keys()
        if unsupported:
            raise NotImplementedError(f"statement elements {sorted(unsupported)}")
        if raw["Effect"] not in ("Allow", "Deny"):
            raise ValueError(f"Effect must be Allow or Deny, not {raw['Effect']!r}")
        return cls(
            effect=raw["Effect"],
            actions=tuple(_as_list(raw["Action"])),
            resources=tuple(_as_list(raw["Resource"])),
            conditions=raw.get("Condition", {}),
            sid=raw.get("Sid", ""),
        )


@dataclass(frozen=True)
class Request:
    """One API call as IAM sees it: the action, the resource ARN it names, and its context keys."""

    action: str
    resource: str
    context: Mapping[str, str | tuple[str, ...]]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def wildcard_match(pattern: str, value: str, *, case_sensitive: bool = True) -> bool:
    """IAM's wildcards: `*` any run of characters (across `:` and `/` too), `?` one character."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, flags=0 if case_sensitive else re.IGNORECASE) is not None


def _operator_matches(operator: str, expected: list[str], actual: str) -> bool:
    if operator == "StringEquals":
        return actual in expected
    if operator == "StringLike":
        return any(wildcard_match(p, actual) for p in expected)
    if operator == "StringNotEquals":
        return actual not in expected
    if operator == "ArnLike":
        return any(wildcard_match(p, actual) for p in expected)
    raise NotImplementedError(f"condition operator {operator}")


def condition_holds(operator: str, key: str, expected: Any, context: Mapping[str, str | tuple[str, ...]]) -> bool:
    values = [str(v) for v in _as_list(expected)]
    qualifier, _, base = operator.rpartition(":")
    if base.endswith("IfExists"):
        raise NotImplementedError(f"condition operator {operator}")
    actual = context.get(key)
    requested = list(actual) if isinstance(actual, tuple) else [] if actual is None else [actual]
    if qualifier == "ForAllValues":
        # True when every value in the request matches (vacuously true when the key is absent, as in IAM).
        return all(_operator_matches(base, values, a) for a in requested)
    if qualifier == "ForAnyValue":
        return any(_operator_matches(base, values, a) for a in requested)
    if qualifier:
        raise NotImplementedError(f"condition qualifier {qualifier}")
    if actual is None:
        # A missing key never satisfies a positive operator; a negated one is then true.
        return base.startswith("StringNot")
    if isinstance(actual, tuple):
        raise ValueError(f"{key} is multi-valued: use ForAllValues or ForAnyValue")
    return _operator_matches(base, values, actual)


def statement_applies(statement: Statement, request: Request) -> bool:
    return (
        any(wildcard_match(a, request.action, case_sensitive=False) for a in statement.actions)
        and any(wildcard_match(r, request.resource) for r in statement.resources)
        and all(
            condition_holds(operator, key, expected, request.context)
            for operator, block in statement.conditions.items()
            for key, expected in block.items()
        )
    )


def decide(statements: Iterable[Statement], request: Request) -> str:
    """ "Allow", "ExplicitDeny" or "ImplicitDeny", as IAM decides for identity policies alone."""
    matching = [s for s in statements if statement_applies(s, request)]
    if any(s.effect == "Deny" for s in matching):
        return "ExplicitDeny"
    return "Allow" if matching else "ImplicitDeny"


def role_statements(template: Mapping[str, Any], env: Environment, role_logical_id: str) -> list[Statement]:
    """Every identity-policy statement attached to a role, resolved."""
    found = []
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::IAM::Policy" and {"Ref": role_logical_id} in resource["Properties"]["Roles"]:
            found += resource["Properties"]["PolicyDocument"]["Statement"]
    role = template["Resources"][role_logical_id]["Properties"]
    for policy in role.get("Policies", []):
        found += policy["PolicyDocument"]["Statement"]
    if role.get("ManagedPolicyArns"):
        raise NotImplementedError("managed policies: list their statements here")
    return [Statement.of(env.resolve(s)) for s in found]
