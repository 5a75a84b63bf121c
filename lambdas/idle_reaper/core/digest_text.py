"""The weekly digest in words: the Slack mrkdwn text of a core.digest.Digest (docs/policy.md "The weekly digest").

Pure, like core/digest.py, whose figures it says; kept apart so the figures and the words each read in one file."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from idle_reaper.core.digest import DELETIONS, AtRisk, Digest
from idle_reaper.core.records import State
from idle_reaper.core.sections import section_text, usd

HUB_ACCOUNT = "the hub's account"  # how the digest names the hub's own account beside member accounts


def named_account(account: str, name: str | None) -> str:
    """An account as people read it: its name and id ("sandbox-a (111111111111)"), the id alone without a name."""
    name = (name or "").strip()
    return f"{name} ({account})" if name and name != account else account


def account_label(account: str | None, names: Mapping[str, str]) -> str:
    """named_account by the directory's names (an account it does not name, having left the organization, is its
    id alone), HUB_ACCOUNT for the hub's own."""
    return HUB_ACCOUNT if account is None else named_account(account, names.get(account))


def _exempt_idle_line(at_risk: Sequence[AtRisk]) -> str:
    """Exempt machines that sat idle this week (read for the digest only; never acted on)."""
    exempt = [a for a in at_risk if a.state == State.EXEMPT.value]
    if not exempt:
        return ""
    read = [a for a in exempt if a.idle_hours is not None]
    idle = sorted((a for a in read if a.idle_hours), key=lambda a: -a.idle_dollars)
    hours = sum(a.idle_hours or 0.0 for a in idle)
    dollars = sum(a.idle_dollars for a in idle)
    bound = any(a.idle_upper_bound and a.idle_dollars for a in idle)
    unread = f"; no data for {len(exempt) - len(read)}" if len(read) < len(exempt) else ""
    if not idle:
        return f"Exempt and idle: nothing ({len(read)} exempt machine(s) read{unread})."
    shown = ", ".join(f"{a.name} {a.idle_hours:g} h" for a in idle[:5])
    return f"Still wasted, exempt and idle: {usd(dollars, bound)} ({hours:g} h): {shown}{unread}."


def digest_text(d: Digest, *, redirected: bool = False, chart_note: str = "") -> str:
    """The digest as Slack mrkdwn text (team names and owners come from tags: the caller escapes nothing
    else). `redirected`: a team without a channel, posted in the admin channel. `chart_note`: why the chart
    is missing, when it is."""
    who = f"team {d.team}" if d.team else "all teams (admins)"
    head = f"*idle-reaper weekly digest: {who}, {d.week.label}* ({d.start:%Y-%m-%d} to {d.end:%Y-%m-%d %H:%M} UTC)"
    lines = [head]
    if redirected:
        lines.append(f"_Team {d.team} has no slack_channel in its policy: its digest is posted here, to the admins._")
    if not d.has_data:
        lines.append("No data for this week: idle-reaper recorded no stop, warning or answer for it.")
    else:
        lines.append(_recovered_line(d))
        lines.append(_kept_line(d))
        stops = "Stops and deletions" if DELETIONS in d.recovered else "Stops"
        lines.append(
            f"{stops}: {d.stops}, of which {d.unwanted_stops} started again within an hour (unwanted). "
            f"Warnings: {d.warnings}, of which {d.warnings_without_stop} led to no stop."
        )
        if d.suggestion:
            lines.append(f"Suggestion: {d.suggestion}")
    if d.at_risk:
        costly = sum(a.hourly_cost or 0.0 for a in d.at_risk)
        shown = ", ".join(
            f"{a.name} ({_in_account(d, a.account)}{a.state.replace('_', ' ')}"
            f"{', ' + usd(a.hourly_cost) + '/h' if a.hourly_cost else ''})"
            for a in d.at_risk[:10]
        )
        more = f" and {len(d.at_risk) - 10} more" if len(d.at_risk) > 10 else ""
        lines.append(
            f"Not watched right now ({usd(costly)}/h): {shown}{more}. Unknown: no data; safe mode: invalid policy; "
            "exempt: tagged, never acted on."
        )
        if exempt_line := _exempt_idle_line(d.at_risk):
            lines.append(exempt_line)
    if d.group_idle:
        lines.append(_group_idle_line(d))
    if d.under_used:
        shown = ", ".join(
            f"{u.name} ({_in_account(d, u.account)}{u.instance_type}, never above {u.peak:g} %: {u.smaller} would "
            f"save {usd(u.saves_hourly)}/h)"
            for u in d.under_used[:5]
        )
        lines.append(
            f"Under-used (busy, but its busiest GPU, or CPU, stayed low all week): {shown}. A suggestion only."
        )
    lines += [section_text(section) for section in d.sections]  # endpoints, ...: each kind on its own line
    if d.teams:
        lines.append(
            "By team: "
            + "; ".join(
                f"{t} saved {usd(r, any(team == t for team, _ in d.spot_in))}, "
                f"kept idle {usd(w, any(team == t for team, _ in d.spot_kept_in))}"
                for t, (r, w) in sorted(d.teams.items())
            )
        )
    if d.accounts:
        lines.append(_accounts_line(d))
    trend = [f"{t.week.label} {usd(t.recovered, t.upper_bound) if t.has_data else 'no data'}" for t in d.trend]
    lines.append("Saved, last 8 weeks: " + " · ".join(trend))
    if chart_note:
        lines.append(f"_{chart_note}_")
    return "\n".join(lines)


