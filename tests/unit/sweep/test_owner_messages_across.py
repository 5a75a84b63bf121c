"""Organization mode: the units of one sweep (member accounts and regions, the hub's shards) share an owner's
message, against the real SlackNotifier, the in-memory state table and a thread-safe Slack stub: concurrent
joiners converge on one message listing everyone; a failed post, a failed edit, an unreadable item, a full
message, a stuck leader each leave every machine delivered in a message that lists it, or pending."""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError
from test_slack_blocks import decision, machine
from test_sweep_fakes import NOW

from idle_reaper.aws import InMemoryStateStore
from idle_reaper.core import Decision, owner_message_key
from idle_reaper.notify import Delivery
from idle_reaper.policy import TeamPolicy
from idle_reaper.slack import OWNER_MESSAGE_MACHINES, ListedGroup, SlackNotifier
from idle_reaper.sweep import owner_messages
from idle_reaper.sweep.owner_messages import OwnerItem, owner_item_key, post_across

OWNER_ONLY = TeamPolicy(notify="owner")
SCOPE = "sweep-1"
REGION = "us-east-1"


def slack_error(code: str) -> SlackApiError:
    return SlackApiError(code, {"ok": False, "error": code})  # type: ignore[arg-type]


@dataclass
class SlackStub:
    """Slack's chat.postMessage and chat.update, thread-safe, keeping each message as it stands; `fail` makes
    the next calls of a method fail with the given error (each used once)."""

    messages: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    posts: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    fail: dict[str, list[Exception]] = field(default_factory=dict)
    jitter: float = 0.0  # an edit lands up to this many seconds after it was sent: edits overtake each other
    on_update: Callable[[], None] | None = None  # called as an edit is sent, before it lands
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _failure(self, method: str) -> None:
        with self.lock:
            pending = self.fail.get(method)
            error = pending.pop(0) if pending else None
        if error is not None:
            raise error

    def chat_postMessage(self, channel: str, **params: Any) -> dict[str, Any]:
        self._failure("chat.postMessage")
        channel = "D" + channel.lstrip("UW") if channel[:1] in ("U", "W") else channel
        with self.lock:
            ts = f"{len(self.posts) + 1}.0"
            self.posts.append({"channel": channel, **params})
            self.messages[(channel, ts)] = dict(params)
        return {"channel": channel, "ts": ts}

    def conversations_join(self, channel: str) -> dict[str, Any]:
        return {"ok": True, "channel": {"id": channel}}

    def chat_update(self, channel: str, ts: str, **params: Any) -> dict[str, Any]:
        self._failure("chat.update")
        time.sleep(random.uniform(0, self.jitter))
        if self.on_update is not None:
            self.on_update()
        with self.lock:
            if (channel, ts) not in self.messages:
                raise slack_error("message_not_found")
            self.updates.append({"channel": channel, "ts": ts, **params})
            self.messages[(channel, ts)] = {**self.messages[(channel, ts)], **params}
        return {"ok": True}

    def shown(self, message: str) -> str:
        channel, _, ts = message.partition("|")
        return json.dumps(self.messages[(channel, ts)]["blocks"])


class SlowStore(InMemoryStateStore):
    """Reads that take a varying while, as DynamoDB's do: units' reads and writes interleave."""

    def get_lookup(self, key: str, now: Any) -> str | None:
        time.sleep(random.uniform(0, 0.004))
        return super().get_lookup(key, now)


def unit(
    store: InMemoryStateStore, account: str, n: int = 1, owner: str = "U0BOB", instance_id: str | None = None
) -> list[Decision]:
    """One unit's warnings for an owner: `n` machines in `account`, their records claimed with their references
    (as the sweep's claim writes them before posting)."""
    found = []
    for i in range(n):
        m = machine(
            instance_id=instance_id or f"i-{int(account[-4:]):05d}{i:012x}",
            account=account,
            region=REGION,
            owner=owner,
            name=f"box-{account[-4:]}-{i}",
        )
        d = decision(m, policy=OWNER_ONLY)
        record = replace(d.record, account=account, region=REGION, warning_ref=secrets.token_urlsafe(18), version=1)
        assert store.save(record)
        found.append(replace(d, record=record, deliver_warning=True))
    return found


def item_key(group: list[Decision]) -> str:
    owners = {d.machine.instance_id: d.machine.owner for d in group}
    return owner_item_key(SCOPE, owner_message_key(group[0], owners))


def share(slack: SlackNotifier, store: InMemoryStateStore, group: list[Decision]) -> list[Any] | None:
    return post_across(store, slack, item_key(group), group, group[0].machine.owner, lambda: False)


