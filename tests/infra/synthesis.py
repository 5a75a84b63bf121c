"""The app synthesized as `make synth` builds it, for the infra tests (shared through conftest's `synth`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk

from infra.stack import build

REPO_ROOT = Path(__file__).resolve().parents[2]
REGIONS = ("eu-west-1", "us-east-2")
ALARM_EMAIL = "ops@example.com"


@dataclass(frozen=True)
class Synth:
    outdir: Path
    stack_names: tuple[str, ...]

    def template(self, stack_name: str | None = None) -> dict[str, Any]:
        template: dict[str, Any] = json.loads(
            (self.outdir / f"{stack_name or self.stack_names[0]}.template.json").read_text()
        )
        return template

    def metadata(self, stack_name: str) -> dict[str, list[dict[str, Any]]]:
        """Where cdk-nag's findings land: beside the template, or in the manifest (older CDK)."""
        path = self.outdir / f"{stack_name}.metadata.json"
        if path.exists():
            metadata: dict[str, list[dict[str, Any]]] = json.loads(path.read_text())
            return metadata
        manifest = json.loads((self.outdir / "manifest.json").read_text())
        found: dict[str, list[dict[str, Any]]] = manifest["artifacts"][stack_name].get("metadata", {})
        return found

    def nag_report(self, stack_name: str) -> str:
        """cdk-nag names its report after the CloudFormation stack name, which every region's stack shares
        (IdleReaperProps.stack_name): the report of the last region synthesized."""
        manifest = json.loads((self.outdir / "manifest.json").read_text())
        cfn_name = manifest["artifacts"][stack_name]["properties"].get("stackName", stack_name)
        return (self.outdir / f"AwsSolutions--{cfn_name}-NagReport.csv").read_text()


def synthesize(outdir: Path, **context: Any) -> Synth:
    """The app as `make synth` builds it (cdk.json's context), without bundling."""
    defaults = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    app = cdk.App(context={**defaults, "aws:cdk:bundling-stacks": [], **context}, outdir=str(outdir))
    stacks = build(app)
    app.synth()
    return Synth(outdir=outdir, stack_names=tuple(s.artifact_id for s in stacks))
