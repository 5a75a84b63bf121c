"""The SageMaker notebook instances' lifecycle configuration: the CloudWatch agent (already on every notebook
instance) publishing CPU, GPU and the human-activity collector's metric, by InstanceId = the notebook
instance's name, the dimension the sweep reads.

SageMaker holds at most 16,384 base64 characters per script: too few for the activity collector
(agent/idle_reaper_activity.py), which the script runs from the notebook's ML storage volume instead."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from idle_reaper.core.kinds import NOTEBOOK_LIFECYCLE_CONFIG

AGENT_DIR = Path(__file__).resolve().parents[1] / "agent"
SCRIPT_LIMIT = 16_384  # SageMaker's limit on one script's base64 content
# Where an admin copies agent/idle_reaper_activity.py (the ML storage volume survives stops; root owns it).
COLLECTOR_ON_VOLUME = "/home/ec2-user/SageMaker/.idle-reaper/idle_reaper_activity.py"
NAME_PLACEHOLDER = "__NOTEBOOK_INSTANCE_NAME__"


def agent_config(gpu: bool) -> dict[str, object]:
    """Every metric carries InstanceId = the notebook instance's name (set per plugin: the agent's global
    append_dimensions only knows EC2's own values), rolled up to that one dimension, as the sweep reads it."""
    name = {"InstanceId": NAME_PLACEHOLDER}
    collected: dict[str, object] = {
        "cpu": {"measurement": ["usage_active"], "totalcpu": True, "append_dimensions": name},
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


def on_start_script(agent_dir: Path = AGENT_DIR) -> str:
    """The OnStart script. It never fails the notebook's start (SageMaker would mark the notebook Failed):
    every step that cannot run says so in the notebook's CloudWatch log and the script goes on.

    The collector (about 43 KB, 12 KB base64'd gzip even without docstrings) does not fit in SageMaker's
    16,384 base64 characters next to the rest, so the script runs the copy an admin puts on the notebook's ML
    storage volume (COLLECTOR_ON_VOLUME, kept across stops) when its SHA-256 is the one agent/ ships."""
    digest = hashlib.sha256((agent_dir / "idle_reaper_activity.py").read_bytes()).hexdigest()
    with_gpu = json.dumps(agent_config(gpu=True), separators=(",", ":"))
    without_gpu = json.dumps(agent_config(gpu=False), separators=(",", ":"))
    return f"""#!/bin/bash
# idle-reaper: CPU, GPU and human activity of this notebook instance to CloudWatch, by its name.
set -u
say() {{ echo "idle-reaper: $*"; }}
NAME=$(sed -n 's/.*"ResourceName" *: *"\\([A-Za-z0-9-]*\\)".*/\\1/p' /opt/ml/metadata/resource-metadata.json)
if [ -z "$NAME" ]; then say "no notebook instance name in /opt/ml/metadata: nothing published"; exit 0; fi
D=/opt/idle-reaper
mkdir -p "$D"
if command -v nvidia-smi >/dev/null 2>&1; then CONFIG='{with_gpu}'; else CONFIG='{without_gpu}'; fi
echo "$CONFIG" | sed "s/{NAME_PLACEHOLDER}/$NAME/g" > "$D/cloudwatch-agent.json"
CTL=/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl
if [ -x "$CTL" ]; then
  "$CTL" -a fetch-config -m ec2 -s -c "file:$D/cloudwatch-agent.json" || say "the CloudWatch agent did not start"
else
  say "no CloudWatch agent at $CTL: no metric is published, the reaper sees this notebook as unknown"
fi
say "publishing as InstanceId=$NAME"
C={COLLECTOR_ON_VOLUME}
if ! echo "{digest}  $C" | sha256sum -c --quiet - >/dev/null 2>&1; then
  say "no activity collector at $C (or not the version idle-reaper ships): CPU and GPU only"; exit 0
fi
install -m 0644 "$C" "$D/idle_reaper_activity.py"
PY=""
for p in /home/ec2-user/anaconda3/envs/JupyterSystemEnv/bin/python /usr/bin/python3.12 /usr/bin/python3.11 \\
         /usr/bin/python3.10 /usr/bin/python3.9 /usr/bin/python3; do
  if [ -x "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then PY=$p; break; fi
done
if [ -z "$PY" ]; then say "no Python 3.9+: the activity collector does not run"; exit 0; fi
nohup setsid sh -c "while :; do '$PY' -I '$D/idle_reaper_activity.py'; sleep 60; done" \\
  >> /var/log/idle-reaper-activity.log 2>&1 < /dev/null &
say "activity collector running"
"""


class NotebookLifecycleConfig(Construct):
    """The lifecycle configuration an admin attaches to a notebook instance (it cannot be forced onto new
    ones: SageMaker has no mechanism); the reaper only reports the notebook instances without it."""

    def __init__(self, scope: Construct, id: str) -> None:
        super().__init__(scope, id)
        script = on_start_script()
        encoded = base64.b64encode(script.encode()).decode()
        if len(encoded) > SCRIPT_LIMIT:
            raise ValueError(
                f"the notebook OnStart script is {len(encoded)} characters base64; SageMaker takes {SCRIPT_LIMIT}"
            )
        self.resource = sagemaker.CfnNotebookInstanceLifecycleConfig(
            self,
            "Config",
            notebook_instance_lifecycle_config_name=NOTEBOOK_LIFECYCLE_CONFIG,
            on_start=[
                sagemaker.CfnNotebookInstanceLifecycleConfig.NotebookInstanceLifecycleHookProperty(content=encoded)
            ],
        )
