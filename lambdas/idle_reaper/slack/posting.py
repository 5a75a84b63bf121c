"""Posting to Slack within its limits: chat.postMessage paced per conversation and across the workspace, public
channels joined before they are posted to, each target posted to on its own, and a post looked for in a
conversation's history when its answer was lost."""

from __future__ import annotations

import copy
import threading
import time
from datetime import UTC, datetime
from typing import Any, Self

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.aws.limits import Pace, Quota
from idle_reaper.aws.state import StateStore
from idle_reaper.core.records import MAYBE_POSTED
from idle_reaper.core.signals import Machine
from idle_reaper.notify import PermanentDeliveryFailure, logger
from idle_reaper.slack.faults import CONFIG_FAULTS, HeldBack, SlackFault, classify
from idle_reaper.slack.shared import WARNING_EVENT, SharedMessages

POST_SECONDS_PER_CHANNEL = 1.0  # chat.postMessage: about one message a second in a channel
# chat.postMessage across the workspace. Slack "will generally allow an app to post 1 message per second to a specific
# channel ... limiting posting to several hundred messages per minute" across the workspace
# (https://api.slack.com/methods/chat.postMessage#rate_limiting), and answers a call past a limit with HTTP 429 and a
# Retry-After header, the seconds until it may be retried (https://api.slack.com/apis/rate-limits): for a limit
# counted by the minute, up to a minute, past the time a sweep's client may wait, so one of a warning's copies would
# be left behind. The limits are counted "per API method per app per workspace" (the same page): what the sweep posts
# shares its limit with everything else this app posts with its token and does not pace here (the Slack handler's
# answers and admin alerts, the alarm relay, the weekly digest, a sweep overlapping this one); other apps in the
# workspace count against limits of their own. "Several hundred" is no number: it is read at its floor, the 300 the
# local Slack holds, and the sweep keeps to two thirds of it, 200 a minute after a burst of 10 (at most 210 in any
# minute), leaving 90 a minute for the rest.
POSTS_PER_MINUTE = 200.0
POSTS_BURST = 10.0
POSTS_QUOTA = Quota(POSTS_BURST, POSTS_PER_MINUTE / 60)
# A post waits its turn at most this long (the sweep's lanes and owner messages take turns): longer, it is held back
# as a failure that passes (the next sweep posts it), never kept waiting past the invocation's time.
POST_WAIT_SECONDS = 15.0


