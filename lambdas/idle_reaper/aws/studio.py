"""SageMaker Studio apps (core/studio.py decides): ListApps, then each space and domain once (DescribeSpace,
DescribeDomain) and each space's tags (ListTags), for the admins' report and, for teams that ask for it, the sweep;
DeleteApp and CreateApp one call each.

ListApps has no tag filter, and the tags that count are the space's (Studio puts none of its space's tags on the
apps it creates, unless the domain propagates them): the spaces that run an app are described and their tags read,
concurrently (a domain holds a few hundred spaces at most). A call that fails fails the listing: the caller reports
that it could not look, and sweeps no app this time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from idle_reaper.aws.clients import AwsError, error_code, run_concurrently
from idle_reaper.aws.fleet import ActionOutcome
from idle_reaper.core.kinds import InstanceFacts
from idle_reaper.core.signals import Machine
from idle_reaper.core.studio import (
    APP_SETTINGS,
    ID_MAX,
    AppFacts,
    AppRestore,
    StudioApp,
    idle_shutdown,
    studio_id,
    studio_parts,
)
from idle_reaper.notify import logger
from idle_reaper.policy import TagKeys

STUDIO_WORKERS = 4
# What CreateApp answers when it cannot start an app again, in words (its messages carry ARNs: kept out of Slack).
# https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateApp.html (Errors)
NOT_CREATED = {
    "ResourceLimitExceeded": "the account's SageMaker quota of Studio apps on {type} is reached: ask for an increase "
    "in Service Quotas, or stop another app of that type",
    "ResourceInUse": "its space already runs an app (someone opened it in Studio meanwhile): use that one",
}

# One app as ListApps lists it, with its space (DescribeSpace), the space's tags and its domain (DescribeDomain).
Listed = tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, Any]]


class StudioApps:
    def __init__(self, sagemaker: Any) -> None:
        self.sagemaker = sagemaker

    def _listed(self, names: Sequence[str] | None = None, failed: list[str] | None = None) -> list[Listed]:
        """The InService JupyterLab and Code Editor apps of every domain in the region (of the machine ids `names`
        alone when given), each with its space, the space's tags and its domain. `failed`: where the Failed ones'
        machine ids go (an app someone started again may fail: sweep/endpoints.py tell_failed_bring_backs)."""
        newest: dict[str, dict[str, Any]] = {}  # ListApps keeps a deleted or failed app a while beside its successor
        for page in self.sagemaker.get_paginator("list_apps").paginate():
            for app in page.get("Apps", []):
                if app.get("AppType") in APP_SETTINGS and app.get("SpaceName"):
                    seen = newest.get(_id(app))
                    if seen is None or _created(app) >= _created(seen):
                        newest[_id(app)] = app
        # Only an app's newest entry says what it is now: an old Failed one must not get its started-again
        # successor (the same name) told failed and deleted.
        listed = list(newest.values())
        if failed is not None:
            failed += [_id(a) for a in listed if a.get("Status") == "Failed" and len(_id(a)) <= ID_MAX]
        apps = [a for a in listed if a.get("Status") == "InService"]
        if names is not None:
            apps = [a for a in apps if _id(a) in names]
        spaces = sorted({(a["DomainId"], a["SpaceName"]) for a in apps})
        domains = sorted({a["DomainId"] for a in apps})
        described = dict(zip(spaces, run_concurrently(self._space, spaces, STUDIO_WORKERS), strict=True))
        settings = dict(zip(domains, run_concurrently(self.domain, domains, STUDIO_WORKERS), strict=True))
        return [(a, *described[(a["DomainId"], a["SpaceName"])], settings[a["DomainId"]]) for a in apps]

    def running(self, team_tag: str, managed_tag: str | None = None) -> list[StudioApp]:
        """Every running app, for the report (core/studio.misaligned)."""
        found = []
        for app, space, tags, domain in self._listed():
            minutes, source = idle_shutdown(space, domain, app["AppType"])
            found.append(
                StudioApp(
                    domain_id=app["DomainId"],
                    space_name=app["SpaceName"],
                    app_type=app["AppType"],
                    instance_type=app.get("ResourceSpec", {}).get("InstanceType") or "unknown",
                    team=tags.get(team_tag) or None,
                    idle_shutdown_minutes=minutes,
                    setting_source=source,
                    opted_in=not managed_tag or tags.get(managed_tag) == "true",
                )
            )
        return found

    def discover(
        self, tags: TagKeys, names: Sequence[str] | None = None, failed: list[str] | None = None
    ) -> list[Machine]:
        """The running apps whose space carries the team tag (and the opt-in tag `true`, when one is set), as
        machines; of the machine ids `names` alone when given. `failed`: where the Failed apps' ids go."""
        machines = []
        for app, space, tag, domain in self._listed(names, failed):
            if not tag.get(tags.team, "").strip() or (tags.managed and tag.get(tags.managed) != "true"):
                continue
            machine_id = _id(app)
            if len(machine_id) > ID_MAX:
                logger.warning("Studio app id too long for the state table: not swept", extra={"app": machine_id})
                continue
            minutes, source = idle_shutdown(space, domain, app["AppType"])
            spec = {k: str(v) for k, v in (app.get("ResourceSpec") or {}).items() if v}
            facts = AppFacts(
                domain_id=app["DomainId"],
                space_name=app["SpaceName"],
                app_type=app["AppType"],
                app_name=app["AppName"],
                status=app["Status"],
                resource_spec=tuple(sorted(spec.items())),
                idle_shutdown_minutes=minutes,
                setting_source=source,
                tags=tuple(sorted(tag.items())),
            )
            machines.append(
                Machine(
                    instance_id=machine_id,
                    instance_type=spec.get("InstanceType") or "unknown",
                    team=tag[tags.team],
                    launch_time=app["CreationTime"].astimezone(UTC),  # its window starts no earlier
                    name=app["SpaceName"],
                    owner=tag.get(tags.owner),
                    exempt_tag=tag.get(tags.exempt),
                    facts=InstanceFacts(studio=facts),
                )
            )
        return sorted(machines, key=lambda m: m.instance_id)

    def _space(self, key: tuple[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        space: dict[str, Any] = self.sagemaker.describe_space(DomainId=key[0], SpaceName=key[1])
        tags: dict[str, str] = {}
        for page in self.sagemaker.get_paginator("list_tags").paginate(ResourceArn=space["SpaceArn"]):
            tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
        return space, tags

    def domain(self, domain_id: str) -> dict[str, Any]:
        domain: dict[str, Any] = self.sagemaker.describe_domain(DomainId=domain_id)
        return domain

    def failure_reason(self, machine_id: str) -> str:
        """Where to read why Studio could not start an app: ListApps does not say, and DescribeApp (which does) is
        left out of the sweep's role (one more statement would outgrow the member stack's inline template)."""
        domain, space, app_type, _ = studio_parts(machine_id)
        return f"Studio's log says why: CloudWatch Logs /aws/sagemaker/studio, streams {domain}/{space}/{app_type}/..."

    def delete(self, machine_ids: Sequence[str]) -> list[ActionOutcome]:
        """DeleteApp for each (the space and its storage stay); a refusal (the app is no longer InService, or IAM's:
        the app carries no opt-in tag) is that app's error, recorded."""

        def delete(machine_id: str) -> ActionOutcome:
            domain, space, app_type, name = studio_parts(machine_id)
            try:
                self.sagemaker.delete_app(DomainId=domain, SpaceName=space, AppType=app_type, AppName=name)
            except AwsError as exc:
                return ActionOutcome(machine_id, f"{error_code(exc)}: {exc}")
            return ActionOutcome(machine_id)

        return run_concurrently(delete, list(machine_ids), STUDIO_WORKERS)

    def recreate(self, machine_id: str, restore: AppRestore | None) -> ActionOutcome:
        """CreateApp in the same space, with the resource spec and the space's tags its record kept (the opt-in tag
        among them: IAM lets idle-reaper create only an app that carries it)."""
        if restore is None:
            return ActionOutcome(machine_id, "Gone: its record keeps nothing to recreate it from")
        try:
            self.sagemaker.create_app(**restore.create_app())
        except AwsError as exc:
            logger.warning("Studio app not started again", extra={"app": machine_id, "error": error_code(exc)})
            return ActionOutcome(machine_id, f"{error_code(exc)}: {exc}")
        return ActionOutcome(machine_id)


def _id(app: dict[str, Any]) -> str:
    return studio_id(app["DomainId"], app["SpaceName"], app["AppType"], app["AppName"])


def _created(app: Mapping[str, Any]) -> datetime:
    """When ListApps says the app was created (an entry without it is the oldest)."""
    created = app.get("CreationTime")
    return created.astimezone(UTC) if isinstance(created, datetime) else datetime.min.replace(tzinfo=UTC)
