"""The notebook instances' lifecycle configuration and its bucket: in the stack, within SageMaker's size limit,
publishing what the sweep reads (by the notebook instance's name), and running the activity collector only
when the object it fetches is the one agent/ ships (the script runs for real, its AWS calls against a fake
`aws` CLI or moto's S3)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from idle_reaper.core.kinds import NOTEBOOK_AGENT_KEY
from idle_reaper.policy import MetricSettings
from infra.notebooks import (
    COLLECTOR,
    FETCH_SECONDS,
    FETCH_WAIT_SECONDS,
    SCRIPT_LIMIT,
    NotebookAgent,
    agent_bucket_name,
    on_start_script,
)
from testkit.fake_jupyter import FakeJupyter

pytestmark = pytest.mark.infra

ACCOUNT = "123456789012"  # moto's
REGION = "us-east-1"
BUCKET = agent_bucket_name("idle-reaper", ACCOUNT, REGION)
ORIGINAL = COLLECTOR.read_bytes()


def of_type(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


@pytest.fixture(scope="module")
def template(synth: Any) -> dict[str, Any]:
    found: dict[str, Any] = synth.template()
    return found


@pytest.fixture(scope="module")
def script(template: dict[str, Any]) -> str:
    (config,) = [r["Properties"] for r in of_type(template, "AWS::SageMaker::NotebookInstanceLifecycleConfig").values()]
    assert config["NotebookInstanceLifecycleConfigName"] == "idle-reaper-notebook-agent", "the default keeps its name"
    assert "OnCreate" not in config, "OnStart runs at every start: a configuration attached later works too"
    (hook,) = config["OnStart"]
    assert isinstance(hook["Content"], str), "a plain string: its size is known at synth"
    assert len(hook["Content"]) <= SCRIPT_LIMIT
    return base64.b64decode(hook["Content"]).decode()


def test_the_bucket_is_private_encrypted_tls_only_versioned_and_logged(template: dict[str, Any]) -> None:
    buckets = of_type(template, "AWS::S3::Bucket")
    (agent_id,) = [k for k, b in buckets.items() if "BucketName" in b["Properties"]]
    agent = buckets[agent_id]["Properties"]
    assert agent["BucketName"] == {
        "Fn::Join": ["", ["idle-reaper-sagemaker-", {"Ref": "AWS::AccountId"}, "-", {"Ref": "AWS::Region"}]]
    }
    logs_id = agent["LoggingConfiguration"]["DestinationBucketName"]["Ref"]
    for props in (agent, buckets[logs_id]["Properties"]):
        assert props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"] == {
            "SSEAlgorithm": "AES256"
        }
        assert set(props["PublicAccessBlockConfiguration"].values()) == {True}
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    policies = {
        p["Properties"]["Bucket"]["Ref"]: p["Properties"]["PolicyDocument"]["Statement"]
        for p in of_type(template, "AWS::S3::BucketPolicy").values()
    }
    for bucket in (agent_id, logs_id):
        assert {"Bool": {"aws:SecureTransport": "false"}} in [s.get("Condition") for s in policies[bucket]]
    (read,) = [s for s in policies[agent_id] if s["Effect"] == "Allow"]
    assert read["Action"] == "s3:GetObject" and ":root" in json.dumps(read["Principal"])
    assert {"Ref": "AWS::AccountId"} in read["Principal"]["AWS"]["Fn::Join"][1], "this account only"
    assert read["Resource"]["Fn::Join"][1][1] == "/notebook-agent/*", "the collector's prefix, nothing else"


def test_the_deploy_puts_the_very_collector_whose_hash_the_script_carries(
    template: dict[str, Any], script: str
) -> None:
    (upload,) = of_type(template, "Custom::IdleReaperNotebookCollector").values()
    (bucket_id,) = [k for k, b in of_type(template, "AWS::S3::Bucket").items() if "BucketName" in b["Properties"]]
    parts = upload["Properties"]["Create"]["Fn::Join"][1]
    create = json.loads("".join(p if isinstance(p, str) else "BUCKET" for p in parts))
    assert {"Ref": bucket_id} in parts and create["parameters"]["Bucket"] == "BUCKET", "into the stack's bucket"
    assert create["action"] == "putObject" and create["parameters"]["Key"] == NOTEBOOK_AGENT_KEY
    assert create["parameters"]["Body"].encode() == ORIGINAL
    assert upload["Properties"]["Update"] == upload["Properties"]["Create"], "a new collector is put again"
    (embedded,) = set(re.findall(r"\b[0-9a-f]{64}\b", script))
    assert embedded == hashlib.sha256(ORIGINAL).hexdigest()
    assert embedded in create["physicalResourceId"]["id"], "a changed collector is a new resource: put again"
    # The provider may put that one object and nothing else; the script's configuration waits for it.
    puts = [
        s
        for p in of_type(template, "AWS::IAM::Policy").values()
        for s in p["Properties"]["PolicyDocument"]["Statement"]
        if "s3:PutObject" in json.dumps(s["Action"])
    ]
    assert [(s["Action"], s["Resource"]["Fn::Join"][1]) for s in puts] == [
        ("s3:PutObject", [{"Fn::GetAtt": [bucket_id, "Arn"]}, f"/{NOTEBOOK_AGENT_KEY}"])
    ]
    (config_id,) = of_type(template, "AWS::SageMaker::NotebookInstanceLifecycleConfig")
    upload_id = next(iter(of_type(template, "Custom::IdleReaperNotebookCollector")))
    assert upload_id in template["Resources"][config_id]["DependsOn"]


def test_a_second_stack_fetches_from_its_own_bucket_and_a_prefix_too_long_for_its_name_is_refused() -> None:
    import aws_cdk as cdk

    stack = cdk.Stack(cdk.App(), "S", env=cdk.Environment(account=ACCOUNT, region="ap-southeast-2"))
    assert 'BUCKET="idle-reaper-staging-sagemaker-$ACCOUNT-$REGION"' in on_start_script("idle-reaper-staging")
    with pytest.raises(ValueError, match="64 characters; S3 takes 63: use a prefix of at most 25 characters"):
        NotebookAgent(stack, "NotebookAgent", prefix="idle-reaper-staging-long-x")


# -- the OnStart script, run ---------------------------------------------------------------------------------

FAKE_AWS = """#!/bin/sh
# The aws CLI as far as the script uses it: `s3api get-object ... OUTFILE`, answered from files of the test.
echo "$@" > {root}/aws-args
for last; do :; done
if [ -f {root}/s3-denied ]; then
  echo "An error occurred (AccessDenied) when calling the GetObject operation: Access Denied" >&2; exit 254