class Posting(SharedMessages):
    """Posting a message to its targets, each on its own, within Slack's limits; finding a post whose answer was
    lost."""

    def __init__(self, client: WebClient, store: StateStore, clock: Any = None, *, sharing: int = 1) -> None:
        self.client = client
        self.store = store
        self.clock = clock or (lambda: datetime.now(UTC))
        self.logger = logger
        self._joined: dict[str, str | None] = {}  # channel -> None once a member, else why it could not join
        self._next_post: dict[str, float] = {}  # channel -> when it may take the next post (time.monotonic())
        self._pace_lock = threading.Lock()
        # The invocations posting at once (a fanned-out sweep's shards) each keep their share of the workspace's rate.
        self.sharing = max(1, sharing)
        self.posts = Pace(POSTS_QUOTA.share(self.sharing))

    def shared_by(self, workers: int) -> Self:
        """This notifier for one of `workers` invocations posting to the workspace at once (the shards of a sweep,
        fanout.ShardTask.concurrent_shards): the same client and caches, its share of the workspace's posting rate,
        so that together they stay inside it (as MetricsReader.shared_by). A channel's one post a second is not
        shared out: an owner's machines are swept by one shard, and a team channel that two shards post to at once
        answers a Retry-After of a second or two, which the client waits out."""
        shared = copy.copy(self)
        shared.sharing = max(1, workers)
        shared.posts = Pace(POSTS_QUOTA.share(shared.sharing))
        return shared

    def _pace_post(self, channel: str) -> None:
        """chat.postMessage "will generally allow an app to post 1 message per second to a specific channel": the
        sweep's lanes (one an owner) that post into one team channel at once get their posts a second apart
        here, rather than as 429s and Retry-After waits. A DM is one owner's lane: posted as it comes."""
        if channel[:1] not in ("C", "G"):
            return
        with self._pace_lock:
            now = time.monotonic()
            at = max(now, self._next_post.get(channel, 0.0))
            self._next_post[channel] = at + POST_SECONDS_PER_CHANNEL
        if at > now:
            time.sleep(at - now)

    def post_message(self, channel: str, *, paced: bool = True, **params: Any) -> Any:
        """chat.postMessage, its turn taken under the workspace's posting rate first (`paced` False: the caller took
        it); HeldBack when that turn would come too late."""
        if paced and not self.posts.take(within=POST_WAIT_SECONDS):
            raise HeldBack("held back under Slack's workspace rate for chat.postMessage")
        self._pace_post(channel)
        return self.client.chat_postMessage(channel=channel, **params)

    def join(self, channel: str) -> str | None:
        """Be a member of public channel `channel` before posting there (once per notifier: a sweep's, a handler's).
        Slack lets a bot post to a public channel it is not in (chat:write.public), but read its history only as
        a member ("Any conversation the relevant bot is a member of", conversations.history): a post whose answer
        was lost could not be looked for there. conversations.join (channels:join, Tier 3) answers at once for a
        channel the bot is in already. None: a member; else why not (a private channel needs an invite)."""
        if not channel.startswith("C"):
            return None  # a DM (the bot is in its own) or a private channel (G...: membership by invite)
        if channel not in self._joined:
            try:
                self.client.conversations_join(channel=channel)
                self._joined[channel] = None
            except (SlackApiError, SlackClientError, OSError) as exc:
                fault = classify(exc, channel)
                if fault.code not in ("method_not_supported_for_channel_type", "is_archived"):
                    self.logger.warning("slack channel not joined", extra={"channel": channel, "error": fault.code})
                self._joined[channel] = fault.code
        return self._joined[channel]

    def _post_to(
        self,
        targets: list[str],
        text: str,
        blocks: list[dict[str, Any]],
        faults: list[SlackFault],
        subject: str,
        metadata: dict[str, Any] | None = None,
    ) -> list[str]:
        """Post to each target on its own: "channel|ts" of each copy delivered; each failure joins `faults`.
        `metadata` (Slack message metadata) lets a later sweep find a post whose outcome it lost. The copies take
        their turns under the workspace's posting rate together: a message goes to all its targets or to none."""
        messages: list[str] = []
        if targets and not self.posts.take(len(targets), within=POST_WAIT_SECONDS):
            held = HeldBack("held back under Slack's workspace rate for chat.postMessage")
            faults += [self._failed("warning", subject, held, channel) for channel in targets]
            return messages
        for channel in targets:
            self.join(channel)  # so a lost answer can be looked for here (a refusal shows in the post below)
            try:
                out = self.post_message(channel, paced=False, text=text, blocks=blocks, metadata=metadata)
                messages.append(f"{out['channel']}|{out['ts']}")
            except (SlackApiError, SlackClientError, OSError) as exc:
                faults.append(self._failed("warning", subject, exc, channel))
        return messages

    def _warning_in(self, channel: str, since: datetime, ref: str) -> dict[str, Any] | None:
        """The message in `channel` since `since` whose metadata carries the warning reference `ref`. A public
        channel the bot is not in is joined first (a post made before the bot joined is there all the same)."""
        try:
            messages = self._history_since(channel, since)
        except SlackApiError as exc:
            if classify(exc, channel).code != "not_in_channel" or self.join(channel) is not None:
                raise
            messages = self._history_since(channel, since)
        for message in messages:
            metadata = message.get("metadata") or {}
            if metadata.get("event_type") == WARNING_EVENT and ref in (
                (metadata.get("event_payload") or {}).get("refs") or ()
            ):
                return message
        return None

    def _history_since(self, channel: str, since: datetime) -> list[dict[str, Any]]:
        """The conversation's messages since `since` (a minute of clock skew allowed), with their metadata."""
        messages: list[dict[str, Any]] = []
        cursor = None
        for _ in range(10):  # a warning is recent: ten pages of 200 reach far enough back
            page = self.client.conversations_history(
                channel=channel,
                oldest=f"{since.timestamp() - 60:.6f}",
                include_all_metadata=True,
                limit=200,
                cursor=cursor,
            )
            messages += page.get("messages") or []
            cursor = (page.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                break
        return messages

    def look_for(self, target: str, since: datetime, ref: str) -> str | None:
        """The copy ("channel|ts") of the warning `ref` posted to `target` (a user's DM, or a channel) since `since`;
        None when that conversation shows none. Raises the Slack failure when it cannot be read."""
        channel = target
        if channel[:1] in ("U", "W"):
            channel = str(self.client.conversations_open(users=channel)["channel"]["id"])
        message = self._warning_in(channel, since, ref)
        return f"{channel}|{message['ts']}" if message is not None else None

    def _copies_owed(self, faults: list[SlackFault], ref: str, since: datetime) -> tuple[list[str], tuple[str, ...]]:
        """For a warning some target got: the copies of the targets that failed for a reason that may pass, looked
        for at once where the post's answer was lost (found, they are kept, so later answers and the stop edit them
        too), and the targets still owed a copy (core.records.owed_target: posted by a later sweep; MAYBE_POSTED
        where a post's answer was lost and it was not seen)."""
        found: list[str] = []
        owed: list[str] = []
        for fault in faults:
            if fault.permanent or not fault.target:
                continue
            if not fault.lost:
                owed.append(fault.target)
                continue
            try:
                copy_found = self.look_for(fault.target, since, ref)
            except (SlackApiError, SlackClientError, OSError):
                copy_found = None
            if copy_found is not None:
                found.append(copy_found)
            else:  # not seen yet, or not readable: looked for again before it is posted
                owed.append(fault.target + MAYBE_POSTED)
        return found, tuple(dict.fromkeys(owed))

    def _raise_if_permanent(self, m: Machine, faults: list[SlackFault]) -> None:
        """Nobody got the warning: give up on it only when every failure is permanent."""
        given_up = self._given_up(m, faults)
        if given_up:
            raise given_up

    def _given_up(self, m: Machine, faults: list[SlackFault]) -> PermanentDeliveryFailure | None:
        if faults and all(f.permanent for f in faults):
            return PermanentDeliveryFailure("; ".join(self._reason(m, f) for f in faults))
        return None

    def _failed(self, what: str, subject: str, exc: Exception, target: str) -> SlackFault:
        fault = classify(exc, target)
        extra = {"subject": subject, "target": target, "error": fault.code, "advice": fault.advice}
        if fault.permanent or fault.code in CONFIG_FAULTS:
            self.logger.error(f"slack {what} failed and will fail again until fixed", extra=extra)
        else:
            # WARNING, not ERROR: Slack being down is expected now and then; the warning stays pending.
            self.logger.warning(f"slack {what} failed", extra=extra)
        return fault
