"""What a sweep works with: its adapters (real AWS, moto or in-memory), its report, and admin alerts sent once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from idle_reaper.aws.clients import (
    DEFAULT_DEPLOY_PREFIX,
    AwsError,
    client,
    deploy_prefix,
    error_code,
    ssm_prefix,
    table_name,
)
from idle_reaper.aws.endpoints import sagemaker_fleet
from idle_reaper.aws.fleet import LISTING_PROCESSES, Fleet
from idle_reaper.aws.metrics import (
    MetricsReader,
)
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.state import DynamoStateStore, StateStore
from idle_reaper.aws.studio import StudioApps
from idle_reaper.core.kinds import notebook_lifecycle_config
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.reports import (
    SweepSummary,
)
from idle_reaper.core.signals import Machine, Signals
from idle_reaper.notify import LoggingNotifier, Notifier
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import PolicyError, Settings, TeamPolicyRef


class SweepCannotRun(Exception):
    """The sweep could not run at all (invalid settings, no EC2 or state table access)."""


@dataclass(frozen=True)
class SweepRead:
    """What a sweep read (its settings, team policies, machines and metrics), for work after it that needs the
    same facts: the doctor's daily check reads none of them again."""

    settings: Settings
    refs: Mapping[str, TeamPolicyRef] | None  # None: the team policies could not be read
    machines: Sequence[Machine]
    signals: Mapping[str, Signals]  # of the machines read this sweep


@dataclass
class SweepReport:
    now: datetime
    dry_run: bool
    decisions: list[Decision]
    settings_version: int | None
    metric_calls: int = 0
    duration_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)
    sweep_id: str = ""  # the owner of this sweep's claims in the state table
    teams_in_safe_mode: list[str] = field(default_factory=list)  # invalid or unreadable policy: nothing acted
    read: SweepRead | None = field(default=None, repr=False)  # for the daily doctor (sweep/doctor.py) to reuse

    @property
    def summary(self) -> SweepSummary:
        return SweepSummary.of(self.decisions)

    @property
    def errors(self) -> list[Decision]:
        return [d for d in self.decisions if d.error and d.error != DEFERRED]

    @property
    def deferred(self) -> list[Decision]:
        """Machines this sweep ran out of time for: untouched, left to the next sweep."""
        return [d for d in self.decisions if d.error == DEFERRED]


@dataclass
class Adapters:
    policies: PolicyStore
    fleet: Fleet
    metrics: MetricsReader
    store: StateStore
    notifier: Notifier
    studio: StudioApps | None = None  # SageMaker Studio, read for the daily report (sweep/studio.py)
    # The lifecycle configuration this stack ships: a notebook instance with another attached is not watched.
    notebook_config: str = notebook_lifecycle_config(DEFAULT_DEPLOY_PREFIX)

    @classmethod
    def from_environment(
        cls,
        notifier: Notifier | None = None,
        slack_budget_seconds: float = 60.0,
        clock: Callable[[], datetime] | None = None,
    ) -> Adapters:
        """Real AWS clients; Slack when a bot token is configured, else warnings are only logged. `clock`: the
        time Slack's notifier tells (when its references expire), the wall clock unless a caller sweeps at
        another time (a test's fixed day)."""
        store = DynamoStateStore(client("dynamodb"), table_name())
        if notifier is None:
            from idle_reaper.slack import SlackNotConfigured, SlackNotifier, load_secrets, make_client

            try:
                secrets = load_secrets()
                notifier = SlackNotifier(make_client(secrets.bot_token, slack_budget_seconds), store, clock)
            except Exception as exc:  # not configured, or the secret cannot be read: warnings stay pending
                logger.warning(
                    "Slack unavailable: warnings stay pending, stops wait for undelivered_warning_max_minutes",
                    extra={"why": str(exc) if isinstance(exc, SlackNotConfigured) else type(exc).__name__},
                )
                notifier = LoggingNotifier(logger)
        return cls(
            policies=PolicyStore(client("ssm"), ssm_prefix()),
            fleet=sagemaker_fleet(
                client("ec2"),
                client("autoscaling"),
                client("sagemaker"),
                client("application-autoscaling"),
                # In Lambda (Linux, the planner's vCPUs) forked children list the zones; locally (the CLI, the
                # demo) threads do: a small fleet gains nothing, and macOS's libraries are not fork-safe.
                listing_processes=LISTING_PROCESSES if os.environ.get("AWS_LAMBDA_FUNCTION_NAME") else 1,
            ),
            metrics=MetricsReader(client("cloudwatch")),
            store=store,
            notifier=notifier,
            studio=StudioApps(client("sagemaker")),
            notebook_config=notebook_lifecycle_config(deploy_prefix()),
        )


def alert_invalid_policies(adapters: Adapters, refs: list[TeamPolicyRef], settings: Settings, now: datetime) -> None:
    """Tell the admins about an invalid stored team policy once per bad parameter version, not every sweep."""
    for ref in refs:
        if ref.policy is not None or ref.version is None:
            continue
        text = (
            f"team {ref.team} is in safe mode (nothing is stopped or unprotected) because its policy is invalid: "
            f"{ref.error}. Fix it with `idle-reaper policy validate` and `idle-reaper policy put {ref.team} FILE`."
        )
        alert_once(adapters, f"policy-alert#{ref.source}@v{ref.version}", text, settings, now)


def alert_once(adapters: Adapters, key: str, text: str, settings: Settings, now: datetime) -> bool:
    """Tell the admins once per `key`: a conditional write lets only the first sweep that sees it alert.
    An alert nobody received is released, so the next sweep tries again. True when this call told them."""
    try:
        if not adapters.store.claim_once(key, now):
            return False
    except Exception as exc:  # an alert must never stop the sweep; the log still says it
        logger.warning("could not record the admin alert", extra={"key": key, "error": str(exc)})
        return False
    try:
        adapters.notifier.admin_alert(text, settings.admins, settings.admin_channel)
    except Exception as exc:
        logger.warning("admin alert failed", extra={"key": key, "error": str(exc)})
        with contextlib.suppress(Exception):
            adapters.store.release_claim(key)  # the next sweep tries again
        return False
    return True


DEFERRED = "deferred: this sweep ran short of time before reaching it; nothing done, the next sweep takes it"


def load_sweep_settings(adapters: Adapters) -> tuple[Settings, int | None]:
    try:
        return adapters.policies.load_settings()
    except PolicyError as exc:
        raise SweepCannotRun(f"settings are invalid, nothing was changed: {exc}") from None
    except AwsError as exc:
        raise SweepCannotRun(f"cannot read settings ({error_code(exc)}): {exc}") from None


def tell_unlisted(
    adapters: Adapters,
    kind: str,
    unlisted: str,
    text: str,
    settings: Settings,
    now: datetime,
    warnings: list[str],
    *,
    alert: bool,
) -> None:
    """A SageMaker kind that could not be listed (`unlisted`: "Code: message"; `text` says what to check): in the
    sweep's warnings, and to the admins once a day per error. `kind` keys the alert ("notebooks", "endpoints")."""
    warnings.append(text)
    if alert:
        alert_once(adapters, f"{kind}-unlisted#{now:%Y-%m-%d}#{unlisted.split(':', 1)[0]}", text, settings, now)
