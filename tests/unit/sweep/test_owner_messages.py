"""One message per owner, the pure parts and the Slack notifier with a recording client: which warnings
share a message, the shared message within Slack's limits (split past them, and says so), and what a
failed post leaves for each machine it lists."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
from botocore.exceptions import ClientError
from test_slack_blocks import (
    INJECTION,
    UNICODE_NAME,
    RecordingClient,
    assert_within_limits,
    decision,
    machine,
    notifier,
    posted,
    slack_error,
)
from test_sweep_fakes import NOW, WARN_SWEEP, account, box, sweep

from idle_reaper.core import Action, State, owner_message_groups
from idle_reaper.notify import Delivery, DeliveryUnknown, PermanentDeliveryFailure
from idle_reaper.policy import TeamPolicy
from idle_reaper.slack import (
    ACTIONS_ELEMENTS,
    MESSAGE_BLOCKS,
    OWNER_MESSAGE_MACHINES,
    Listed,
    ListedGroup,
    SlackNotifier,
    blocks_json,
    owner_message_blocks,
)
from idle_reaper.slack.notices import EditPace
from testkit.aws import CountingStateStore


def warning(n: int, owner: str | None = "U0BOB", team: str = "ml", policy: TeamPolicy | None = None, **kw: Any):
    d = decision(machine(instance_id=f"i-{n:017x}", owner=owner, team=team, name=f"box-{n}", **kw), policy=policy)
    d.__dict__["deliver_warning"] = True  # frozen dataclass: the decisions a sweep would post
    return d


OWNER_ONLY = TeamPolicy(notify="owner")


def ids(groups: list[list[Any]]) -> list[list[int]]:
    return [[int(d.machine.instance_id[2:], 16) for d in g] for g in groups]


def test_an_owners_warnings_share_a_message_across_teams_a_channel_sees_only_its_team() -> None:
    both_ml = TeamPolicy(notify="both", slack_channel="C0ML")
    both_cv = TeamPolicy(notify="both", slack_channel="C0CV")
    decisions = [
        warning(1, policy=OWNER_ONLY),
        warning(2, "u0bob ", team="cv", policy=OWNER_ONLY),  # the same owner, spelled loosely
        warning(3, "U0ANN", policy=OWNER_ONLY),
        warning(4, None, policy=OWNER_ONLY),  # no owner: alone
        warning(5, policy=both_ml),
        warning(6, policy=both_ml),
        warning(7, team="cv", policy=both_cv),  # bob's too, but another channel
        warning(8, policy=OWNER_ONLY),
    ]
    not_due = warning(9, policy=OWNER_ONLY)
    not_due.__dict__["deliver_warning"] = False
    assert ids(owner_message_groups([*decisions, not_due])) == [[1, 2, 8], [3], [5, 6], [7], [4], [9]]


def listed(n: int) -> list[Listed]:
    line = "x" * 4000  # a caller's line over a section's limit is fitted
    return [Listed(f"i-{i:017x}", line, ref=f"ref-{i}") for i in range(n)]


def test_a_full_message_stays_within_slacks_limits_and_one_more_machine_is_refused() -> None:
    blocks = blocks_json(owner_message_blocks(listed(OWNER_MESSAGE_MACHINES), "group-ref"))
    assert len(blocks) <= MESSAGE_BLOCKS
    actions = [b for b in blocks if b["type"] == "actions"]
    assert all(len(b["elements"]) <= ACTIONS_ELEMENTS for b in actions)
    assert len({b["block_id"] for b in blocks if "block_id" in b}) == len([b for b in blocks if "block_id" in b])
    assert actions[-1]["elements"][0]["action_id"] == "keep_all" and actions[-1]["elements"][0]["value"] == "group-ref"
    assert_within_limits(blocks)
    with pytest.raises(ValueError, match=f"1 to {OWNER_MESSAGE_MACHINES}"):
        owner_message_blocks(listed(OWNER_MESSAGE_MACHINES + 1), "group-ref")


def test_answered_machines_lose_their_buttons_and_keep_all_goes_when_none_waits() -> None:
    entries = [
        Listed("i-1", "*Kept*: by bob"),
        Listed("i-2", "*Stopped*: at 15:00", start_ref="start-2"),
        Listed("i-3", "waiting", ref="ref-3"),
    ]
    blocks = blocks_json(owner_message_blocks(entries, "g"))
    assert blocks[0]["text"]["text"] == "Idle machines: 1 of yours will be stopped unless kept"
    pressed = [(e["action_id"], e["value"]) for b in blocks if b["type"] == "actions" for e in b["elements"]]
    assert pressed == [("start_again", "start-2"), ("keep_2h", "ref-3"), ("stop_now", "ref-3"), ("keep_all", "g")]
    done = blocks_json(owner_message_blocks(entries[:2], "g"))
    assert [e["action_id"] for b in done if b["type"] == "actions" for e in b["elements"]] == ["start_again"]


def test_more_machines_than_one_message_holds_are_split_and_say_so() -> None:
    slack, client = notifier()
    decisions = [warning(n, policy=OWNER_ONLY) for n in range(OWNER_MESSAGE_MACHINES + 2)]
    outcomes = slack.warn_owner(decisions)
    messages = posted(client)
    assert len(messages) == 2 and all(p["channel"] == "D0BOB" for p in messages)
    assert all(len(p["blocks"]) <= MESSAGE_BLOCKS for p in messages)
    assert "part 1 of 2" in str(messages[0]["blocks"][-1]) and "part 2 of 2" in str(messages[1]["blocks"][-1])
    assert all(isinstance(o, Delivery) for o in outcomes)
    first, last = outcomes[0], outcomes[-1]
    assert isinstance(first, Delivery) and isinstance(last, Delivery)
    assert first.group_ref != last.group_ref and first.messages != last.messages
    assert len({o.ref for o in outcomes if isinstance(o, Delivery)}) == len(decisions)
    # What each part lists is kept server-side under its "Keep all" reference: never taken from a payload.
    group = slack.listed_group(first.group_ref or "")
    assert isinstance(group, ListedGroup) and len(group.ids) == OWNER_MESSAGE_MACHINES
    assert slack.listed_group("forged") is None


def test_a_post_that_fails_leaves_every_listed_machine_undelivered() -> None:
    decisions = [warning(n, policy=OWNER_ONLY) for n in range(3)]
    slack, _ = notifier({"chat.postMessage": slack_error("ratelimited", 429)})
    assert slack.warn_owner(decisions) == [None, None, None]  # may pass: retried next sweep
    slack, _ = notifier({"chat.postMessage": slack_error("internal_error", 500)})
    lost = slack.warn_owner(decisions)  # it may have been posted: looked for before posting again
    assert all(isinstance(o, DeliveryUnknown) for o in lost)
    slack, _ = notifier({"chat.postMessage D0BOB": slack_error("user_not_found")})
    outcomes = slack.warn_owner(decisions)
    assert all(isinstance(o, PermanentDeliveryFailure) for o in outcomes)
    assert [d.machine.instance_id in str(o) for d, o in zip(decisions, outcomes, strict=True)] == [True] * 3


def test_a_channel_refusing_still_delivers_to_the_owner_and_names_it_per_machine() -> None:
    policy = TeamPolicy(notify="both", slack_channel="C0TEAM")
    decisions = [warning(n, policy=policy) for n in range(2)]
    slack, client = notifier({"chat.postMessage C0TEAM": slack_error("not_in_channel")})
    outcomes = slack.warn_owner(decisions)
    assert [p["channel"] for p in posted(client)] == ["D0BOB", "C0TEAM"]
    for d, o in zip(decisions, outcomes, strict=True):
        assert isinstance(o, Delivery) and len(o.messages) == 1
        assert len(o.undelivered) == 1 and d.machine.instance_id in o.undelivered[0]


def test_a_huge_unicode_name_and_injected_tags_fit_their_line_inertly() -> None:
    slack, client = notifier()
    slack.warn_owner(
        [warning(1, policy=OWNER_ONLY, instance_type=INJECTION), warning(2, team=INJECTION, policy=OWNER_ONLY)]
    )
    (message,) = posted(client)
    assert_within_limits(message["blocks"])
    slack, client = notifier()
    big = decision(machine(name=UNICODE_NAME, instance_id="i-0000000000000000a"), policy=OWNER_ONLY)
    big.__dict__["deliver_warning"] = True
    slack.warn_owner([big, warning(2, policy=OWNER_ONLY)])
    assert_within_limits(posted(client)[0]["blocks"])


def test_the_sweep_posts_one_message_per_owner_and_a_failed_one_holds_each_stop() -> None:
    from test_sweep_fakes import NOW as SWEEP_NOW
    from test_sweep_fakes import WARN_SWEEP, account, box, by_id, sweep

    from idle_reaper.core import Action
    from idle_reaper.slack import SlackNotifier
    from testkit.aws import CountingStateStore

    aws = account()
    bobs = [box(aws, owner="U0BOB") for _ in range(3)]
    ann = box(aws, owner="U0ANN")
    store = CountingStateStore()
    _, client = notifier({"chat.postMessage D0BOB": slack_error("ratelimited", 429)})
    slack = SlackNotifier(client, store, clock=lambda: WARN_SWEEP)  # type: ignore[arg-type]
    first = by_id(sweep(aws, store, WARN_SWEEP, notifier=slack))
    assert all(first[i].action is Action.WARN for i in [*bobs, ann])
    assert [p["channel"] for p in posted(client)] == ["D0BOB", "D0ANN"]  # bob's three in one (failed) post
    for i in bobs:  # the failed message leaves each of its machines undelivered, and not marked as posting
        r = store.records[i]
        assert r.warning_delivered_at is None and r.warning_post_started_at is None and r.group_ref is None
    assert store.records[ann].warning_delivered_at == WARN_SWEEP and store.records[ann].group_ref is None

    client.errors.clear()
    slack.clock = lambda: SWEEP_NOW
    later = by_id(sweep(aws, store, SWEEP_NOW, notifier=slack))
    assert later[ann].action is Action.STOP
    assert all(later[i].action is Action.WARN or later[i].action is Action.NONE for i in bobs)
    assert all(aws.ec2.state_of(i) == "running" for i in bobs), "no stop before a delivered warning"
    retried = posted(client)[2:]
    assert [p["channel"] for p in retried] == ["D0BOB"] and all(i in str(retried[0]["blocks"]) for i in bobs)
    (group_ref,) = {store.records[i].group_ref for i in bobs}
    assert group_ref and all(store.records[i].warning_delivered_at == SWEEP_NOW for i in bobs)


def test_a_state_table_fault_while_editing_a_shared_message_never_raises() -> None:
    from botocore.exceptions import ClientError

    from idle_reaper.core import MachineRecord

    slack, client = notifier()
    (first, _) = slack.warn_owner([warning(1, policy=OWNER_ONLY), warning(2, policy=OWNER_ONLY)])
    assert isinstance(first, Delivery)
    record = MachineRecord("i-00000000000000001", "ml", messages=first.messages, group_ref=first.group_ref)

    def down(*_: Any, **__: Any) -> None:
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "GetItem")

    slack.store.get_lookup = down  # type: ignore[method-assign]
    assert slack.update(record, "Kept", "by bob") is False
    assert not [m for m, _ in client.calls if m == "chat.update"]


class GroupWriteFailsOnce(CountingStateStore):
    """The state table throttles the 2nd shared message's "group#" lookup write (part 2 of 2)."""

    groups = 0

    def put_lookup(self, key, value, expires):
        if key.startswith("group#"):
            self.groups += 1
            if self.groups == 2:
                raise ClientError({"Error": {"Code": "ProvisionedThroughputExceededException"}}, "PutItem")
        super().put_lookup(key, value, expires)


