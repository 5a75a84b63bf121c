"""The `idle-reaper` command: wiring only. Decisions live in core, AWS calls in aws."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from idle_reaper import aws
from idle_reaper.policy import Settings
from idle_reaper.sweep import Adapters, SweepCannotRun, SweepReport, decision_row, run_sweep

Command = Callable[[argparse.Namespace], int]


def parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


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
        report = run_sweep(Adapters.from_environment(), now=now, dry_run=args.dry_run)
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
    return 0


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
    p.set_defaults(func=cmd_sweep)

    from idle_reaper.demo import cmd_demo

    p = sub.add_parser("demo", help="run the sweep against a local emulated AWS with a seeded fleet")
    p.set_defaults(func=cmd_demo)
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


if __name__ == "__main__":
    raise SystemExit(main())
