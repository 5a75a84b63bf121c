"""`idle-reaper report --week 2026-W47 [--team T] [--png out.png]`: the weekly digest of one team (or, without
--team, the admins' digest of every team) from the state table, printed; the chart written locally."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from idle_reaper import aws
from idle_reaper.aws.policies import policy_for
from idle_reaper.core.digest import (
    RECOVERY_HORIZON,
    TREND_WEEKS,
    Week,
    account_of,
    build_digest,
    parse_week,
)
from idle_reaper.core.digest_text import digest_text
from idle_reaper.policy import PolicyError
from idle_reaper.pricing import DEFAULT_PRICES


def iso_week(text: str) -> Week:
    try:
        return parse_week(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def account_names(accounts: set[str]) -> dict[str, str]:
    """The names of member accounts, from AWS Organizations (the management account, or a delegated
    administrator, may list them); {} when they cannot be listed: the digest then says each by its id."""
    if not accounts:
        return {}
    try:
        pages = aws.client("organizations").get_paginator("list_accounts").paginate()
        return {a["Id"]: str(a.get("Name", "")) for page in pages for a in page["Accounts"] if a["Id"] in accounts}
    except Exception as exc:  # not allowed, or not in an organization: ids only
        print(
            f"idle-reaper: account names not listed ({type(exc).__name__}); accounts are shown by id", file=sys.stderr
        )
        return {}


def cmd_report(args: argparse.Namespace) -> int:
    week: Week = args.week
    now: datetime = args.now or datetime.now(UTC)
    png_path = Path(args.png) if args.png else None
    if png_path is not None and not png_path.parent.is_dir():
        print(f"idle-reaper: --png {args.png}: no such directory; nothing written", file=sys.stderr)
        return 2
    policies = aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())
    try:
        settings, _ = policies.load_settings()
    except PolicyError as exc:
        print(f"idle-reaper: settings are invalid: {exc}", file=sys.stderr)
        return 2
    refs = policies.load_teams(settings)
    policy = (policy_for(args.team, refs, settings).policy if args.team else None) or settings.default_policy
    start, _ = week.span(policy.timezone)
    if start > now:
        print(f"idle-reaper: {week.label} has not begun (it starts {start:%Y-%m-%d %H:%M} UTC)", file=sys.stderr)
        return 2
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    first, _ = week.previous(TREND_WEEKS - 1).span(policy.timezone)
    records, audits = store.records_and_audit(first - RECOVERY_HORIZON, now)
    entries = [(a.instance_id, a.at, a.entry) for a in audits]
    teams = set(refs) | {r.team for r in records} | {str(e.get("team") or "") for _, _, e in entries}
    if args.team and args.team not in teams:
        print(
            f"idle-reaper: no team {args.team!r}; known: {', '.join(sorted(teams - {''})) or 'none'}", file=sys.stderr
        )
        return 2
    digest = build_digest(
        entries,
        records,
        week,
        now=now,
        team=args.team,
        zone=policy.timezone,
        policy=policy if args.team else None,
        prices=DEFAULT_PRICES,
        account_names=account_names(
            {r.account for r in records if r.account} | {a for i, _, _ in entries if (a := account_of(i))}
        ),
    )
    print(digest_text(digest))
    if png_path is not None:
        from idle_reaper.slack.chart import render_chart

        png_path.write_bytes(render_chart(digest, {r.key: r.name or r.instance_id for r in records}))
        print(f"chart: {png_path}")
    return 0