def test_a_part_already_posted_is_recorded_delivered_and_never_posted_again() -> None:
    """Part 2 of an owner's message fails on the state table: part 1, already posted, counts as delivered."""
    aws = account()
    bobs = [box(aws, owner="U0BOB") for _ in range(OWNER_MESSAGE_MACHINES + 2)]
    store = GroupWriteFailsOnce()
    client = RecordingClient({})
    slack = SlackNotifier(client, store, clock=lambda: WARN_SWEEP)  # type: ignore[arg-type]
    sweep(aws, store, WARN_SWEEP, notifier=slack)
    first = posted(client)
    assert len(first) == 1, "part 1 reached the owner"
    in_part_1 = [i for i in bobs if i in str(first[0]["blocks"])]
    slack.clock = lambda: NOW
    sweep(aws, store, NOW, notifier=slack)
    again = [i for i in in_part_1 if any(i in str(p["blocks"]) for p in posted(client)[1:])]
    assert again == [], (
        f"{len(again)} machines warned twice; records say delivered="
        f"{[store.records[i].warning_delivered_at for i in in_part_1[:2]]}"
    )


def lines(blocks: list[dict[str, Any]]) -> list[str]:
    return [b["text"]["text"] for b in blocks if b["type"] == "section"]


@pytest.mark.parametrize(
    ("action", "asg_action", "title"),
    [(Action.UNPROTECT, "unprotect", "Released to its group"), (Action.TERMINATE, "terminate", "Terminated")],
)
def test_a_group_member_released_or_terminated_is_named_on_its_line_of_the_shared_message(
    action: Action, asg_action: str, title: str
) -> None:
    """A note replaces the machine's line in its shared message: the note itself names the machine. Before: a
    group member's stop notice read "Released to its group: <reason>" on a line naming no machine (found by
    benchmarks/slack_throughput.py: 960 of 2,596 notices at 10,000 machines, a team channel's list of workers);
    and a member terminated under asg_action: terminate was titled "Released to its group" too."""
    policy = TeamPolicy(notify="channel", slack_channel="C0TEAM", asg_action=asg_action)  # type: ignore[arg-type]
    decisions = [warning(n, owner=None, policy=policy, asg_name="workers") for n in (1, 2)]
    slack, client = notifier()
    outcomes = slack.warn_owner(decisions)
    assert all(isinstance(o, Delivery) for o in outcomes)
    stops = [
        replace(
            d,
            action=action,
            state=State.REAPED,
            notify="reaped",
            reason=f"idle member of workers: {action.value}",
            record=replace(d.record, messages=o.messages, group_ref=o.group_ref),  # type: ignore[union-attr]
        )
        for d, o in zip(decisions, outcomes, strict=True)
    ]
    drafted = []
    for d in stops:
        notice = slack.stop_notice(d)
        assert notice is not None and notice.title == title
        drafted.append(replace(d.record, notice=notice.to_json()))
    told = slack.send_notices(drafted, EditPace(60, time.monotonic() + 30))
    assert {status for status, _ in told.values()} == {"sent"}
    (update,) = [params for method, params in client.calls if method == "chat.update"]  # one edit for both
    released = [line for line in lines(update["blocks"]) if title in line]
    assert len(released) == 2
    if action is Action.TERMINATE:
        assert not [line for line in lines(update["blocks"]) if "eleased" in line], "terminated, not released"
    for d, line in zip(decisions, released, strict=True):
        assert d.machine.instance_id in line and d.machine.name in line


def test_a_warning_withdrawn_is_named_on_its_line_of_the_shared_message() -> None:
    slack, client = notifier()
    decisions = [warning(n, policy=OWNER_ONLY) for n in (1, 2)]
    (first, _) = slack.warn_owner(decisions)
    assert isinstance(first, Delivery)
    busy = replace(
        decisions[0],
        reason="busy: CPU 40%",
        record=replace(decisions[0].record, messages=first.messages, group_ref=first.group_ref),
    )
    slack.resolved(busy)
    (update,) = [params for method, params in client.calls if method == "chat.update"]
    (withdrawn,) = [line for line in lines(update["blocks"]) if "Warning withdrawn" in line]
    assert "i-00000000000000001" in withdrawn and "box-1" in withdrawn
