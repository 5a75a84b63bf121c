#!/usr/bin/env python3
"""CDK entry point: `make synth`, `make deploy` (see docs/deploying.md).

Stack properties come from CDK context (cdk.json or `-c key=value`): scheduleMinutes, alarmEmail,
regions (one stack per region, e.g. `-c regions=us-east-1,eu-west-1`), ssmPrefix, managedTagKey,
gpuAgentTagKey, gpuAgentTagValue.
"""

import aws_cdk as cdk

from infra.stack import build

app = cdk.App()
build(app)
app.synth()