def setup(store: InMemoryStateStore | None = None) -> tuple[SlackNotifier, SlackStub, InMemoryStateStore]:
    store, stub = store or InMemoryStateStore(), SlackStub()
    return SlackNotifier(stub, store, clock=lambda: NOW), stub, store  # type: ignore[arg-type]


def delivered(outcomes: list[Any] | None) -> list[Delivery]:
    assert outcomes is not None
    assert all(isinstance(o, Delivery) for o in outcomes), outcomes
    return outcomes


def test_units_joining_at_once_end_with_one_message_listing_every_machine() -> None:
    slack, stub, store = setup(SlowStore())
    stub.jitter = 0.03
    units = [unit(store, f"1111111{n:05d}", n=1 + n % 3) for n in range(10)]
    start = threading.Barrier(len(units))
    outcomes: dict[int, list[Any] | None] = {}

    def run(n: int) -> None:
        start.wait()
        outcomes[n] = share(slack, store, units[n])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(units))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stub.posts) == 1, "one message for the owner across the units"
    (message,) = {o.messages for n in outcomes for o in delivered(outcomes[n])}
    (group_ref,) = {o.group_ref for n in outcomes for o in delivered(outcomes[n])}
    every = [d for u in units for d in u]
    shown = stub.shown(message[0])
    for d in every:  # the last edit to land lists everyone, with each machine's own buttons
        assert d.machine.instance_id in shown and d.record.warning_ref in shown
    assert f'"value": "{group_ref}"' in shown  # and "Keep all"
    listed = slack.listed_group(group_ref or "")
    assert listed is not None and sorted(listed.ids) == sorted(d.machine.key for d in every)
    # Each machine's reference is its own and finds its own machine; the metadata names them all (find_warning).
    refs = {o.ref for n in outcomes for o in delivered(outcomes[n])}
    assert refs == {d.record.warning_ref for d in every}
    assert all(store.get_lookup(f"ref#{d.record.warning_ref}", NOW) == d.machine.key for d in every)
    last = stub.updates[-1]["metadata"]["event_payload"]
    assert sorted(last["refs"]) == sorted(refs) and last["group_ref"] == group_ref


def test_a_joiner_arriving_while_an_edit_is_in_flight_waits_for_it_and_edits_after_it() -> None:
    """Two edits in flight at once can land in either order, and an older listing landing last hides machines
    already reported delivered. Edits of one message are made one at a time: joiner Y, arriving while X's edit
    is in flight, waits for X's lease and edits after it, with the listing as it stands then."""
    slack, stub, store = setup()
    a, x, y = unit(store, "111111111111"), unit(store, "222222222222"), unit(store, "333333333333")
    [led] = delivered(share(slack, store, a))
    x_sending, y_waiting = threading.Event(), threading.Event()
    acquire = store.replace_lookup

    def watch(key: str, *args: Any, **kwargs: Any) -> bool:
        got = acquire(key, *args, **kwargs)
        if key.startswith("groupedit#") and not got and threading.current_thread().name == "Y":
            y_waiting.set()  # Y found the message being edited
        return got

    store.replace_lookup = watch  # type: ignore[method-assign]

    def hold_x() -> None:
        if threading.current_thread().name == "X" and not y_waiting.is_set():
            x_sending.set()
            assert y_waiting.wait(5), "Y came while X's edit was in flight, and waited"

    stub.on_update = hold_x
    outcomes: dict[str, Any] = {}
    threads = [
        threading.Thread(name="X", target=lambda: outcomes.update(X=share(slack, store, x))),
        threading.Thread(name="Y", target=lambda: outcomes.update(Y=share(slack, store, y))),
    ]
    threads[0].start()
    assert x_sending.wait(5)
    threads[1].start()
    for t in threads:
        t.join()
    delivered(outcomes["X"]), delivered(outcomes["Y"])
    shown = stub.shown(led.messages[0])
    assert all(d.machine.instance_id in shown for d in [*a, *x, *y])
    assert len(stub.posts) == 1
    # Y's edit came after X's had landed: the last one lists all three.
    assert y[0].machine.instance_id in json.dumps(stub.updates[-1]["blocks"])


