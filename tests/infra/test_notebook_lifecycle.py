"""The notebook instances' lifecycle configuration: in the stack, within SageMaker's size limit, publishing
what the sweep reads (by the notebook instance's name) and carrying the collector that agent/ ships."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from idle_reaper.core.kinds import NOTEBOOK_LIFECYCLE_CONFIG
from idle_reaper.policy import MetricSettings
from infra.notebooks import AGENT_DIR, COLLECTOR_ON_VOLUME, SCRIPT_LIMIT

pytestmark = pytest.mark.infra


@pytest.fixture(scope="module")
def script(synth: Any) -> str:
    (config,) = [
        r["Properties"]
        for r in synth.template()["Resources"].values()
        if r["Type"] == "AWS::SageMaker::NotebookInstanceLifecycleConfig"
    ]
    assert config["NotebookInstanceLifecycleConfigName"] == NOTEBOOK_LIFECYCLE_CONFIG
    assert "OnCreate" not in config, "OnStart runs at every start: a configuration attached later works too"
    (hook,) = config["OnStart"]
    assert len(hook["Content"]) <= SCRIPT_LIMIT
    return base64.b64decode(hook["Content"]).decode()


def run(
    script: str, root: Path, name: str, *, gpu: bool, collector: bytes | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The script as SageMaker runs it, its absolute paths moved under `root`; the CloudWatch agent's ctl and
    nvidia-smi are stand-ins, `collector` what an admin put on the ML volume, and the collector loop is
    only logged, never started."""
    if collector is not None:
        on_volume = root / COLLECTOR_ON_VOLUME.lstrip("/")
        on_volume.parent.mkdir(parents=True)
        on_volume.write_bytes(collector)
    (root / "opt/ml/metadata").mkdir(parents=True)
    (root / "opt/ml/metadata/resource-metadata.json").write_text(
        json.dumps({"ResourceArn": "arn:aws:sagemaker:us-east-1:1:notebook-instance/x", "ResourceName": name})
    )
    ctl = root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl"
    ctl.parent.mkdir(parents=True)
    ctl.write_text(f'#!/bin/sh\necho "$@" > {root}/ctl-args\n')
    ctl.chmod(0o755)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    (root / "var/log").mkdir(parents=True)
    moved = (
        script.replace("/opt/", f"{root}/opt/")
        .replace("/var/log/", f"{root}/var/log/")
        .replace("/home/ec2-user/SageMaker/", f"{root}/home/ec2-user/SageMaker/")
        .replace("nohup setsid sh -c", "echo started:")
        .replace("< /dev/null &", "< /dev/null")  # in the foreground: written before the script ends
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["bash", "-c", moved], env=env, capture_output=True, text=True, timeout=60), root


def test_the_agent_publishes_cpu_gpu_and_activity_by_the_notebook_name(script: str, tmp_path: Path) -> None:
    original = (AGENT_DIR / "idle_reaper_activity.py").read_bytes()
    done, root = run(script, tmp_path, "team-ml-gpu-nb", gpu=True, collector=original)
    assert done.returncode == 0, done.stderr
    assert "publishing as InstanceId=team-ml-gpu-nb" in done.stdout
    config = json.loads((root / "opt/idle-reaper/cloudwatch-agent.json").read_text())
    metrics = config["metrics"]
    assert metrics["namespace"] == "CWAgent" and metrics["aggregation_dimensions"] == [["InstanceId"]]
    collected = metrics["metrics_collected"]
    assert set(collected) == {"cpu", "nvidia_gpu", "statsd"}
    assert all(p["append_dimensions"] == {"InstanceId": "team-ml-gpu-nb"} for p in collected.values())
    # What the sweep reads: the agent's CPU (settings.metrics.notebook_cpu) and GPU metric names.
    read = MetricSettings()
    assert read.notebook_cpu.name == "cpu_" + collected["cpu"]["measurement"][0]
    assert read.gpu.name == "nvidia_smi_" + collected["nvidia_gpu"]["measurement"][0]
    assert (root / "ctl-args").read_text().split()[:2] == ["-a", "fetch-config"]
    assert "started: while" in (root / "var/log/idle-reaper-activity.log").read_text()
    assert "nohup setsid" in script and "< /dev/null &" in script, "on a notebook the loop runs in the background"
    assert (root / "opt/idle-reaper/idle_reaper_activity.py").read_bytes() == original


def test_no_gpu_plugin_without_nvidia_smi_no_unknown_collector_and_a_bad_name_publishes_nothing(
    script: str, tmp_path: Path
) -> None:
    changed = (AGENT_DIR / "idle_reaper_activity.py").read_bytes() + b"\nimport os; os.system('id')\n"
    done, root = run(script, tmp_path / "cpu", "cpu-nb", gpu=False, collector=changed)
    assert done.returncode == 0, done.stderr
    config = json.loads((root / "opt/idle-reaper/cloudwatch-agent.json").read_text())
    assert set(config["metrics"]["metrics_collected"]) == {"cpu", "statsd"}
    # A collector that is not the one agent/ ships is never run (nor one that is missing).
    assert "CPU and GPU only" in done.stdout and not (root / "var/log/idle-reaper-activity.log").exists()
    # A name the metadata gives that is not a notebook name: nothing written, the start never fails.
    done, root = run(script, tmp_path / "bad", "x'; rm -rf /", gpu=False)
    assert done.returncode == 0 and "nothing published" in done.stdout
    assert not (root / "opt/idle-reaper/cloudwatch-agent.json").exists()
