"""SageMaker Studio apps, reported, never acted on: running JupyterLab and Code Editor apps whose idle shutdown
is off, or later than their team's idle window, with what they cost an hour, so an admin can align them.

Pure: the adapter (aws/studio.py) reads ListApps, DescribeSpace and DescribeDomain and hands their answers here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The Studio app types that run a person's interactive work and have an idle shutdown setting.
APP_SETTINGS = {"JupyterLab": "JupyterLabAppSettings", "CodeEditor": "CodeEditorAppSettings"}


@dataclass(frozen=True)
class StudioApp:
    domain_id: str
    space_name: str
    app_type: str  # JupyterLab | CodeEditor
    instance_type: str  # ml.t3.medium, ...
    team: str | None  # the space's team tag (None: untagged)
    # Idle shutdown in minutes: None when it is off; the space's own setting, else the domain's default.
    idle_shutdown_minutes: int | None
    setting_source: str  # "space" or "domain": where that setting comes from


def idle_shutdown(space: Mapping[str, Any], domain: Mapping[str, Any], app_type: str) -> tuple[int | None, str]:
    """The app's idle shutdown in minutes (None: off) and where it is set. The domain turns it on or off
    (DefaultSpaceSettings, else DefaultUserSettings: LifecycleManagement); where it is on, a space's own
    IdleTimeoutInMinutes (SpaceSettings) comes before the domain's."""
    key = APP_SETTINGS[app_type]

    def idle(settings: Mapping[str, Any]) -> Mapping[str, Any]:
        found: Mapping[str, Any] = settings.get(key, {}).get("AppLifecycleManagement", {}).get("IdleSettings", {})
        return found

    domain_idle = idle(domain.get("DefaultSpaceSettings", {})) or idle(domain.get("DefaultUserSettings", {}))
    if domain_idle.get("LifecycleManagement") != "ENABLED":
        return None, "domain"
    own = idle(space.get("SpaceSettings", {})).get("IdleTimeoutInMinutes")
    if own is not None:
        return int(own), "space"
    minutes = domain_idle.get("IdleTimeoutInMinutes")
    return (int(minutes) if minutes is not None else None), "domain"


@dataclass(frozen=True)
class StudioFinding:
    app: StudioApp
    why: str
    hourly: float | None

    def line(self) -> str:
        cost = f"${self.hourly:,.2f}/h" if self.hourly is not None else "price unknown"
        team = f"team {self.app.team}" if self.app.team else "no team tag"
        return (
            f"{self.app.app_type} in space {self.app.space_name} (domain {self.app.domain_id}, {team}, "
            f"{self.app.instance_type}, {cost}): {self.why}"
        )


def misaligned(
    apps: list[StudioApp], idle_minutes_of: Callable[[str | None], int], price_of: Callable[[str], float | None]
) -> list[StudioFinding]:
    """The running apps whose idle shutdown is off or longer than their team's idle_minutes (the default
    policy's for an untagged space)."""
    found = []
    for app in apps:
        window = idle_minutes_of(app.team)
        if app.idle_shutdown_minutes is None:
            why = f"idle shutdown is off ({app.setting_source} setting); the team's idle window is {window} min"
        elif app.idle_shutdown_minutes > window:
            why = (
                f"idle shutdown after {app.idle_shutdown_minutes} min ({app.setting_source} setting), longer than "
                f"the team's idle window of {window} min"
            )
        else:
            continue
        found.append(StudioFinding(app, why, price_of(app.instance_type)))
    return sorted(found, key=lambda f: (f.app.domain_id, f.app.space_name, f.app.app_type))