def test_an_overtaken_joiner_whose_next_edit_fails_leaves_no_machine_hidden() -> None:
    """The Slack issue's item 4, as it happened: X's edit is in flight while Y joins and edits; X's older listing
    lands after Y's, and X's edit to correct it is refused (429). Before, X took its refused edit as sent, and
    the message went on showing X's listing, hiding Y's machine, which was reported delivered and would be
    stopped warn_minutes later with no line its owner could see."""
    slack, stub, store = setup()
    a, x, y = unit(store, "111111111111"), unit(store, "222222222222"), unit(store, "333333333333")
    [led] = delivered(share(slack, store, a))
    stub.updates.clear()
    stub.fail["chat.update"] = [None, None, slack_error("ratelimited")]  # type: ignore[list-item]
    y_done = threading.Event()
    outcomes: dict[str, Any] = {}

    def y_joins() -> None:
        outcomes["Y"] = share(slack, store, y)
        y_done.set()

    def overtake() -> None:
        if threading.current_thread().name == "X" and "started" not in outcomes:
            outcomes["started"] = True
            threading.Thread(name="Y", target=y_joins).start()
            y_done.wait(1)  # Y's whole join lands first, when nothing makes it wait for X's edit

    stub.on_update = overtake
    x_thread = threading.Thread(name="X", target=lambda: outcomes.update(X=share(slack, store, x)))
    x_thread.start()
    x_thread.join()
    assert y_done.wait(30)
    reported = [d for d, o in zip([*x, *y], [*outcomes["X"], *outcomes["Y"]], strict=True) if isinstance(o, Delivery)]
    shown = stub.shown(led.messages[0])
    assert y[0] in reported and all(d.machine.instance_id in shown for d in [*a, *reported])


@pytest.mark.parametrize("seed", range(2))
def test_units_joining_at_once_while_edits_fail_never_hide_a_machine_reported_delivered(seed: int) -> None:
    """The Slack issue's item 4: a joiner's edit that fails (here a third of them, at random) must not leave the
    message showing an older listing that hides machines already reported delivered. Whatever the order the
    units come in, the message as it ends lists every machine reported delivered and no machine left pending."""
    rng = random.Random(seed)
    slack, stub, store = setup(SlowStore())
    stub.jitter = 0.02
    units = [unit(store, f"4444444{n:05d}", n=1 + n % 2) for n in range(8)]
    [led] = delivered(share(slack, store, units[0]))
    # The edits in the order they are sent: a third of them refused (None: that one goes through), one at least.
    failing: list[Any] = [slack_error("ratelimited") if rng.random() < 0.33 else None for _ in range(len(units))]
    failing[rng.randrange(len(failing))] = slack_error("ratelimited")
    stub.fail["chat.update"] = failing
    start = threading.Barrier(len(units) - 1)
    outcomes: dict[int, list[Any] | None] = {}

    def run(n: int) -> None:
        start.wait()
        outcomes[n] = share(slack, store, units[n])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(1, len(units))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shown = stub.shown(led.messages[0])
    reported = [
        d for n in outcomes for d, o in zip(units[n], outcomes[n] or [], strict=False) if isinstance(o, Delivery)
    ]
    pending = [d for n in outcomes for d, o in zip(units[n], outcomes[n] or [], strict=False) if o is None]
    assert pending, "some edits failed"
    assert all(d.machine.instance_id in shown for d in [*units[0], *reported]), "nothing delivered is hidden"
    assert not any(d.machine.instance_id in shown for d in pending), "nothing pending is shown"


def test_a_lone_leader_looks_like_a_warning_of_its_own_until_another_unit_joins() -> None:
    slack, stub, store = setup()
    (lone,) = unit(store, "111111111111")
    [first] = delivered(share(slack, store, [lone]))
    post = stub.posts[0]
    assert {e["action_id"] for b in post["blocks"] if b["type"] == "actions" for e in b["elements"]} >= {
        "keep_2h",
        "stop_now",
    }
    assert "keep_all" not in json.dumps(post["blocks"]) and first.group_ref
    assert post["metadata"]["event_payload"]["group_ref"] == first.group_ref  # found again if its outcome is lost
    other = unit(store, "222222222222", n=2)
    joined = delivered(share(slack, store, other))
    assert {o.messages for o in joined} == {first.messages} and len(stub.posts) == 1
    shown = stub.shown(first.messages[0])
    assert "keep_all" in shown and all(d.machine.instance_id in shown for d in [lone, *other])


def test_the_leaders_failed_post_leaves_its_machines_pending_and_the_next_unit_leads() -> None:
    slack, stub, store = setup()
    stub.fail["chat.postMessage"] = [slack_error("internal_error")]
    a, b, c = unit(store, "111111111111"), unit(store, "222222222222", n=2), unit(store, "333333333333")
    assert share(slack, store, a) == [None], "not posted: pending, retried next sweep"
    item = OwnerItem.parse(store.get_lookup(item_key(a), NOW))
    assert item is not None and item.state == "failed"
    led = delivered(share(slack, store, b))
    joined = delivered(share(slack, store, c))
    assert len(stub.posts) == 1 and {o.messages for o in [*led, *joined]} == {led[0].messages}
    shown = stub.shown(led[0].messages[0])
    assert all(d.machine.instance_id in shown for d in [*b, *c])
    assert a[0].machine.instance_id not in shown  # pending is not "listed": nobody was told of it


