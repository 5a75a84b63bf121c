"""Organization mode: each sweep makes sure the hub can work in every member account and region, and says so
when it cannot (issue 30). The sweep does not yet read or act on machines there; this is the part that finds
the accounts, holds their credentials for the sweep, and reports the accounts it cannot reach."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from idle_reaper.aws.accounts import AccountFailure, MemberAccess, MemberCheck, Reason, save_member_check
from idle_reaper.notify import logger as logger  # re-exported: handlers log through it
from idle_reaper.sweep.adapters import Adapters, alert_once


def check_member_accounts(adapters: Adapters, members: MemberAccess, now: datetime) -> list[str]:
    """List the enrolled accounts (cached an hour), hold credentials in each (account, region) (reused while
    valid), keep what failed for `status`, and tell the admins at most once a day per account that cannot be
    reached, with the reason. Returns the lines for the sweep's log. A side job: one account's failure never
    stops the others, and nothing here ever takes the sweep down."""
    try:
        listing = members.directory.current()
        pairs = [(a.id, r) for a in listing.accounts for r in members.config.regions]
        held = members.sessions.all_credentials(pairs, started=now)
        failures = [f for f in held.values() if isinstance(f, AccountFailure)]
        check = MemberCheck(
            checked_at=now,
            accounts=len(listing.accounts),
            units=len(pairs) - len(failures),
            failures=(*failures, *listing.skipped),
            listing_error=listing.error,
            listed_at=listing.listed_at,
        )
        save_member_check(adapters.store, check, now)
        settings, _ = adapters.policies.load_settings()
    except Exception as exc:  # contained: the sweep goes on, the next one checks again
        logger.warning("member accounts not checked", extra={"error": str(exc)})
        return [f"could not check the member accounts: {exc}; the next sweep tries again"]
    names = {a.id: a.name for a in listing.accounts}
    lines = [f"member accounts: {check.accounts} accounts, credentials in {check.units} of {len(pairs)} regions"]
    if listing.error:
        lines.append(f"the member accounts could not be listed ({listing.error}); using the last listing")
        alert_once(
            adapters,
            f"member-listing#{now:%Y-%m-%d}",
            f"idle-reaper could not list the organization's member accounts ({listing.error}); it works with the "
            "last listing it has. Check the hub's access to AWS Organizations.",
            settings,
            now,
        )
    by_account: dict[str, list[AccountFailure]] = defaultdict(list)
    for failure in failures:
        by_account[failure.account].append(failure)
    for account, found in sorted(by_account.items()):
        text = "; ".join(f.describe() for f in found)
        lines.append(text)
        reasons = sorted({f.reason.value for f in found})
        alert_once(
            adapters,
            f"member-account#{account}#{now:%Y-%m-%d}",
            f"idle-reaper cannot work in member account {account} {names.get(account, '')!r} "
            f"({', '.join(reasons)}): {text}. Its machines are not looked at until this is fixed; the other "
            "accounts are not affected.",
            settings,
            now,
        )
    # Accounts listed as suspended are shown in `status`, not alerted: closing an account is a choice.
    lines += [f"account {s.account} left out: {s.detail}" for s in listing.skipped if s.reason is Reason.SUSPENDED]
    return lines
