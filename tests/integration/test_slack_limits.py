"""Warnings that always fit, against the local Slack fake through the real slack-sdk client: an Auto
Scaling Group member with EC2's longest Unicode Name tag is warned; a channel the bot is not in is a
permanent failure that says how to fix it."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from idle_reaper import aws as adapters_aws
from idle_reaper.notify import PermanentDeliveryFailure
from idle_reaper.slack import SlackNotifier, make_client
from idle_reaper.sweep import Adapters, run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import adapters_at, at

pytestmark = pytest.mark.integration

NOW = at(15)
# 256 characters, EC2's limit for a tag value: CJK, astral emoji, a combining accent, a ZWJ sequence,
# and an attempt to ping the channel.
NAME = ("<!channel> 训练-😀-e\u0301-👩\u200d💻 " * 20)[:256]


def idle(_t):
    return (1.0, None)


def units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


@pytest.fixture
def member(aws, slack):
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, slack_channel="C0MLTEAM")
    local.init_account(teams={"ml": policy})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    (instance_id,) = local.launch_group(
        "workers", "m5.large", team="ml", size=1, min_size=0, launch_time=at(8), owner="bob@example.com"
    )
    adapters_aws.client("ec2").create_tags(Resources=[instance_id], Tags=[{"Key": "Name", "Value": NAME}])
    local.write_metrics(instance_id, idle, at(12), NOW + timedelta(hours=1))
    return instance_id


def test_a_group_member_with_a_256_character_unicode_name_is_warned(member, slack):
    (d,) = run_sweep(adapters_at(NOW), now=NOW).decisions
    assert d.machine.name == NAME and d.machine.asg_name == "workers"
    assert d.action_label == "warn" and d.error is None
    posts = slack.calls_to("chat.postMessage")
    assert sorted(p.params["channel"] for p in posts) == ["C0MLTEAM", "D0BOB"]
    stored = adapters_aws.DynamoStateStore(adapters_aws.client("dynamodb"), adapters_aws.table_name()).load([member])[
        member
    ]
    assert stored.warning_delivered_at == NOW and len(stored.messages) == 2
    blocks = posts[0].params["blocks"]
    header = blocks[0]["text"]["text"]
    assert header.startswith("Idle machine: <!channel> 训练-😀") and units(header) <= 150
    assert header.endswith(f"… ({member})")
    mrkdwn = [text for text in json.dumps(blocks).split('"text": ') if '"mrkdwn"' in text]
    assert mrkdwn and not any("<!channel>" in text for text in mrkdwn), "a tag cannot ping the channel"
    assert "<!channel>" not in posts[0].params["text"] and units(posts[0].params["text"]) <= 3000


def test_a_channel_the_bot_is_not_in_is_a_permanent_failure_naming_the_fix(member, slack):
    slack.errors["chat.postMessage C0MLTEAM"] = "not_in_channel"
    slack.errors["chat.postMessage D0BOB"] = "cannot_dm_bot"
    store = adapters_aws.DynamoStateStore(adapters_aws.client("dynamodb"), adapters_aws.table_name())
    adapters = Adapters.from_environment(notifier=SlackNotifier(make_client("xoxb-local-fake", 10), store))
    (d,) = run_sweep(adapters, now=NOW, dry_run=True).decisions
    with pytest.raises(PermanentDeliveryFailure) as err:
        adapters.notifier.warn(d)
    reason = err.value.reason
    assert f"warning for {member} (team ml): the bot is not in channel C0MLTEAM" in reason
    assert "/invite @idle-reaper" in reason and "channels:join" in reason
    assert "Slack user U0BOB is a bot" in reason
    assert sorted(c.params["channel"] for c in slack.calls_to("chat.postMessage")) == ["C0MLTEAM", "D0BOB"]


def test_one_failed_target_still_delivers_the_warning(member, slack):
    slack.errors["chat.postMessage C0MLTEAM"] = "is_archived"
    (d,) = run_sweep(adapters_at(NOW), now=NOW).decisions
    assert d.action_label == "warn"
    stored = adapters_aws.DynamoStateStore(adapters_aws.client("dynamodb"), adapters_aws.table_name()).load([member])[
        member
    ]
    assert stored.warning_delivered_at == NOW and [m.split("|")[0] for m in stored.messages] == ["D0BOB"]


def test_a_warning_that_missed_one_target_is_reported_to_the_admins_once(member, slack):
    settings = json.loads(adapters_aws.client("ssm").get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    settings["admin_channel"] = "C0ADMINS"
    adapters_aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value=json.dumps(settings), Type="String", Overwrite=True
    )
    slack.errors["chat.postMessage C0MLTEAM"] = "is_archived"
    for minutes in (0, 5, 10):
        run_sweep(adapters_at(NOW + timedelta(minutes=minutes)), now=NOW + timedelta(minutes=minutes))
    alerts = [c.params["text"] for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "C0ADMINS"]
    assert len(alerts) == 1, alerts
    assert member in alerts[0] and "not to every target" in alerts[0] and "C0MLTEAM" in alerts[0]
    warnings = [c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB"]
    assert len(warnings) == 1, "the owner was warned once"
