"""SageMaker Studio's adapter: the idle shutdown each running app has (from SageMaker's own answer shapes, through
botocore's Stubber), which ones would outlast their team's window, the daily note, and which apps a sweep lists
(their space opted in) and leaves out of the note (those it acts on)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.aws.studio import StudioApps
from idle_reaper.core.studio import StudioApp, idle_shutdown, misaligned
from idle_reaper.notify import LoggingNotifier, logger
from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.sweep.studio import report_studio

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
ACCOUNT = "123456789012"
D1 = "d-abc123"


def idle_settings(state: str | None = None, minutes: int | None = None) -> dict[str, Any]:
    idle: dict[str, Any] = {}
    if state:
        idle["LifecycleManagement"] = state
    if minutes is not None:
        idle["IdleTimeoutInMinutes"] = minutes
    return {"JupyterLabAppSettings": {"AppLifecycleManagement": {"IdleSettings": idle}}}


@pytest.mark.parametrize(
    "space,domain,expected",
    [
        ({}, {}, (None, "domain")),  # nothing set: Studio never shuts it down
        ({}, {"DefaultUserSettings": idle_settings("DISABLED", 60)}, (None, "domain")),
        (
            {"SpaceSettings": idle_settings(minutes=60)},
            {"DefaultUserSettings": idle_settings("DISABLED")},
            (None, "domain"),
        ),
        ({}, {"DefaultUserSettings": idle_settings("ENABLED", 240)}, (240, "domain")),
        (
            {"SpaceSettings": idle_settings(minutes=60)},
            {"DefaultSpaceSettings": idle_settings("ENABLED", 240)},
            (60, "space"),
        ),
    ],
)
def test_the_idle_shutdown_is_the_domains_switch_and_the_spaces_own_minutes_first(space, domain, expected):
    assert idle_shutdown(space, domain, "JupyterLab") == expected


def app(space: str, team: str | None, minutes: int | None, app_type: str = "JupyterLab") -> StudioApp:
    return StudioApp(D1, space, app_type, "ml.g5.xlarge", team, minutes, "space")


def test_only_apps_that_would_outlast_their_teams_window_are_reported_with_their_cost():
    windows = {"ml": 60, None: 120}
    found = misaligned(
        [app("off", "ml", None), app("long", "ml", 240), app("ok", "ml", 60), app("untagged", None, 180, "CodeEditor")],
        lambda team: windows[team],
        lambda _t: 1.408,
    )
    assert [f.app.space_name for f in found] == ["long", "off", "untagged"]
    assert (
        "idle shutdown after 240 min (space setting), longer than the team's idle window of 60 min" in found[0].line()
    )
    assert "idle shutdown is off" in found[1].why and "$1.41/h" in found[1].line()
    assert "no team tag" in found[2].line()


def stubbed() -> tuple[Any, Stubber]:
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def space_arn(name: str) -> str:
    return f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:space/{D1}/{name}"


def listed_apps() -> dict[str, Any]:
    base = {"DomainId": D1, "AppName": "default", "ResourceSpec": {"InstanceType": "ml.g5.xlarge"}}
    return {
        "Apps": [
            {**base, "SpaceName": "alice-space", "AppType": "JupyterLab", "Status": "InService"},
            {**base, "SpaceName": "bob-space", "AppType": "CodeEditor", "Status": "InService"},
            {**base, "SpaceName": "bob-space", "AppType": "JupyterLab", "Status": "Deleted"},  # not running
            {**base, "SpaceName": "carol-space", "AppType": "KernelGateway", "Status": "InService"},  # not a person's
        ]
    }


@pytest.fixture
def in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Stubber answers in the order its responses were added: the spaces are read one after another, as one
    worker reads them, so two spaces' DescribeSpace and ListTags never interleave on the pool's threads."""
    monkeypatch.setattr("idle_reaper.aws.studio.STUDIO_WORKERS", 1)


def stub_studio(stub: Stubber) -> None:
    stub.add_response("list_apps", listed_apps(), {})
    for space, settings, team in (
        ("alice-space", idle_settings(minutes=60), "ml"),
        (
            "bob-space",
            {"CodeEditorAppSettings": {"AppLifecycleManagement": {"IdleSettings": {"IdleTimeoutInMinutes": 300}}}},
            "ml",
        ),
    ):
        stub.add_response(
            "describe_space",
            {"DomainId": D1, "SpaceName": space, "SpaceArn": space_arn(space), "SpaceSettings": settings},
            {"DomainId": D1, "SpaceName": space},
        )
        stub.add_response("list_tags", {"Tags": [{"Key": "Team", "Value": team}]}, {"ResourceArn": space_arn(space)})
    code_editor_on = {
        "CodeEditorAppSettings": {
            "AppLifecycleManagement": {"IdleSettings": {"LifecycleManagement": "ENABLED", "IdleTimeoutInMinutes": 120}}
        }
    }
    stub.add_response(
        "describe_domain",
        {"DomainId": D1, "DefaultUserSettings": {**idle_settings("ENABLED", 120), **code_editor_on}},
        {"DomainId": D1},
    )


def test_running_apps_are_read_once_per_space_and_domain(in_order: None) -> None:
    client, stub = stubbed()
    stub_studio(stub)
    with stub:
        apps = StudioApps(client).running("Team")
    stub.assert_no_pending_responses()
    assert [(a.space_name, a.app_type, a.idle_shutdown_minutes, a.team) for a in apps] == [
        ("alice-space", "JupyterLab", 60, "ml"),
        ("bob-space", "CodeEditor", 300, "ml"),
    ]


class Adapters:
    """What report_studio uses of the sweep's adapters."""

    def __init__(self, studio: StudioApps) -> None:
        self.studio = studio
        self.store = InMemoryStateStore()
        self.notifier = LoggingNotifier(logger)


