"""SageMaker Studio's spaces and apps in the local world (local.py installs it in moto's server).

moto 5.2 has Studio domains (CreateDomain, DescribeDomain) but no spaces and no apps, and its ListTags cannot read a
space's or an app's ARN (two slashes). They are answered here, in moto's server, from state kept on moto's SageMaker
backend (so moto's reset empties it), each as its API reference page describes the answer:

- CreateSpace, DescribeSpace (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DescribeSpace.html):
  a space with its SpaceSettings (its AppType, its AppLifecycleManagement) and its tags.
- CreateApp (API_CreateApp.html): the app is Pending; Studio takes minutes to start it, here it is InService at the
  next read of it (ListApps, DescribeApp), which keeps the order a caller sees without waiting.
- DeleteApp (API_DeleteApp.html): Deleted. ListApps still lists a deleted app (Status Deleted), as Studio does.
  An app Studio could not start is Failed (`fail_app`), with DescribeApp's FailureReason.
- DescribeApp (API_DescribeApp.html), with LastHealthCheckTimestamp and LastUserActivityTimestamp both the time
  of the read: SageMaker's health checks update the second too, "set to the same value as
  LastHealthCheckTimestamp", whether or not anyone used the app.
- ListApps (API_ListApps.html: AppDetails with DomainId, SpaceName, AppType, AppName, Status, CreationTime,
  ResourceSpec); ListTags and AddTags of a space's or an app's ARN.

SageMaker's refusals (DeleteApp of an app not InService, CreateApp in a space that runs an app, the Studio
instance quota) are aws_rules_sagemaker.py's, in front of all this, as they are for endpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from idle_reaper import aws

_STATE = "idle_reaper_studio"
# An app in one of these states runs, or is about to: its space runs no second app, and it counts against a quota.
RUNNING = frozenset({"Pending", "InService"})


@dataclass
class Space:
    domain_id: str
    name: str
    arn: str
    settings: dict[str, Any]
    tags: list[dict[str, str]]
    created: datetime


@dataclass
class App:
    domain_id: str
    space: str
    app_type: str
    name: str
    arn: str
    status: str
    spec: dict[str, Any]
    created: datetime
    tags: list[dict[str, str]] = field(default_factory=list)
    failure: str | None = None  # DescribeApp's FailureReason of a Failed app

    def details(self) -> dict[str, Any]:
        return {
            "DomainId": self.domain_id,
            "SpaceName": self.space,
            "AppType": self.app_type,
            "AppName": self.name,
            "Status": self.status,
            "CreationTime": self.created,
            "ResourceSpec": self.spec,
        }


@dataclass
class Studio:
    spaces: dict[tuple[str, str], Space] = field(default_factory=dict)
    apps: dict[tuple[str, str, str, str], App] = field(default_factory=dict)

    def running_in(self, domain_id: str, space: str) -> App | None:
        return next(
            (a for a in self.apps.values() if (a.domain_id, a.space) == (domain_id, space) and a.status in RUNNING),
            None,
        )


def studio_of(backend: Any) -> Studio:
    """The Studio state of one moto SageMaker backend (made on first use; moto's reset makes new backends)."""
    state: Studio | None = getattr(backend, _STATE, None)
    if state is None:
        state = Studio()
        setattr(backend, _STATE, state)
    return state


def install() -> None:
    """Answer Studio's space and app requests in moto's server (idempotent)."""
    from moto.core.responses import ActionResult, EmptyResult
    from moto.sagemaker.exceptions import ResourceNotFound, ValidationError
    from moto.sagemaker.responses import SageMakerResponse

    responses: Any = SageMakerResponse
    if getattr(responses, "_idle_reaper_studio", False):
        return
    responses._idle_reaper_studio = True
    moto_list_tags, moto_add_tags = responses.list_tags, responses.add_tags

    def state(self: Any) -> Studio:
        return studio_of(self.sagemaker_backend)

    def arn(self: Any, kind: str, *parts: str) -> str:
        where = f"{self.sagemaker_backend.region_name}:{self.sagemaker_backend.account_id}"
        return f"arn:aws:sagemaker:{where}:{kind}/" + "/".join(p.lower() for p in parts)

    def create_space(self: Any) -> Any:
        domain_id, name = self._get_param("DomainId"), self._get_param("SpaceName")
        self.sagemaker_backend.describe_domain(domain_id)  # ValidationException for a domain that does not exist
        space = Space(
            domain_id,
            name,
            arn(self, "space", domain_id, name),
            self._get_param("SpaceSettings") or {},
            self._get_param("Tags") or [],
            datetime.now(UTC),
        )
        state(self).spaces[(domain_id, name)] = space
        return ActionResult({"SpaceArn": space.arn})

    def find_space(self: Any) -> Space:
        key = (self._get_param("DomainId"), self._get_param("SpaceName"))
        if key not in state(self).spaces:
            raise ResourceNotFound(f"Space {key[1]} does not exist in domain {key[0]}.")
        return state(self).spaces[key]

    def describe_space(self: Any) -> Any:
        space = find_space(self)
        return ActionResult(
            {
                "DomainId": space.domain_id,
                "SpaceName": space.name,
                "SpaceArn": space.arn,
                "Status": "InService",
                "CreationTime": space.created,
                "SpaceSettings": space.settings,
            }
        )

    def app_key(self: Any) -> tuple[str, str, str, str]:
        return (
            self._get_param("DomainId"),
            self._get_param("SpaceName"),
            self._get_param("AppType"),
            self._get_param("AppName"),
        )

    def create_app(self: Any) -> Any:
        space = find_space(self)
        key = app_key(self)
        spec = dict(self._get_param("ResourceSpec") or {})
        spec.setdefault("InstanceType", "ml.t3.medium")
        app = App(*key, arn(self, "app", *key), "Pending", spec, datetime.now(UTC), self._get_param("Tags") or [])
        state(self).apps[key] = app
        del space  # the space only had to exist
        return ActionResult({"AppArn": app.arn})

    def read(self: Any, key: tuple[str, str, str, str]) -> App:
        app = state(self).apps.get(key)
        if app is None:
            raise ResourceNotFound("Resource Not Found")
        if app.status == "Pending":  # Studio started it meanwhile
            app.status = "InService"
        return app

    def delete_app(self: Any) -> Any:
        app = state(self).apps.get(app_key(self))
        if app is None or app.status == "Deleted":
            raise ResourceNotFound("Resource Not Found")
        app.status = "Deleted"
        return EmptyResult()

    def describe_app(self: Any) -> Any:
        app = read(self, app_key(self))
        checked = datetime.now(UTC)  # a health check just now, and so, whoever used it, a "user activity"
        return ActionResult(
            {
                **app.details(),
                **({"FailureReason": app.failure} if app.failure else {}),
                "AppArn": app.arn,
                "LastHealthCheckTimestamp": checked,
                "LastUserActivityTimestamp": checked,
            }
        )

    def list_apps(self: Any) -> Any:
        apps = [read(self, key) for key in sorted(state(self).apps)]
        domain, space = self._get_param("DomainIdEquals"), self._get_param("SpaceNameEquals")
        listed = [a.details() for a in apps if domain in (None, a.domain_id) and space in (None, a.space)]
        return ActionResult({"Apps": listed})

    def tagged(self: Any) -> list[dict[str, str]] | None:
        """The tags of the space or app an ARN names (None: not a space's or app's ARN)."""
        resource_arn = str(self._get_param("ResourceArn"))
        if ":space/" not in resource_arn and ":app/" not in resource_arn:
            return None
        found = [s.tags for s in state(self).spaces.values() if s.arn == resource_arn]
        found += [a.tags for a in state(self).apps.values() if a.arn == resource_arn and a.status != "Deleted"]
        if not found:
            raise ValidationError(f"Could not find resource {resource_arn}")
        return found[0]

    def list_tags(self: Any) -> Any:
        tags = tagged(self)
        return moto_list_tags(self) if tags is None else ActionResult({"Tags": tags})

    def add_tags(self: Any) -> Any:
        tags = tagged(self)
        if tags is None:
            return moto_add_tags(self)
        tags.extend(self._get_param("Tags") or [])
        return ActionResult({"Tags": tags})

    for name, handler in {
        "create_space": create_space,
        "describe_space": describe_space,
        "create_app": create_app,
        "delete_app": delete_app,
        "describe_app": describe_app,
        "list_apps": list_apps,
        "list_tags": list_tags,
        "add_tags": add_tags,
    }.items():
        setattr(responses, name, handler)


def _backend() -> Any:
    from moto.sagemaker.models import sagemaker_backends

    from idle_reaper_tools.local import ACCOUNT, REGION

    return sagemaker_backends[ACCOUNT][aws.client("sagemaker").meta.region_name or REGION]


def launch_studio_app(
    space: str,
    instance_type: str = "ml.g4dn.xlarge",
    *,
    team: str,
    launch_time: datetime,
    owner: str | None = None,
    managed: bool = True,
    app_type: str = "JupyterLab",
    idle_shutdown_minutes: int | None = None,
) -> str:
    """A Studio space of `team` (tagged like a machine) in the local domain (made on first use, idle shutdown off
    unless `idle_shutdown_minutes`), running one app `default` of `app_type` on `instance_type`, InService since
    `launch_time`. Its machine id (core/studio.studio_id)."""
    from idle_reaper.core.studio import APP_SETTINGS, studio_id
    from idle_reaper_tools.local import MANAGED_TAG

    sagemaker = aws.client("sagemaker")
    domain_id = studio_domain()
    tags = {"Team": team, **({"Owner": owner} if owner else {}), **({MANAGED_TAG: "true"} if managed else {})}
    settings: dict[str, Any] = {"AppType": app_type}
    if idle_shutdown_minutes is not None:
        idle = {"IdleSettings": {"IdleTimeoutInMinutes": idle_shutdown_minutes}}
        settings[APP_SETTINGS[app_type]] = {"AppLifecycleManagement": idle}
    sagemaker.create_space(
        DomainId=domain_id,
        SpaceName=space,
        SpaceSettings=settings,
        Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
    )
    sagemaker.create_app(
        DomainId=domain_id,
        SpaceName=space,
        AppType=app_type,
        AppName="default",
        ResourceSpec={"InstanceType": instance_type},
    )
    app = studio_of(_backend()).apps[(domain_id, space, app_type, "default")]
    app.status, app.created = "InService", launch_time.astimezone(UTC)
    return studio_id(domain_id, space, app_type, "default")


def studio_domain() -> str:
    """The local account's Studio domain (one; idle shutdown on for JupyterLab apps, so a space's own timeout applies
    where it sets one): its id."""
    sagemaker = aws.client("sagemaker")
    domains = sagemaker.list_domains().get("Domains", [])
    if domains:
        return str(domains[0]["DomainId"])
    lifecycle = {"AppLifecycleManagement": {"IdleSettings": {"LifecycleManagement": "ENABLED"}}}
    arn = sagemaker.create_domain(
        DomainName="local-studio",
        AuthMode="IAM",
        DefaultUserSettings={
            "ExecutionRole": f"arn:aws:iam::{_backend().account_id}:role/studio",
            "JupyterLabAppSettings": lifecycle,
            "CodeEditorAppSettings": lifecycle,
        },
        SubnetIds=["subnet-12345678"],
        VpcId="vpc-12345678",
    )["DomainArn"]
    return str(arn.rsplit("/", 1)[-1])


def app_statuses(machine_ids: list[str]) -> dict[str, str | None]:
    """Each app's Status as Studio keeps it (None: never created), without reading it (a read starts a Pending app)."""
    from idle_reaper.core.studio import studio_parts

    apps = studio_of(_backend()).apps
    return {m: (a.status if (a := apps.get(studio_parts(m))) else None) for m in machine_ids}


def fail_app(machine_id: str, reason: str) -> None:
    """Studio could not start an app it took CreateApp for (no capacity, an image that does not start): Failed,
    with DescribeApp's FailureReason."""
    from idle_reaper.core.studio import studio_parts

    app = studio_of(_backend()).apps[studio_parts(machine_id)]
    app.status, app.failure = "Failed", reason


def set_app(machine_id: str, *, created: datetime) -> None:
    """Date an app's creation (CreateApp dates it by the wall clock; a test's sweeps run on a simulated day)."""
    from idle_reaper.core.studio import studio_parts

    studio_of(_backend()).apps[studio_parts(machine_id)].created = created.astimezone(UTC)
