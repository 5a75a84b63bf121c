"""Every warning reaches every conversation its policy names, under a local Slack that keeps Slack's rate limits:
the sweep paces chat.postMessage under the workspace's limit (no 429 to begin with), and a copy that a 429 (or an
outage) kept from one conversation while another got it is posted there by a later sweep, once, before the stop;
the stop waits for the owner's own copy; a copy given up is told to the admins. Each test failed before: the
missing copy was dropped with no retry and no report (benchmarks/slack_throughput.py: 53 of 3,260 warnings at
10,000 machines, 29 of those machines stopped since)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from test_slack_as_slack import told_stopped, until_stopped, warning_posts
from test_sweep_faults import (
    HOLD,
    T0,
    Clock,
    adapters,
    admin_alerts,
    dynamo_store,
    idle,
    notebook,  # noqa: F401 (the fixture: an idle m5.large of bob's, team ml: notify both, C0MLTEAM)
    only,
)

from idle_reaper import aws
from idle_reaper.aws.limits import Pace, Quota
from idle_reaper.core import Action, Assessment, Decision, Machine, MachineRecord, State
from idle_reaper.notify import Delivery
from idle_reaper.policy import TeamPolicy, TeamPolicyRef
from idle_reaper.slack import SlackNotifier, make_client
from idle_reaper.slack.posting import POSTS_BURST, POSTS_PER_MINUTE, POSTS_QUOTA
from idle_reaper.slack.shared import WARNING_EVENT
from idle_reaper.sweep import run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import TIER_PER_MINUTE, RateLimits

pytestmark = pytest.mark.integration


def crowd(slack: Any, conversation: str) -> None:
    """Slack's next answer to a post in `conversation` is a 429 whose Retry-After (7 s) is past the sweep client's
    budget (5 s): as if the conversation had just taken ten posts (the local Slack's clock is the wall's)."""
    slack.limits.posted[conversation] = [slack.limits.clock()] * 10


def warned(n: int) -> Decision:
    """A warning due for machine n, to its own owner's DM alone (no conversation's own limit in play)."""
    m = Machine(f"i-{n:017x}", "m5.large", "ml", T0 - timedelta(hours=8), name=f"box-{n}", owner=f"U{n:05d}")
    assessment = Assessment("idle", "quiet", quiet_since=T0 - timedelta(minutes=75), max_cpu=1.0)
    ref = TeamPolicyRef(team="ml", policy=TeamPolicy(notify="owner"), source="/idle-reaper/teams/ml", version=1)
    record = MachineRecord(m.instance_id, "ml", state=State.WARNED, updated_at=T0)
    return Decision(m, State.WARNED, Action.WARN, "quiet", "idle", record, assessment=assessment, policy=ref)


def listings_posted(slack: Any) -> dict[str, int]:
    """Warnings Slack took (posted, whatever became of the answer) by conversation, a shared message's among them."""
    posts: dict[str, int] = {}
    for c in slack.calls_to("chat.postMessage"):
        if c.ok and (c.params.get("metadata") or {}).get("event_type") == WARNING_EVENT:
            posts[c.params["channel"]] = posts.get(c.params["channel"], 0) + 1
    return posts


def channels_of(record: Any) -> list[str]:
    return sorted(m.split("|")[0] for m in record.messages)


# --- Prevention: the workspace's posting limit -------------------------------------------------------------------


def test_the_sweeps_posts_stay_under_the_workspaces_posting_limit_so_none_meets_a_429(
    slack: Any, virtual_pacing: list[float]
) -> None:
    # 330 warnings, each to its own owner's DM (no conversation's own limit in play), as the sweep's lanes post them:
    # the local Slack counts the workspace's minute on the pacers' clock. Before: all at once, the 301st met a 429
    # with a Retry-After of up to 60 s, past the client's budget, and its warning was not delivered.
    slack.limits = RateLimits(clock=lambda: virtual_pacing[0])
    notifier = SlackNotifier(make_client("xoxb-test", 5), aws.InMemoryStateStore(), clock=lambda: T0)
    start = virtual_pacing[0]
    delivered = [notifier.warn(warned(n)) for n in range(330)]
    assert all(isinstance(o, Delivery) and o.messages for o in delivered), "every warning delivered"
    posts = [c for c in slack.calls if c.method == "chat.postMessage"]
    assert len(posts) == 330 and not [c for c in posts if c.limited], "no 429: none asked past the limit"
    # The pace: a burst, then POSTS_PER_MINUTE (a third under the 300 Slack takes, for this app's other posters).
    took = virtual_pacing[0] - start
    assert took >= (330 - POSTS_BURST) / POSTS_PER_MINUTE * 60 - 1, took
    at = sorted(t for times in slack.limits.posted.values() for t in times)  # when Slack took each
    most = max(sum(1 for u in at if t <= u < t + 60) for t in at)
    assert most <= POSTS_PER_MINUTE + POSTS_BURST < TIER_PER_MINUTE["chat.postMessage"], most


