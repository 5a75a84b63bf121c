"""SageMaker's refusals for real-time endpoints and Studio apps, kept in front of moto (aws_rules.AwsRules.judge
asks here; Studio's spaces and apps themselves are local_studio.py's, moto has none).

moto deletes an endpoint in any status, creates one whose configuration names a model that is gone, and knows no
quota. SageMaker refuses each:

- **DeleteEndpoint** of an endpoint being created or updated (Creating, Updating, SystemUpdating, RollingBack):
  ValidationException. The API reference lists only the common errors
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DeleteEndpoint.html); an endpoint stuck Creating
  cannot be deleted until it is Failed (https://github.com/aws/amazon-sagemaker-examples/issues/3432). AWS does
  not publish the message's wording: the one below is ours, the code SageMaker's (as for StopNotebookInstance
  outside InService).
- **CreateEndpoint** whose endpoint configuration is gone (ValidationException "Could not find endpoint
  configuration", as moto answers too) or names a model that is gone: ValidationException "Could not find model",
  the answer CreateEndpointConfig gives for a missing model (moto's, and SageMaker's). SageMaker may instead take the
  request and leave the endpoint Creating, then Failed (the issue above): the product checks DescribeModel first
  and never relies on either.
- **CreateEndpoint** of a name an endpoint already has, in any status (a Failed one too: it must be deleted first):
  ValidationException "Cannot create already existing endpoint" (the name "must be unique within an AWS Region in
  your AWS account", https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateEndpoint.html,
  EndpointName). moto replaces the endpoint instead.
- **CreateEndpoint** past the account's quota of an instance type for endpoint usage: ResourceLimitExceeded
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateEndpoint.html, Errors), worded as
  SageMaker words it. Quotas are the test's (`AwsRules.sagemaker_quotas`, instance type -> instances): a type
  without one has no limit here. An account's default is often 0 for large GPU types
  (https://docs.aws.amazon.com/general/latest/gr/sagemaker.html).
- **DeleteApp** of an app that is not InService (Pending while Studio starts it, Deleting, Deleted): SageMaker's
  DeleteApp errors are ResourceInUse ("Resource being accessed is in use") and ResourceNotFound
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DeleteApp.html, Errors): a Pending app is
  ResourceInUse here, a deleted one ResourceNotFound (local_studio.py). The wording is ours, the codes SageMaker's.
- **CreateApp** in a space that already runs an app (Pending or InService): a space runs one app at a time
  (https://docs.aws.amazon.com/sagemaker/latest/dg/domain-space.html), and CreateApp answers ResourceInUse
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateApp.html, Errors).
- **CreateApp** past the account's quota of Studio apps of that type on that instance type ("Studio JupyterLab Apps
  running on ml.g5.xlarge instance", Service Quotas): ResourceLimitExceeded (API_CreateApp.html, Errors), worded as
  SageMaker words its account-level limits. Quotas are the test's (`AwsRules.studio_quotas`, (app type, instance
  type) -> apps); the default for GPU types is often 0 (https://docs.aws.amazon.com/general/latest/gr/sagemaker.html).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from idle_reaper_tools.aws_rules import Refusal

# Statuses in which SageMaker is creating or changing the endpoint's instances.
CHANGING = frozenset({"Creating", "Updating", "SystemUpdating", "RollingBack"})


def _backend(account: str, region: str) -> Any:
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[account][region]


def _arn(kind: str, name: str, account: str, region: str) -> str:
    return f"arn:aws:sagemaker:{region}:{account}:{kind}/{name.lower()}"


def sagemaker_refusal(
    operation: str,
    params: Mapping[str, Any],
    account: str,
    region: str,
    quotas: Mapping[str, int],
    studio_quotas: Mapping[tuple[str, str], int] | None = None,
) -> Refusal | None:
    """The refusal SageMaker would answer this endpoint or Studio app request with, or None."""
    if operation in ("DeleteApp", "CreateApp"):
        return _studio_app(operation, params, _backend(account, region), studio_quotas or {})
    if operation == "DeleteEndpoint":
        endpoint = _backend(account, region).endpoints.get(str(params.get("EndpointName")))
        if endpoint is not None and endpoint.endpoint_status in CHANGING:
            arn = _arn("endpoint", endpoint.endpoint_name, account, region)
            return Refusal(
                "ValidationException",
                f'Cannot delete endpoint "{arn}" while its status is {endpoint.endpoint_status}; wait until it is '
                "InService or Failed.",
            )
    if operation == "CreateEndpoint":
        return _create_endpoint(params, account, region, quotas)
    return None


def _create_endpoint(params: Mapping[str, Any], account: str, region: str, quotas: Mapping[str, int]) -> Refusal | None:
    backend = _backend(account, region)
    if (existing := str(params.get("EndpointName"))) in backend.endpoints:
        arn = _arn("endpoint", existing, account, region)
        return Refusal("ValidationException", f'Cannot create already existing endpoint "{arn}".')
    name = str(params.get("EndpointConfigName"))
    config = backend.endpoint_configs.get(name)
    if config is None:
        arn = _arn("endpoint-config", name, account, region)
        return Refusal("ValidationException", f'Could not find endpoint configuration "{arn}".')
    variants = config.production_variants
    for variant in variants:
        model = variant.get("ModelName")
        if model and model not in backend._models:
            return Refusal("ValidationException", f'Could not find model "{_arn("model", model, account, region)}".')
    for variant in variants:
        instance_type, wanted = variant.get("InstanceType"), int(variant.get("InitialInstanceCount") or 0)
        if not instance_type or instance_type not in quotas:
            continue
        used = sum(
            int(v.get("CurrentInstanceCount") or 0)
            for endpoint in backend.endpoints.values()
            for v in endpoint.production_variants
            if _instance_type(backend, endpoint, v["VariantName"]) == instance_type
        )
        limit = quotas[instance_type]
        if used + wanted > limit:
            return Refusal(
                "ResourceLimitExceeded",
                f"The account-level service limit '{instance_type} for endpoint usage' is {limit} Instances, with "
                f"current utilization of {used} Instances and a request delta of {wanted} Instances. Please use AWS "
                "Service Quotas to request an increase for this quota. If AWS Service Quotas is not available, contact "
                "AWS support to request an increase for this quota.",
            )
    return None


def _instance_type(backend: Any, endpoint: Any, variant: str) -> str | None:
    config = backend.endpoint_configs.get(endpoint.endpoint_config_name)
    for v in config.production_variants if config is not None else ():
        if v.get("VariantName") == variant:
            return str(v.get("InstanceType") or "") or None
    return None


def _studio_app(
    operation: str, params: Mapping[str, Any], backend: Any, quotas: Mapping[tuple[str, str], int]
) -> Refusal | None:
    from idle_reaper_tools.local_studio import RUNNING, studio_of

    studio = studio_of(backend)
    domain, space = str(params.get("DomainId")), str(params.get("SpaceName"))
    app_type = str(params.get("AppType"))
    if operation == "DeleteApp":
        app = studio.apps.get((domain, space, app_type, str(params.get("AppName"))))
        if app is not None and app.status not in ("InService", "Deleted", "Failed"):
            return Refusal("ResourceInUse", f'App "{app.arn}" is {app.status}; it can be deleted once it is InService.')
        return None
    running = studio.running_in(domain, space)
    if running is not None:
        return Refusal(
            "ResourceInUse", f'Space "{space}" already has an app "{running.name}" of type {running.app_type}.'
        )
    instance_type = str((params.get("ResourceSpec") or {}).get("InstanceType") or "ml.t3.medium")
    limit = quotas.get((app_type, instance_type))
    if limit is None:
        return None
    used = sum(
        1
        for a in studio.apps.values()
        if a.status in RUNNING and a.app_type == app_type and a.spec.get("InstanceType") == instance_type
    )
    if used + 1 > limit:
        return Refusal(
            "ResourceLimitExceeded",
            f"The account-level service limit 'Studio {app_type} Apps running on {instance_type} instance' is {limit} "
            f"Apps, with current utilization of {used} Apps and a request delta of 1 Apps. Please use AWS Service "
            "Quotas to request an increase for this quota. If AWS Service Quotas is not available, contact AWS "
            "support to request an increase for this quota.",
        )
    return None
