"""SageMaker Studio apps, read for the report (core/studio.py): ListApps, then each space and domain once
(DescribeSpace, DescribeDomain) and each space's tags (ListTags). Nothing here acts on an app."""

from __future__ import annotations

from typing import Any

from idle_reaper.aws.clients import run_concurrently
from idle_reaper.core.studio import APP_SETTINGS, StudioApp, idle_shutdown

STUDIO_WORKERS = 4


class StudioApps:
    def __init__(self, sagemaker: Any) -> None:
        self.sagemaker = sagemaker

    def running(self, team_tag: str) -> list[StudioApp]:
        """The InService JupyterLab and Code Editor apps of every domain in the region. A call that fails
        fails the listing: the caller reports that it could not look."""
        apps = [
            app
            for page in self.sagemaker.get_paginator("list_apps").paginate()
            for app in page.get("Apps", [])
            if app.get("Status") == "InService" and app.get("AppType") in APP_SETTINGS and app.get("SpaceName")
        ]
        spaces = sorted({(a["DomainId"], a["SpaceName"]) for a in apps})
        domains = sorted({a["DomainId"] for a in apps})
        described = dict(zip(spaces, run_concurrently(self._space, spaces, STUDIO_WORKERS), strict=True))
        settings = dict(zip(domains, run_concurrently(self._domain, domains, STUDIO_WORKERS), strict=True))
        found = []
        for app in apps:
            space, tags = described[(app["DomainId"], app["SpaceName"])]
            minutes, source = idle_shutdown(space, settings[app["DomainId"]], app["AppType"])
            found.append(
                StudioApp(
                    domain_id=app["DomainId"],
                    space_name=app["SpaceName"],
                    app_type=app["AppType"],
                    instance_type=app.get("ResourceSpec", {}).get("InstanceType") or "unknown",
                    team=tags.get(team_tag) or None,
                    idle_shutdown_minutes=minutes,
                    setting_source=source,
                )
            )
        return found

    def _space(self, key: tuple[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        space: dict[str, Any] = self.sagemaker.describe_space(DomainId=key[0], SpaceName=key[1])
        tags: dict[str, str] = {}
        for page in self.sagemaker.get_paginator("list_tags").paginate(ResourceArn=space["SpaceArn"]):
            tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
        return space, tags

    def _domain(self, domain_id: str) -> dict[str, Any]:
        domain: dict[str, Any] = self.sagemaker.describe_domain(DomainId=domain_id)
        return domain