def test_shards_posting_at_once_share_the_workspaces_posting_rate() -> None:
    notifier = SlackNotifier(make_client("xoxb-test", 5), aws.InMemoryStateStore())
    shard = notifier.shared_by(4)
    assert isinstance(shard, SlackNotifier) and shard.client is notifier.client
    assert shard.posts.quota == POSTS_QUOTA.share(4) and notifier.posts.quota == POSTS_QUOTA, "its own bucket"


def test_a_warning_whose_turn_would_come_too_late_stays_pending_as_a_whole_not_half_delivered(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    store = dynamo_store(Clock())
    notifier = SlackNotifier(make_client("xoxb-test", 5), store)
    notifier.posts = Pace(Quota(2.0, 1 / 3600))  # the workspace's rate spent by other posters: a turn is an hour off
    assert notifier.posts.take(2)
    d = only(run_sweep(adapters(store, notifier), now=T0))
    assert warning_posts(slack) == {} and d.error is None and "held back" not in d.reason
    record = store.load([notebook])[notebook]
    assert record.warning_delivered_at is None and record.warning_owed == (), "both copies go together, next sweep"
    assert record.warning_post_started_at is None, "not posted: nothing to look for"


# --- Nothing lost: a copy owed is posted by a later sweep -----------------------------------------------------------


def test_a_copy_a_429_kept_from_the_team_channel_is_posted_there_by_the_next_sweep_once_before_the_stop(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    store = dynamo_store(Clock())
    crowd(slack, "C0MLTEAM")
    only(run_sweep(adapters(store), now=T0))
    assert warning_posts(slack) == {"D0BOB": 1}
    assert store.load([notebook])[notebook].warning_delivered_at == T0, "delivered: the owner can answer it"
    slack.limits.posted.clear()  # the channel's second has passed
    only(run_sweep(adapters(store), now=T0 + timedelta(minutes=5)))
    assert warning_posts(slack) == {"D0BOB": 1, "C0MLTEAM": 1}, "before: dropped once the DM had it, never retried"
    record = store.load([notebook])[notebook]
    assert record.warning_owed == () and channels_of(record) == ["C0MLTEAM", "D0BOB"]
    assert record.stop_not_before == T0 + timedelta(minutes=25), "the channel's copy announced a stop 20 min on"
    stopped_at, _ = until_stopped(store, notebook, T0 + timedelta(minutes=10))
    assert stopped_at == T0 + timedelta(minutes=25), "never before a copy of its warning said"
    assert warning_posts(slack) == {"D0BOB": 1, "C0MLTEAM": 1}, "each conversation warned once"
    assert told_stopped(slack) == ["C0MLTEAM", "D0BOB"], "the stop is told in the late copy too"
    assert not [a for a in admin_alerts(slack) if "not to every target" in a], "nothing to fix: nobody bothered"


def test_the_stop_waits_for_the_owners_own_copy_and_gives_them_warn_minutes_from_it(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    store = dynamo_store(Clock())
    for minutes in (0, 5, 10, 15, 20, 25):
        crowd(slack, "D0BOB")
        d = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=minutes)))
        assert d.action.value in ("warn", "none"), f"+{minutes} min: {d.reason}"  # before: stopped at +20
    assert local.instance_states([notebook]) == {notebook: "running"}
    assert warning_posts(slack) == {"C0MLTEAM": 1} and "owner's own copy is not delivered yet" in d.reason
    slack.limits.posted.clear()
    only(run_sweep(adapters(store), now=T0 + timedelta(minutes=30)))  # the DM takes it now
    assert warning_posts(slack) == {"C0MLTEAM": 1, "D0BOB": 1}
    stopped_at, _ = until_stopped(store, notebook, T0 + timedelta(minutes=35))
    assert stopped_at == T0 + timedelta(minutes=50), "warn_minutes from the owner's own copy"
    assert told_stopped(slack) == ["C0MLTEAM", "D0BOB"]


