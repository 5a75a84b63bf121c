"""Why a Slack call failed, and whether retrying can help: a transient failure leaves the message pending (the next
sweep tries again), a permanent one is told to the admins with what they must do (slack.notifier, slack.posting)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from slack_sdk.errors import SlackApiError, SlackClientError, SlackObjectFormationError

from idle_reaper.slack.blocks import fit

# ---------------------------------------------------------------------------------------------
# Failures
#
# A failure is either transient (Slack down, 5xx, 429 beyond the time budget, a timeout: the warning
# stays pending and the next sweep tries again) or permanent: it fails the same way until a person
# changes something, so it is raised as PermanentDeliveryFailure with what an admin must do, instead of
# being retried in silence. A rejected token or a missing scope is a configuration fault: transient for
# the warning (every pending warning goes out once the admin fixes the secret, so none is given up), but
# logged as an ERROR, since an admin alert through Slack would fail the same way.

# Error code -> what an admin must do; {target} is the channel or user.
_TARGET_FAULTS = {
    "not_in_channel": "the bot is not in channel {target}: invite it there (/invite @idle-reaper). A private "
    "channel always needs the invite; a public one the bot joins by itself unless the app lacks the channels:join "
    "scope (reinstall it from slack/manifest.yml)",
    "method_not_supported_for_channel_type": "channel {target} is private: the bot cannot join it, invite it there "
    "(/invite @idle-reaper)",
    "channel_not_found": "channel {target} does not exist or the bot cannot see it (a private channel needs "
    "an invite): check the channel id (slack_channel in the team policy, admin_channel in settings)",
    "is_archived": "channel {target} is archived: unarchive it or set another channel in the policy",
    "is_inactive": "channel {target} is archived or frozen: its messages cannot be edited",
    "restricted_action": "the workspace does not let the bot post in {target}: ask a Slack admin",
    "user_not_found": "Slack user {target} does not exist: fix the Owner tag it comes from",
    "user_disabled": "Slack user {target} is deactivated: fix the Owner tag it comes from",
    "cannot_dm_bot": "Slack user {target} is a bot and cannot get a DM: fix the Owner tag it comes from",
    "message_not_found": "the message in {target} was deleted; it cannot be updated",
    "cant_update_message": "the message in {target} cannot be updated by the bot",
    "edit_window_closed": "the message in {target} is too old to be edited",
}
# Slack refused the message itself: fitting should make this impossible, so it is a bug to report.
_MESSAGE_FAULTS = frozenset(
    {"msg_too_long", "invalid_blocks", "invalid_blocks_format", "no_text", "too_many_attachments", "invalid_arguments"}
)
CONFIG_FAULTS = frozenset(
    {
        "invalid_auth",
        "not_authed",
        "token_revoked",
        "token_expired",
        "account_inactive",
        "missing_scope",
        "not_allowed_token_type",
        "team_access_not_granted",
        "ekm_access_denied",
    }
)


class HeldBack(SlackClientError):
    """Not posted, and Slack not asked: its turn under the workspace's posting rate would come too late
    (slack.posting.POST_WAIT_SECONDS). It passes: the next sweep posts it."""


@dataclass(frozen=True)
class SlackFault:
    """Why a Slack call failed, and whether retrying can help. `answered`: Slack answered with a refusal (HTTP 200,
    ok false), so the call did nothing. `lost`: the call may have been carried out and its answer lost (a timeout,
    a dropped connection, an HTTP 5xx): a post is looked for before it is made again."""

    code: str
    permanent: bool
    advice: str
    answered: bool = False
    lost: bool = False
    target: str = ""  # the channel or user the call was for


def classify(exc: Exception, target: str) -> SlackFault:
    """Sort a failed Slack call (to `target`, a channel or user id) into permanent or transient."""
    return replace(_classify(exc, target), target=target)


def _classify(exc: Exception, target: str) -> SlackFault:
    if isinstance(exc, SlackObjectFormationError | ValueError):
        return SlackFault(
            "unbuildable", True, f"the message could not be built ({fit(str(exc), 300)}): a bug in idle-reaper"
        )
    if isinstance(exc, HeldBack):
        return SlackFault("held_back", False, f"{exc}; retried")
    if not isinstance(exc, SlackApiError):
        name = type(exc).__name__
        return SlackFault(name, False, f"Slack unreachable or its answer lost ({name}); retried", lost=True)
    status = int(getattr(exc.response, "status_code", 200))
    code = str(exc.response.get("error") or f"http_{status}")
    answered = status == 200
    if code in _TARGET_FAULTS:
        return SlackFault(code, True, _TARGET_FAULTS[code].format(target=target), answered=answered)
    if code in _MESSAGE_FAULTS:
        advice = f"Slack refused the message for {target} ({code}): a bug in idle-reaper"
        return SlackFault(code, True, advice, answered=answered)
    if code in CONFIG_FAULTS:
        advice = f"Slack rejects the bot token ({code}): fix the Slack secret or reinstall the app"
        if code == "missing_scope":
            needed = exc.response.get("needed")
            advice = f"the app lacks the Slack scope {needed or 'a call needs'} ({code}): reinstall it"
        return SlackFault(code, False, advice + " (with the scopes of slack/manifest.yml)", answered=answered)
    # 5xx, 429 beyond the time budget, ratelimited, internal_error, and codes we do not know: retrying is
    # the safe side, and the stop waits for the warning (up to undelivered_warning_max_minutes). A 5xx may
    # have done what it was asked (Slack posted, then failed to answer): lost.
    return SlackFault(code, False, f"Slack answered {code}; retried", answered=answered, lost=status >= 500)
