"""The weekly digest against moto and the local Slack fake: the handler posts one digest with its chart per
destination through Slack's external upload flow, however many invocations overlap; a failed upload posts the
text alone and says so."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from test_accounts import denied, org, real_sts  # noqa: F401  (org: the organization fixture)

from idle_reaper import aws as reaper_aws
from idle_reaper.core.digest import claim_key, running_again_entry, week_of
from idle_reaper.handlers import digest
from idle_reaper.policy import Settings, TeamPolicy
from idle_reaper_tools import local
from idle_reaper_tools.fake_slack import BOT_USER, LambdaContextStub

pytestmark = pytest.mark.integration

CTX = LambdaContextStub(function_name="idle-reaper-digest")


@pytest.fixture
def last_week(aws: object, slack: Any) -> datetime:
    """An account whose digests are due now (digest time Monday 00:00 UTC), with one stop last week."""
    settings = Settings(admin_channel="C0ADMIN", default_policy=TeamPolicy(digest_time="00:00"))
    local.init_account(settings=settings, teams={"ml": '{"slack_channel": "C0ML"}'})
    start, _ = week_of(datetime.now(UTC)).previous().span()
    store = reaper_aws.DynamoStateStore(reaper_aws.client("dynamodb"), reaper_aws.table_name())
    stopped, back = start + timedelta(days=2), start + timedelta(days=2, hours=5)
    entry = {"action": "stop", "team": "ml", "owner": "ada", "hourly_savings": 1.006, "error": None}
    store.audit("i-0abc", stopped, entry)
    store.audit("i-0abc", back, running_again_entry("i-0abc", "ml", "ada", "g5.xlarge", back))
    return start


def test_one_digest_with_its_chart_per_destination_when_invocations_overlap(last_week: datetime, slack: Any) -> None:
    barrier = threading.Barrier(3)
    results: list[dict[str, Any]] = []

    def invoke() -> None:
        barrier.wait()
        results.append(digest.handler({}, CTX))

    threads = [threading.Thread(target=invoke) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(d["destination"] for r in results for d in r["digests"]) == ["admins", "ml"]
    assert len(slack.calls_to("files.getUploadURLExternal")) == 2
    assert len(slack.calls_to("files.completeUploadExternal")) == 2
    for channel in ("C0ML", "C0ADMIN"):
        [message] = slack.messages_in(channel)
        [file_id] = message["files"]
        assert slack.files[file_id]["data"].startswith(b"\x89PNG") and slack.files[file_id]["channel"] == channel
        assert "*$5.03*" in message["text"]  # 5 h at $1.006
    assert not slack.calls_to("chat.postMessage")
    assert digest.handler({}, CTX) == {"digests": []}  # sent for this week


def test_a_failed_upload_posts_the_text_alone_and_says_so(last_week: datetime, slack: Any) -> None:
    slack.upload_fails = True
    outcomes = digest.handler({}, CTX)["digests"]
    assert {(d["destination"], d["with_chart"]) for d in outcomes} == {("admins", False), ("ml", False)}
    assert not slack.calls_to("files.completeUploadExternal")
    texts = {c.params["channel"]: c.params["text"] for c in slack.calls_to("chat.postMessage")}
    assert set(texts) == {"C0ML", "C0ADMIN"}
    assert all("without its chart: the chart could not be uploaded" in t and "$5.03" in t for t in texts.values())


def test_the_fake_completes_only_files_that_were_uploaded(slack: Any) -> None:
    """The fake is as strict as Slack's documented flow: an announced file never uploaded is not shared."""
    client = WebClient(token="xoxb-test", base_url=slack.url)
    slack.channels["C0ML"] = [BOT_USER]  # sharing a file into a channel needs the bot in it (not_in_channel)
    got = client.files_getUploadURLExternal(filename="chart.png", length=4)
    assert str(got["upload_url"]).startswith(slack.url.removesuffix("api/") + "upload/")
    with pytest.raises(SlackApiError, match="file_not_found"):
        client.files_completeUploadExternal(files=[{"id": got["file_id"], "title": "chart"}], channel_id="C0ML")
    with pytest.raises(SlackApiError, match="invalid_arguments"):
        client.files_getUploadURLExternal(filename="chart.png", length=0)
    done = client.files_upload_v2(channel="C0ML", content=b"\x89PNG", filename="c.png", initial_comment="hi")
    assert done["file"]["name"] == "c.png" and slack.messages_in("C0ML")[0]["text"] == "hi"


