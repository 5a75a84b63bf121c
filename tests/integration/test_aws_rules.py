"""AWS's documented limits in front of moto (tools/idle_reaper_tools/aws_rules.py): each refused with AWS's own
code, message and status, through a real boto3 client, in the protocol that client speaks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from idle_reaper import aws as adapters
from idle_reaper_tools import local
from testkit.aws_rules import (
    ITEM_MAX_BYTES,
    ITEM_TOO_LARGE,
    SSM_NO_DOWNGRADE,
    SSM_TOO_LONG,
    attribute_size,
    item_size,
)

pytestmark = pytest.mark.integration
ONCE = Config(retries={"mode": "standard", "max_attempts": 1})  # a refusal is seen, not retried


def refused(call: Any, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(ClientError) as caught:
        call(**kwargs)
    return {**caught.value.response["Error"], "status": caught.value.response["ResponseMetadata"]["HTTPStatusCode"]}


def frozen(aws: Any) -> list[float]:
    """The rules' clock, set by the test."""
    now = [0.0]
    aws.rules.clock = lambda: now[0]
    return now


# ---------------------------------------------------------------------------------------------
# DynamoDB


def test_item_size_counts_names_and_values_as_dynamodb_does():
    assert attribute_size({"S": "héllo"}) == 6  # UTF-8 bytes
    assert attribute_size({"N": "123.45"}) == 1 + 3  # 5 significant digits: 3 bytes, plus 1
    assert attribute_size({"N": "-1000"}) == 1 + 1 + 1  # one significant digit, the sign
    assert attribute_size({"BOOL": True}) == attribute_size({"NULL": True}) == 1
    assert attribute_size({"L": [{"S": "ab"}, {"N": "1"}]}) == 3 + (1 + 2) + (1 + 2)
    assert attribute_size({"M": {"k": {"S": "v"}}}) == 3 + 1 + 1 + 1
    assert item_size({"pk": {"S": "a"}, "value": {"S": "xyz"}}) == 2 + 1 + 5 + 3


def test_an_item_over_400_kb_is_refused_on_every_write_path(aws):
    client = adapters.client("dynamodb")
    adapters.create_table(client, "t")
    # 409,600 bytes with its names: accepted; one more byte: refused, as DynamoDB words it.
    head = {"pk": {"S": "a"}, "sk": {"S": "b"}}
    room = ITEM_MAX_BYTES - item_size(head) - len("v")
    client.put_item(TableName="t", Item={**head, "v": {"S": "x" * room}})
    big = {**head, "v": {"S": "x" * (room + 1)}}
    assert refused(client.put_item, TableName="t", Item=big) == {
        "Code": "ValidationException",
        "Message": ITEM_TOO_LARGE,
        "status": 400,
    }
    put = {"PutRequest": {"Item": big}}
    assert refused(client.batch_write_item, RequestItems={"t": [put]})["Message"] == ITEM_TOO_LARGE
    transact = [{"Put": {"TableName": "t", "Item": big}}]
    assert refused(client.transact_write_items, TransactItems=transact)["Message"] == ITEM_TOO_LARGE
    stored = client.get_item(TableName="t", Key=head, ConsistentRead=True)["Item"]
    assert len(stored["v"]["S"]) == room, "the refused writes changed nothing"


def test_batches_hold_dynamodbs_counts(aws):
    client = adapters.client("dynamodb")
    adapters.create_table(client, "t")
    keys = [{"pk": {"S": f"k{i}"}, "sk": {"S": "s"}} for i in range(101)]
    assert refused(client.batch_get_item, RequestItems={"t": {"Keys": keys}})["Message"] == (
        "Too many items requested for the BatchGetItem call"
    )
    assert "Responses" in client.batch_get_item(RequestItems={"t": {"Keys": keys[:100]}})
    puts = [{"PutRequest": {"Item": k}} for k in keys[:26]]
    assert refused(client.batch_write_item, RequestItems={"t": puts})["Message"] == (
        "Too many items requested for the BatchWriteItem call"
    )


# ---------------------------------------------------------------------------------------------
# SSM


def test_ssm_tiers_hold_their_sizes(aws):
    ssm = adapters.client("ssm")
    standard, advanced = "x" * 4096, "x" * 8192
    ssm.put_parameter(Name="/p/standard", Value=standard, Type="String")
    assert refused(ssm.put_parameter, Name="/p/no-tier", Value=standard + "x", Type="String") == {
        "Code": "ValidationException",
        "Message": SSM_TOO_LONG,
        "status": 400,
    }
    assert refused(ssm.put_parameter, Name="/p/no-tier", Value=standard + "x", Type="String", Tier="Standard")
    ssm.put_parameter(Name="/p/advanced", Value=advanced, Type="String", Tier="Advanced")
    assert (
        "8192"
        in refused(
            ssm.put_parameter, Name="/p/advanced", Value=advanced + "x", Type="String", Tier="Advanced", Overwrite=True
        )["Message"]
    )
    # An advanced parameter stays advanced: asking for Standard is refused, no tier keeps it advanced.
    down = refused(ssm.put_parameter, Name="/p/advanced", Value="small", Type="String", Tier="Standard", Overwrite=True)
    assert down["Message"] == SSM_NO_DOWNGRADE
    ssm.put_parameter(Name="/p/advanced", Value=advanced, Type="String", Overwrite=True)
    ssm.put_parameter(Name="/p/smart", Value=standard + "x", Type="String", Tier="Intelligent-Tiering")
    tiers = {p["Name"]: p["Tier"] for p in ssm.describe_parameters()["Parameters"]}
    assert tiers["/p/advanced"] == "Advanced" and tiers["/p/standard"] == "Standard"
    assert refused(ssm.get_parameter, Name="/p/no-tier")["Code"] == "ParameterNotFound", "refused: nothing written"


