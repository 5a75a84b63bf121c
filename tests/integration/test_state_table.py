"""The state table as DynamoDB keeps it (moto behind AWS's rules, aws_rules.py): expired items that TTL has not
deleted yet, keys a batch read leaves unprocessed, and records that grow with the fleet."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest

from idle_reaper import aws as adapters
from idle_reaper.aws.limits import Pacing
from idle_reaper.aws.state import CLAIM_TTL_DAYS, UNPROCESSED_ATTEMPTS, UnprocessedKeys

pytestmark = pytest.mark.integration
NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)


@pytest.fixture
def table(aws: Any) -> adapters.DynamoStateStore:
    client = adapters.client("dynamodb")
    adapters.create_table(client, "state")
    return adapters.DynamoStateStore(client, "state")


@pytest.fixture(params=["dynamodb", "in-memory"])
def store(request: pytest.FixtureRequest) -> Any:
    if request.param == "in-memory":
        return adapters.InMemoryStateStore()
    return request.getfixturevalue("table")


def test_an_expired_claim_ends_whether_or_not_dynamodb_has_deleted_it(store):
    """Issue 43 (9): claim_once's claim lasts CLAIM_TTL_DAYS, so a failure still there that long is told again.
    DynamoDB deletes expired items days late (moto never does): the claim must end by its expiry, not by the
    deletion. Before, the item's mere existence held it for ever, in the table and in its in-memory twin."""
    assert store.claim_once("doctor#day#2026-11-27", NOW)
    assert not store.claim_once("doctor#day#2026-11-27", NOW + timedelta(days=CLAIM_TTL_DAYS - 1))
    assert store.claim_once("doctor#day#2026-11-27", NOW + timedelta(days=CLAIM_TTL_DAYS, seconds=1))
    assert not store.claim_once("doctor#day#2026-11-27", NOW + timedelta(days=CLAIM_TTL_DAYS, seconds=2))


class _Unprocessed:
    """BatchGetItem answered by DynamoDB under load: every key left unprocessed, `times` times."""

    def __init__(self, times: int) -> None:
        self.times, self.calls = times, 0

    def __call__(self, params: dict[str, Any], **_: Any) -> Any:
        self.calls += 1
        if self.calls > 50:
            raise AssertionError("asked again 50 times without a pause")
        if self.calls > self.times:
            return None
        import json

        from botocore.awsrequest import AWSResponse

        from idle_reaper_tools.aws_rules import _Raw

        request = json.loads(params["body"])
        body = json.dumps({"Responses": {}, "UnprocessedKeys": request["RequestItems"]}).encode()
        return AWSResponse("", 200, {}, _Raw(body)), None


@pytest.fixture
def sleeps() -> Iterator[list[float]]:
    slept: list[float] = []
    saved = Pacing.sleep
    Pacing.sleep = slept.append  # type: ignore[assignment]
    try:
        yield slept
    finally:
        Pacing.sleep = saved  # type: ignore[method-assign]


def _answering(answer: _Unprocessed) -> Any:
    client = boto3.client("dynamodb")
    client.meta.events.register_first(
        "before-call.dynamodb.BatchGetItem", lambda params, **kw: _parsed(answer(params, **kw))
    )
    return client


def _parsed(answered: Any) -> Any:
    if answered is None:
        return None
    import json

    response, _ = answered
    return response, {**json.loads(response.content), "ResponseMetadata": {"HTTPStatusCode": 200}}


def test_unprocessed_keys_are_asked_again_after_a_backoff_and_not_for_ever(table, sleeps):
    """Issue 43 (8): BatchGetItem's UnprocessedKeys were asked again at once, without backoff or bound. DynamoDB
    asks for an exponential backoff: the keys are asked again after growing pauses, and after
    UNPROCESSED_ATTEMPTS the read fails whole (never a part of the records returned as if it were all)."""
    record = adapters.item_to_record({"instance_id": "i-0abc", "team": "ml", "version": 1})
    table.save(record)
    key = record.key
    twice = _Unprocessed(times=2)
    patient = adapters.DynamoStateStore(_answering(twice), "state")
    assert list(patient.load([key])) == [key], "answered on the third call"
    assert twice.calls == 3 and len(sleeps) == 2 and 0 < sleeps[0] <= 0.1 and sleeps[1] <= 0.2
    sleeps.clear()
    never = _Unprocessed(times=10**6)
    with pytest.raises(UnprocessedKeys, match="unprocessed"):
        adapters.DynamoStateStore(_answering(never), "state").load([key])
    assert never.calls == UNPROCESSED_ATTEMPTS and len(sleeps) == UNPROCESSED_ATTEMPTS - 1
