"""The `idle-reaper` command: wiring only. Decisions live in core, AWS calls in aws."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from idle_reaper import aws
from idle_reaper.policy import Settings
from idle_reaper.sweep import SHARD_SIZE, Adapters, SweepCannotRun, SweepReport, decision_row, run_sharded

Command = Callable[[argparse.Namespace], int]


def parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def account_id(text: str) -> str:
    if not re.fullmatch(r"\d{12}", text):
        raise argparse.ArgumentTypeError(f"not an AWS account id (12 digits): {text[:40]!r}")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def cmd_init(args: argparse.Namespace) -> int:
    created = aws.create_table(aws.client("dynamodb"), aws.table_name())
    print(f"state table {aws.table_name()}: {'created' if created else 'already exists'}")
    store = aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())
    try:
        store.put(store.settings_name, Settings().model_dump_json(indent=2), overwrite=False)
        print(f"settings {store.settings_name}: written with defaults")
    except aws.AwsError as exc:
        if aws.error_code(exc) != "ParameterAlreadyExists":
            raise
        print(f"settings {store.settings_name}: already exists, left as is")
    return 0


def format_table(report: SweepReport) -> str:
    rows = [decision_row(d) for d in report.decisions]
    header = ("INSTANCE", "TEAM", "STATE", "ACTION", "REASON")
    body = [
        (
            r["instance_id"],
            r["team"],
            r["state"],
            r["action"] + (" (FAILED)" if r["error"] else ""),
            r["error"] or r["reason"],
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(4)]
    lines = [
        "  ".join(str(v).ljust(w) for v, w in zip(row[:4], widths, strict=True)) + "  " + str(row[4])
        for row in [header, *body]
    ]
    title = f"sweep at {report.now.isoformat()}{' (dry run: nothing was changed)' if report.dry_run else ''}"
    footer = [f"warning: {w}" for w in report.warnings]
    return "\n".join([title, *lines, *footer])


def cmd_sweep(args: argparse.Namespace) -> int:
    now = args.now or datetime.now(UTC)
    try:
        # The planner, the shard workers (on threads) and the gather step: what the state machine runs.
        sharded = run_sharded(
            Adapters.from_environment(), now=now, dry_run=args.dry_run, shard_size=args.shard_size, workers=args.workers
        )
        report = sharded.merged()
    except SweepCannotRun as exc:
        print(f"idle-reaper: sweep could not run: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for d in report.decisions:
            print(json.dumps(decision_row(d), sort_keys=True))
    else:
        print(format_table(report))
    for w in report.warnings:
        print(f"idle-reaper: {w}", file=sys.stderr)
    return 1 if sharded.gathered.failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="idle-reaper", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every decision to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="create the state table and default settings when missing")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("sweep", help="run one sweep now")
    p.add_argument("--now", type=parse_time, help="simulated clock, ISO-8601 (default: now)")
    p.add_argument("--dry-run", action="store_true", help="decide and report, change nothing")
    p.add_argument("--json", action="store_true", help="one JSON object per machine")
    p.add_argument(
        "--shard-size",
        type=positive_int,
        default=SHARD_SIZE,
        help=f"machines per shard, each swept by its own worker (default {SHARD_SIZE:,})",
    )
    p.add_argument("--workers", type=positive_int, default=4, help="shards swept at once, on threads (default 4)")
    p.set_defaults(func=cmd_sweep)

    from idle_reaper_tools.demo import cmd_demo

    p = sub.add_parser("demo", help="run the sweep against a local emulated AWS with a seeded fleet")
    p.set_defaults(func=cmd_demo)

    import idle_reaper_tools.admin as admin

    policy = sub.add_parser("policy", help="validate, preview and change policies in SSM").add_subparsers(
        dest="policy_command", required=True
    )
    p = policy.add_parser("validate", help="check a policy file; every error with its path (exit 1 if invalid)")
    p.add_argument("file", help="a team policy JSON file (a partial override of the default policy)")
    p.add_argument("--settings", action="store_true", help="the file is the account settings, not a team policy")
    p.add_argument(
        "--stored-defaults", action="store_true", help="merge on the stored settings' default_policy, as `put` does"
    )
    p.set_defaults(func=admin.cmd_validate)
    p = policy.add_parser("put", help="validate, diff, confirm and write a team policy")
    p.add_argument("team")
    p.add_argument("file", help="the team policy JSON file")
    p.add_argument("--yes", action="store_true", help="write without asking (for scripts)")
    p.add_argument("--plan", action="store_true", help="also show which machines the change would warn or stop")
    p.add_argument("--now", type=parse_time, help="simulated clock for --plan, ISO-8601 (default: now)")
    p.set_defaults(func=admin.cmd_put)
    p = policy.add_parser("plan", help="which machines a proposed team policy would warn or stop (a dry run)")
    p.add_argument("team")
    p.add_argument("file", help="the proposed team policy JSON file")
    p.add_argument("--now", type=parse_time, help="simulated clock, ISO-8601 (default: now)")
    p.set_defaults(func=admin.cmd_plan)
    p = policy.add_parser("show", help="the effective policy, defaults filled in, and where each value came from")
    p.add_argument("team", nargs="?", help="a team (default: the default policy)")
    p.add_argument(
        "--account",
        type=account_id,
        help="organization mode: as in this member account (its own default policy, if the organization settings "
        "give it one)",
    )
    p.add_argument("--now", type=parse_time, help="which schedules are in force at this time (default: now)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=admin.cmd_show)
    p = policy.add_parser("list", help="teams, policy versions, last change, machines covered")
    p.add_argument("--json", action="store_true", help="one JSON object per team")
    p.set_defaults(func=admin.cmd_list)
    p = policy.add_parser("schema", help="print the JSON Schema of a team policy file")
    p.add_argument("--settings", action="store_true", help="the schema of the settings parameter instead")
    p.set_defaults(func=admin.cmd_schema)

    p = sub.add_parser("status", help="every machine's lifecycle from the state table")
    p.add_argument("--team")
    p.add_argument("--owner", help="an Owner tag value (email or Slack user id)")
    p.add_argument("--now", type=parse_time, help="simulated clock, ISO-8601 (default: now)")
    p.add_argument("--json", action="store_true", help="one JSON object per machine")
    p.set_defaults(func=admin.cmd_status)

    from idle_reaper_tools.doctor import cmd_doctor

    p = sub.add_parser("doctor", help="read-only checks of a deploy: ok / warn / fail / unknown, each with its fix")
    p.add_argument("--region", help="check this region only (default: every region with a stack)")
    p.add_argument("--stack", help="the stack's name (default: IdleReaper, or the prefix of IDLE_REAPER_TABLE)")
    p.add_argument("--endpoint", metavar="URL", help="the Slack request URL (SlackFunctionUrl): send it a signed ping")
    p.add_argument("--json", action="store_true", help="a JSON list of {check, status, subjects, message, fix}")
    p.add_argument(
        "--sweep-minutes", type=positive_int, default=5, help="the stack's sweep interval (default 5, the stack's)"
    )
    p.add_argument(
        "--send-test",
        nargs="?",
        const="",
        metavar="USER",
        help="post one test message to the admins and the admin channel (and to this Slack user id)",
    )
    p.set_defaults(func=cmd_doctor)

    from idle_reaper_tools.import_state import cmd_import_state

    organization = sub.add_parser(
        "organization", help="organization mode: move a single-account stack's state into the hub"
    ).add_subparsers(dest="organization_command", required=True)
    p = organization.add_parser(
        "import-state",
        help="copy an account's single-account state table into the hub's, under the member keys",
        description="Copy a single-account stack's machine records (snoozes, warnings in flight, history) and "
        "audit items into the hub's state table as the machines of a member account (docs/deploying.md, "
        "Organizations). Conditional writes: the hub's newer records are kept; running it again changes nothing.",
    )
    p.add_argument("--from-table", required=True, help="the old stack's state table (name or ARN)")
    p.add_argument("--account", required=True, help="the member account it ran in (12 digits)")
    p.add_argument("--region", required=True, help="the region it ran in (one of the hub's member regions)")
    p.add_argument(
        "--from-role", metavar="ROLE_ARN", help="a role in that account to read the old table with (default: yours)"
    )
    p.add_argument(
        "--same-slack-app",
        action="store_true",
        help="the old stack's Slack app is the hub's: keep its warnings' buttons and messages (default: the hub "
        "warns again with its own app)",
    )
    p.add_argument(
        "--while-watched", action="store_true", help="import although the hub is not told to exclude the account"
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be copied, write nothing")
    p.set_defaults(func=cmd_import_state)

    from idle_reaper_tools.report import cmd_report, iso_week

    p = sub.add_parser("report", help="the weekly digest of a team (or of every team) from the state table")
    p.add_argument("--week", type=iso_week, required=True, help="the ISO week, e.g. 2026-W47")
    p.add_argument("--team", help="one team's digest (default: the admins' digest of every team)")
    p.add_argument("--png", metavar="OUT.png", help="also write the digest's chart here")
    p.add_argument(
        "--now", type=parse_time, help="simulated clock, ISO-8601 (default: now): the end of a week under way"
    )
    p.set_defaults(func=cmd_report)

    from idle_reaper.core.waiting import WaitingRule
    from idle_reaper_tools.replay import (
        BASELINES,
        cmd_replay,
        non_negative_minutes,
        positive_minutes,
        snooze_rate,
        waiting_rule,
    )

    p = sub.add_parser(
        "replay",
        help="run the decision core over a utilization trace (CSV) and report what it would have saved",
        description="Replay a trace (columns timestamp, instance_id, cpu; optional gpu, team, instance_type, "
        "network; .csv or .csv.gz) through the real decision core with a simulated clock.",
    )
    p.add_argument("trace", help="the trace: a .csv or .csv.gz file")
    p.add_argument("--policy", help="a team policy JSON for every team, or {default_policy, teams: {...}}")
    p.add_argument("--price-table", help="JSON object of instance type to hourly price (default: built-in)")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG: fleet state over time and savings per team")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--baseline", choices=BASELINES, help="also replay the AWS-native alternative, side by side")
    p.add_argument(
        "--unwanted-within",
        "--still-wanted-minutes",
        dest="still_wanted_minutes",
        type=non_negative_minutes,
        default=60,
        metavar="N",
        help="count stops followed by activity within N minutes as unwanted (default 60)",
    )
    p.add_argument(
        "--snooze-rate",
        type=snooze_rate,
        default=0.0,
        metavar="P",
        help="fraction of warnings assumed answered with 'Keep 2 h' (default 0; seeded)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the assumed snoozes (default 0)")
    p.add_argument(
        "--sweep-policy",
        action="append",
        metavar="JSON",
        help="also replay with these team-policy fields merged in (repeatable), e.g. '{\"idle_minutes\": 180}': "
        "a table, and with --plot a Pareto PNG (recovery against unwanted stops)",
    )
    p.add_argument(
        "--waiting",
        type=waiting_rule,
        default=WaitingRule(),
        metavar="JSON",
        help="the constants of waiting to replay with (core/waiting.py WaitingRule), e.g. "
        '\'{"profile_days": 7, "min_days_seen": 2}\' (default: the sweep\'s own)',
    )
    p.add_argument(
        "--split",
        choices=["time", "machines"],
        help="time: score each half of the trace's days apart (the machines are still swept over all of it); "
        "machines: each of two sides of the machines, look-alike machines (hourly series correlated 0.7 or more) "
        "always on one side. Tune a setting on one part, judge it on the other",
    )
    p.add_argument(
        "--period-minutes", type=positive_minutes, default=5, help="metric period and sweep interval (default 5)"
    )
    p.add_argument("--instance-type", help="instance type assumed for machines the trace gives none (for prices)")
    p.add_argument(
        "--clamp-utilization", action="store_true", help="read CPU/GPU values above 100 as 100 (default: an error)"
    )
    p.add_argument(
        "--skip-duplicates", action="store_true", help="drop rows identical to their instance's previous row"
    )
    p.set_defaults(func=cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Decision logs are for Lambda and --verbose; the CLI's own output is the table or JSON.
    logging.getLogger("idle-reaper").setLevel(logging.INFO if args.verbose else logging.WARNING)
    func: Command = args.func
    try:
        return func(args)
    except aws.AwsError as exc:
        print(f"idle-reaper: AWS error ({aws.error_code(exc)}): {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): not an error. Point stdout at nothing so the exit flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
