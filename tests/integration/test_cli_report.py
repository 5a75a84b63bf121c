"""`idle-reaper report`: the weekly digest from the state table, printed, and its chart written locally; a bad
week or path is a clear error that writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from test_accounts import org  # noqa: F401  (the organization fixture)

from idle_reaper import aws as reaper_aws
from idle_reaper.core.digest import running_again_entry
from idle_reaper_tools import cli, local

pytestmark = pytest.mark.integration

MONDAY = datetime(2026, 11, 16, tzinfo=UTC)


@pytest.fixture
def account(aws: object) -> None:
    local.init_account(teams={"ml": '{"slack_channel": "C0ML"}'})
    store = reaper_aws.DynamoStateStore(reaper_aws.client("dynamodb"), reaper_aws.table_name())
    for team, hourly in (("ml", 2.0), ("cv", 1.0)):
        stopped, back = MONDAY + timedelta(hours=10), MONDAY + timedelta(hours=13)
        store.audit(f"i-{team}", stopped, {"action": "stop", "team": team, "hourly_savings": hourly, "error": None})
        store.audit(f"i-{team}", back, running_again_entry(f"i-{team}", team, "ada", "g5.xlarge", back))


def test_report_prints_the_digest_and_writes_the_chart(account: None, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "ml.png"
    now = "2026-11-23T09:00:00Z"
    assert cli.main(["report", "--week", "2026-W47", "--team", "ml", "--png", str(out), "--now", now]) == 0
    printed = capsys.readouterr().out
    assert "team ml, 2026-W47" in printed and "*$6.00*" in printed and f"chart: {out}" in printed
    assert out.read_bytes().startswith(b"\x89PNG")
    assert cli.main(["report", "--week", "2026-W47", "--now", now]) == 0
    assert "*$9.00*" in capsys.readouterr().out  # every team, each stop once
    assert cli.main(["report", "--week", "2026-W46", "--team", "ml", "--now", now]) == 0
    assert "No data for this week" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--week", "2026-47"], "expected YEAR-Wnn"),
        (["--week", "2025-W53"], "2025 has no ISO week 53"),
        (["--week", "2026-W47", "--team", "nope"], "no team 'nope'"),
        (["--week", "2026-W49"], "has not begun"),
        (["--week", "2026-W47", "--png", "/no/such/dir/x.png"], "no such directory"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(
    account: None, tmp_path: Path, capsys: Any, args: list[str], error: str
) -> None:
    png = tmp_path / "out.png"
    argv = ["report", *args, "--now", "2026-11-23T09:00:00Z"]
    if "--png" not in args:
        argv += ["--png", str(png)]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: a bad --week
        code = int(exc.code or 0)
    assert code == 2 and error in capsys.readouterr().err
    assert not png.exists()


def test_report_in_organization_mode_says_each_account_by_name(org: Any, capsys: Any) -> None:  # noqa: F811
    """Member accounts are named from AWS Organizations; one it no longer lists (it left) is said by its id."""
    from idle_reaper.core.records import machine_key

    local.init_account(teams={"ml": "{}"})
    store = reaper_aws.DynamoStateStore(reaper_aws.client("dynamodb"), reaper_aws.table_name())
    training, gone = org.accounts["training"], "444444444444"
    stopped, back = MONDAY + timedelta(hours=10), MONDAY + timedelta(hours=13)  # 3 h each
    for key, hourly in (
        ("i-0abc", 1.0),  # the hub's
        (machine_key("i-0abc", training, "us-east-1"), 2.0),  # the same id in training
        (machine_key("i-0abc", gone, "us-east-1"), 1.0),  # an account that has left the organization
    ):
        store.audit(key, stopped, {"action": "stop", "team": "ml", "hourly_savings": hourly, "error": None})
        store.audit(key, back, running_again_entry(key, "ml", "ada", "g5.xlarge", back))
    assert cli.main(["report", "--week", "2026-W47", "--now", "2026-11-23T09:00:00Z"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("By account: "))
    assert line == (
        "By account: the hub's account saved $3.00, kept idle $0.00; 444444444444 saved $3.00, kept idle $0.00; "
        f"training ({training}) saved $6.00, kept idle $0.00"
    )
