"""SageMaker real-time endpoints: listed with their tags, configuration, models and scaling minimum; deleted one
call each; brought back from what their record kept (core/endpoints.py decides).

ListEndpoints has no tag filter: ListTags is asked for each endpoint that may cost (an account holds a few hundred
at most), concurrently; only those with the team tag (and the opt-in tag `true`, when one is set) are described
further: DescribeEndpoint, DescribeEndpointConfig, DescribeModel of each model, and Application Auto Scaling's
scalable targets of their variants (50 resource ids a call). A call that fails fails the listing (the caller
sweeps no endpoint this time and says so); a configuration or model SageMaker cannot find is a fact (the endpoint
could not be brought back), not a failure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC
from functools import partial
from typing import Any

from idle_reaper.aws.clients import AwsError, chunks, error_code, run_concurrently
from idle_reaper.aws.fleet import ActionOutcome, Fleet
from idle_reaper.aws.notebooks import NotebookInstances
from idle_reaper.aws.studio import StudioApps
from idle_reaper.core.endpoints import FAILED, EndpointFacts, Restore, endpoint_id, endpoint_name, variants_of
from idle_reaper.core.kinds import InstanceFacts
from idle_reaper.core.signals import Machine
from idle_reaper.notify import logger
from idle_reaper.policy import TagKeys

ENDPOINT_WORKERS = 8
# Nothing to decide about: going away, or failed (a failed endpoint runs no instance).
_NOT_RUNNING = frozenset({"Deleting", FAILED})
SCALABLE_TARGETS_PER_CALL = 50  # DescribeScalableTargets' ResourceIds
# SageMaker's answer to a Describe* of a configuration or model that does not exist (ValidationException
# "Could not find endpoint configuration ..."/"Could not find model ...").
_NOT_FOUND = "Could not find"
# What CreateEndpoint answers when it cannot bring an endpoint back, in words (the message's own are kept out of
# Slack: they carry ARNs).
NOT_CREATED = {
    "ResourceLimitExceeded": "the account's SageMaker quota of {type} instances for endpoint usage is reached: ask for "
    "an increase in Service Quotas, or delete another endpoint of that type",
}


class Endpoints:
    def __init__(self, sagemaker: Any, app_autoscaling: Any) -> None:
        self.sagemaker = sagemaker
        self.app_autoscaling = app_autoscaling  # Application Auto Scaling: the variants' minimum capacity

    def discover(
        self, tags: TagKeys, names: Sequence[str] | None = None, failed: list[str] | None = None
    ) -> list[Machine]:
        """The endpoints with the team tag (and the opt-in tag `true`, when one is set), of `names` alone when
        given (endpoint names). `failed` receives the machine ids of the Failed ones (listed, not described: the
        sweep looks for a bring-back of its own among them, sweep/endpoints.py)."""
        listed = [
            s
            for page in self.sagemaker.get_paginator("list_endpoints").paginate()
            for s in page.get("Endpoints", [])
            if names is None or s["EndpointName"] in names
        ]
        if failed is not None:
            failed += [endpoint_id(s["EndpointName"]) for s in listed if s.get("EndpointStatus") == FAILED]
        summaries = [s for s in listed if s.get("EndpointStatus") not in _NOT_RUNNING]
        tagged = run_concurrently(self._tags, [s["EndpointArn"] for s in summaries], ENDPOINT_WORKERS)
        chosen = [
            (summary, tag)
            for summary, tag in zip(summaries, tagged, strict=True)
            if tag.get(tags.team, "").strip() and (not tags.managed or tag.get(tags.managed) == "true")
        ]
        described = run_concurrently(self._described, [s["EndpointName"] for s, _ in chosen], ENDPOINT_WORKERS)
        minimum = self._min_capacity([(d[0]["EndpointName"], d[0]) for d in described])
        machines = []
        for (summary, tag), (endpoint, config, missing) in zip(chosen, described, strict=True):
            name = summary["EndpointName"]
            facts = EndpointFacts(
                name=name,
                status=endpoint.get("EndpointStatus") or summary.get("EndpointStatus") or "",
                config=endpoint.get("EndpointConfigName") or "",
                variants=variants_of(endpoint, config, minimum.get(name, {})),
                missing=missing,
                tags=tuple(sorted(tag.items())),
                asynchronous=bool((config or {}).get("AsyncInferenceConfig")),
            )
            machines.append(
                Machine(
                    instance_id=endpoint_id(name),
                    instance_type=facts.hardware,
                    team=tag[tags.team],
                    # The last change (its creation, or an update): its window starts no earlier.
                    launch_time=summary["LastModifiedTime"].astimezone(UTC),
                    name=name,
                    owner=tag.get(tags.owner),
                    exempt_tag=tag.get(tags.exempt),
                    facts=InstanceFacts(endpoint=facts),
                )
            )
        return sorted(machines, key=lambda m: m.instance_id)

    def _tags(self, arn: str) -> dict[str, str]:
        tags: dict[str, str] = {}
        for page in self.sagemaker.get_paginator("list_tags").paginate(ResourceArn=arn):
            tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
        return tags

    def _described(self, name: str) -> tuple[dict[str, Any], dict[str, Any] | None, tuple[str, ...]]:
        """DescribeEndpoint, its configuration (None: gone), and what of it CreateEndpoint would need and is gone."""
        endpoint: dict[str, Any] = self.sagemaker.describe_endpoint(EndpointName=name)
        config, missing = self.configuration(endpoint.get("EndpointConfigName") or "")
        return endpoint, config, missing

    def configuration(self, config_name: str) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
        """An endpoint configuration (None when SageMaker cannot find it) and what CreateEndpoint would need from
        it that is gone: the configuration itself, or the models it names."""
        found = self._found(lambda: self.sagemaker.describe_endpoint_config(EndpointConfigName=config_name))
        if found is None:
            return None, (f"endpoint configuration {config_name}",)
        models = sorted({v["ModelName"] for v in found.get("ProductionVariants", []) if v.get("ModelName")})
        gone = tuple(f"model {model}" for model in models if self._found(partial(self._model, model)) is None)
        return found, gone

    def _model(self, name: str) -> dict[str, Any]:
        model: dict[str, Any] = self.sagemaker.describe_model(ModelName=name)
        return model

    @staticmethod
    def _found(call: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        try:
            return call()
        except AwsError as exc:
            if error_code(exc) == "ValidationException" and _NOT_FOUND in str(exc):
                return None
            raise

    def _min_capacity(self, endpoints: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, int]]:
        """Application Auto Scaling's MinCapacity of each variant that has a scalable target, by endpoint name."""
        ids = [
            f"endpoint/{name}/variant/{v['VariantName']}"
            for name, answer in endpoints
            for v in answer.get("ProductionVariants", [])
        ]
        found: dict[str, dict[str, int]] = {}
        for batch in chunks(ids, SCALABLE_TARGETS_PER_CALL):
            pages = self.app_autoscaling.get_paginator("describe_scalable_targets").paginate(
                ServiceNamespace="sagemaker",
                ResourceIds=list(batch),
                ScalableDimension="sagemaker:variant:DesiredInstanceCount",
            )
            for page in pages:
                for target in page.get("ScalableTargets", []):
                    _, name, _, variant = target["ResourceId"].split("/", 3)
                    found.setdefault(name, {})[variant] = int(target["MinCapacity"])
        return found

    def failure_reason(self, machine_id: str) -> str:
        """Why SageMaker could not create (or update) the endpoint: its FailureReason ("" when it gives none)."""
        return str(self.sagemaker.describe_endpoint(EndpointName=endpoint_name(machine_id)).get("FailureReason") or "")

    def delete(self, machine_ids: Sequence[str]) -> list[ActionOutcome]:
        """DeleteEndpoint for each (its configuration, models and the record's copy of its tags stay); a refusal
        (it began updating meanwhile: ValidationException) is that endpoint's error, recorded and retried at the
        next sweep."""

        def delete(machine_id: str) -> ActionOutcome:
            try:
                self.sagemaker.delete_endpoint(EndpointName=endpoint_name(machine_id))
            except AwsError as exc:
                return ActionOutcome(machine_id, f"{error_code(exc)}: {exc}")
            return ActionOutcome(machine_id)

        return run_concurrently(delete, list(machine_ids), ENDPOINT_WORKERS)

    def recreate(self, machine_id: str, restore: Restore | None) -> ActionOutcome:
        """CreateEndpoint with the configuration and tags its record kept. Checked first: a configuration or model
        that is gone is said ("Gone: ..."), and nothing is created (SageMaker would otherwise accept the request
        and leave the endpoint Creating, then Failed)."""
        name = endpoint_name(machine_id)
        if restore is None:
            return ActionOutcome(machine_id, "Gone: its record keeps no endpoint configuration")
        try:
            _, missing = self.configuration(restore.config)
            if missing:
                return ActionOutcome(machine_id, f"Gone: its {' and '.join(missing)} no longer exists")
            self.sagemaker.create_endpoint(
                EndpointName=name, EndpointConfigName=restore.config, Tags=restore.tag_list()
            )
        except AwsError as exc:
            logger.warning("endpoint not brought back", extra={"endpoint": name, "error": error_code(exc)})
            return ActionOutcome(machine_id, f"{error_code(exc)}: {exc}")
        return ActionOutcome(machine_id)


def sagemaker_fleet(
    ec2: Any, autoscaling: Any, sagemaker: Any, application_autoscaling: Any, *, listing_processes: int = 1
) -> Fleet:
    """EC2 machines, notebook instances, endpoints (`application_autoscaling`: the endpoints' minimums) and Studio
    apps."""
    return Fleet(
        ec2,
        autoscaling,
        NotebookInstances(sagemaker),
        listing_processes=listing_processes,
        endpoints=Endpoints(sagemaker, application_autoscaling),
        studio=StudioApps(sagemaker),
    )