def test_ssm_pages_hold_their_sizes(aws):
    ssm = adapters.client("ssm")
    found = refused(ssm.get_parameters_by_path, Path="/p/", MaxResults=11)
    assert found["Code"] == "ValidationException" and "less than or equal to 10" in found["Message"]
    assert refused(ssm.get_parameters, Names=[f"/p/{i}" for i in range(11)])["Code"] == "ValidationException"


# ---------------------------------------------------------------------------------------------
# CloudWatch: its client speaks Smithy RPC v2 CBOR; the refusals are parsed as CloudWatch's own


def test_metric_dimensions_must_be_ascii(aws):
    cloudwatch = adapters.client("cloudwatch")
    datum = {"MetricName": "m", "Value": 1.0, "Dimensions": [{"Name": "team", "Value": "données"}]}
    assert refused(cloudwatch.put_metric_data, Namespace="IdleReaper", MetricData=[datum]) == {
        "Code": "InvalidParameterValue",
        "Message": "The value for parameter MetricData.member.1.Dimensions.member.1.Value contains non-ASCII "
        "characters.",
        "status": 400,
    }
    blank = {**datum, "Dimensions": [{"Name": "team", "Value": " "}]}
    assert "non-whitespace" in refused(cloudwatch.put_metric_data, Namespace="N", MetricData=[blank])["Message"]
    cloudwatch.put_metric_data(Namespace="N", MetricData=[{**datum, "Dimensions": [{"Name": "team", "Value": "ml"}]}])


def _queries(n: int, period: int = 60) -> list[dict[str, Any]]:
    metric = {
        "Namespace": "AWS/EC2",
        "MetricName": "CPUUtilization",
        "Dimensions": [{"Name": "InstanceId", "Value": "i-1"}],
    }
    return [{"Id": f"q{i}", "MetricStat": {"Metric": metric, "Period": period, "Stat": "Maximum"}} for i in range(n)]


def test_get_metric_data_holds_its_queries_calls_and_datapoints(aws):
    cloudwatch = boto3.client("cloudwatch", config=ONCE)
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    too_many = refused(cloudwatch.get_metric_data, MetricDataQueries=_queries(501), StartTime=now, EndTime=now)
    assert (too_many["Code"], too_many["Message"], too_many["status"]) == (
        "ValidationError",
        "The collection MetricDataQueries must not have a size greater than 500.",
        400,
    )
    clock = frozen(aws)
    # 500 queries of 110 one-minute points: 55,000 datapoints a call; 180,000 a second allow three.
    window = {"StartTime": now - timedelta(minutes=110), "EndTime": now}
    for _ in range(3):
        cloudwatch.get_metric_data(MetricDataQueries=_queries(500), **window)
    throttled = refused(cloudwatch.get_metric_data, MetricDataQueries=_queries(500), **window)
    assert (throttled["Code"], throttled["Message"], throttled["status"]) == ("Throttling", "Rate exceeded", 400)
    clock[0] += 1.0  # a second later the datapoints are there again, and 50 calls (the bucket holds no more)
    for _ in range(50):
        cloudwatch.get_metric_data(MetricDataQueries=_queries(1), **window)
    assert refused(cloudwatch.get_metric_data, MetricDataQueries=_queries(1), **window)["Code"] == "Throttling"


# ---------------------------------------------------------------------------------------------
# EC2, STS, Organizations: rates


