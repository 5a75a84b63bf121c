"""SageMaker Studio apps: reported, and, for a team whose policy asks for it (`studio_apps: delete`), swept.

Reported (the default): running JupyterLab and Code Editor apps whose idle shutdown is off, or later than their
team's idle window, with what they cost an hour, so an admin can align them.

Swept: an app whose space carries the team tag (and the opt-in tag) is a machine (core/signals.Machine) whose id is
`studio:<domain id>:<space>:<app type>:<app name>` and whose facts carry `AppFacts`. Its action is DeleteApp: the
space and its storage stay, and the record keeps what CreateApp needs (`AppRestore`), so "Start it again" recreates
it on the same instance type, image and lifecycle configuration.

Its idle signal, in this order:
1. Studio's own, where the domain (or space) has idle shutdown on for the app's type with a timeout no longer than
   the team's window: Studio sees from inside the app what nobody outside can (kernels, terminals, open files) and
   deletes the app itself, so idle-reaper leaves it to Studio (`swept` is False: not warned, not deleted).
   No API reads that signal from outside: DescribeApp's LastUserActivityTimestamp "is also updated when SageMaker AI
   performs health checks without user activity. As a result, this value is set to the same value as
   LastHealthCheckTimestamp" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DescribeApp.html), so
   it says the app is alive, never that a person used it: it is not read as a person signal, nor as idleness.
2. Else the app's CloudWatch metrics. SageMaker publishes none for Studio apps; a lifecycle configuration that runs
   the CloudWatch agent (and the activity collector) publishes them as for a notebook instance, with the dimension
   InstanceId = the app's machine id (`metrics.notebook_cpu`, the GPU and person metrics): CPU, GPU and a person's
   input decide as for any machine.
3. Else unknown: an app without datapoints is never idle, never warned, never deleted.

Pure: the adapter (aws/studio.py) reads ListApps, DescribeSpace, DescribeDomain and ListTags and hands their answers
here."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from idle_reaper.core.doctor import Finding, listed, unknown
from idle_reaper.core.endpoints import (
    FAILURE_CHARS,
    IN_SERVICE,
    STUDIO_PREFIX,
    EndpointFacts,
    Restore,
    is_studio_id,
    passed_on,
)
from idle_reaper.core.endpoints import kept_restore as endpoint_restore
from idle_reaper.policy import TeamPolicy

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
    opted_in: bool = False  # its space carries the opt-in tag (or none is set): a team may have it swept


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


def studio_lifecycle_config(prefix: str, app_type: str) -> str:
    """The name of the Studio lifecycle configuration a stack ships for one app type (infra/studio.py), from its
    deploy prefix (idle-reaper-studio-jupyterlab, idle-reaper-studio-codeeditor)."""
    return f"{prefix}-studio-{app_type.lower()}"


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


# ---------------------------------------------------------------------------------------------
# Swept: one app as a machine, and what recreating it needs

# A machine id is at most 128 characters in the state table (core/records.py): an app whose id would be longer (a
# domain id and a space name of 60 characters each) is left out of the sweep, and stays in the report.
ID_MAX = 128


def studio_id(domain_id: str, space: str, app_type: str, app_name: str) -> str:
    """The machine id of one app. SageMaker's names have no colon (domain ids ^d-(-*[a-z0-9]){1,61}, space and app
    names ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}), so the id splits back into them."""
    return f"{STUDIO_PREFIX}{domain_id}:{space}:{app_type}:{app_name}"


def studio_parts(machine_id: str) -> tuple[str, str, str, str]:
    """(domain id, space, app type, app name) of a machine id; ValueError for an id no app has."""
    parts = machine_id.removeprefix(STUDIO_PREFIX).split(":") if is_studio_id(machine_id) else []
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"not a Studio app's id: {machine_id!r}")
    return parts[0], parts[1], parts[2], parts[3]


@dataclass(frozen=True)
class AppFacts:
    """What a sweep knows of one running Studio app. Part of its Machine: an app that changed (status, spec, the
    space's tags) since it was listed counts as changed (`Fleet.still_as_listed`)."""

    domain_id: str
    space_name: str
    app_type: str  # JupyterLab | CodeEditor
    app_name: str
    status: str  # InService (discovery lists no other)
    # The app's ResourceSpec as ListApps gives it (InstanceType, SageMakerImageArn, SageMakerImageVersionArn,
    # SageMakerImageVersionAlias, LifecycleConfigArn), sorted: CreateApp gets it back as it was.
    resource_spec: tuple[tuple[str, str], ...] = ()
    idle_shutdown_minutes: int | None = None  # Studio's idle shutdown for its type (None: off), as `idle_shutdown`
    setting_source: str = "domain"
    tags: tuple[tuple[str, str], ...] = ()  # the space's tags, sorted

    @property
    def machine_id(self) -> str:
        return studio_id(self.domain_id, self.space_name, self.app_type, self.app_name)

    def restore(self) -> AppRestore:
        spec = self.resource_spec
        return AppRestore(self.domain_id, self.space_name, self.app_type, self.app_name, spec, passed_on(self.tags))


def swept(app: AppFacts, policy: TeamPolicy | None) -> bool:
    """Whether the sweep decides about this app: its team's policy asks for it (`studio_apps: delete`; a team in
    safe mode never does), and Studio's own idle shutdown would not end it within the team's idle window."""
    if policy is None or policy.studio_apps != "delete":
        return False
    return app.idle_shutdown_minutes is None or app.idle_shutdown_minutes > policy.idle_minutes


@dataclass(frozen=True)
class AppRestore:
    """What CreateApp needs to recreate a deleted app as it was, kept on its record (MachineRecord.endpoint, the
    field of what recreating a deleted SageMaker resource needs). `pending_by`: who asked to start it again, until a
    sweep sees it InService (or Failed) and says so in its message. `failed`: why SageMaker could not start it the
    last time someone asked (its FailureReason), until someone tries again."""

    domain_id: str
    space_name: str
    app_type: str
    app_name: str
    resource_spec: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, str], ...] = ()
    pending_by: str | None = None
    pending_since: str | None = None  # ISO-8601 UTC
    failed: str | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "app": [self.domain_id, self.space_name, self.app_type, self.app_name],
            "spec": dict(self.resource_spec),
            "tags": [list(t) for t in self.tags],
        }
        if self.pending_by:
            data.update(pending_by=self.pending_by, pending_since=self.pending_since)
        if self.failed:
            data.update(failed=self.failed)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, raw: str | None) -> AppRestore | None:
        """None for nothing kept, or for text this never wrote (a corrupt item must never fail a sweep)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            domain, space, app_type, name = (str(x) for x in data["app"])
            spec = tuple(sorted((str(k), str(v)) for k, v in data.get("spec", {}).items()))
            tags = tuple((str(k), str(v)) for k, v in data.get("tags", []))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not all((domain, space, app_type, name)):
            return None
        failed = data.get("failed") or None
        return cls(
            domain,
            space,
            app_type,
            name,
            spec,
            tags,
            data.get("pending_by") or None,
            data.get("pending_since") or None,
            str(failed) if failed else None,
        )

    def brought_back_by(self, user: str, now: datetime) -> AppRestore:
        """As kept once `user` asked to start it again at `now` (a failure before it no longer the last word)."""
        return replace(self, pending_by=user, pending_since=now.isoformat(), failed=None)

    def failed_with(self, why: str) -> AppRestore:
        """As kept once the sweep found the app started again Failed: told, not pending, and why."""
        reason = (why or "SageMaker gave no reason")[:FAILURE_CHARS]
        return replace(self, pending_by=None, pending_since=None, failed=reason)

    @property
    def instance_type(self) -> str | None:
        return dict(self.resource_spec).get("InstanceType")

    def create_app(self) -> dict[str, Any]:
        """CreateApp's parameters."""
        request: dict[str, Any] = {
            "DomainId": self.domain_id,
            "SpaceName": self.space_name,
            "AppType": self.app_type,
            "AppName": self.app_name,
            "Tags": [{"Key": k, "Value": v} for k, v in self.tags],
        }
        if self.resource_spec:
            request["ResourceSpec"] = dict(self.resource_spec)
        return request

    def recreate_command(self) -> str:
        """How a person recreates it by hand (its record lasts 30 days after its last write)."""
        spec = f" --resource-spec InstanceType={self.instance_type}" if self.instance_type else ""
        return (
            f"aws sagemaker create-app --domain-id {self.domain_id} --space-name {self.space_name} --app-type "
            f"{self.app_type} --app-name {self.app_name}{spec}"
        )


