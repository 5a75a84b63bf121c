"""The app synthesized as `make synth` builds it, for the infra tests (shared through conftest's `synth`)."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
    import aws_cdk as cdk  # starts jsii: only in a test that synthesizes

    from infra.stack import build

    defaults = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    app = cdk.App(context={**defaults, "aws:cdk:bundling-stacks": [], **context}, outdir=str(outdir))
    stacks = build(app)
    app.synth()
    return Synth(outdir=outdir, stack_names=tuple(s.artifact_id for s in stacks))


def shared_synth(tmp_path_factory: pytest.TempPathFactory, name: str, **context: object) -> Synth:
    """The app synthesized once per run with `context`.

    Under pytest-xdist every worker has its own session: the first one synthesizes, under a lock,
    into a directory all workers of this run share, and the others read what it wrote."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return synthesize(tmp_path_factory.mktemp(f"{name}-cdk.out"), **context)
    run_dir = tmp_path_factory.getbasetemp().parent  # pytest-N/, shared by this run's workers
    outdir, done = run_dir / f"{name}-cdk.out", run_dir / f"{name}-cdk.out.stacks.json"
    with open(run_dir / f"{name}-cdk.out.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(synthesize(outdir, **context).stack_names))
    return Synth(outdir=outdir, stack_names=tuple(json.loads(done.read_text())))


def made_synth(outdir: Path) -> Synth:
    """What `make test` synthesized into `outdir` (the cdk CLI, with the Makefile's TEST_SYNTH_CONTEXT), checked to
    be the app with the infra tests' context: a stack per region of REGIONS, in that order, and the alarm e-mail
    subscribed. Anything else is a Makefile that drifted from these tests: said, not silently synthesized anew."""
    manifest = json.loads((outdir / "manifest.json").read_text())
    stacks = {
        artifact["environment"].rsplit("/", 1)[-1]: name
        for name, artifact in manifest["artifacts"].items()
        if artifact["type"] == "aws:cloudformation:stack"
    }
    if sorted(stacks) != sorted(REGIONS):
        raise AssertionError(f"{outdir} holds stacks for {sorted(stacks)}, not the infra tests' {sorted(REGIONS)}")
    made = Synth(outdir=outdir, stack_names=tuple(stacks[region] for region in REGIONS))
    for name in made.stack_names:
        subscriptions = [
            r["Properties"].get("Endpoint")
            for r in made.template(name)["Resources"].values()
            if r["Type"] == "AWS::SNS::Subscription"
        ]
        if ALARM_EMAIL not in subscriptions:
            raise AssertionError(f"{outdir}/{name} does not subscribe {ALARM_EMAIL}: not the infra tests' context")
    return made