def test_a_joiners_failed_edit_leaves_its_machines_pending_and_unlisted() -> None:
    slack, stub, store = setup()
    [led] = delivered(share(slack, store, unit(store, "111111111111")))
    stub.fail["chat.update"] = [slack_error("internal_error")]
    joiner = unit(store, "222222222222", n=2)
    assert share(slack, store, joiner) == [None, None]
    listed = slack.listed_group(led.group_ref or "")
    assert listed is not None and listed.ids == (machine_of(store, "111111111111"),)
    assert all(d.machine.instance_id not in stub.shown(led.messages[0]) for d in joiner)


def machine_of(store: InMemoryStateStore, account: str) -> str:
    (key,) = [k for k, r in store.records.items() if r.account == account]
    return key


def test_a_message_that_can_no_longer_be_edited_is_replaced_by_a_new_one_the_next_units_join() -> None:
    slack, stub, store = setup()
    [led] = delivered(share(slack, store, unit(store, "111111111111")))
    stub.messages.clear()  # deleted in Slack: chat.update answers message_not_found
    b, c = unit(store, "222222222222"), unit(store, "333333333333")
    [own] = delivered(share(slack, store, b))
    assert own.messages != led.messages and len(stub.posts) == 2
    [joined] = delivered(share(slack, store, c))
    assert joined.messages == own.messages and c[0].machine.instance_id in stub.shown(own.messages[0])


def test_a_full_message_is_not_overfilled_the_joiner_posts_its_own() -> None:
    slack, stub, store = setup()
    first = delivered(share(slack, store, unit(store, "111111111111", n=OWNER_MESSAGE_MACHINES - 1)))
    more = unit(store, "222222222222", n=2)
    own = delivered(share(slack, store, more))
    assert len(stub.posts) == 2 and own[0].messages != first[0].messages
    listed = slack.listed_group(first[0].group_ref or "")
    assert listed is not None and len(listed.ids) == OWNER_MESSAGE_MACHINES - 1
    assert all(d.machine.instance_id in stub.shown(own[0].messages[0]) for d in more)


def test_an_unreadable_item_or_a_stuck_leader_means_posting_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    slack, stub, store = setup()
    lone = unit(store, "111111111111")
    store.put_lookup(item_key(lone), "{not json", NOW + owner_messages.REF_TTL)
    assert share(slack, store, lone) is None, "a lone warning: posted alone by the sweep (warn)"
    pair = unit(store, "222222222222", n=2)
    assert len(delivered(share(slack, store, pair))) == 2 and len(stub.posts) == 1  # warn_owner, alone
    # A unit that began posting and never finished: the others wait a bounded time, then post alone.
    slack, stub, store = setup()
    monkeypatch.setattr(owner_messages, "POSTING_WAIT_SECONDS", 0.3)
    pair = unit(store, "333333333333", n=2)
    store.put_lookup(item_key(pair), json.dumps({"state": "posting", "by": "gone"}), NOW + owner_messages.REF_TTL)
    assert len(delivered(share(slack, store, pair))) == 2 and len(stub.posts) == 1


def test_two_owners_are_never_merged_and_one_instance_id_in_two_accounts_is_two_machines() -> None:
    slack, stub, store = setup()
    bob_a = unit(store, "111111111111", instance_id="i-0abc")
    bob_b = unit(store, "222222222222", instance_id="i-0abc")
    ann = unit(store, "333333333333", owner="U0ANN", instance_id="i-0abc")
    [a] = delivered(share(slack, store, bob_a))
    [b] = delivered(share(slack, store, bob_b))
    [n] = delivered(share(slack, store, ann))
    assert a.messages == b.messages and n.messages != a.messages and len(stub.posts) == 2
    assert stub.posts[1]["channel"] == "D0ANN"
    listed = slack.listed_group(a.group_ref or "")
    assert isinstance(listed, ListedGroup)
    assert listed.ids == (bob_a[0].machine.key, bob_b[0].machine.key)
    assert store.get_lookup(f"ref#{a.ref}", NOW) == bob_a[0].machine.key
    assert store.get_lookup(f"ref#{b.ref}", NOW) == bob_b[0].machine.key
    assert "i-0abc" in stub.shown(a.messages[0]) and "222222222222" in stub.shown(a.messages[0])
    assert "111111111111" not in stub.shown(n.messages[0])