def kept_restore(previous: str | None, endpoint: EndpointFacts | None, app: AppFacts | None) -> str | None:
    """The record's note of what recreating a deleted SageMaker resource needs, as this sweep sees it (an endpoint's
    or an app's; a bring-back still waiting to be told carried over); any other machine's record keeps its own."""
    if endpoint is not None:
        return endpoint_restore(previous, endpoint)
    if app is None:
        return previous
    before, now = AppRestore.parse(previous), app.restore()
    if before is not None and before.pending_by:
        now = replace(now, pending_by=before.pending_by, pending_since=before.pending_since)
    return now.to_json()


def recreate_sentence(record_note: str | None) -> str:
    """What a deleted app's messages say of starting it again (plain text: the caller escapes)."""
    restore = AppRestore.parse(record_note)
    if restore is None:
        return "Its space and the space's storage are kept."
    by_hand = restore.recreate_command()
    return f"Its space and the space's storage are kept: Start it again recreates the app (by hand: {by_hand})."


def pending_restore(
    endpoint: EndpointFacts | None, app: AppFacts | None, note: str | None
) -> Restore | AppRestore | None:
    """The record's note of a deleted endpoint or app someone asked to bring back, once it is InService again (the
    sweep then says so in its message, once); None otherwise."""
    restore: Restore | AppRestore | None = None
    if endpoint is not None:
        restore, status = Restore.parse(note), endpoint.status
    elif app is not None:
        restore, status = AppRestore.parse(note), app.status
    if restore is None or not restore.pending_by or status != IN_SERVICE:
        return None
    return restore


