"""Quiet hours: stops made while a team sleeps are noted, and each owner gets one summary when they end."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta

from idle_reaper.aws.clients import AwsError, error_code
from idle_reaper.aws.policies import policy_for
from idle_reaper.aws.state import StateStore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import State
from idle_reaper.core.reports import QUIET_REPORT_GIVE_UP, owner_key, quiet_hours_reports
from idle_reaper.notify import OwnerNotifier, PermanentDeliveryFailure
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.sweep.adapters import Adapters, alert_once
from idle_reaper.sweep.delivery import OUTCOME_NOT_RECORDED

QUIET_INDEX = "quiet-stops"  # lookup: JSON {team: [instance ids stopped during quiet hours, not yet reported]}
QUIET_INDEX_TTL = timedelta(days=7)


def report_quiet_hours(
    adapters: Adapters, decisions: list[Decision], refs: Mapping[str, TeamPolicyRef], settings: Settings, now: datetime
) -> None:
    """Quiet hours are not lost: the machines this sweep stopped during their team's quiet hours join an
    index in the state table; at the first sweep after a team's quiet hours end, each owner gets ONE
    summary of what was stopped (core.quiet_hours_reports), with "Start it again" per machine. Every shard
    of a sweep runs this: each stop is claimed once (claim_once per machine and stop), so no stop is told
    twice; a post that fails releases its claims and the next sweep tries again, for at most
    core.QUIET_REPORT_GIVE_UP. The index is updated conditionally (shards of one sweep and overlapping
    sweeps update it at once: none loses another's entries); stops that cannot be added are reported to the
    admins. Never fails the sweep."""
    notifier, store = adapters.notifier, adapters.store
    if not isinstance(notifier, OwnerNotifier):
        return
    stopped: dict[str, list[str]] = defaultdict(list)
    for d in decisions:
        # Indexed from what the stop did: a stop whose outcome write failed still happened (its intent, with
        # quiet_stop_at, was written with the claim); one refused or never attempted did not.
        did_stop = d.error is None or d.error.startswith(OUTCOME_NOT_RECORDED)
        if d.record.quiet_stop_at == now and did_stop and d.record.state is State.REAPED:
            stopped[d.machine.team].append(d.machine.key)

    def add_stopped(index: dict[str, list[str]]) -> dict[str, list[str]]:
        for team, ids in stopped.items():
            index.setdefault(team, []).extend(i for i in ids if i not in index.get(team, []))
        return index

    try:
        pending = _update_quiet_index(store, now, add_stopped)
    except Exception as exc:
        lost = sorted(i for ids in stopped.values() for i in ids)
        logger.warning("quiet hours index not updated", extra={"error": str(exc), "instance_ids": lost})
        if lost:
            text = (
                f"{len(lost)} machines stopped during quiet hours will not be in their owners' morning summary "
                f"(the state table refused the update: {exc}): {', '.join(lost[:20])}"
            )
            alert_once(adapters, f"quiet-index#{now.isoformat()}", text, settings, now)
        return
    try:
        awake = {t for t in pending if (p := policy_for(t, refs, settings).at(now).policy) and not p.quiet_hours}
        if not awake:
            return
        due = [i for t in sorted(awake) for i in pending[t]]
        done = set(due) - set(_send_quiet_summaries(adapters, notifier, due, now))  # sent, or given up

        def remove_done(index: dict[str, list[str]]) -> dict[str, list[str]]:
            left = {team: [i for i in ids if i not in done] for team, ids in index.items()}
            return {team: ids for team, ids in left.items() if ids}

        if done:
            _update_quiet_index(store, now, remove_done)
    except Exception as exc:  # the summary must never fail the sweep; the index stays for the next one
        logger.warning("quiet hours summary failed", extra={"error": str(exc)})


QUIET_INDEX_ATTEMPTS = 6


def _update_quiet_index(
    store: StateStore, now: datetime, change: Callable[[dict[str, list[str]]], dict[str, list[str]]]
) -> dict[str, list[str]]:
    """Read, change and write back the quiet-stops index, conditionally on what was read; again when another
    sweep wrote it first. Returns the index as written (or as read, when the change changes nothing)."""
    failure = "it changed under this sweep every time"
    for attempt in range(QUIET_INDEX_ATTEMPTS):
        if attempt:  # shards of one sweep write it at once: back off, jittered, before reading again
            time.sleep(random.uniform(0, 0.02 * 2**attempt))
        try:
            raw = store.get_lookup(QUIET_INDEX, now)
            before = _quiet_index(raw)
            after = change({team: list(ids) for team, ids in before.items()})
            if after == before:
                return before
            if store.replace_lookup(
                QUIET_INDEX, json.dumps(after, sort_keys=True), now + QUIET_INDEX_TTL, expected=raw, now=now
            ):
                return after
        except AwsError as exc:  # a throttle or a transient fault: try again
            failure = f"{error_code(exc)}: {exc}"
    raise RuntimeError(f"quiet hours index not written in {QUIET_INDEX_ATTEMPTS} attempts ({failure})")


def _quiet_index(raw: str | None) -> dict[str, list[str]]:
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        logger.warning("quiet hours index unreadable; reset", extra={"value": (raw or "")[:200]})
        return {}
    return {str(team): [str(i) for i in ids] for team, ids in data.items()}


def _send_quiet_summaries(adapters: Adapters, notifier: OwnerNotifier, ids: list[str], now: datetime) -> list[str]:
    """One summary per owner of the stopped machines `ids`; returns the ids to try again next sweep."""
    store = adapters.store
    retry: list[str] = []
    for stopped in quiet_hours_reports(store.load(ids).values()):
        oldest = min(r.quiet_stop_at or now for r in stopped)
        # One summary per owner per sweep: the shards of a sweep share its time, and whichever claims the owner
        # first tells all of the owner's stops; the others leave them to it.
        owner = stopped[0].owner_slack_id or owner_key(stopped[0].owner) or stopped[0].key
        owner_claim = f"quiet-summary-owner#{owner}@{now.isoformat()}"
        if not store.claim_once(owner_claim, now):
            retry += [r.key for r in stopped] if now - oldest < QUIET_REPORT_GIVE_UP else []
            continue
        keys = {r.key: f"quiet-summary#{r.key}@{(r.quiet_stop_at or now).isoformat()}" for r in stopped}
        group = [r for r in stopped if store.claim_once(keys[r.key], now)]
        # A stop claimed elsewhere is being told by another shard or sweep (or was): kept in the index until
        # its record says it was told, in case that post fails.
        claimed = {r.key for r in group}
        held = [r.key for r in stopped if r.key not in claimed]
        if held and now - oldest < QUIET_REPORT_GIVE_UP:
            retry += held
        if not group:
            continue
        try:
            deliveries = notifier.quiet_summary(group)
        except PermanentDeliveryFailure as exc:
            logger.warning("quiet hours summary cannot be delivered", extra={"why": exc.reason})
            continue
        except Exception as exc:
            logger.warning("quiet hours summary failed", extra={"error": str(exc)})
            deliveries = None
        if deliveries is None:
            store.release_claim(owner_claim)
            for r in group:
                store.release_claim(keys[r.key])
            if now - oldest < QUIET_REPORT_GIVE_UP:
                retry += [r.key for r in group]
            else:
                logger.warning("quiet hours summary given up", extra={"instance_ids": [r.instance_id for r in group]})
            continue
        for r, delivery in zip(group, deliveries, strict=True):
            told = replace(
                r,
                version=r.version + 1,
                quiet_stop_at=None,
                warning_ref=delivery.ref or r.warning_ref,
                group_ref=delivery.group_ref,
                messages=delivery.messages or r.messages,
                owner_slack_id=delivery.owner_slack_id or r.owner_slack_id,
            )
            with contextlib.suppress(*AwsError):
                if not store.save(told):
                    logger.warning(
                        "machine changed while its quiet hours summary was sent", extra={"id": r.instance_id}
                    )
    return retry
