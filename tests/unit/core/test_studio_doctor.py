"""The doctor's Studio checks (core/studio.check_studio): what leaves `studio_apps: delete` doing nothing in a real
account, decided from DescribeDomain's answers and the apps' last hour of CPU."""

from __future__ import annotations

from typing import Any

from idle_reaper.core.studio import AppFacts, check_studio, runs_ours

ARN = "arn:aws:sagemaker:eu-west-1:111122223333:studio-lifecycle-config/"


def app(domain: str, space: str = "s") -> AppFacts:
    return AppFacts(domain, space, "JupyterLab", "default", "InService")


def domain(*, propagate: bool = True, builtin: str | None = None, default: str | None = None, **more: Any) -> Any:
    settings: dict[str, Any] = {}
    if builtin:
        settings["BuiltInLifecycleConfigArn"] = ARN + builtin
    if default:
        settings["DefaultResourceSpec"] = {"InstanceType": "ml.t3.medium", "LifecycleConfigArn": ARN + default}
    settings.update(more)
    return {
        "TagPropagation": "ENABLED" if propagate else "DISABLED",
        "DefaultUserSettings": {"JupyterLabAppSettings": settings},
    }


def by_check(findings: Any) -> dict[str, Any]:
    return {f.check: f for f in findings}


def test_a_domain_runs_ours_when_it_is_the_built_in_or_the_default_not_merely_attached() -> None:
    assert runs_ours(domain(builtin="idle-reaper-studio-jupyterlab"), "idle-reaper")
    assert runs_ours(domain(default="idle-reaper-studio-codeeditor"), "idle-reaper")
    assert not runs_ours(domain(builtin="idle-reaper-studio-jupyterlab"), "staging"), "another stack's"
    assert not runs_ours(domain(default="someone-elses"), "idle-reaper")
    assert not runs_ours(domain(LifecycleConfigArns=[ARN + "idle-reaper-studio-jupyterlab"]), "idle-reaper")
    assert not runs_ours({}, "idle-reaper")


def test_each_gap_is_a_warning_naming_its_domains_or_apps_and_a_healthy_domain_is_ok() -> None:
    apps = [app("d-good"), app("d-dark"), app("d-closed", "x"), app("d-closed", "y")]
    domains = {
        "d-good": domain(builtin="idle-reaper-studio-jupyterlab"),
        "d-dark": domain(),
        "d-closed": domain(propagate=False, default="idle-reaper-studio-jupyterlab"),
    }
    found = by_check(check_studio(apps, domains, [apps[1].machine_id], "idle-reaper"))
    assert (found["studio.tags"].status, found["studio.tags"].subjects) == ("fail", ("d-closed",))
    assert "AccessDenied" in found["studio.tags"].message and "--tag-propagation ENABLED" in found["studio.tags"].fix
    assert (found["studio.lifecycle"].status, found["studio.lifecycle"].subjects) == ("fail", ("d-dark",))
    assert "read unknown" in found["studio.lifecycle"].message
    assert found["studio.signals"].subjects == (apps[1].machine_id,)
    healthy = by_check(check_studio([apps[0]], domains, [], "idle-reaper"))
    assert {f.status for f in healthy.values()} == {"ok"}
    assert by_check(check_studio([apps[0]], domains, None, "idle-reaper"))["studio.signals"].status == "unknown"
    (none,) = check_studio([], {}, [], "idle-reaper")
    assert none.status == "ok" and "no running Studio app is swept" in none.message


def test_the_sweeps_daily_doctor_checks_the_domains_of_the_apps_it_sweeps() -> None:
    # Before, only `idle-reaper doctor` run by hand said that a domain's tag propagation is off (every DeleteApp
    # AccessDenied) or that it runs none of our lifecycle configurations (every app unknown): the admins never heard.
    from types import SimpleNamespace

    from idle_reaper.core.signals import Signals
    from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
    from idle_reaper.sweep.adapters import SweepRead
    from idle_reaper.sweep.doctor_daily import studio_daily
    from tests.unit.core.test_studio_apps import facts, machine

    asked: list[str] = []

    def describe(domain_id: str) -> Any:
        asked.append(domain_id)
        return domain(propagate=False)

    closed, dark = machine(facts(domain_id="d-closed")), machine(facts(domain_id="d-closed", space_name="b"))
    acting = TeamPolicyRef(
        team="ml", policy=TeamPolicy(studio_apps="delete"), source="/idle-reaper/teams/ml", version=1
    )
    read = SweepRead(
        Settings(), {"ml": acting}, [closed, dark], {closed.instance_id: Signals(cpu=[]), dark.instance_id: Signals()}
    )
    adapters: Any = SimpleNamespace(fleet=SimpleNamespace(studio=SimpleNamespace(domain=describe)))
    found = by_check(studio_daily(adapters, read))
    assert asked == ["d-closed"]  # one DescribeDomain a domain
    assert found["studio.tags"].status == found["studio.lifecycle"].status == "fail"  # told by the daily doctor
    assert found["studio.signals"].subjects == (closed.instance_id, dark.instance_id)
    report_only = TeamPolicyRef(team="ml", policy=TeamPolicy(), source="/idle-reaper/teams/ml", version=1)
    assert studio_daily(adapters, SweepRead(Settings(), {"ml": report_only}, [closed], {})) == []
    assert asked == ["d-closed"], "no app swept: nothing read"