def test_in_organization_mode_the_digest_names_each_account_and_reads_exempt_machines_in_their_own(
    last_week: datetime,
    slack: Any,
    org: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler names member accounts from Organizations (one that has left, by its id); an exempt member
    machine's week is read through its account's read role (member_metrics with the digest's sessions), never
    with the hub's CloudWatch, and an account whose role is refused leaves its machine "no data"."""
    import json

    from idle_reaper.aws.accounts import MemberAccess, MemberCredentials
    from idle_reaper.core.records import machine_key
    from idle_reaper.slack.digest import DigestSender
    from idle_reaper.slack.notifier import load_secrets, make_client
    from idle_reaper.sweep.digest import DigestAccounts, member_metrics, send_week_digests

    region = "us-east-1"
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [region], "hubAccount": local.ACCOUNT}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    training, sandbox, gone = org.accounts["training"], org.accounts["alice-sandbox"], "444444444444"
    store = reaper_aws.DynamoStateStore(reaper_aws.client("dynamodb"), reaper_aws.table_name())
    stopped, back = last_week + timedelta(days=3), last_week + timedelta(days=3, hours=2)
    for account, hourly in ((training, 2.0), (gone, 1.0)):
        key = machine_key("i-0abc", account, region)  # the hub's own i-0abc stopped too (the fixture)
        store.audit(key, stopped, {"action": "stop", "team": "ml", "hourly_savings": hourly, "error": None})
        store.audit(key, back, running_again_entry(key, "ml", "ada", "g5.xlarge", back))
    digest.handler({}, CTX)
    [admins] = slack.messages_in("C0ADMIN")
    line = next(x for x in admins["text"].splitlines() if x.startswith("By account: "))
    assert line == (
        "By account: the hub's account saved $5.03, kept idle $0.00; 444444444444 saved $2.00, kept idle $0.00; "
        f"training ({training}) saved $4.00, kept idle $0.00"
    )

    # Exempt machines: the same id in the hub (busy all week), in training (idle all week), in alice's sandbox
    # (its role refused).
    members = MemberAccess.from_environment("sweep")
    assert members is not None
    held = members.sessions.credentials(training, region)
    assert isinstance(held, MemberCredentials)
    for cloudwatch, cpu in ((reaper_aws.client("cloudwatch"), 90.0), (held.client("cloudwatch"), 1.0)):
        put_week_of_cpu(cloudwatch, "i-0exempt", last_week, cpu)
    now = last_week + timedelta(days=7, minutes=30)
    save_exempt_boxes(store, {None: "hub-box", training: "training-box", sandbox: "sandbox-box"}, region, now)
    for destination in ("admins", "ml"):  # sent once above: claimed for the week
        store.release_claim(claim_key(destination, week_of(last_week)))
    sts = real_sts({sandbox: denied(sandbox)})
    refused = MemberAccess(members.config, members.directory, members.config.sessions("digest", members.directory, sts))
    sent = send_week_digests(
        store,
        reaper_aws.PolicyStore(reaper_aws.client("ssm"), reaper_aws.ssm_prefix()),
        DigestSender(make_client(load_secrets().bot_token, 60.0)),
        week_of(last_week),
        now,
        metrics=reaper_aws.MetricsReader(reaper_aws.client("cloudwatch")),
        accounts=lambda: DigestAccounts({training: "training"}, member_metrics(refused, now)),
        render=lambda *_: b"\x89PNG fake",
    )
    assert {o.destination for o in sent} == {"admins", "ml"}
    ml = slack.messages_in("C0ML")[-1]["text"]
    # training's machine idle all week (168 h at $0.096); the hub's busy; alice's not read: no data.
    assert f"Still wasted, exempt and idle: ${168 * 0.096:,.2f} (168 h): training-box 168 h; no data for 1." in ml


def put_week_of_cpu(cloudwatch: Any, instance_id: str, start: datetime, cpu: float) -> None:
    """Five-minute CPU datapoints over the week from `start` (and an hour before it)."""
    t, points = start - timedelta(hours=1), []
    while t < start + timedelta(days=7):
        dims = [{"Name": "InstanceId", "Value": instance_id}]
        points.append({"MetricName": "CPUUtilization", "Dimensions": dims, "Timestamp": t, "Value": cpu})
        t += timedelta(minutes=5)
    for i in range(0, len(points), 1000):
        cloudwatch.put_metric_data(Namespace="AWS/EC2", MetricData=points[i : i + 1000])


def save_exempt_boxes(store: Any, names: dict[str | None, str], region: str, now: datetime) -> None:
    """An exempt m5.large `i-0exempt` of team ml, running at `now`, in each account (None: the hub's own)."""
    from idle_reaper.core import MachineRecord, State

    for account, name in names.items():
        record = MachineRecord(
            "i-0exempt",
            "ml",
            State.EXEMPT,
            name=name,
            instance_type="m5.large",
            updated_at=now,
            account=account,
            region=region if account else None,
        )
        assert store.save(record)


def test_the_digest_reads_member_exempt_machines_through_the_read_role_and_an_account_without_it_is_no_data(
    last_week: datetime,
    slack: Any,
    org: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hourly handler, end to end: each member account's exempt machine is read in its own account and region
    through the read role (`<prefix>-digest-read-<region>`, session `<prefix>-digest-...`), never the member role
    and never the hub's CloudWatch. An account whose StackSet update has not added the read role yet (its member
    role is there) answers AccessDenied, as AWS does for a missing role: its machine is "no data", the other
    accounts have their figures, and the digest goes out."""
    import boto3

    from idle_reaper.aws.accounts import (
        DIGEST_READS_KEY,
        MemberCredentials,
        MemberSessions,
        Reason,
        last_member_check,
    )
    from idle_reaper.organization import member_read_role_name, member_role_name

    region = "us-east-1"
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": [region], "hubAccount": local.ACCOUNT}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    training, sandbox = org.accounts["training"], org.accounts["alice-sandbox"]
    # Each member account as its member stack made it, in moto's IAM of that account: training has both roles,
    # alice's sandbox the member role only. Credentials in each from moto's STS, made before the answers below.
    operator = MemberSessions(reaper_aws.client("sts"), prefix="idle-reaper", purpose="sweep")
    held = {a: operator.credentials(a, region) for a in (training, sandbox)}
    trust = json.dumps({"Version": "2012-10-17", "Statement": []})
    for account, names in (
        (training, [member_role_name("idle-reaper", region), member_read_role_name("idle-reaper", region)]),
        (sandbox, [member_role_name("idle-reaper", region)]),
    ):
        creds = held[account]
        assert isinstance(creds, MemberCredentials)
        for name in names:
            creds.client("iam").create_role(RoleName=name, AssumeRolePolicyDocument=trust)
    iam_of = {a: c.client("iam") for a, c in held.items() if isinstance(c, MemberCredentials)}

    # AWS's answer where moto accepts anything: AccessDenied for a role that does not exist in that account.
    assumed: list[tuple[str, str]] = []

    def only_existing_roles(params: dict[str, Any], **_: Any) -> None:
        arn, account = params["RoleArn"], params["RoleArn"].split(":")[4]
        assumed.append((arn, params["RoleSessionName"]))
        names = {r["RoleName"] for r in iam_of[account].list_roles()["Roles"]} if account in iam_of else set()
        if arn.rsplit("/", 1)[1] not in names:
            raise denied(account)

    events = boto3._get_default_session().events  # the handler's STS client is made after this
    events.register("provide-client-params.sts.AssumeRole", only_existing_roles, unique_id="only-existing-roles")
    try:
        # The same instance id everywhere: busy in the hub, idle all week in training and in alice's sandbox.
        put_week_of_cpu(reaper_aws.client("cloudwatch"), "i-0exempt", last_week, 90.0)
        for account in (training, sandbox):
            creds = held[account]
            assert isinstance(creds, MemberCredentials)
            put_week_of_cpu(creds.client("cloudwatch"), "i-0exempt", last_week, 1.0)
        store = reaper_aws.DynamoStateStore(reaper_aws.client("dynamodb"), reaper_aws.table_name())
        now = datetime.now(UTC)
        save_exempt_boxes(store, {None: "hub-box", training: "training-box", sandbox: "sandbox-box"}, region, now)
        result = digest.handler({}, CTX)
    finally:
        events.unregister("provide-client-params.sts.AssumeRole", unique_id="only-existing-roles")

    assert {d["destination"] for d in result["digests"]} == {"admins", "ml"}
    ml = slack.messages_in("C0ML")[-1]["text"]
    # training's machine idle all week (168 h at $0.096) read in training; the hub's busy one is not wasted; alice's
    # sandbox (no read role) is not read at all, least of all with the hub's CloudWatch (which says busy).
    assert f"Still wasted, exempt and idle: ${168 * 0.096:,.2f} (168 h): training-box 168 h; no data for 1." in ml
    # Only the read role, one AssumeRole per account and region, each session named for the digest.
    read_role = member_read_role_name("idle-reaper", region)
    assert sorted(arn for arn, _ in assumed) == sorted(
        f"arn:aws:iam::{a}:role/{read_role}" for a in (training, sandbox)
    )
    assert all(session.startswith("idle-reaper-digest-") for _, session in assumed), assumed
    # What the doctor is told: alice's sandbox refused, as AWS answered (a missing role: AccessDenied).
    kept = last_member_check(store, now, key=DIGEST_READS_KEY)
    assert kept is not None and kept.checked == tuple(sorted((training, sandbox))) and kept.units == 1
    assert [(f.account, f.region, f.reason) for f in kept.failures] == [(sandbox, region, Reason.ROLE_MISSING)]