def _group_idle_line(d: Digest) -> str:
    """Idle Auto Scaling group members released to their group that still run: the group did not scale them in
    (its desired capacity, or its minimum size, keeps them). Nothing is saved until it does."""
    costly = sum(a.idle_hourly or 0.0 for a in d.group_idle)
    bound = any(a.idle_upper_bound and a.idle_hourly for a in d.group_idle)
    shown = ", ".join(
        f"{a.name} ({_in_account(d, a.account)}"
        f"{usd(a.idle_hourly, a.idle_upper_bound) + '/h' if a.idle_hourly else 'no known price'})"
        for a in d.group_idle[:10]
    )
    more = f" and {len(d.group_idle) - 10} more" if len(d.group_idle) > 10 else ""
    return (
        f"Idle in an Auto Scaling group, still running ({usd(costly, bound)}/h): {shown}{more}. Released to the "
        "group, which has not scaled them in: lower its desired capacity (or its minimum size) to stop paying for them."
    )


def _in_account(d: Digest, account: str | None) -> str:
    """A member machine's account before its other facts ("sandbox-a, "); nothing in a digest of the hub's
    account alone, and for the hub's own machines."""
    if not d.accounts or account is None:
        return ""
    return f"{(d.account_names.get(account) or '').strip() or account}, "


def _accounts_line(d: Digest) -> str:
    """Organization mode: the week's money per account, and the machines not watched in each."""
    not_watched: dict[str | None, int] = defaultdict(int)
    for a in d.at_risk:
        not_watched[a.account] += 1
    parts = []
    for account in sorted(d.accounts, key=lambda a: (a is not None, account_label(a, d.account_names))):
        recovered, wasted = d.accounts[account]
        unwatched = f", {not_watched[account]} not watched" if not_watched[account] else ""
        bound, kept_bound = (any(a == account for _, a in spots) for spots in (d.spot_in, d.spot_kept_in))
        parts.append(
            f"{account_label(account, d.account_names)} saved {usd(recovered, bound)}, "
            f"kept idle {usd(wasted, kept_bound)}{unwatched}"
        )
    return "By account: " + "; ".join(parts)


def _recovered_line(d: Digest) -> str:
    if not d.recovered:
        return "Saved: $0.00 (no stops this week)."
    parts = [
        f"{r.count} {word} ({r.hours:,.1f} h, {usd(r.dollars, r.upper_bound)})"
        for word, r in sorted(d.recovered.items())
    ]
    unpriced = f"; {d.unpriced_hours:,.1f} h more at no known price" if d.unpriced_hours else ""
    hours = "hours stopped or deleted" if DELETIONS in d.recovered else "machine-hours"
    total = f"*{usd(d.recovered_dollars, d.recovered_upper_bound)}* over {d.recovered_hours:,.1f} {hours}"
    spot = " (up to: Spot machines' savings at the most they can be; idle-reaper does not read Spot prices)"
    # Other kinds' deletions are counted here as deletions; their own lines say what each saved.
    kinds = ", ".join(f"{s.label} {usd(s.saved_dollars, s.upper_bound)}" for s in d.sections if s.saved_dollars)
    others = f"; of it, {kinds} (each kind's own line below)" if kinds else ""
    return f"Saved: {total}: {', '.join(parts)}{unpriced}{others}{spot if d.recovered_upper_bound else ''}."


def _kept_line(d: Digest) -> str:
    if not d.kept:
        return "Kept idle by answers: nothing."
    owners = ", ".join(
        f"{k.owner}: {k.keeps} keep(s), {k.hours:,.1f} h, {usd(k.dollars, k.upper_bound)}" for k in d.kept[:5]
    )
    more = f" and {len(d.kept) - 5} more owners" if len(d.kept) > 5 else ""
    total = usd(d.kept_dollars, d.kept_upper_bound)
    return f"Still wasted, kept idle by answers: {total} ({d.kept_hours:,.1f} h). {owners}{more}."
