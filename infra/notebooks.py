"""The SageMaker notebook instances' lifecycle configuration and what it fetches: the CloudWatch agent (already
on every notebook instance) publishing CPU, GPU, network and the human-activity collector's metric, by
InstanceId = the notebook instance's name, the dimension the sweep reads.

SageMaker holds at most 16,384 base64 characters per script: too few for the activity collector
(agent/idle_reaper_activity.py, about 56 KB). The stack puts it into its own bucket at deploy time; the OnStart
script fetches it and runs it only when its SHA-256 is the one baked into the script at synth."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from aws_cdk import Aws, CfnOutput, Duration, RemovalPolicy, Stack, Token
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sagemaker as sagemaker
from aws_cdk import custom_resources as cr
from constructs import Construct

from idle_reaper.core.kinds import NOTEBOOK_AGENT_KEY, notebook_lifecycle_config

AGENT_DIR = Path(__file__).resolve().parents[1] / "agent"
COLLECTOR = AGENT_DIR / "idle_reaper_activity.py"
SCRIPT_LIMIT = 16_384  # SageMaker's limit on one script's base64 content
NAME_PLACEHOLDER = "__NOTEBOOK_INSTANCE_NAME__"
BUCKET_NAME_LIMIT = 63  # S3's
LONGEST_REGION = len("ap-southeast-5")  # the name is checked against the stack's own region when it is known


def agent_bucket_name(prefix: str, account: str, region: str) -> str:
    """The notebook-agent bucket's name: derived, so the OnStart script finds it from the notebook's own ARN
    (account and region) without a token in its text. "sagemaker" in it: AmazonSageMakerFullAccess, the usual
    execution-role policy, already lets a role read objects of buckets named *sagemaker*."""
    return f"{prefix}-sagemaker-{account}-{region}"


def agent_config(gpu: bool) -> dict[str, object]:
    """Every metric carries InstanceId = the notebook instance's name (set per plugin: the agent's global
    append_dimensions only knows EC2's own values), rolled up to that one dimension, as the sweep reads it.
    `net`: bytes sent and received on the notebook's interfaces (the agent's default set), each interval's bytes
    (the agent turns the kernel's counters into deltas), so a notebook's Sum per period means what EC2's
    NetworkIn/Out does. Traffic counted twice (a container's bridge and eth0) only makes it look busier."""
    name = {"InstanceId": NAME_PLACEHOLDER}
    collected: dict[str, object] = {
        "cpu": {"measurement": ["usage_active"], "totalcpu": True, "append_dimensions": name},
        "net": {"measurement": ["bytes_recv", "bytes_sent"], "append_dimensions": name},
        "statsd": {
            "service_address": "127.0.0.1:8125",
            "metrics_collection_interval": 60,
            "metrics_aggregation_interval": 60,
            "append_dimensions": name,
        },
    }
    if gpu:
        collected["nvidia_gpu"] = {
            "measurement": ["utilization_gpu"],
            "drop_original_metrics": ["utilization_gpu"],
            "append_dimensions": name,
        }
    return {
        "agent": {"metrics_collection_interval": 60},
        "metrics": {"namespace": "CWAgent", "aggregation_dimensions": [["InstanceId"]], "metrics_collected": collected},
    }


def collector_sha256(agent_dir: Path = AGENT_DIR) -> str:
    return hashlib.sha256((agent_dir / COLLECTOR.name).read_bytes()).hexdigest()


# Where the notebook's conda Python is; the system's next (the collector needs 3.9+, standard library only).
_PYTHONS = (
    "/home/ec2-user/anaconda3/envs/JupyterSystemEnv/bin/python /usr/bin/python3.12 /usr/bin/python3.11 "
    "/usr/bin/python3.10 /usr/bin/python3.9 /usr/bin/python3"
)
# The fallback fetch when no aws CLI is found: boto3 of the notebook's own Python.
_BOTO3_FETCH = (
    "import sys, boto3; o = boto3.client('s3', region_name=sys.argv[1]).get_object(Bucket=sys.argv[2], "
    "Key=sys.argv[3], ExpectedBucketOwner=sys.argv[4]); open(sys.argv[5], 'wb').write(o['Body'].read())"
)


# Bounds of the OnStart script (SageMaker fails a notebook's start when OnStart runs past five minutes): the
# CloudWatch agent's start, the collector's fetch (in the background: a notebook in a VPC without a route to S3
# waits for nothing), and how long the script waits for the fetch's outcome to show it in its own log.
AGENT_START_SECONDS = 120
FETCH_SECONDS = 120
FETCH_WAIT_SECONDS = 30
LOG = "/var/log/idle-reaper-activity.log"


def script_head() -> str:
    """The start every lifecycle script of ours shares: `say`, `bounded` and the resource's metadata file."""
    return """set -u
say() { echo "idle-reaper: $*"; }
# At most $1 seconds (SageMaker fails the start past five minutes); unbounded where the image has no timeout.
bounded() { S=$1; shift; if command -v timeout >/dev/null 2>&1; then timeout -k 5 "$S" "$@"; else "$@"; fi; }
M=/opt/ml/metadata/resource-metadata.json
"""


def find_python(pythons: str, missing: str) -> str:
    """Sets PY to the first of `pythons` that is Python 3.9+ (the collector's floor); `missing`: the words said
    when none is, and the script ends there (exit 0: never a failed start)."""
    return f"""PY=""
for p in {pythons}; do
  if [ -x "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then PY=$p; break; fi
done
if [ -z "$PY" ]; then say "no Python 3.9+: {missing}"; exit 0; fi
"""


def fetch_and_run(prefix: str, aws_clis: str, loop: str, log: str, without: str, agent_dir: Path = AGENT_DIR) -> str:
    """The collector's fetch and its loop, in the background (`nohup setsid`: the script ends whether S3 answers or
    not, and no unit manager is needed: a Studio app's container has no systemd). Needs ACCOUNT, REGION, PY and D
    set; `aws_clis`: where the aws CLI may be besides PATH; `loop`: the collector's loop; `without`: what the
    machine publishes without the collector. The script waits for the fetch's outcome at most FETCH_WAIT_SECONDS
    and repeats it in its own log; past that it says the fetch goes on, and where its outcome will be (`log`)."""
    digest = collector_sha256(agent_dir)
    return f"""BUCKET="{agent_bucket_name(prefix, "$ACCOUNT", "$REGION")}"
C="$D/idle_reaper_activity.py"
AWS=""
for a in "$(command -v aws)" {aws_clis}; do
  if [ -n "$a" ] && [ -x "$a" ]; then AWS=$a; break; fi
done
OUTCOME="$D/fetch.outcome"
rm -f "$C" "$OUTCOME"
export AWS PY REGION ACCOUNT BUCKET C D OUTCOME
# The fetch and the collector, in the background: this script ends whether S3 answers or not.
FETCH=$(cat <<'FETCH'
say() {{ echo "idle-reaper: $*" | tee -a "$OUTCOME"; }}
bounded() {{ S=$1; shift; if command -v timeout >/dev/null 2>&1; then timeout -k 5 "$S" "$@"; else "$@"; fi; }}
NOT="no activity collector: {without}"
if [ -n "$AWS" ]; then
  bounded {FETCH_SECONDS} "$AWS" s3api get-object --region "$REGION" --bucket "$BUCKET" --key {NOTEBOOK_AGENT_KEY} \\
    --expected-bucket-owner "$ACCOUNT" --cli-connect-timeout 10 --cli-read-timeout 30 "$C" > "$D/fetch.log" 2>&1
else
  bounded {FETCH_SECONDS} "$PY" -c "{_BOTO3_FETCH}" "$REGION" "$BUCKET" {NOTEBOOK_AGENT_KEY} "$ACCOUNT" "$C" \\
    > "$D/fetch.log" 2>&1
fi
CODE=$?
if [ $CODE -ne 0 ] || [ ! -s "$C" ]; then
  WHY=$(tail -c 300 "$D/fetch.log" | tr '\\n' ' ')
  if [ $CODE -eq 124 ] || [ $CODE -eq 137 ]; then WHY="no answer within {FETCH_SECONDS} s: no route to S3? $WHY"; fi
  say "cannot fetch s3://$BUCKET/{NOTEBOOK_AGENT_KEY} ($WHY): the execution role needs s3:GetObject on it; $NOT"
  rm -f "$C"; exit 0
fi
if ! echo "{digest}  $C" | sha256sum -c --quiet - >/dev/null 2>&1; then
  say "s3://$BUCKET/{NOTEBOOK_AGENT_KEY} is not the collector this configuration names (SHA-256 {digest}): \\
refused; $NOT"
  rm -f "$C"; exit 0
fi
chmod 0644 "$C"
say "activity collector running"
{loop}
FETCH
)
nohup setsid bash -c "$FETCH" >> {log} 2>&1 < /dev/null &
# Its outcome in this log too, when it comes within {FETCH_WAIT_SECONDS} s.
for _ in $(seq {FETCH_WAIT_SECONDS}); do [ -s "$OUTCOME" ] && break; sleep 1; done
if [ -s "$OUTCOME" ]; then cat "$OUTCOME"; else
  say "fetching s3://$BUCKET/{NOTEBOOK_AGENT_KEY} goes on in the background (at most {FETCH_SECONDS} s): \\
its outcome in {log}"
fi
exit 0
"""


# The resource's ARN in its metadata file, for sed.
_ARN_SED = r"""s/.*"ResourceArn" *: *"\(arn:[a-z-]*:sagemaker:[a-z0-9-]*:[0-9]\{12\}:[^"]*\)".*/\1/p"""


def account_and_region(missing: str) -> str:
    """ACCOUNT and REGION from the resource's own ARN in its metadata file (the bucket's name holds both)."""
    return f"""ARN=$(sed -n '{_ARN_SED}' $M)
if [ -z "$ARN" ]; then say "no ARN in $M: {missing}"; exit 0; fi
REGION=$(echo "$ARN" | cut -d: -f4)
ACCOUNT=$(echo "$ARN" | cut -d: -f5)
"""


NOTEBOOK_WITHOUT = "CPU, GPU and network only"
NOTEBOOK_LOOP = 'while :; do "$PY" -I "$C" --state-dir "$D"; sleep 60; done'


def on_start_script(prefix: str, agent_dir: Path = AGENT_DIR) -> str:
    """The OnStart script. It never fails the notebook's start (SageMaker marks the notebook Failed when OnStart
    fails or runs past five minutes): every step that cannot run says so in the notebook's CloudWatch log and the
    script goes on, and every step that could wait is bounded (`timeout`, where the image has it).

    The collector is fetched in the background (`nohup setsid`, its output in LOG, never the script's own
    stdout: SageMaker would wait for it), at most FETCH_SECONDS, from the stack's bucket (`agent_bucket_name`,
    the account and region read from the notebook's own ARN; `--expected-bucket-owner`: a bucket of that name in
    another account is never read), and run only when its SHA-256 is the one this script carries: a tampered,
    stale, missing or unreachable object leaves the notebook publishing CPU, GPU and network, as without the
    collector (`fetch_and_run`)."""
    with_gpu = json.dumps(agent_config(gpu=True), separators=(",", ":"))
    without_gpu = json.dumps(agent_config(gpu=False), separators=(",", ":"))
    return (
        f"""#!/bin/bash
# idle-reaper: CPU, GPU, network and human activity of this notebook instance to CloudWatch, by its name.
{script_head()}NAME=$(sed -n 's/.*"ResourceName" *: *"\\([A-Za-z0-9-]*\\)".*/\\1/p' $M)
if [ -z "$NAME" ]; then say "no notebook instance name in $M: nothing published"; exit 0; fi
D=/opt/idle-reaper
mkdir -p "$D"
if command -v nvidia-smi >/dev/null 2>&1; then CONFIG='{with_gpu}'; else CONFIG='{without_gpu}'; fi
echo "$CONFIG" | sed "s/{NAME_PLACEHOLDER}/$NAME/g" > "$D/cloudwatch-agent.json"
CTL=/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl
if [ -x "$CTL" ]; then
  bounded {AGENT_START_SECONDS} "$CTL" -a fetch-config -m ec2 -s -c "file:$D/cloudwatch-agent.json" \\
    || say "the CloudWatch agent did not start"
else
  say "no CloudWatch agent at $CTL: no metric is published, the reaper sees this notebook as unknown"
fi
say "publishing as InstanceId=$NAME"
"""
        + account_and_region(f"no activity collector: {NOTEBOOK_WITHOUT}")
        + find_python(_PYTHONS, f"no activity collector: {NOTEBOOK_WITHOUT}")
        + fetch_and_run(prefix, "/home/ec2-user/anaconda3/bin/aws", NOTEBOOK_LOOP, LOG, NOTEBOOK_WITHOUT, agent_dir)
    )


def encoded_script(script: str, what: str) -> str:
    """A lifecycle script as SageMaker holds it (base64); refused at synth when it outgrows SageMaker's limit."""
    encoded = base64.b64encode(script.encode()).decode()
    if len(encoded) > SCRIPT_LIMIT:
        raise ValueError(f"the {what} is {len(encoded)} characters base64; SageMaker takes {SCRIPT_LIMIT}")
    return encoded


def encoded_on_start(prefix: str) -> str:
    return encoded_script(on_start_script(prefix), "notebook OnStart script")


class NotebookAgent(Construct):
    """What notebook instances need to publish their signals: the lifecycle configuration an admin attaches to
    a notebook instance (it cannot be forced onto new ones: SageMaker has no mechanism; the reaper only reports
    the notebook instances without it), and the bucket its OnStart script fetches the activity collector from.

    The bucket: S3-managed encryption (a notebook's role needs no KMS grant), TLS only, no public access,
    versioned, its server access logs in a second bucket. Its policy lets this account's principals read the
    collector's prefix; each principal's own IAM policy must allow it too (docs/policy.md)."""

    def __init__(self, scope: Construct, id: str, *, prefix: str) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        region_length = LONGEST_REGION if Token.is_unresolved(stack.region) else len(stack.region)
        longest = len(agent_bucket_name(prefix, "0" * 12, "r" * region_length))
        if longest > BUCKET_NAME_LIMIT:
            raise ValueError(
                f"prefix {prefix!r} makes the notebook-agent bucket's name {longest} characters; S3 takes "
                f"{BUCKET_NAME_LIMIT}: use a prefix of at most {len(prefix) - (longest - BUCKET_NAME_LIMIT)} characters"
            )
        access_logs = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,  # the only encryption server access logging writes to
            enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=True,
            lifecycle_rules=[
                s3.LifecycleRule(expiration=Duration.days(365), noncurrent_version_expiration=Duration.days(30))
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            bucket_name=agent_bucket_name(prefix, Aws.ACCOUNT_ID, Aws.REGION),
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=True,
            server_access_logs_bucket=access_logs,
            server_access_logs_prefix="notebook-agent-bucket/",
            lifecycle_rules=[s3.LifecycleRule(noncurrent_version_expiration=Duration.days(90))],
            # Emptied and deleted by hand after the stack: it only holds what a deploy writes again.
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.bucket.add_to_resource_policy(
            iam.PolicyStatement(
                sid="ThisAccountReadsTheNotebookAgent",
                principals=[iam.AccountRootPrincipal()],
                actions=["s3:GetObject"],
                resources=[self.bucket.arn_for_objects(f"{NOTEBOOK_AGENT_KEY.rsplit('/', 1)[0]}/*")],
            )
        )
        # The collector, put at deploy time by CDK's AwsCustomResource provider (the one the stack's seeded
        # parameters use): the text in the template, one PutObject allowed on that one key. A new collector is
        # a new physical id: put again. The notebook checks what it fetches against the hash in its script.
        collector = COLLECTOR.read_bytes()
        put = cr.AwsSdkCall(
            service="S3",
            action="putObject",
            parameters={
                "Bucket": self.bucket.bucket_name,
                "Key": NOTEBOOK_AGENT_KEY,
                "Body": collector.decode(),
                "ContentType": "text/x-python",
            },
            physical_resource_id=cr.PhysicalResourceId.of(f"{NOTEBOOK_AGENT_KEY}@{collector_sha256()}"),
            logging=cr.Logging.with_data_hidden(),  # else 43 KB of collector in the provider's log
        )
        self.collector = deployment = cr.AwsCustomResource(
            self,
            "Collector",
            resource_type="Custom::IdleReaperNotebookCollector",
            on_create=put,
            on_update=put,
            policy=cr.AwsCustomResourcePolicy.from_statements(
                [
                    iam.PolicyStatement(
                        actions=["s3:PutObject"], resources=[self.bucket.arn_for_objects(NOTEBOOK_AGENT_KEY)]
                    )
                ]
            ),
            install_latest_aws_sdk=False,
        )
        self.lifecycle_config = sagemaker.CfnNotebookInstanceLifecycleConfig(
            self,
            "Config",
            notebook_instance_lifecycle_config_name=notebook_lifecycle_config(prefix),
            on_start=[
                sagemaker.CfnNotebookInstanceLifecycleConfig.NotebookInstanceLifecycleHookProperty(
                    content=encoded_on_start(prefix)
                )
            ],
        )
        # The script names the new collector's hash only once the new collector is in the bucket.
        self.lifecycle_config.node.add_dependency(deployment)
        CfnOutput(
            stack,
            "NotebookAgentObject",
            value=self.bucket.arn_for_objects(NOTEBOOK_AGENT_KEY),
            description="What a notebook instance's execution role must be allowed to s3:GetObject (docs/policy.md)",
        )
