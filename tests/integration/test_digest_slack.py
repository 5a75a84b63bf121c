"""The weekly digest against moto and the local Slack fake: the handler posts one digest with its chart per
destination through Slack's external upload flow, however many invocations overlap; a failed upload posts the
text alone and says so."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from idle_reaper import aws as reaper_aws
from idle_reaper.core.digest import running_again_entry, week_of
from idle_reaper.handlers import digest
from idle_reaper.policy import Settings, TeamPolicy
from idle_reaper_tools import local
from idle_reaper_tools.fake_slack import LambdaContextStub

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
    got = client.files_getUploadURLExternal(filename="chart.png", length=4)
    assert str(got["upload_url"]).startswith(slack.url.removesuffix("api/") + "upload/")
    with pytest.raises(SlackApiError, match="file_not_found"):
        client.files_completeUploadExternal(files=[{"id": got["file_id"], "title": "chart"}], channel_id="C0ML")
    with pytest.raises(SlackApiError, match="invalid_arguments"):
        client.files_getUploadURLExternal(filename="chart.png", length=0)
    done = client.files_upload_v2(channel="C0ML", content=b"\x89PNG", filename="c.png", initial_comment="hi")
    assert done["file"]["name"] == "c.png" and slack.messages_in("C0ML")[0]["text"] == "hi"