# ---------------------------------------------------------------------------------------------
# The doctor: what leaves a team's `studio_apps: delete` doing nothing in a real account

TAG_PROPAGATION_DOC = "https://docs.aws.amazon.com/sagemaker/latest/dg/custom-tags.html"


def runs_ours(domain: Mapping[str, Any], prefix: str) -> bool:
    """Whether one of the stack's Studio lifecycle configurations runs in the domain's apps by default: it is the
    built-in (BuiltInLifecycleConfigArn) or the default (DefaultResourceSpec.LifecycleConfigArn) of its JupyterLab
    or Code Editor settings, the domain's user or space defaults. One merely attached (LifecycleConfigArns) runs
    only where a person picks it."""
    ours = {studio_lifecycle_config(prefix, app_type) for app_type in APP_SETTINGS}
    for scope in ("DefaultUserSettings", "DefaultSpaceSettings"):
        for key in APP_SETTINGS.values():
            settings = domain.get(scope, {}).get(key, {})
            for arn in (
                settings.get("BuiltInLifecycleConfigArn"),
                settings.get("DefaultResourceSpec", {}).get("LifecycleConfigArn"),
            ):
                if arn and ":studio-lifecycle-config/" in arn and arn.rsplit("/", 1)[-1] in ours:
                    return True
    return False


def check_studio(
    apps: Sequence[AppFacts], domains: Mapping[str, Mapping[str, Any]], without_data: Sequence[str] | None, prefix: str
) -> list[Finding]:
    """The running apps the sweep acts on (their team's policy says `studio_apps: delete`), their domains
    (DescribeDomain) and those of them without a CPU datapoint in the last hour (None: not read): a failure for each
    domain whose tag propagation is off (DeleteApp will be AccessDenied) and each that runs no lifecycle
    configuration of ours (its apps will read unknown): the team asked for what cannot happen there, so the
    sweep's daily doctor tells the admins; a warning for the apps that read unknown for want of data."""
    if not apps:
        return [Finding(check="studio", status="ok", message="no running Studio app is swept (studio_apps: delete)")]
    used = sorted({app.domain_id for app in apps})
    untagged = [d for d in used if domains.get(d, {}).get("TagPropagation") != "ENABLED"]
    dark = [d for d in used if not runs_ours(domains.get(d, {}), prefix)]
    names = ", ".join(studio_lifecycle_config(prefix, t) for t in APP_SETTINGS)
    findings = [
        Finding(
            check="studio.tags",
            status="fail",
            subjects=tuple(untagged),
            message=f"tag propagation is off in domain(s) {listed(untagged)}: the apps Studio starts there carry no "
            "opt-in tag, so idle-reaper's DeleteApp is AccessDenied and idle apps keep running",
            fix=f"aws sagemaker update-domain --domain-id D --tag-propagation ENABLED ({TAG_PROPAGATION_DOC})",
        )
        if untagged
        else Finding(check="studio.tags", status="ok", message="tag propagation is on where apps are swept"),
        Finding(
            check="studio.lifecycle",
            status="fail",
            subjects=tuple(dark),
            message=f"domain(s) {listed(dark)} run none of idle-reaper's Studio lifecycle configurations ({names}): "
            "their apps publish no CPU, GPU, network or activity data and read unknown, never deleted",
            fix="set the stack outputs StudioJupyterLabLifecycleConfigArn and StudioCodeEditorLifecycleConfigArn as "
            "the domain's BuiltInLifecycleConfigArn (docs/policy.md, SageMaker Studio apps: aws sagemaker "
            "update-domain --domain-id D --default-user-settings ...); apps pick it up at their next start",
        )
        if dark
        else Finding(check="studio.lifecycle", status="ok", message="every domain of swept apps runs ours"),
    ]
    if without_data is None:
        findings.append(unknown("studio.signals", "the apps' metrics could not be read"))
    elif without_data:
        findings.append(
            Finding(
                check="studio.signals",
                status="warn",
                subjects=tuple(without_data),
                message=f"{len(without_data)} swept Studio app(s) published no CPU data in the last hour: "
                f"{listed(without_data)}; they are unknown, never deleted",
                fix="see the app's LifecycleConfigOnStart log (CloudWatch /aws/sagemaker/studio, "
                "<domain>/<space>/<type>/default/LifecycleConfigOnStart) and /var/tmp/idle-reaper/activity.log in "
                "the app; its execution role needs cloudwatch:PutMetricData (namespace CWAgent) and s3:GetObject on "
                "the stack output NotebookAgentObject",
            )
        )
    else:
        findings.append(Finding(check="studio.signals", status="ok", message="every swept Studio app publishes CPU"))
    return findings
