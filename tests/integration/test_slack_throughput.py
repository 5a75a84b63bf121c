"""Posting concurrently within Slack's documented limits, against moto and the Slack fake holding them: posts to
one channel go a second apart, as chat.postMessage allows, without Slack having to refuse any; every warning is
delivered; different owners' DMs go out at once."""

from __future__ import annotations

import itertools

import pytest
from test_slack import record, sweep

from idle_reaper.core import Action
from idle_reaper_tools import local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import POST_BURST, RateLimits

pytestmark = pytest.mark.integration

T0 = at(14)


def idle(_t):
    return (1.0, 0.0)


def test_one_channel_gets_a_message_a_second_and_every_warning_is_delivered(aws, slack):
    local.init_account(
        teams={
            "ml": local.team_policy_json(idle_minutes=60, warn_minutes=20, notify="channel", slack_channel="C0ML"),
            "cv": local.team_policy_json(idle_minutes=60, warn_minutes=20),
        }
    )
    people = {"ann@example.com": "U0ANN", "bob@example.com": "U0BOB", "cy@example.com": "U0CY"}
    slack.users_by_email.update(people)
    team_boxes = [local.launch(f"t{n}", "g5.xlarge", team="ml", launch_time=at(8)) for n in range(POST_BURST + 2)]
    owned = [local.launch(f"o{n}", "g5.xlarge", team="cv", launch_time=at(8), owner=o) for n, o in enumerate(people)]
    for instance_id in team_boxes + owned:
        local.write_metrics(instance_id, idle, at(11), at(23))
    slack.limits = RateLimits()

    report = sweep(T0)

    assert {d.machine.instance_id for d in report.decisions if d.action is Action.WARN} == set(team_boxes + owned)
    assert all(record(i).warning_delivered_at == T0 for i in team_boxes + owned), "every warning delivered"
    # More posts for one channel than its burst, from several lanes at once: the sweep paces them a second apart
    # itself (before: the lanes posted at once and Slack answered 429, waited out with Retry-After).
    assert slack.limits.refused == 0, "nothing Slack had to refuse"
    channel_posts = [c for c in slack.calls if c.method == "chat.postMessage" and c.params["channel"] == "C0ML"]
    assert len(channel_posts) == len(team_boxes) > POST_BURST
    # Each owner's DM once; the channel once a machine, a second apart.
    assert sorted(slack.limits.posted) == ["C0ML", "D0ANN", "D0BOB", "D0CY"]
    assert [len(times) for times in slack.limits.posted.values()].count(1) == 3
    posted = slack.limits.posted["C0ML"]
    assert all(later - earlier >= 0.95 for earlier, later in itertools.pairwise(posted))