def test_the_admins_hear_once_a_day_and_a_failed_read_is_tried_again(in_order: None) -> None:
    settings = Settings(admins=("U0ADMIN",))
    refs = {
        "ml": TeamPolicyRef(team="ml", policy=TeamPolicy(idle_minutes=60), source="/idle-reaper/teams/ml", version=1)
    }
    client, stub = stubbed()
    stub.add_client_error("list_apps", "ThrottlingException")
    stub_studio(stub)
    adapters = Adapters(StudioApps(client))
    with stub:
        report_studio(adapters, refs, settings, NOW)  # type: ignore[arg-type]
        assert adapters.notifier.sent == [], "a failed read says nothing and releases the day's claim"
        report_studio(adapters, refs, settings, NOW)  # type: ignore[arg-type]
        report_studio(adapters, refs, settings, NOW)  # type: ignore[arg-type]  # claimed: no call, no note
    stub.assert_no_pending_responses()
    ((kind, text),) = adapters.notifier.sent
    assert kind == "admin_alert" and "1 running SageMaker Studio app(s)" in text
    assert "CodeEditor in space bob-space" in text and "300 min" in text and "alice-space" not in text
    assert "does not stop them" in text


class _Pages:
    def __init__(self, pages: list[dict[str, Any]]) -> None:
        self.pages = pages

    def paginate(self, **_: Any) -> list[dict[str, Any]]:
        return self.pages


class StudioAnswers:
    """SageMaker's answers for two running apps: alice-space opted in, bob-space with a team tag alone."""

    def __init__(self) -> None:
        self.tags = {"alice-space": {"Team": "ml", "idle-reaper:managed": "true"}, "bob-space": {"Team": "ml"}}
        self.tags_of = ""

    def get_paginator(self, name: str) -> _Pages:
        if name == "list_tags":
            return _Pages([{"Tags": [{"Key": k, "Value": v} for k, v in self.tags[self.tags_of].items()]}])
        spec = {"InstanceType": "ml.g5.xlarge", "SageMakerImageArn": "arn:aws:sagemaker:us-east-1:1:image/smd"}
        base = {"DomainId": D1, "AppName": "default", "Status": "InService", "CreationTime": NOW, "ResourceSpec": spec}
        return _Pages([{"Apps": [{**base, "SpaceName": s, "AppType": "JupyterLab"} for s in self.tags]}])

    def describe_space(self, DomainId: str, SpaceName: str) -> dict[str, Any]:
        self.tags_of = SpaceName  # the next ListTags is this space's (one worker: in_order)
        return {"DomainId": DomainId, "SpaceName": SpaceName, "SpaceArn": space_arn(SpaceName)}

    def describe_domain(self, DomainId: str) -> dict[str, Any]:
        return {"DomainId": DomainId}  # idle shutdown off


def test_a_sweep_lists_only_apps_whose_space_opted_in_and_the_note_leaves_out_those_it_acts_on(in_order: None):
    from idle_reaper.policy import TagKeys
    from idle_reaper.sweep.studio import studio_findings

    apps = StudioApps(StudioAnswers())
    (found,) = apps.discover(TagKeys())
    assert found.instance_id == f"studio:{D1}:alice-space:JupyterLab:default" and found.launch_time == NOW
    assert found.facts.studio is not None and dict(found.facts.studio.resource_spec)["InstanceType"] == "ml.g5.xlarge"

    class Swept:
        studio = apps

    def refs(studio_apps: str) -> dict[str, TeamPolicyRef]:
        policy = TeamPolicy(idle_minutes=60, studio_apps=studio_apps)
        return {"ml": TeamPolicyRef(team="ml", policy=policy, source="/idle-reaper/teams/ml", version=1)}

    reported = [f.app.space_name for f in studio_findings(Swept(), refs("report"), Settings())]  # type: ignore[arg-type]
    assert reported == ["alice-space", "bob-space"]
    # A team that deletes idle apps: the sweep acts on alice-space, so the note is bob-space's alone (not opted in).
    acting = [f.app.space_name for f in studio_findings(Swept(), refs("delete"), Settings())]  # type: ignore[arg-type]
    assert acting == ["bob-space"]


def test_an_old_failed_entry_never_marks_its_started_again_successor_failed(in_order: None) -> None:
    # ListApps lists a failed or deleted app for a while beside the app started again under the same name. Read by
    # its old Failed entry, the sweep told the new app's bring-back failed and deleted it, running.
    from datetime import timedelta

    from idle_reaper.policy import TagKeys

    class Retried(StudioAnswers):
        def get_paginator(self, name: str) -> _Pages:
            pages = super().get_paginator(name)
            if name == "list_apps":
                (page,) = pages.pages
                old = {**page["Apps"][0], "Status": "Failed", "CreationTime": NOW - timedelta(hours=1)}
                pages = _Pages([{"Apps": [old, *page["Apps"]]}])
            return pages

    failed: list[str] = []
    (found,) = StudioApps(Retried()).discover(TagKeys(), failed=failed)
    assert failed == [] and found.instance_id == f"studio:{D1}:alice-space:JupyterLab:default"
    failed_now: list[str] = []

    class FailedAgain(StudioAnswers):  # the newest entry Failed: told
        def get_paginator(self, name: str) -> _Pages:
            pages = super().get_paginator(name)
            if name == "list_apps":
                (page,) = pages.pages
                page["Apps"][0] = {**page["Apps"][0], "Status": "Failed"}
            return pages

    assert StudioApps(FailedAgain()).discover(TagKeys(), failed=failed_now) == []
    assert failed_now == [f"studio:{D1}:alice-space:JupyterLab:default"]