fi
if [ ! -f {root}/s3-object ]; then
  echo "An error occurred (NoSuchKey) when calling the GetObject operation: The specified key does not exist." >&2
  exit 254
fi
cp {root}/s3-object "$last"
"""
# A notebook in a VPC without a route to S3: the aws CLI waits for an answer that never comes.
HANGING_AWS = """#!/bin/sh
echo $$ > {root}/aws-pid
exec sleep 600
"""
LOOP = 'while :; do "$PY" -I "$C" --state-dir "$D"; sleep 60; done'


def run(
    script: str,
    root: Path,
    *,
    name: str = "team-ml-nb",
    gpu: bool = False,
    s3_object: bytes | None = None,
    denied: bool = False,
    aws_cli: bool = True,
    aws: str = FAKE_AWS,
    background: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """The script as SageMaker runs it, its absolute paths moved under `root`: the CloudWatch agent's ctl,
    nvidia-smi and the aws CLI are stand-ins (`s3_object`: what the bucket holds, `denied`: the role may not
    read it), the notebook's conda Python is this one (boto3 included), and the collector loop is only
    logged, never started. The fetch runs in the foreground (its outcome is written before the script ends)
    unless `background`, as on a notebook."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "opt/ml/metadata").mkdir(parents=True)
    arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:notebook-instance/{name.lower()}"
    (root / "opt/ml/metadata/resource-metadata.json").write_text(json.dumps({"ResourceArn": arn, "ResourceName": name}))
    ctl = root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl"
    ctl.parent.mkdir(parents=True)
    ctl.write_text(f'#!/bin/sh\necho "$@" > {root}/ctl-args\n')
    ctl.chmod(0o755)
    conda = root / "home/ec2-user/anaconda3/envs/JupyterSystemEnv/bin/python"
    conda.parent.mkdir(parents=True)
    conda.symlink_to(sys.executable)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    if aws_cli:
        (bin_dir / "aws").write_text(aws.format(root=root))
        (bin_dir / "aws").chmod(0o755)
    if s3_object is not None:
        (root / "s3-object").write_bytes(s3_object)
    if denied:
        (root / "s3-denied").touch()
    (root / "var/log").mkdir(parents=True)
    moved = (
        script.replace("/opt/", f"{root}/opt/")
        .replace("/var/log/", f"{root}/var/log/")
        .replace("/home/ec2-user/", f"{root}/home/ec2-user/")
        .replace(LOOP, 'echo started: "$PY" -I "$C" --state-dir "$D"')
    )
    if not background:
        moved = moved.replace("< /dev/null &", "< /dev/null")
    return subprocess.run(
        ["bash", "-c", moved],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started(root: Path) -> str:
    """The collector loop, as it would have started (nothing when it did not)."""
    log = root / "var/log/idle-reaper-activity.log"
    return "".join(line for line in log.read_text().splitlines(True) if "started:" in line) if log.exists() else ""


def test_the_agent_publishes_cpu_gpu_network_and_activity_by_the_notebook_name_and_the_collector_runs(
    script: str, tmp_path: Path
) -> None:
    done = run(script, tmp_path, name="team-ml-gpu-nb", gpu=True, s3_object=ORIGINAL)
    assert done.returncode == 0, done.stderr
    assert "publishing as InstanceId=team-ml-gpu-nb" in done.stdout and "activity collector running" in done.stdout
    config = json.loads((tmp_path / "opt/idle-reaper/cloudwatch-agent.json").read_text())
    metrics = config["metrics"]
    assert metrics["namespace"] == "CWAgent" and metrics["aggregation_dimensions"] == [["InstanceId"]]
    collected = metrics["metrics_collected"]
    assert set(collected) == {"cpu", "net", "nvidia_gpu", "statsd"}
    assert all(p["append_dimensions"] == {"InstanceId": "team-ml-gpu-nb"} for p in collected.values())
    # What the sweep reads: the agent's CPU, network (settings.metrics.notebook_*) and GPU metric names.
    read = MetricSettings()
    assert read.notebook_cpu.name == "cpu_" + collected["cpu"]["measurement"][0]
    assert {read.notebook_network_in.name, read.notebook_network_out.name} == {
        "net_" + m for m in collected["net"]["measurement"]
    }
    assert read.gpu.name == "nvidia_smi_" + collected["nvidia_gpu"]["measurement"][0]
    assert (tmp_path / "ctl-args").read_text().split()[:2] == ["-a", "fetch-config"]
    # Fetched from this account's bucket, refusing a bucket of that name owned by anyone else.
    args = (tmp_path / "aws-args").read_text().split()
    assert args[:2] == ["s3api", "get-object"]
    assert {"--bucket": BUCKET, "--key": NOTEBOOK_AGENT_KEY, "--expected-bucket-owner": ACCOUNT}.items() <= dict(
        zip(args[2::2], args[3::2], strict=False)
    ).items()
    fetched = tmp_path / "opt/idle-reaper/idle_reaper_activity.py"
    assert fetched.read_bytes() == ORIGINAL
    loop = started(tmp_path)
    assert f"{sys.executable} -I {fetched} --state-dir" in loop.replace(
        str(tmp_path / "home/ec2-user/anaconda3/envs/JupyterSystemEnv/bin/python"), sys.executable
    )
    assert LOOP in script and 'nohup setsid bash -c "$FETCH"' in script and "< /dev/null &" in script
    # The fetched collector, run as the loop runs it (once, printing instead of sending), finds the notebook's
    # own Jupyter server the way SageMaker runs it: HTTPS on loopback with a self-signed certificate, no
    # token, its runtime file in ec2-user's home; a cell sent three minutes ago counts (ec2-user's IPython
    # history), the kernel's later output does not.
    home = tmp_path / "home/ec2-user"
    with sagemaker_jupyter(home, tmp_path / "tls", finished_minutes_ago=3) as requests:
        shown = subprocess.run(
            [sys.executable, "-I", str(fetched), "--print", "--home", str(home), "--state-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert shown.returncode == 0, shown.stderr
    (cell,) = [line for line in shown.stdout.splitlines() if "ipython" in line or "kernel" in line]
    assert cell.startswith("ipython history (ec2-user, ") and 3 <= float(cell.split()[-2]) < 4, shown.stdout
    assert requests and all("no_track_activity=1" in r for r in requests), "its own polls are not activity"


@contextlib.contextmanager
def sagemaker_jupyter(home: Path, tls_dir: Path, *, finished_minutes_ago: float) -> Iterator[list[str]]:
    """A Jupyter API as a notebook instance serves it (HTTPS, self-signed, no token) with one idle conda_python3
    kernel that printed a minute ago, the last cell sent to it `finished_minutes_ago` (ec2-user's IPython
    history), and its runtime file where a notebook instance's server writes it. Yields the paths it was asked."""
    printed = datetime.now(UTC) - timedelta(minutes=1)
    kernel = {
        "id": "k1",
        "name": "conda_python3",
        "execution_state": "idle",
        "last_activity": f"{printed:%Y-%m-%dT%H:%M:%S.%fZ}",
    }
    argv = ["/home/ec2-user/anaconda3/envs/python3/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    specs = {
        "default": "conda_python3",
        "kernelspecs": {"conda_python3": {"name": "conda_python3", "spec": {"argv": argv}}},
    }
    jupyter = FakeJupyter(tls_dir)
    jupyter.serve("/", "", json.dumps([kernel]).encode(), kernelspecs=json.dumps(specs).encode())
    history = home / ".ipython/profile_default/history.sqlite"
    history.parent.mkdir(parents=True)
    history.write_bytes(b"SQLite format 3\x00")
    sent = time.time() - finished_minutes_ago * 60
    os.utime(history, (sent, sent))
    runtime = home / ".local/share/jupyter/runtime"
    runtime.mkdir(parents=True)
    (runtime / f"nbserver-{os.getpid()}.json").write_text(
        json.dumps(
            {
                "base_url": "/",
                "hostname": "0.0.0.0",
                "notebook_dir": "/home/ec2-user/SageMaker",
                "password": False,
                "pid": os.getpid(),  # a live process: the collector skips the files of servers that exited
                "port": jupyter.port,
                "secure": True,
                "sock": "",
                "token": "",
                "url": f"https://ip-172-16-0-1:{jupyter.port}/",
            }
        )
    )
    try:
        yield jupyter.requests
    finally:
        jupyter.close()


@pytest.mark.parametrize(
    ("case", "s3_object", "denied", "said"),
    [
        (
            "tampered",
            ORIGINAL + b"\nimport os; os.system('id')\n",
            False,
            "is not the collector this configuration names",
        ),
        ("stale", ORIGINAL.replace(b"CAP_MINUTES = 10080", b"CAP_MINUTES = 10081"), False, "refused"),
        ("missing", None, False, "NoSuchKey"),
        ("denied", ORIGINAL, True, "AccessDenied"),
    ],
)
def test_a_collector_that_is_not_agents_or_cannot_be_fetched_never_runs_and_the_notebook_publishes_the_rest(
    script: str, tmp_path: Path, case: str, s3_object: bytes | None, denied: bool, said: str
) -> None:
    done = run(script, tmp_path / case, s3_object=s3_object, denied=denied)
    assert done.returncode == 0, done.stderr
    assert said in done.stdout and "no activity collector: CPU, GPU and network only" in done.stdout
    if s3_object is None or denied:
        assert "needs s3:GetObject" in done.stdout
    assert not started(tmp_path / case) and not (tmp_path / case / "opt/idle-reaper/idle_reaper_activity.py").exists()
    config = json.loads((tmp_path / case / "opt/idle-reaper/cloudwatch-agent.json").read_text())
    assert set(config["metrics"]["metrics_collected"]) == {"cpu", "net", "statsd"}, "no GPU plugin without nvidia-smi"
    assert (tmp_path / case / "ctl-args").exists(), "the agent still runs"


def test_without_the_aws_cli_the_notebooks_boto3_fetches_it_from_s3(script: str, tmp_path: Path, aws: Any) -> None:
    """Against moto's S3 (AWS_ENDPOINT_URL): the real boto3 call the script makes, the object there or not."""
    import boto3

    environment = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    done = run(script, tmp_path / "missing", aws_cli=False, env=environment)
    assert "cannot fetch" in done.stdout and "NoSuchKey" in done.stdout and not started(tmp_path / "missing")
    s3.put_object(Bucket=BUCKET, Key=NOTEBOOK_AGENT_KEY, Body=ORIGINAL[:-1] + b" ")
    done = run(script, tmp_path / "changed", aws_cli=False, env=environment)
    assert "refused" in done.stdout and not started(tmp_path / "changed")
    s3.put_object(Bucket=BUCKET, Key=NOTEBOOK_AGENT_KEY, Body=ORIGINAL)
    done = run(script, tmp_path / "good", aws_cli=False, env=environment)
    assert done.returncode == 0 and "activity collector running" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "good/opt/idle-reaper/idle_reaper_activity.py").read_bytes() == ORIGINAL


def test_a_fetch_that_hangs_never_holds_the_notebooks_start(script: str, tmp_path: Path) -> None:
    """SageMaker fails a notebook's start when OnStart runs past five minutes: a fetch from a VPC without a route
    to S3 must neither hold the script nor hang for ever. Its bound here is 2 s (the script's is 120 s) and the
    script waits 1 s for its outcome (30 s), so that the test takes seconds."""
    quick = script.replace(f'bounded {FETCH_SECONDS} "$AWS"', 'bounded 2 "$AWS"').replace(
        f"seq {FETCH_WAIT_SECONDS}", "seq 1"
    )
    began = time.monotonic()
    try:
        done = run(quick, tmp_path, s3_object=ORIGINAL, aws=HANGING_AWS, background=True, timeout=20)
        took = time.monotonic() - began
        assert done.returncode == 0 and took < 10, (took, done.stderr)
        assert f"goes on in the background (at most {FETCH_SECONDS} s)" in done.stdout, done.stdout
        assert "publishing as InstanceId=team-ml-nb" in done.stdout, "CPU, GPU and network are published anyway"
        # In the background, the fetch gives up at its bound and says why; the collector never runs.
        log = tmp_path / "var/log/idle-reaper-activity.log"
        deadline = time.monotonic() + 15
        while "cannot fetch" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.1)
        assert f"no answer within {FETCH_SECONDS} s: no route to S3?" in log.read_text()
        assert not started(tmp_path) and not (tmp_path / "opt/idle-reaper/idle_reaper_activity.py").exists()
        assert not Path(f"/proc/{(tmp_path / 'aws-pid').read_text().strip()}").exists(), "the hung fetch was ended"
    finally:  # a hung aws left behind (the script before its fetch was bounded) is this test's to end
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "aws-pid").read_text()), 9)


def test_a_bad_name_publishes_nothing_and_never_fails_the_start(script: str, tmp_path: Path) -> None:
    done = run(script, tmp_path, name="x'; rm -rf /", s3_object=ORIGINAL)
    assert done.returncode == 0 and "nothing published" in done.stdout
    assert not (tmp_path / "opt/idle-reaper/cloudwatch-agent.json").exists() and not started(tmp_path)


def test_the_notebook_agent_is_cdk_nag_clean_without_a_suppression(synth: Any) -> None:
    for stack in synth.stack_names:
        rows = [r for r in synth.nag_report(stack).splitlines() if f"{stack}/NotebookAgent/" in r]
        assert rows and all('"Compliant"' in r for r in rows), [r for r in rows if '"Compliant"' not in r]
