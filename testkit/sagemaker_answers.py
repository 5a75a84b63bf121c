"""SageMaker's answers for real-time endpoints, in the shapes botocore parses them into (DescribeEndpoint,
DescribeEndpointConfig), for the pure tests and the adapter's; the integration tests get theirs from moto."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from idle_reaper.core.endpoints import EndpointFacts, endpoint_id, variants_of
from idle_reaper.core.kinds import InstanceFacts
from idle_reaper.core.signals import Machine


def variant(
    name: str = "AllTraffic", instance_type: str = "ml.g5.2xlarge", count: int = 1, model: str | None = "model-a"
) -> dict[str, Any]:
    """One ProductionVariants item of an endpoint configuration (model None: inference components)."""
    item: dict[str, Any] = {"VariantName": name, "InstanceType": instance_type, "InitialInstanceCount": count}
    if model:
        item["ModelName"] = model
    return item


def serverless_variant(name: str = "AllTraffic", model: str = "model-a") -> dict[str, Any]:
    return {"VariantName": name, "ModelName": model, "ServerlessConfig": {"MemorySizeInMB": 2048, "MaxConcurrency": 5}}


def endpoint_config(name: str = "config-a", *variants: dict[str, Any]) -> dict[str, Any]:
    return {"EndpointConfigName": name, "ProductionVariants": list(variants) or [variant()]}


def describe_endpoint(
    name: str = "demo", config: dict[str, Any] | None = None, status: str = "InService"
) -> dict[str, Any]:
    """DescribeEndpoint of an endpoint running `config` (each variant at its initial count)."""
    config = config or endpoint_config()
    running = []
    for v in config["ProductionVariants"]:
        item: dict[str, Any] = {"VariantName": v["VariantName"]}
        if "ServerlessConfig" in v:
            item["CurrentServerlessConfig"] = v["ServerlessConfig"]
        else:
            item["CurrentInstanceCount"] = item["DesiredInstanceCount"] = v["InitialInstanceCount"]
        running.append(item)
    return {
        "EndpointName": name,
        "EndpointArn": f"arn:aws:sagemaker:eu-west-1:123456789012:endpoint/{name}",
        "EndpointConfigName": config["EndpointConfigName"],
        "EndpointStatus": status,
        "ProductionVariants": running,
        "LastModifiedTime": datetime(2026, 11, 1, tzinfo=UTC),
    }


def endpoint_facts(
    name: str = "demo",
    config: dict[str, Any] | None = None,
    *,
    status: str = "InService",
    gone: bool = False,
    missing: tuple[str, ...] = (),
    min_capacity: dict[str, int] | None = None,
    tags: dict[str, str] | None = None,
) -> EndpointFacts:
    """What the adapter makes of those answers (`gone`: its configuration could not be found)."""
    config = config or endpoint_config()
    answer = describe_endpoint(name, config, status)
    return EndpointFacts(
        name=name,
        status=status,
        config=config["EndpointConfigName"],
        variants=variants_of(answer, None if gone else config, min_capacity or {}),
        missing=(f"endpoint configuration {config['EndpointConfigName']}",) if gone else missing,
        tags=tuple(sorted((tags or {"Team": "ml", "Owner": "U0OWNER", "idle-reaper:managed": "true"}).items())),
    )


def endpoint_machine(facts: EndpointFacts, launch_time: datetime, team: str = "ml", owner: str = "U0OWNER") -> Machine:
    return Machine(
        instance_id=endpoint_id(facts.name),
        instance_type=facts.hardware,
        team=team,
        launch_time=launch_time,
        name=facts.name,
        owner=owner,
        facts=InstanceFacts(endpoint=facts),
    )
