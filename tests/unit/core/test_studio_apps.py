"""SageMaker Studio apps swept (issue 46) in the core: the policy field, which apps a sweep decides about, when one
is busy, idle or unknown, what its deletion saves, the lifecycle, and what its record keeps to start it again. Pure:
no AWS."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.core import Action, State, decide, kind_policy
from idle_reaper.core.dollars import of_kind
from idle_reaper.core.endpoints import words_for
from idle_reaper.core.kinds import InstanceFacts, Kind, Lookups, classify
from idle_reaper.core.records import MachineRecord
from idle_reaper.core.signals import Machine, Signals, assess
from idle_reaper.core.studio import (
    AppFacts,
    AppRestore,
    kept_restore,
    pending_restore,
    studio_id,
    studio_parts,
    swept,
)
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, PolicyError, TeamPolicy, TeamPolicyRef, parse_team_policy
from idle_reaper.pricing import hourly_price

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
P = timedelta(minutes=5)
LONG_AGO = NOW - timedelta(days=7)
ACTING = TeamPolicy(idle_minutes=60, warn_minutes=20, studio_apps="delete")
SPEC = (
    ("InstanceType", "ml.t3.medium"),
    ("SageMakerImageArn", "arn:aws:sagemaker:us-east-1:1:image/sagemaker-distribution-cpu"),
)
TAGS = {"Team": "ml", "Owner": "U0OWNER", "idle-reaper:managed": "true", "aws:cloudformation:stack-name": "x"}


def facts(**kw) -> AppFacts:
    base = {
        "domain_id": "d-abc123",
        "space_name": "alice-space",
        "app_type": "JupyterLab",
        "app_name": "default",
        "status": "InService",
        "resource_spec": SPEC,
        "tags": tuple(sorted(TAGS.items())),
    }
    return AppFacts(**{**base, **kw})


def machine(app: AppFacts | None = None, launched: datetime = LONG_AGO) -> Machine:
    app = app or facts()
    spec = dict(app.resource_spec)
    return Machine(
        app.machine_id, spec["InstanceType"], "ml", launched, app.space_name, "U0OWNER", facts=InstanceFacts(studio=app)
    )


def ref(policy: TeamPolicy = ACTING) -> TeamPolicyRef:
    return TeamPolicyRef(team="ml", policy=policy, source="/idle-reaper/teams/ml", version=1)


def cpu(value: float, minutes: int = 120, end: datetime = NOW) -> list:
    count = (minutes - 5) // 5
    return [(end - P * (count - i + 1), value) for i in range(count)]


def sweep_at(at: datetime, previous, series, app: AppFacts | None = None):
    m = machine(app)
    kind = classify(m.facts, Lookups(), at)
    own = kind_policy(ref(), kind, m)
    assert own.policy is not None
    a = assess(m, Signals(cpu=series), own.policy, now=at, period=P, gpu_families=DEFAULT_GPU_FAMILIES)
    return decide(m, own, a, previous, now=at, kind=kind)


class TestPolicyField:
    def test_report_only_by_default_and_delete_when_asked(self):
        assert TeamPolicy().studio_apps == "report"
        assert parse_team_policy("/t/ml", '{"studio_apps": "delete"}', TeamPolicy()).studio_apps == "delete"

    @pytest.mark.parametrize("value", ['"yes"', "true", '"Delete"', "null", "1"])
    def test_a_bad_value_is_refused_and_named(self, value):
        with pytest.raises(PolicyError) as err:
            parse_team_policy("/t/ml", f'{{"studio_apps": {value}, "idle_minutes": 90}}', TeamPolicy())
        assert "studio_apps" in str(err.value) and "'report' or 'delete'" in str(err.value)


class TestWhichAppsAreSwept:
    def test_report_only_teams_and_teams_in_safe_mode_never_have_an_app_swept(self):
        assert not swept(facts(), TeamPolicy())  # the default: the admins' daily note reports it
        assert not swept(facts(), None)  # a team in safe mode does less, never more

    @pytest.mark.parametrize(("shutdown", "expected"), [(None, True), (60, False), (45, False), (120, True)])
    def test_an_app_studio_shuts_down_itself_within_the_window_is_left_to_studio(self, shutdown, expected):
        assert swept(facts(idle_shutdown_minutes=shutdown), ACTING) is expected


class TestSignal:
    def test_a_busy_app_is_never_warned(self):
        d = sweep_at(NOW, None, cpu(60.0))
        assert d.signal == "busy" and d.action is Action.NONE and d.state is not State.WARNED

    def test_an_app_without_metrics_is_unknown_never_idle(self):
        d = sweep_at(NOW, None, [])
        assert d.signal == "unknown" and d.action is Action.NONE

    def test_a_quiet_app_is_idle_and_its_kind_deletes_it_saving_its_instance_price(self):
        d = sweep_at(NOW, None, cpu(0.5))
        assert d.signal == "idle" and d.action is Action.WARN and "delete it at" in d.reason
        kind = classify(machine().facts, Lookups(), NOW)
        assert kind.kind is Kind.STUDIO_APP and kind.can_stop
        assert of_kind(kind, hourly_price("ml.g4dn.xlarge")).stop.hourly == 0.7364

    def test_an_app_younger_than_its_window_is_not_idle(self):
        m = machine(launched=NOW - timedelta(minutes=30))
        kind = classify(m.facts, Lookups(), NOW)
        a = assess(m, Signals(cpu=cpu(0.5, 30)), ACTING, now=NOW, period=P, gpu_families=DEFAULT_GPU_FAMILIES)
        assert decide(m, ref(), a, None, now=NOW, kind=kind).action is Action.NONE


class TestLifecycle:
    def test_warned_then_deleted_and_the_record_keeps_how_to_recreate_it(self):
        warned = sweep_at(NOW, None, cpu(0.5))
        assert (warned.state, warned.notify) == (State.WARNED, "warning")
        record = replace(warned.record, warning_delivered_at=NOW)
        deleted = sweep_at(NOW + timedelta(minutes=25), record, cpu(0.5, 150, NOW + timedelta(minutes=25)))
        assert (deleted.state, deleted.action, deleted.notify) == (State.REAPED, Action.STOP, "reaped")
        assert "delete it (its space and the space's storage kept)" in deleted.reason
        restore = AppRestore.parse(deleted.record.endpoint)
        assert restore is not None and restore.resource_spec == SPEC
        # AWS's own tags are not CreateApp's to set; the opt-in tag is, so IAM lets the reaper create it.
        assert dict(restore.tags) == {k: v for k, v in TAGS.items() if not k.startswith("aws:")}

    def test_notify_only_reports_and_never_deletes(self):
        m = machine()
        kind = classify(m.facts, Lookups(), NOW)
        own = ref(ACTING.model_copy(update={"action": "notify_only"}))
        a = assess(m, Signals(cpu=cpu(0.5, 200)), ACTING, now=NOW, period=P, gpu_families=DEFAULT_GPU_FAMILIES)
        previous = MachineRecord(
            instance_id=m.instance_id,
            team="ml",
            state=State.WARNED,
            warned_at=NOW - timedelta(hours=2),
            warning_delivered_at=NOW - timedelta(hours=2),
            observed_at=NOW - timedelta(minutes=5),
            idle_since=NOW - timedelta(hours=3),
            machine_kind="studio-app",
        )
        d = decide(m, own, a, previous, now=NOW, kind=kind)
        assert (d.action, d.applied) == (Action.STOP, False)
        assert d.state is State.WARNED and "notify_only" in d.reason


class TestRestore:
    def test_ids_round_trip_and_never_meet_another_kind(self):
        mid = studio_id("d-abc123", "alice-space", "CodeEditor", "default")
        assert studio_parts(mid) == ("d-abc123", "alice-space", "CodeEditor", "default")
        assert words_for(mid).noun == "Studio app" and words_for(f"123456789012/us-east-1/{mid}").deletes
        for bad in ("i-0123456789abcdef0", "endpoint:x", "studio:d-1:space", "studio:d-1::JupyterLab:default"):
            with pytest.raises(ValueError, match="not a Studio app's id"):
                studio_parts(bad)

    def test_round_trip_create_app_and_by_hand(self):
        restore = facts().restore()
        assert AppRestore.parse(restore.to_json()) == restore
        request = restore.create_app()
        assert (
            request["ResourceSpec"] == dict(SPEC) and {"Key": "idle-reaper:managed", "Value": "true"} in request["Tags"]
        )
        assert (request["DomainId"], request["SpaceName"], request["AppType"], request["AppName"]) == (
            "d-abc123",
            "alice-space",
            "JupyterLab",
            "default",
        )
        by_hand = "--app-type JupyterLab --app-name default --resource-spec InstanceType=ml.t3.medium"
        assert restore.recreate_command().endswith(f"--space-name alice-space {by_hand}")

    @pytest.mark.parametrize("raw", ["", "not json", "[]", '{"app": ["d-1", "s"]}', '{"app": ["", "s", "t", "n"]}'])
    def test_text_it_never_wrote_is_nothing_kept(self, raw):
        assert AppRestore.parse(raw) is None

    def test_a_pending_start_is_carried_over_and_told_once_in_service(self):
        pending = replace(facts().restore(), pending_by="U0BOB", pending_since=NOW.isoformat()).to_json()
        carried = kept_restore(pending, None, facts())
        assert AppRestore.parse(carried).pending_by == "U0BOB"
        assert pending_restore(None, facts(), carried) is not None
        assert pending_restore(None, facts(status="Pending"), carried) is None
        assert pending_restore(None, facts(), facts().restore().to_json()) is None
        assert json.loads(kept_restore(None, None, facts()))["app"] == [
            "d-abc123",
            "alice-space",
            "JupyterLab",
            "default",
        ]