def test_an_owners_copy_never_delivered_holds_the_stop_until_the_hold_then_the_admins_are_told_once(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    store = dynamo_store(Clock())
    now = T0
    while now < T0 + HOLD:  # every 55 min: the 60-min window stays watched
        crowd(slack, "D0BOB")
        d = only(run_sweep(adapters(store), now=now))
        assert d.action.value in ("warn", "none"), d.reason
        now += timedelta(minutes=55)
    crowd(slack, "D0BOB")
    d = only(run_sweep(adapters(store), now=now))
    assert d.action.value == "stop", "undelivered_warning_max_minutes over: the channel's copy stands"
    assert warning_posts(slack) == {"C0MLTEAM": 1}
    told = [a for a in admin_alerts(slack) if "not to every target" in a]
    assert len(told) == 1 and notebook in told[0] and "the owner's DM was not posted before the stop" in told[0]
    assert store.load([notebook])[notebook].warning_owed == ()


def test_a_shared_message_a_429_kept_from_the_channel_is_posted_there_once_for_all_its_machines(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    other = local.launch("notebook-2", "m5.large", team="ml", launch_time=at(8), owner="U0BOB")
    local.write_metrics(other, idle, at(11), at(23))
    store = dynamo_store(Clock())
    now = [T0]

    def sweep() -> Any:  # the notifier on the sweeps' clock: the listing's references expire a week after T0
        return run_sweep(adapters(store, SlackNotifier(make_client("xoxb-test", 5), store, lambda: now[0])), now=now[0])

    crowd(slack, "C0MLTEAM")
    report = sweep()
    assert len(report.decisions) == 2 and listings_posted(slack) == {"D0BOB": 1}, "one message for both"
    slack.limits.posted.clear()
    now[0] = T0 + timedelta(minutes=5)
    sweep()
    assert listings_posted(slack) == {"D0BOB": 1, "C0MLTEAM": 1}, "one post of the listing, not one a machine"
    (copy,) = [c for c in slack.calls_to("chat.postMessage") if c.ok and c.params["channel"] == "C0MLTEAM"]
    assert sorted(copy.params["metadata"]["event_payload"]["instance_ids"]) == sorted([notebook, other])
    records = store.load([notebook, other])
    assert all(channels_of(r) == ["C0MLTEAM", "D0BOB"] and r.warning_owed == () for r in records.values())


class DiesAfterTheCopy(SlackNotifier):
    """The sweep posts an owed copy and dies before recording it."""

    def post_owed(self, decisions: Sequence[Decision], target: str, maybe_posted: bool) -> list[Delivery]:
        super().post_owed(decisions, target, maybe_posted)
        raise SystemExit("the Lambda timed out")


def test_a_copy_posted_by_a_sweep_that_died_is_found_by_the_next_not_posted_twice(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    clock = Clock()
    store = dynamo_store(clock)
    crowd(slack, "C0MLTEAM")
    only(run_sweep(adapters(store), now=T0))
    slack.limits.posted.clear()
    with pytest.raises(SystemExit):
        run_sweep(adapters(store, DiesAfterTheCopy(make_client("xoxb-test", 5), store)), now=T0 + timedelta(minutes=5))
    assert warning_posts(slack) == {"D0BOB": 1, "C0MLTEAM": 1}
    assert store.load([notebook])[notebook].warning_owed == ("C0MLTEAM?",), "the claim said it may be posted"
    clock.now += aws.SWEEP_LEASE
    only(run_sweep(adapters(store), now=T0 + timedelta(minutes=10)))
    record = store.load([notebook])[notebook]
    assert warning_posts(slack) == {"D0BOB": 1, "C0MLTEAM": 1}, "found in the channel, not posted again"
    assert record.warning_owed == () and channels_of(record) == ["C0MLTEAM", "D0BOB"]


class DiesBetweenTheCopies(SlackNotifier):
    """The sweep posts the warning to the owner's DM and dies before posting it to the team channel."""

    def _post_to(self, targets: list[str], *args: Any, **kwargs: Any) -> list[str]:
        super()._post_to(targets[:1], *args, **kwargs)
        raise SystemExit("the Lambda timed out")


def test_a_sweep_that_died_between_the_copies_leaves_the_next_to_find_one_and_post_the_other(
    notebook: str,  # noqa: F811
    slack: Any,
) -> None:
    clock = Clock()
    store = dynamo_store(clock)
    with pytest.raises(SystemExit):
        run_sweep(adapters(store, DiesBetweenTheCopies(make_client("xoxb-test", 5), store)), now=T0)
    assert warning_posts(slack) == {"D0BOB": 1}
    clock.now += aws.SWEEP_LEASE
    d = only(run_sweep(adapters(store), now=T0 + timedelta(minutes=5)))
    assert "found delivered at 14:00" in d.reason
    assert warning_posts(slack) == {"D0BOB": 1, "C0MLTEAM": 1}, "before: found in the DM, the channel never warned"
    record = store.load([notebook])[notebook]
    assert record.warning_owed == () and channels_of(record) == ["C0MLTEAM", "D0BOB"]
    assert record.stop_not_before == T0 + timedelta(minutes=25)
