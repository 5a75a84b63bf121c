"""Running instances in regions without a stack are counted, not silently ignored (issue 10, point 9)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_sweep_faults import adapters, admin_alerts

from idle_reaper import aws as aws_module
from idle_reaper.policy import TagKeys
from idle_reaper_tools import local

pytestmark = pytest.mark.integration


def run_in(region: str, tags: dict[str, str]) -> str:
    return run_with(aws_module.client("ec2", region), tags)


def run_with(ec2: Any, tags: dict[str, str], instance_type: str = "m5.large") -> str:
    """A machine (an m5.large unless told) with these tags, launched by this EC2 client (its region, account)."""
    out = ec2.run_instances(
        ImageId=local.AMI,
        MinCount=1,
        MaxCount=1,
        InstanceType=instance_type,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
    )
    instance_id: str = out["Instances"][0]["InstanceId"]
    return instance_id


def test_running_instances_in_regions_without_a_stack_are_counted(aws: object) -> None:
    opted_in = {"Team": "ml", "idle-reaper:managed": "true"}
    run_in("us-east-1", opted_in)  # watched: the home region
    run_in("eu-west-1", opted_in)  # watched: another stack
    run_in("eu-north-1", opted_in)
    run_in("eu-north-1", {"Team": "ml"})  # a cost-allocation tag alone: running, but not the reaper's
    stopped = run_in("ap-south-1", opted_in)
    aws_client = aws_module.client("ec2", "ap-south-1")
    aws_client.stop_instances(InstanceIds=[stopped])

    counts = aws_module.count_unwatched(
        lambda region: aws_module.client("ec2", region), ["us-east-1", "eu-west-1"], TagKeys()
    )

    assert counts == ([aws_module.RegionCount("eu-north-1", running=2, opted_in=1)], [])
    everything = aws_module.count_unwatched(
        lambda region: aws_module.client("ec2", region), ["us-east-1", "eu-west-1"], TagKeys(managed=None)
    )
    assert everything == ([aws_module.RegionCount("eu-north-1", running=2, opted_in=2)], [])


def test_watched_regions_are_home_and_the_listed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDLE_REAPER_REGIONS", "eu-west-1, us-east-1,")
    assert aws_module.watched_regions("us-east-1") == ["us-east-1", "eu-west-1"]
    monkeypatch.delenv("IDLE_REAPER_REGIONS")
    assert aws_module.watched_regions("us-east-1") == ["us-east-1"]


def test_status_shows_the_last_daily_count(aws: object, capsys: pytest.CaptureFixture[str]) -> None:
    from datetime import UTC, datetime

    from idle_reaper_tools import cli

    local.init_account()
    store = aws_module.DynamoStateStore(aws_module.client("dynamodb"), aws_module.table_name())
    counted = datetime.now(UTC).replace(microsecond=0)
    aws_module.save_unwatched(store, [aws_module.RegionCount("eu-north-1", running=12, opted_in=3)], counted)

    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "Regions without an idle-reaper stack" in out and "eu-north-1: 12 running, 3 tagged for idle-reaper" in out
    assert cli.main(["status", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[-1]["unwatched_regions"] == [{"region": "eu-north-1", "running": 12, "opted_in": 3}]


def sweep_adapters() -> Any:
    return adapters(aws_module.DynamoStateStore(aws_module.client("dynamodb"), aws_module.table_name()))


def test_the_first_listed_region_counts_once_a_day_and_tells_the_admins(
    aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idle_reaper.policy import Settings
    from idle_reaper.sweep import report_unwatched_regions

    monkeypatch.setenv("IDLE_REAPER_REGIONS", "us-east-1,eu-west-1")
    local.init_account(Settings(admins=["U0ADMIN"]))
    run_in("eu-north-1", {"Team": "ml", "idle-reaper:managed": "true"})
    run_in("eu-north-1", {"Team": "ml"})
    run_in("eu-west-1", {"Team": "ml", "idle-reaper:managed": "true"})  # watched by the other stack
    adapters = sweep_adapters()
    ec2_in = lambda region: aws_module.client("ec2", region)  # noqa: E731
    morning = datetime(2026, 11, 23, 6, 0, tzinfo=UTC)

    assert report_unwatched_regions(adapters, ec2_in, "eu-west-1", morning) == [], "only the first listed region"
    lines = report_unwatched_regions(adapters, ec2_in, "us-east-1", morning)

    assert lines == ["eu-north-1 has no idle-reaper stack: 2 running instances, 1 tagged for idle-reaper"]
    (alert,) = admin_alerts(slack)
    assert "1 running instances in eu-north-1 are tagged for idle-reaper" in alert
    assert aws_module.last_unwatched(adapters.store, morning) == (
        morning,
        [aws_module.RegionCount("eu-north-1", running=2, opted_in=1)],
        [],
    )
    # Every later sweep of the day neither counts nor alerts again; the next day counts (the alert is weekly).
    assert report_unwatched_regions(adapters, ec2_in, "us-east-1", morning + timedelta(hours=6)) == []
    assert len(report_unwatched_regions(adapters, ec2_in, "us-east-1", morning + timedelta(days=1))) == 1
    assert len(admin_alerts(slack)) == 1


def test_a_failed_count_changes_nothing_and_is_tried_again(
    aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.exceptions import ClientError

    from idle_reaper.sweep import report_unwatched_regions

    monkeypatch.delenv("IDLE_REAPER_REGIONS", raising=False)
    local.init_account()
    run_in("eu-north-1", {"Team": "ml", "idle-reaper:managed": "true"})
    adapters = sweep_adapters()
    morning = datetime(2026, 11, 23, 6, 0, tzinfo=UTC)

    def denied(region: str) -> Any:
        raise ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": "no"}}, "DescribeRegions")

    (line,) = report_unwatched_regions(adapters, denied, "us-east-1", morning)
    assert "could not count" in line and "UnauthorizedOperation" in line
    assert aws_module.last_unwatched(adapters.store, morning) is None, "nothing saved"
    ec2_in = lambda r: aws_module.client("ec2", r)  # noqa: E731
    soon = morning + timedelta(minutes=5)
    assert report_unwatched_regions(adapters, ec2_in, "us-east-1", soon) == [], "not retried every sweep"
    retried = report_unwatched_regions(adapters, ec2_in, "us-east-1", morning + timedelta(hours=1))
    assert retried == ["eu-north-1 has no idle-reaper stack: 1 running instances, 1 tagged for idle-reaper"]


def test_a_denied_region_is_skipped_and_named_and_the_rest_is_counted(
    aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from botocore.exceptions import ClientError

    from idle_reaper.sweep import report_unwatched_regions
    from idle_reaper_tools import cli

    monkeypatch.delenv("IDLE_REAPER_REGIONS", raising=False)
    local.init_account()
    run_in("eu-north-1", {"Team": "ml", "idle-reaper:managed": "true"})
    adapters = sweep_adapters()
    morning = datetime(2026, 11, 23, 6, 0, tzinfo=UTC)
    calls: list[str] = []

    def scp_denies_eu_west_3(region: str) -> Any:
        calls.append(region)
        client = aws_module.client("ec2", region)
        if region == "eu-west-3":  # EC2's answer under a service control policy that denies the region
            message = "You are not authorized to perform this operation. User: ... with an explicit deny"
            error = ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": message}}, "DescribeInstances")
            client.meta.events.register("before-call.ec2.DescribeInstances", lambda **kw: (_ for _ in ()).throw(error))
        return client

    lines = report_unwatched_regions(adapters, scp_denies_eu_west_3, "us-east-1", morning)
    assert "eu-north-1 has no idle-reaper stack: 1 running instances, 1 tagged for idle-reaper" in lines
    assert any("eu-west-3" in line and "may not look there" in line for line in lines)
    counted, counts, denied = aws_module.last_unwatched(adapters.store, morning)
    assert counted == morning
    assert denied == ["eu-west-3"] and [c.region for c in counts] == ["eu-north-1"]
    before = len(calls)
    assert report_unwatched_regions(adapters, scp_denies_eu_west_3, "us-east-1", morning + timedelta(hours=3)) == []
    assert len(calls) == before, "counted today: no retry storm"
    assert cli.main(["status", "--now", morning.isoformat()]) == 0
    assert "may not look there (a service control policy?): eu-west-3" in capsys.readouterr().out


def test_a_throttled_count_never_takes_the_sweep_down(aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.exceptions import ClientError

    from idle_reaper.handlers import sweep as sweep_handler
    from idle_reaper_tools.fake_slack import LambdaContextStub

    monkeypatch.delenv("IDLE_REAPER_REGIONS", raising=False)
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    box = run_in("us-east-1", {"Team": "ml", "idle-reaper:managed": "true"})
    real = aws_module.DynamoStateStore.claim_once

    def throttled(self: Any, key: str, at: datetime) -> bool:
        if key.startswith("unwatched-regions#"):
            error = {"Code": "ProvisionedThroughputExceededException", "Message": "Rate of requests exceeds"}
            raise ClientError({"Error": error}, "PutItem")
        return real(self, key, at)

    monkeypatch.setattr(aws_module.DynamoStateStore, "claim_once", throttled)
    result = sweep_handler.handler({}, LambdaContextStub())
    assert result["machines"] == 1 and result["errors"] == 0
    store = aws_module.DynamoStateStore(aws_module.client("dynamodb"), aws_module.table_name())
    assert box in store.load([box]), "the machine was swept"


def test_in_organization_mode_the_count_says_it_is_the_hubs_account(
    aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idle_reaper.policy import Settings
    from idle_reaper.sweep import report_unwatched_regions

    monkeypatch.setenv("IDLE_REAPER_REGIONS", "us-east-1")
    organization = {"prefix": "idle-reaper", "targets": ["r-ab12"], "regions": ["us-east-1", "eu-west-1"]}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps({**organization, "hubAccount": local.ACCOUNT}))
    local.init_account(Settings(admins=["U0ADMIN"]))
    run_in("eu-north-1", {"Team": "ml", "idle-reaper:managed": "true"})
    # eu-west-1 is a member region but not one of the hub's: the hub's own machines there are swept by nothing
    # (the member listing leaves the hub's account out), so they are counted and told like any region's.
    run_in("eu-west-1", {"Team": "ml", "idle-reaper:managed": "true"})
    lines = report_unwatched_regions(
        sweep_adapters(), lambda r: aws_module.client("ec2", r), "us-east-1", datetime.now(UTC)
    )
    assert lines == [
        f"{region} has no idle-reaper stack in the hub's account {local.ACCOUNT}: 1 running instances, 1 tagged "
        "for idle-reaper"
        for region in ("eu-north-1", "eu-west-1")
    ]
    alert, west = admin_alerts(slack)
    assert f"in eu-west-1 in the hub's account {local.ACCOUNT}" in west
    assert f"in eu-north-1 in the hub's account {local.ACCOUNT}" in alert
    # Member accounts are counted on their own (test_member_unwatched_regions.py), not said missing here.
    assert "Member accounts" not in alert


def test_regions_where_the_hubs_account_is_swept_as_a_member_are_not_counted_unwatched(
    aws: object, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's account sits in a target OU: in eu-west-1 (an organization region without a hub stack) the hub
    sweeps it as a member account, so the daily count leaves eu-west-1 out; eu-north-1 is still unwatched."""
    from types import SimpleNamespace

    from idle_reaper.handlers import sweep as sweep_handler
    from idle_reaper.policy import Settings
    from idle_reaper_tools.fake_slack import LambdaContextStub

    monkeypatch.setenv("IDLE_REAPER_REGIONS", "us-east-1")
    local.init_account(Settings(admins=["U0ADMIN"]))
    run_in("eu-north-1", {"Team": "ml", "idle-reaper:managed": "true"})
    run_in("eu-west-1", {"Team": "ml", "idle-reaper:managed": "true"})
    enrolled = SimpleNamespace(hub_member_regions=lambda: ("eu-west-1",))
    monkeypatch.setattr(sweep_handler, "member_access", lambda: enrolled)
    monkeypatch.setattr(sweep_handler, "current_region", lambda: "us-east-1")
    now = datetime.now(UTC)
    adapters = sweep_adapters()
    sweep_handler.count_unwatched_regions(adapters, now, LambdaContextStub())
    found = aws_module.last_unwatched(adapters.store, now)
    assert found is not None
    assert [c.region for c in found[1]] == ["eu-north-1"]
    (alert,) = admin_alerts(slack)
    assert "eu-north-1" in alert and "eu-west-1" not in alert
