"""Once a day, the admins hear which running Studio apps would outlast their team's idle window (core/studio.py),
but for those the sweep acts on (their team's policy says `studio_apps: delete`, their space carries the opt-in
tag); and a sweep that could not list Studio apps says so."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import datetime

from idle_reaper.aws.clients import AwsError, error_code
from idle_reaper.aws.policies import policy_for
from idle_reaper.core.studio import StudioFinding, misaligned
from idle_reaper.notify import logger
from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.pricing import hourly_price
from idle_reaper.sweep.adapters import Adapters, tell_unlisted


def studio_findings(adapters: Adapters, refs: Mapping[str, TeamPolicyRef], settings: Settings) -> list[StudioFinding]:
    """What `status` and the daily note list. Raises AwsError when Studio cannot be read."""
    if adapters.studio is None:
        return []

    def policy_of(team: str | None) -> TeamPolicy:
        policy = policy_for(team, refs, settings).policy if team else None
        return policy or settings.default_policy

    apps = [
        app
        for app in adapters.studio.running(settings.tags.team, settings.tags.managed)
        if not (app.team and app.opted_in and policy_of(app.team).studio_apps == "delete")
    ]
    return misaligned(apps, lambda team: policy_of(team).idle_minutes, hourly_price)


def report_unlisted_studio(
    adapters: Adapters, settings: Settings, now: datetime, warnings: list[str], *, alert: bool
) -> None:
    """Studio apps that could not be listed are not swept this time: the sweep's warnings say so, and the admins
    hear it once a day per error (as for notebook instances and endpoints)."""
    unlisted = adapters.fleet.studio_unlisted
    if not unlisted:
        return
    text = (
        f"idle-reaper could not list SageMaker Studio apps ({unlisted}); none is swept until it can. Check the "
        "sweep role's sagemaker:ListApps, DescribeSpace, DescribeDomain and ListTags."
    )
    tell_unlisted(adapters, "studio", unlisted, text, settings, now, warnings, alert=alert)


def report_studio(adapters: Adapters, refs: Mapping[str, TeamPolicyRef], settings: Settings, now: datetime) -> None:
    """The day's first sweep claims the note, reads Studio, and tells the admins; a read that fails releases
    the claim (a later sweep tries again) and is logged."""
    if adapters.studio is None or not settings.sagemaker_notebooks:
        return
    key = f"studio#{now:%Y-%m-%d}"
    try:
        if not adapters.store.claim_once(key, now):
            return
        findings = studio_findings(adapters, refs, settings)
    except AwsError as exc:
        logger.warning("could not read SageMaker Studio apps", extra={"error": error_code(exc)})
        with contextlib.suppress(*AwsError):
            adapters.store.release_claim(key)
        return
    if findings:
        text = (
            f"{len(findings)} running SageMaker Studio app(s) would outlast their team's idle window (idle-reaper "
            "reports these Studio apps, it does not stop them): " + "; ".join(f.line() for f in findings) + ". Align "
            "the domain's or space's idle shutdown (AppLifecycleManagement) with the team's idle_minutes."
        )
        try:
            adapters.notifier.admin_alert(text, settings.admins, settings.admin_channel)
        except Exception as exc:  # a note must never stop the sweep
            logger.warning("Studio note failed", extra={"error": str(exc)})