def test_ec2_buckets_answer_request_limit_exceeded(aws):
    ec2 = boto3.client("ec2", config=ONCE)
    clock = frozen(aws)
    # StopInstances: a resource bucket of 1,000 instances, 20 a second, each id of a call counting.
    ids = [local.launch(f"m{i}", "m5.large", team="ml", launch_time=datetime.now(UTC)) for i in range(3)]
    aws.rules._buckets[("123456789012", "us-east-1", "ec2:StopInstances:instances")] = _bucket(2, 20)
    assert refused(ec2.stop_instances, InstanceIds=ids)["Code"] == "RequestLimitExceeded"
    assert local.instance_states(ids) == dict.fromkeys(ids, "running"), "a throttled stop stops nothing"
    ec2.stop_instances(InstanceIds=ids[:2])
    running = [{"Name": "instance-state-name", "Values": ["running"]}]
    for _ in range(100):  # filtered: 100 tokens, 20 a second
        ec2.describe_instances(Filters=running)
    assert refused(ec2.describe_instances, Filters=running) == {
        "Code": "RequestLimitExceeded",
        "Message": "Request limit exceeded.",
        "status": 503,
    }
    for _ in range(49):  # neither a filter nor pagination: a bucket of its own, 50 tokens (instance_states: 1)
        ec2.describe_instances()
    assert refused(ec2.describe_instances)["Code"] == "RequestLimitExceeded"
    clock[0] += 1.0
    for _ in range(20):
        ec2.describe_instances(Filters=running)
    assert refused(ec2.describe_instances, Filters=running)["Code"] == "RequestLimitExceeded"


def _bucket(tokens: float, refill: float) -> Any:
    from testkit.aws_rules import TokenBucket

    return TokenBucket(capacity=1000, refill=refill, tokens=tokens, stamp=0.0)  # the frozen clock's 0


def test_sts_and_organizations_rates(aws):
    sts = boto3.client("sts", config=ONCE)
    frozen(aws)
    for _ in range(600):
        sts.get_caller_identity()
    assert refused(sts.get_caller_identity) == {
        "Code": "Throttling",
        "Message": "Rate exceeded",
        "status": 400,
        "Type": "Sender",
    }
    organizations = boto3.client("organizations", config=ONCE)
    organizations.create_organization(FeatureSet="ALL")
    for _ in range(10):
        organizations.describe_organization()
    found = refused(organizations.describe_organization)
    assert found["Code"] == "TooManyRequestsException" and found["status"] == 400
    assert "another request is already in progress" in found["Message"]
    assert refused(organizations.list_accounts, MaxResults=21)["status"] == 400


def test_a_throttle_is_retried_by_botocore_and_reset_forgets_it(aws):
    """A throttled call is retried by the client's own (adaptive) retries, as AWS's is, and answered once the
    bucket has refilled; the rules' reset refills every bucket and drops the kept clients, whose rate limiter
    remembers the throttle, so the next test's calls are not slowed."""
    from testkit.aws_rules import TokenBucket

    ec2 = adapters.client("ec2")
    running = [{"Name": "instance-state-name", "Values": ["running"]}]
    ec2.describe_instances(Filters=running)
    empty = TokenBucket(capacity=100, refill=20, tokens=0.0, stamp=aws.rules.clock())
    aws.rules._buckets[("123456789012", "us-east-1", "ec2:DescribeInstances")] = empty
    answered = ec2.describe_instances(Filters=running)
    assert answered["ResponseMetadata"]["RetryAttempts"] >= 1 and aws.rules.throttles("DescribeInstances") >= 1
    aws.reset()
    assert adapters.client("ec2") is not ec2, "the throttled client was dropped"
    assert aws.rules.throttles() == 0


def test_step_functions_keeps_execution_names(aws):
    """moto keeps Step Functions' name rules as AWS does; the rules add the input's size."""
    sfn = boto3.client("stepfunctions", config=ONCE)
    role = "arn:aws:iam::123456789012:role/sfn"
    machine = sfn.create_state_machine(
        name="m", definition='{"StartAt":"x","States":{"x":{"Type":"Pass","End":true}}}', roleArn=role
    )
    arn = machine["stateMachineArn"]
    assert refused(sfn.start_execution, stateMachineArn=arn, name="a b")["Code"] == "InvalidName"
    sfn.start_execution(stateMachineArn=arn, name="sweep-1", input="{}")
    sfn.stop_execution(executionArn=f"{arn.replace(':stateMachine:', ':execution:')}:sweep-1")
    assert (
        refused(sfn.start_execution, stateMachineArn=arn, name="sweep-1", input="{}")["Code"]
        == "ExecutionAlreadyExists"
    )
    big = '{"x":"' + "y" * 262_144 + '"}'
    assert refused(sfn.start_execution, stateMachineArn=arn, name="sweep-2", input=big)["Code"] == "ValidationException"


def test_a_world_started_inside_another_hands_the_rules_back(aws):
    """The demo starts a world of its own (moto and the rules) in a test process that has one (test_demo.py). Its
    rules judge while it runs; when it ends the outer world's rules are back for every client made after. Before,
    botocore kept the outer rules' handler (one per unique id) and ending the inner world removed it: every later
    integration test in that worker ran without AWS's rules, and one asking them how many calls they saw got 0."""
    with local.local_aws() as inner:
        adapters.client("ssm", kept=False).get_parameters_by_path(Path="/inner")
        assert inner.rules.calls["GetParametersByPath"] == 1 and aws.rules.calls["GetParametersByPath"] == 0
    adapters.client("ssm", kept=False).get_parameters_by_path(Path="/outer")
    assert aws.rules.calls["GetParametersByPath"] == 1
