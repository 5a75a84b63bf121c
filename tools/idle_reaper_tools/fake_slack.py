"""A local Slack Web API for tests and the demo: an HTTP server on 127.0.0.1 that the real slack-sdk WebClient
talks to through SLACK_API_URL. It keeps Slack's own rules, each cited beside the code that keeps it, and refuses
what Slack refuses with Slack's own errors:

- scopes per method (`missing_scope` with `needed` and `provided`), for the token's scopes (`scopes`);
- membership: a bot reads a conversation's history only as a member, posts to a public channel it is not in only
  with chat:write.public, and sees a private channel only as a member; conversations.join joins public ones;
- rate tiers per method, and about one post a second per conversation with short bursts, answered with HTTP 429
  and an integer Retry-After (RateLimits), on the fake's clock;
- archived channels, deactivated users, messages only their poster may edit;
- message `ts` on the clock the test sweeps on (`clock`), unique and increasing in each conversation.

It records every request, and can answer any Slack error for one method or one target (`errors`), 429 for the
next calls (`rate_limit_next`), invalid_auth (`auth_revoked`), 503 (`down`), or carry out a call and lose its
answer (`lose_answer`: the connection closes before the reply, as a timeout or a dropped connection does).

File uploads follow Slack's external-upload flow as documented (files.getUploadURLExternal: a file id and
an upload URL, served here; a POST of the bytes to that URL; files.completeUploadExternal: the ids must have
been uploaded, with as many bytes as announced, and are shared to channel_id with initial_comment)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from idle_reaper.core.doctor import MANIFEST_BOT_SCOPES


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    limited: bool = False  # answered 429: Slack did not take it
    ok: bool = False  # carried out (Slack answered ok, or would have: its answer lost)


# Slack's documented rate limits (https://docs.slack.dev/apis/web-api/rate-limits), per app and workspace, in
# calls a minute: "Tier 2: 20+ per minute, Tier 3: 50+, Tier 4: 100+" (the "+" is Slack's headroom; the fake holds
# the floor). Each method's tier is on its own page (https://docs.slack.dev/reference/methods/<method>, Facts).
# chat.postMessage has its own: "1 message per second to a specific channel ... limiting posting to several
# hundred messages per minute. Generous burst behavior is also granted" (the fake: 300 a minute, and a burst of
# POST_BURST posts in a conversation before it holds one a second).
TIER_PER_MINUTE = {
    "users.list": 20,  # Tier 2
    "usergroups.users.list": 20,  # Tier 2
    "conversations.list": 20,  # Tier 2
    "users.lookupByEmail": 50,  # Tier 3
    "conversations.open": 50,  # Tier 3
    "conversations.history": 50,  # Tier 3 (internal apps: the 2025 limits are for Marketplace-less distributed apps)
    "conversations.replies": 50,  # Tier 3
    "conversations.join": 50,  # Tier 3
    "conversations.info": 50,  # Tier 3
    "chat.update": 50,  # Tier 3
    "chat.delete": 50,  # Tier 3
    "users.info": 100,  # Tier 4
    "conversations.members": 100,  # Tier 4
    "chat.postEphemeral": 100,  # Tier 4
    "files.getUploadURLExternal": 100,  # Tier 4
    "files.completeUploadExternal": 100,  # Tier 4
    "chat.postMessage": 300,  # Special: "several hundred messages per minute" across the workspace
}
POSTS_PER_CONVERSATION_SECONDS = 1.0
POST_BURST = 4  # posts a conversation takes at once before the one-a-second pace holds
BOT_USER = "UBOT"
MANIFEST_SCOPES = sorted(MANIFEST_BOT_SCOPES)

# The bot scopes each method needs, by the kind of conversation it acts on (public channel, private channel, DM):
# each method page's "Required scopes". None: no scope (auth.test). chat:write.public is checked with membership.
_SCOPES: dict[str, tuple[str, str, str] | str | None] = {
    "auth.test": None,
    "chat.postMessage": "chat:write",
    "chat.update": "chat:write",
    "chat.delete": "chat:write",
    "chat.postEphemeral": "chat:write",
    "conversations.history": ("channels:history", "groups:history", "im:history"),
    "conversations.replies": ("channels:history", "groups:history", "im:history"),
    "conversations.info": ("channels:read", "groups:read", "im:read"),
    "conversations.members": ("channels:read", "groups:read", "im:read"),
    "conversations.join": "channels:join",
    "conversations.open": "im:write",
    "users.lookupByEmail": "users:read.email",
    "users.info": "users:read",
    "users.list": "users:read",
    "usergroups.users.list": "usergroups:read",
    "files.getUploadURLExternal": "files:write",
    "files.completeUploadExternal": "files:write",
}


@dataclass
class RateLimits:
    """The documented limits on a clock (real, or a benchmark's virtual one): a call over its method's
    minute, or a post to a conversation past its burst and one-a-second pace, is answered 429 with Retry-After."""

    clock: Callable[[], float] = time.monotonic
    calls: dict[str, list[float]] = field(default_factory=dict)
    posted: dict[str, list[float]] = field(default_factory=dict)  # conversation -> when each post was accepted
    refused: int = 0
    refused_by_method: dict[str, int] = field(default_factory=dict)

    def retry_after(self, method: str, channel: str) -> float:
        """0 when the call may go now (and it is counted), else the seconds to wait."""
        now = self.clock()
        limit = TIER_PER_MINUTE.get(method)
        window = [t for t in self.calls.get(method, []) if now - 60 < t <= now]
        wait = 0.0
        if limit is not None and len(window) >= limit:
            wait = min(window) + 60 - now
        if method == "chat.postMessage" and self.posted.get(channel):
            # A bucket of POST_BURST posts a conversation, refilled one a second: a burst goes at once, then one a
            # second. The bucket is the posts accepted since it was last full.
            level, last = 0.0, None
            for t in self.posted[channel]:
                if last is not None:
                    level = max(0.0, level - (t - last) / POSTS_PER_CONVERSATION_SECONDS)
                level, last = level + 1, t
            assert last is not None
            level = max(0.0, level - (now - last) / POSTS_PER_CONVERSATION_SECONDS)
            if level + 1 > POST_BURST:
                wait = max(wait, (level + 1 - POST_BURST) * POSTS_PER_CONVERSATION_SECONDS)
        if wait > 0:
            self.refused += 1
            self.refused_by_method[method] = self.refused_by_method.get(method, 0) + 1
            return wait
        self.calls[method] = [*window, now]
        if method == "chat.postMessage":
            self.posted.setdefault(channel, []).append(now)
        return 0.0


@dataclass
class FakeSlack:
    url: str = ""
    calls: list[Call] = field(default_factory=list)
    users_by_email: dict[str, str] = field(default_factory=dict)
    usergroups: dict[str, list[str]] = field(default_factory=dict)
    messages: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (channel, ts) -> params
    replies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (response_url name, JSON body)
    rate_limit_next: int = 0  # answer this many next calls with 429
    retry_after: int = 1
    auth_revoked: bool = False
    down: bool = False  # answer 503 to everything
    # Slack error codes to answer, by "method" or "method target" (target: the channel, or the user of
    # conversations.open), e.g. {"chat.postMessage C0MLTEAM": "not_in_channel"}
    errors: dict[str, str] = field(default_factory=dict)
    # Calls carried out whose answer never arrives, by "method" or "method target": how many more to lose.
    lose_answer: dict[str, int] = field(default_factory=dict)
    # Uploads by file id: {"filename", "length", "data" (None until the bytes are posted), "channel"}.
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    upload_fails: bool = False  # the upload URL answers 500
    # Slack's documented rate limits, on by default (real time); None: off.
    limits: RateLimits | None = field(default_factory=RateLimits)
    # The workspace, as Slack documents it: the token's scopes (the x-oauth-scopes header on every answer; None:
    # the header is left out, and every scope is granted), the channels with their members (BOT_USER among
    # them when the bot is in), which are private or archived, and users that do not exist or are deactivated.
    # A channel id no test described is a public channel the bot was never invited to (unless
    # `unknown_channels_exist` is False: then it does not exist).
    scopes: list[str] | None = field(default_factory=lambda: list(MANIFEST_SCOPES))
    channels: dict[str, list[str]] = field(default_factory=dict)
    private_channels: set[str] = field(default_factory=set)
    archived_channels: set[str] = field(default_factory=set)
    unknown_channels_exist: bool = True
    missing_users: set[str] = field(default_factory=set)
    deactivated_users: set[str] = field(default_factory=set)
    # The clock message ts are on (epoch seconds): the wall clock, or the one the test sweeps on.
    clock: Callable[[], float] = time.time
    _last_ts: dict[str, int] = field(default_factory=dict)  # conversation -> its newest ts, in microseconds
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.messages.clear()
            self.replies.clear()
            self.users_by_email.clear()
            self.usergroups.clear()
            self.errors.clear()
            self.lose_answer.clear()
            self.files.clear()
            self.upload_fails = False
            self.scopes = list(MANIFEST_SCOPES)
            self.channels.clear()
            self.private_channels.clear()
            self.archived_channels.clear()
            self.unknown_channels_exist = True
            self.missing_users.clear()
            self.deactivated_users.clear()
            self.clock = time.time
            self._last_ts.clear()
            self.rate_limit_next, self.auth_revoked, self.down = 0, False, False
            self.limits = RateLimits()

    def on_clock(self, now: Callable[[], datetime]) -> None:
        """Message ts on the clock the test sweeps on (a callable returning the test's aware datetime)."""
        self.clock = lambda: now().timestamp()

    def calls_to(self, method: str) -> list[Call]:
        """The calls of `method` Slack took (not those answered 429: `calls` has every request)."""
        return [c for c in self.calls if c.method == method and not c.limited]

    def response_url(self, name: str) -> str:
        """A response_url like the one Slack puts in every interaction and command payload."""
        return self.url.removesuffix("api/") + f"response/{name}"

    def replies_to(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [body for to, body in self.replies if to == name]

    def answer(self, method: str, params: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
        with self._lock:
            call = Call(method, params)
            self.calls.append(call)
            status, headers, body = self._answer(method, params)
            call.limited, call.ok = status == 429, bool(body.get("ok"))
            return status, headers, body

    def _answer(self, method: str, params: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
        """answer(), under the lock."""
        if self.down:
            return 503, {}, {"ok": False, "error": "service_unavailable"}
        if self.rate_limit_next > 0:
            self.rate_limit_next -= 1
            return 429, {"Retry-After": str(self.retry_after)}, {"ok": False, "error": "ratelimited"}
        if self.auth_revoked:
            return 200, {}, {"ok": False, "error": "invalid_auth"}
        if method == "chat.postMessage" and str(params.get("channel", ""))[:1] in ("U", "W"):
            # A user id: Slack posts to the app's DM with them ("a direct message conversation will be opened
            # if it isn't open already"); the call is recorded where it landed.
            params["channel"] = "D" + str(params["channel"]).lstrip("UW")
        target = self.target(params)
        wait = self.limits.retry_after(method, target) if self.limits is not None else 0.0
        if wait > 0:
            # "HTTP 429 Too Many Requests ... a Retry-After HTTP header containing the number of seconds until you
            # can retry" (https://docs.slack.dev/apis/web-api/rate-limits): whole seconds, as slack-sdk reads it.
            return 429, {"Retry-After": str(math.ceil(wait))}, {"ok": False, "error": "ratelimited"}
        scopes = {"x-oauth-scopes": ",".join(self.scopes)} if self.scopes is not None else {}
        error = self.errors.get(f"{method} {target}") or self.errors.get(method)
        if error:
            return 200, scopes, {"ok": False, "error": error}
        # Slack answers a refusal with HTTP 200 and ok: false (https://docs.slack.dev/apis/web-api#responses).
        refused = self._refusal(method, params)
        if refused is not None:
            return 200, scopes, refused
        return 200, scopes, self._method(method, params)

    @staticmethod
    def target(params: dict[str, Any]) -> str:
        return str(params.get("channel") or params.get("channel_id") or params.get("users") or "")

    def loses_answer(self, method: str, params: dict[str, Any]) -> bool:
        """Whether this call's answer is lost (it was carried out): counted down per "method target" or "method"."""
        with self._lock:
            for key in (f"{method} {self.target(params)}", method):
                if self.lose_answer.get(key, 0) > 0:
                    self.lose_answer[key] -= 1
                    return True
        return False

    def kind_of(self, channel: str) -> str:
        """ "im" (the bot's DM with someone), "private", "public", or "missing"."""
        if channel.startswith("D"):
            return "im"
        if channel in self.private_channels or channel.startswith("G"):
            return "private"
        if channel in self.channels or (self.unknown_channels_exist and channel.startswith("C")):
            return "public"
        return "missing"

    def bot_in(self, channel: str) -> bool:
        return channel.startswith("D") or BOT_USER in self.channels.get(channel, [])

    def _refusal(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """What Slack answers instead of carrying the call out: a missing scope, then membership and the
        channel's state, as each method's page documents them (https://docs.slack.dev/reference/methods/...)."""
        channel = str(params.get("channel") or params.get("channel_id") or "")
        kind = self.kind_of(channel) if channel else None
        needed = _SCOPES.get(method)
        scope = (
            needed[("public", "private", "im").index(kind)]
            if isinstance(needed, tuple)
            and kind
            in (
                "public",
                "private",
                "im",
            )
            else (needed[0] if isinstance(needed, tuple) else needed)
        )
        if self.scopes is not None and scope and scope not in self.scopes:
            # {"ok": false, "error": "missing_scope", "needed": ..., "provided": ...}: `needed` one scope, `provided`
            # the token's, comma-joined (as Slack sends it; the SDKs' response types declare both).
            return {"ok": False, "error": "missing_scope", "needed": scope, "provided": ",".join(self.scopes)}
        if method == "conversations.open":
            return self._open_refusal(params)
        if not channel or method in ("users.info", "users.lookupByEmail", "users.list", "auth.test"):
            return None
        if kind == "missing":
            return {"ok": False, "error": "channel_not_found"}
        member, archived = self.bot_in(channel), channel in self.archived_channels
        if kind == "private" and not member:
            return {"ok": False, "error": "channel_not_found"}  # Slack hides a private channel from non-members
        if method in ("chat.postMessage", "chat.postEphemeral"):
            if archived:
                return {"ok": False, "error": "is_archived"}  # "Channel has been archived."
            public = "chat:write.public" in (self.scopes if self.scopes is not None else ["chat:write.public"])
            if kind == "public" and not member and not public:
                # chat:write.public: "Send messages to channels your Slack app isn't a member of"
                return {"ok": False, "error": "not_in_channel"}
        if method in ("chat.update", "chat.delete") and archived:
            # chat.update's page: is_inactive, "The message cannot be edited within a frozen, archived or deleted
            # channel." (is_archived is not among its errors).
            return {"ok": False, "error": "is_inactive"}
        if method in ("conversations.history", "conversations.replies") and not member:
            # "Bot token | Any conversation the relevant bot is a member of" (conversations.history, Token types):
            # a public channel too.
            return {"ok": False, "error": "not_in_channel"}
        if method == "conversations.join":
            if kind != "public":
                return {"ok": False, "error": "method_not_supported_for_channel_type"}
            if archived:
                return {"ok": False, "error": "is_archived"}
        if method == "files.completeUploadExternal" and not member:
            return {"ok": False, "error": "not_in_channel"}  # "User/bot membership is required for the channel."
        return None

    def _open_refusal(self, params: dict[str, Any]) -> dict[str, Any] | None:
        users = [u for u in str(params.get("users") or "").split(",") if u]
        if not users:
            return {"ok": False, "error": "users_list_not_supplied"}
        if len(users) > 8:
            return {"ok": False, "error": "too_many_users"}
        if any(u in self.missing_users for u in users):
            return {"ok": False, "error": "user_not_found"}
        if any(u in self.deactivated_users for u in users):
            return {"ok": False, "error": "user_disabled"}  # conversations.open's page: a deactivated user
        return None

    def _next_ts(self, channel: str) -> str:
        """A ts on the fake's clock, unique and increasing in the conversation (microseconds, as Slack's)."""
        micros = max(round(self.clock() * 1_000_000), self._last_ts.get(channel, 0) + 1)
        self._last_ts[channel] = micros
        return f"{micros // 1_000_000}.{micros % 1_000_000:06d}"

    def _method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "auth.test":
            return {"ok": True, "user_id": BOT_USER, "team": "Demo"}
        if method == "users.lookupByEmail":
            user = self.users_by_email.get(str(params.get("email", "")).lower())
            if not user or user in self.deactivated_users:  # a deactivated user is not found by email
                return {"ok": False, "error": "users_not_found"}
            return {"ok": True, "user": {"id": user}}
        if method == "users.info":
            if params.get("user") in self.missing_users:
                return {"ok": False, "error": "user_not_found"}
            deleted = params.get("user") in self.deactivated_users  # users.info: a deactivated user, deleted: true
            return {"ok": True, "user": {"id": params.get("user"), "name": params.get("user"), "deleted": deleted}}
        if method == "conversations.join":
            channel = str(params.get("channel"))
            members = self.channels.setdefault(channel, [])
            if BOT_USER in members:
                return {"ok": True, "channel": {"id": channel}, "warning": "already_in_channel",
                        "response_metadata": {"warnings": ["already_in_channel"]}}  # fmt: skip
            members.append(BOT_USER)
            return {"ok": True, "channel": {"id": channel, "is_member": True}}
        if method in ("conversations.info", "conversations.members"):
            return self._conversation(method, params)
        if method == "usergroups.users.list":
            group = self.usergroups.get(str(params.get("usergroup")))
            return {"ok": True, "users": group} if group is not None else {"ok": False, "error": "no_such_subteam"}
        if method == "conversations.open":
            return {"ok": True, "channel": {"id": "D" + str(params.get("users", "")).lstrip("UW")}}
        if method == "users.list":  # every user the fake knows by email, 200 a page at most
            users = sorted(self.users_by_email.items(), key=lambda item: item[1])
            start = int(params.get("cursor") or 0)
            limit = max(1, min(200, int(params.get("limit") or 200)))
            page = [
                {"id": uid, "deleted": uid in self.deactivated_users, "profile": {"email": email}}
                for email, uid in users[start : start + limit]
            ]
            more = start + limit < len(users)
            return {
                "ok": True,
                "members": page,
                "response_metadata": {"next_cursor": str(start + limit) if more else ""},
            }
        if method == "chat.postMessage":
            channel = str(params.get("channel"))
            ts = self._next_ts(channel)
            params["_ts"] = ts  # the recorded call shares this dict: tests can see which ts it got
            self.messages[(channel, ts)] = params
            return {"ok": True, "channel": channel, "ts": ts}
        if method == "conversations.history":
            return self._history(params)
        if method == "chat.update":
            key = (str(params.get("channel")), str(params.get("ts")))
            if key not in self.messages:
                return {"ok": False, "error": "message_not_found"}
            self.messages[key] = {**self.messages[key], **params}
            return {"ok": True, "channel": key[0], "ts": key[1]}
        if method == "chat.postEphemeral":
            return {"ok": True, "message_ts": f"{time.time():.6f}"}
        if method == "files.getUploadURLExternal":
            return self._upload_url(params)
        if method == "files.completeUploadExternal":
            return self._complete_upload(params)
        return {"ok": False, "error": "unknown_method"}

    def _conversation(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        channel = str(params.get("channel", ""))
        members = self.channels.get(channel, [])
        if method == "conversations.info":
            info = {
                "id": channel,
                "is_member": self.bot_in(channel),
                "is_private": self.kind_of(channel) == "private",
                "is_archived": channel in self.archived_channels,
                "is_im": channel.startswith("D"),
            }
            return {"ok": True, "channel": info}
        return {"ok": True, "members": members, "response_metadata": {"next_cursor": ""}}

    def messages_in(self, channel: str) -> list[dict[str, Any]]:
        """A channel's messages (posts and shared files), oldest first."""
        with self._lock:
            return [m for (c, ts), m in sorted(self.messages.items(), key=lambda p: float(p[0][1])) if c == channel]

    def _upload_url(self, params: dict[str, Any]) -> dict[str, Any]:
        filename, length = str(params.get("filename") or ""), str(params.get("length") or "")
        if not filename or not length.isdigit() or int(length) < 1:
            return {"ok": False, "error": "invalid_arguments"}
        file_id = f"F{len(self.files) + 1:08d}"
        self.files[file_id] = {"filename": filename, "length": int(length), "data": None, "channel": None}
        return {"ok": True, "upload_url": self.url.removesuffix("api/") + f"upload/{file_id}", "file_id": file_id}

    def receive_upload(self, file_id: str, data: bytes) -> tuple[int, bytes]:
        """The POST of a file's bytes to its upload URL."""
        with self._lock:
            if self.upload_fails or self.down:
                return 500, b"upload failed"
            upload = self.files.get(file_id)
            if upload is None:
                return 404, b"not found"
            upload["data"] = data
            return 200, f"OK - {len(data)}".encode()

    def _complete_upload(self, params: dict[str, Any]) -> dict[str, Any]:
        try:
            listed = json.loads(params.get("files") or "")
            ids = [str(f["id"]) for f in listed]
        except (ValueError, TypeError, KeyError):
            return {"ok": False, "error": "invalid_arguments"}
        if not ids:
            return {"ok": False, "error": "invalid_arguments"}
        for file_id in ids:
            upload = self.files.get(file_id)
            if upload is None or upload["data"] is None or upload["channel"] is not None:
                return {"ok": False, "error": "file_not_found"}  # never announced, never uploaded, or shared
            if len(upload["data"]) != upload["length"]:
                return {"ok": False, "error": "file_upload_size_mismatch"}
        channel = str(params.get("channel_id") or "")
        shared = [
            {"id": i, "name": self.files[i]["filename"], "title": f.get("title")}
            for i, f in zip(ids, listed, strict=True)
        ]
        for file_id in ids:
            self.files[file_id]["channel"] = channel or "private"
        if channel:
            ts = self._next_ts(channel)
            self.messages[(channel, ts)] = {
                "channel": channel,
                "text": params.get("initial_comment") or "",
                "files": ids,
            }
        return {"ok": True, "files": shared}

    def _history(self, params: dict[str, Any]) -> dict[str, Any]:
        """conversations.history as Slack documents it: a channel's messages newest first, between `oldest`
        and `latest` (exclusive), `limit` a page (at most 999) with a next_cursor, and each message's
        `metadata` ({event_type, event_payload}) only when include_all_metadata is true."""
        channel = str(params.get("channel", ""))
        if not channel:
            return {"ok": False, "error": "channel_not_found"}
        oldest = float(params.get("oldest") or 0)
        latest = float(params.get("latest") or "inf")
        limit = max(1, min(999, int(params.get("limit") or 100)))
        start = int(params.get("cursor") or 0)
        with_metadata = str(params.get("include_all_metadata", "")).lower() in ("true", "1")
        found = sorted(
            ((ts, m) for (c, ts), m in self.messages.items() if c == channel and oldest < float(ts) < latest),
            key=lambda pair: float(pair[0]),
            reverse=True,
        )
        page = found[start : start + limit]
        messages = []
        for ts, m in page:
            message: dict[str, Any] = {"type": "message", "ts": ts, "text": m.get("text", "")}
            if with_metadata and isinstance(m.get("metadata"), dict):
                message["metadata"] = m["metadata"]
            messages.append(message)
        more = start + limit < len(found)
        return {
            "ok": True,
            "messages": messages,
            "has_more": more,
            "response_metadata": {"next_cursor": str(start + limit) if more else ""},
        }


def _handler(fake: FakeSlack) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            method = self.path.rstrip("/").rsplit("/", 1)[-1]
            if self.path.startswith("/upload/"):  # an upload URL from files.getUploadURLExternal: raw bytes
                length = int(self.headers.get("Content-Length", "0") or 0)
                status, answer = fake.receive_upload(method, self.rfile.read(length))
                self._send(status, {"Content-Type": "text/plain"}, answer)
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0)).decode()
            if self.path.startswith("/response/"):  # a response_url: Slack answers a plain "ok"
                with fake._lock:
                    fake.replies.append((method, json.loads(raw or "{}")))
                self._send(200, {"Content-Type": "text/plain"}, b"ok")
                return
            if "json" in (self.headers.get("Content-Type") or ""):
                params = json.loads(raw or "{}")
            else:
                params = {k: v[-1] for k, v in urllib.parse.parse_qs(raw).items()}
                for key in ("blocks", "attachments", "metadata"):
                    if isinstance(params.get(key), str):
                        params[key] = json.loads(params[key])
            self._answer(method, params)

        def do_GET(self) -> None:  # the read methods slack-sdk sends as GET (conversations.history)
            path, _, query = self.path.partition("?")
            method = path.rstrip("/").rsplit("/", 1)[-1]
            params: dict[str, Any] = {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}
            self._answer(method, params)

        def _answer(self, method: str, params: dict[str, Any]) -> None:
            status, headers, body = fake.answer(method, params)
            if status == 200 and fake.loses_answer(method, params):
                self.close_connection = True  # carried out, and the connection drops before the answer
                return
            self._send(status, {"Content-Type": "application/json", **headers}, json.dumps(body).encode())

        def _send(self, status: int, headers: dict[str, str], data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@dataclass
class LambdaContextStub:
    """What Powertools reads from a Lambda context, for invoking handlers locally."""

    function_name: str = "idle-reaper-local"
    memory_limit_in_mb: int = 256
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:idle-reaper-local"
    aws_request_id: str = "local"

    def get_remaining_time_in_millis(self) -> int:
        return 240_000  # the stack's sweep timeout at the default 5-minute schedule


def signed_request(
    path: str, body: str, secret: str, *, timestamp: int | None = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """A Lambda Function URL event carrying a form body signed the way Slack signs it (v0 HMAC-SHA256)."""
    ts = str(timestamp if timestamp is not None else int(time.time()))
    signature = "v0=" + hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {
            "content-type": "application/x-www-form-urlencoded",
            "x-slack-request-timestamp": ts,
            "x-slack-signature": signature,
            **(headers or {}),
        },
        "requestContext": {"http": {"method": "POST", "path": path, "sourceIp": "127.0.0.1"}, "stage": "$default"},
        "body": body,
        "isBase64Encoded": False,
    }


def button_click(
    user: str, action_id: str, value: str, response_url: str, secret: str = "local-signing-secret"
) -> dict[str, Any]:
    """The Function URL event of a person pressing a message's button, as Slack sends it (block_actions, signed)."""
    payload = {
        "type": "block_actions",
        "user": {"id": user},
        "actions": [{"action_id": action_id, "value": value}],
        "response_url": response_url,
    }
    return signed_request("/slack/interactions", urllib.parse.urlencode({"payload": json.dumps(payload)}), secret)


@contextmanager
def slack_environment(fake: FakeSlack, signing_secret: str = "local-signing-secret") -> Iterator[None]:
    """Point idle-reaper's Slack client at the fake (and give it a token and signing secret)."""
    import os

    values = {"SLACK_API_URL": fake.url, "SLACK_BOT_TOKEN": "xoxb-local-fake", "SLACK_SIGNING_SECRET": signing_secret}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def fake_slack() -> Iterator[FakeSlack]:
    fake = FakeSlack()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/api/"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
