"""SageMaker Studio's lifecycle configurations: one for JupyterLab apps, one for Code Editor apps, the same script.

A Studio app runs in a container: no CloudWatch agent, no systemd, and the script runs as the image's user
(sagemaker-user in SageMaker Distribution images), not root. So the script fetches the activity collector from the
notebook agent's bucket (infra/notebooks.py's pieces: the same object, the same SHA-256 check, the same background
fetch) and runs it in its Studio mode (`--cloudwatch`), in a `nohup setsid` loop once a minute: the collector
publishes CPU, network, the busiest GPU and its person gauge itself, with PutMetricData, by InstanceId = the app's
machine id (core/studio.studio_id), the one dimension the sweep reads for an app. The app's identity comes from
its metadata file (/opt/ml/metadata/resource-metadata.json: DomainId, SpaceName, AppType, ResourceName = the app's
name, ResourceArn = account and region). Studio runs a lifecycle script at most five minutes (its
LifecycleConfigOnStart log stream, /aws/sagemaker/studio <domain>/<space>/<type>/default/LifecycleConfigOnStart);
this one never fails an app's start, and waits at most FETCH_WAIT_SECONDS.

https://docs.aws.amazon.com/sagemaker/latest/dg/jl-lcc.html (16,384 characters a script),
https://docs.aws.amazon.com/sagemaker/latest/dg/jl-lcc-debug.html (its log, its five minutes)."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import CfnOutput, Stack
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from idle_reaper.core.studio import APP_SETTINGS, studio_lifecycle_config
from infra.notebooks import (
    AGENT_DIR,
    account_and_region,
    encoded_script,
    fetch_and_run,
    find_python,
    script_head,
)

# SageMaker Distribution's Python (boto3 in it: the collector's Studio mode publishes with it), then the system's.
STUDIO_PYTHONS = "/opt/conda/bin/python /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3.10 /usr/bin/python3"
# Not the home directory: that is the space's storage, kept across apps; /var/tmp is the app's own.
STUDIO_DIR = "/var/tmp/idle-reaper"
STUDIO_LOG = f"{STUDIO_DIR}/activity.log"
STUDIO_LOOP = 'while :; do "$PY" -I "$C" --state-dir "$D" --cloudwatch "$ID" --region "$REGION"; sleep 60; done'
STUDIO_WITHOUT = "nothing published, the reaper sees this app as unknown"


def studio_script(prefix: str, agent_dir: Path = AGENT_DIR) -> str:
    """The Studio lifecycle script (JupyterLab and Code Editor alike). Without the collector an app publishes
    nothing at all (no agent beside it): it stays unknown, never idle."""
    return (
        f"""#!/bin/bash
# idle-reaper: CPU, GPU, network and human activity of this Studio app to CloudWatch, by its machine id.
{script_head()}field() {{ sed -n "s/.*\\"$1\\" *: *\\"\\([A-Za-z0-9-]*\\)\\".*/\\1/p" $M | head -n 1; }}
DOMAIN=$(field DomainId); SPACE=$(field SpaceName); TYPE=$(field AppType); APP=$(field ResourceName)
if [ -z "$DOMAIN" ] || [ -z "$SPACE" ] || [ -z "$TYPE" ] || [ -z "$APP" ]; then
  say "not a space's Studio app in $M (DomainId, SpaceName, AppType, ResourceName): {STUDIO_WITHOUT}"; exit 0
fi
ID="studio:$DOMAIN:$SPACE:$TYPE:$APP"
export ID
D={STUDIO_DIR}
if ! mkdir -p "$D"; then say "cannot create $D: {STUDIO_WITHOUT}"; exit 0; fi
say "publishing as InstanceId=$ID"
"""
        + account_and_region(STUDIO_WITHOUT)
        + find_python(STUDIO_PYTHONS, STUDIO_WITHOUT)
        + fetch_and_run(prefix, "/opt/conda/bin/aws", STUDIO_LOOP, STUDIO_LOG, STUDIO_WITHOUT, agent_dir)
    )


def encoded_studio_script(prefix: str) -> str:
    """The script as StudioLifecycleConfigContent holds it: base64, at most SCRIPT_LIMIT characters (refused at
    synth past that; https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateStudioLifecycleConfig.html)."""
    return encoded_script(studio_script(prefix), "Studio lifecycle script")


class StudioAgent(Construct):
    """The two Studio lifecycle configurations an admin attaches to a domain (docs/policy.md: its
    BuiltInLifecycleConfigArn, or LifecycleConfigArns and DefaultResourceSpec.LifecycleConfigArn, in
    DefaultUserSettings' JupyterLabAppSettings and CodeEditorAppSettings). `collector`: the notebook agent's upload,
    which each configuration waits for (it names that collector's hash). Their ARNs are stack outputs."""

    def __init__(self, scope: Construct, id: str, *, prefix: str, collector: Construct) -> None:
        super().__init__(scope, id)
        content = encoded_studio_script(prefix)
        self.configs: dict[str, sagemaker.CfnStudioLifecycleConfig] = {}
        for app_type in APP_SETTINGS:
            config = sagemaker.CfnStudioLifecycleConfig(
                self,
                app_type,
                studio_lifecycle_config_name=studio_lifecycle_config(prefix, app_type),
                studio_lifecycle_config_app_type=app_type,
                studio_lifecycle_config_content=content,
            )
            config.node.add_dependency(collector)
            self.configs[app_type] = config
            CfnOutput(
                Stack.of(self),
                f"Studio{app_type}LifecycleConfigArn",
                value=config.attr_studio_lifecycle_config_arn,
                description=f"Attach to the Studio domain's {app_type} apps (docs/policy.md, SageMaker Studio apps)",
            )
