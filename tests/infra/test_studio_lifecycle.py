"""SageMaker Studio's lifecycle configurations (infra/studio.py): one for JupyterLab, one for Code Editor, in the
stack within SageMaker's size limit, their ARNs out; the script, run for real (its paths moved under a test
directory, the aws CLI a stand-in, as test_notebook_lifecycle.py runs the notebooks'), names the app by the machine
id the sweep reads and starts the collector in its Studio mode; and that collector, run for real against moto's
CloudWatch, publishes what the sweep's own reader reads back as the app's CPU, network and person signals."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from test_notebook_lifecycle import ACCOUNT, BUCKET, FAKE_AWS, ORIGINAL, REGION, of_type

from idle_reaper.core.kinds import NOTEBOOK_AGENT_KEY
from idle_reaper.core.studio import studio_id
from idle_reaper.policy import MetricSettings
from infra.notebooks import SCRIPT_LIMIT
from infra.studio import STUDIO_LOOP, studio_script

pytestmark = pytest.mark.infra

APP = studio_id("d-abc123xyz", "alice-space", "JupyterLab", "default")


@pytest.fixture(scope="module")
def template(synth: Any) -> dict[str, Any]:
    found: dict[str, Any] = synth.template()
    return found


def test_the_stack_ships_one_configuration_per_app_type_and_outputs_their_arns(template: dict[str, Any]) -> None:
    configs = of_type(template, "AWS::SageMaker::StudioLifecycleConfig")
    props = {c["Properties"]["StudioLifecycleConfigAppType"]: c["Properties"] for c in configs.values()}
    assert {t: p["StudioLifecycleConfigName"] for t, p in props.items()} == {
        "JupyterLab": "idle-reaper-studio-jupyterlab",
        "CodeEditor": "idle-reaper-studio-codeeditor",
    }
    for config in props.values():
        content = config["StudioLifecycleConfigContent"]
        assert isinstance(content, str) and len(content) <= SCRIPT_LIMIT, "a plain string: its size known at synth"
        assert base64.b64decode(content).decode() == studio_script("idle-reaper")
    (upload,) = of_type(template, "Custom::IdleReaperNotebookCollector")
    assert all(upload in c["DependsOn"] for c in configs.values()), "the script names the collector in the bucket"
    outputs = template["Outputs"]
    for app_type in props:
        (config_id,) = [k for k, c in configs.items() if c["Properties"]["StudioLifecycleConfigAppType"] == app_type]
        value = outputs[f"Studio{app_type}LifecycleConfigArn"]["Value"]
        assert value == {"Fn::GetAtt": [config_id, "StudioLifecycleConfigArn"]}


def run_studio(root: Path, metadata: dict[str, str], *, loop: str, env: dict[str, str] | None = None) -> Any:
    """The script as Studio runs it (as the image's user, no systemd), its paths under `root`: the app's metadata
    file, SageMaker Distribution's Python (this one), the aws CLI a stand-in answering with agent/'s collector; the
    collector's loop replaced by `loop`, in the foreground."""
    (root / "opt/ml/metadata").mkdir(parents=True)
    (root / "opt/ml/metadata/resource-metadata.json").write_text(json.dumps(metadata, indent=1))
    (root / "opt/conda/bin").mkdir(parents=True)
    (root / "opt/conda/bin/python").symlink_to(sys.executable)
    (root / "bin").mkdir()
    (root / "bin/aws").write_text(FAKE_AWS.format(root=root))
    (root / "bin/aws").chmod(0o755)
    (root / "s3-object").write_bytes(ORIGINAL)
    script = (
        studio_script("idle-reaper")
        .replace("/opt/", f"{root}/opt/")
        .replace("/var/tmp/", f"{root}/var/tmp/")
        .replace(STUDIO_LOOP, loop)
        .replace("< /dev/null &", "< /dev/null")
    )
    return subprocess.run(
        ["bash", "-c", script],
        env={"PATH": f"{root}/bin:/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def studio_metadata(app_type: str = "JupyterLab") -> dict[str, str]:
    """/opt/ml/metadata/resource-metadata.json of a space's app, as Studio writes it (more keys than these)."""
    return {
        "AppType": app_type,
        "DomainId": "d-abc123xyz",
        "UserProfileName": "",
        "SpaceName": "alice-space",
        "ResourceArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:app/d-abc123xyz/alice-space/{app_type.lower()}/default",
        "ResourceName": "default",
        "AppImageVersion": "",
    }


def test_the_script_names_the_app_by_its_machine_id_and_starts_the_collector_in_studio_mode(tmp_path: Path) -> None:
    echo = 'echo started: "$PY" -I "$C" --state-dir "$D" --cloudwatch "$ID" --region "$REGION"'
    done = run_studio(tmp_path, studio_metadata(), loop=echo)
    assert done.returncode == 0, done.stderr
    assert f"publishing as InstanceId={APP}" in done.stdout and "activity collector running" in done.stdout
    args = (tmp_path / "aws-args").read_text().split()
    assert {"--bucket": BUCKET, "--key": NOTEBOOK_AGENT_KEY, "--expected-bucket-owner": ACCOUNT}.items() <= dict(
        zip(args[2::2], args[3::2], strict=False)
    ).items()
    fetched = tmp_path / "var/tmp/idle-reaper/idle_reaper_activity.py"
    assert fetched.read_bytes() == ORIGINAL
    log = (tmp_path / "var/tmp/idle-reaper/activity.log").read_text()
    assert f"-I {fetched} --state-dir {fetched.parent} --cloudwatch {APP} --region {REGION}" in log
    code_editor = run_studio(tmp_path / "ce", studio_metadata("CodeEditor"), loop=echo)
    assert (
        f"--cloudwatch {APP.replace('JupyterLab', 'CodeEditor')} "
        in (tmp_path / "ce/var/tmp/idle-reaper/activity.log").read_text()
    ), code_editor.stdout


def test_a_resource_that_is_not_a_spaces_app_publishes_nothing_and_never_fails_the_start(tmp_path: Path) -> None:
    notebook = {"ResourceArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:notebook-instance/nb", "ResourceName": "nb"}
    for case, metadata in (("notebook", notebook), ("injected", {**studio_metadata(), "SpaceName": "x'; rm -rf /"})):
        done = run_studio(tmp_path / case, metadata, loop="echo started")
        assert done.returncode == 0 and "not a space's Studio app" in done.stdout, done.stdout + done.stderr
        assert not (tmp_path / case / "aws-args").exists() and not (tmp_path / case / "var/tmp/idle-reaper").exists()


def test_the_collector_publishes_what_the_sweep_reads_back_as_the_apps_signals(tmp_path: Path, aws: Any) -> None:
    """Two runs of the real collector (the loop's command, once each), with the real boto3 against moto's CloudWatch;
    read back by the sweep's own reader (aws/metrics.py) with the app among its agent-published machines."""
    import boto3

    from idle_reaper.aws.metrics import MetricsReader

    once = (
        f'"$PY" -I "$C" --state-dir "$D" --cloudwatch "$ID" --region "$REGION" --home {tmp_path} '
        f"--utmp {tmp_path}/no-utmp --dev-root {tmp_path}/no-dev"
    )
    environment = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    began = datetime.now(UTC)
    for run in ("first", "second"):
        root = tmp_path / run
        done = run_studio(root, studio_metadata(), loop=once, env=environment)
        assert done.returncode == 0 and "activity collector running" in done.stdout, done.stdout + done.stderr
        if run == "first":  # the next run's interval starts from this run's sample
            (tmp_path / "second/var/tmp/idle-reaper").mkdir(parents=True)
            state = root / "var/tmp/idle-reaper/machine.json"
            (tmp_path / "second/var/tmp/idle-reaper/machine.json").write_text(state.read_text())
    signals = MetricsReader(boto3.client("cloudwatch", region_name=REGION)).fetch(
        [APP],
        MetricSettings(period_seconds=60),
        start=began - timedelta(minutes=5),
        end=datetime.now(UTC) + timedelta(minutes=1),
        network=True,
        gpu=False,
        notebooks={APP},
    )[APP]
    assert signals.cpu and 0 <= signals.cpu[-1][1] <= 100
    assert signals.network_in and signals.network_out
    assert signals.user, "the person signal, by the same InstanceId"
