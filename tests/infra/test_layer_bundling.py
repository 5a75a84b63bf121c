"""The dependency layer, bundled for real (no Docker): wheels for Lambda's arm64 Python 3.12 from
uv.lock, without what the runtime already ships. Needs the Python package index (or uv's cache)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_lambda as lambda_

from infra.bundling import REPO_ROOT, RUNTIME_PROVIDED, dependency_layer_code, export_requirements

pytestmark = pytest.mark.infra

ELF_MACHINE_AARCH64 = 183


def bundle_layer(outdir: Path) -> Path:
    app = cdk.App(outdir=str(outdir))  # bundling on, as in `make synth`
    stack = cdk.Stack(app, "LayerOnly")
    lambda_.LayerVersion(stack, "Dependencies", code=dependency_layer_code(REPO_ROOT))
    app.synth()
    assets = json.loads((outdir / "LayerOnly.assets.json").read_text())
    [path] = [a["source"]["path"] for a in assets["files"].values() if a["source"]["path"].startswith("asset.")]
    return outdir / path / "python"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# One test, so that pytest-xdist never bundles twice.
def test_layer_is_built_for_lambda_arm64_python312_from_the_lock_without_boto3(tmp_path: Path) -> None:
    layer = bundle_layer(tmp_path)

    # pydantic-core's compiled extension is for Linux aarch64 and CPython 3.12.
    [extension] = (layer / "pydantic_core").glob("_pydantic_core*.so")
    assert extension.name == "_pydantic_core.cpython-312-aarch64-linux-gnu.so"
    header = extension.read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", header, 18)[0] == ELF_MACHINE_AARCH64
    [wheel] = layer.glob("pydantic_core-*.dist-info/WHEEL")
    tags = re.findall(r"^Tag: (.+)$", wheel.read_text(), flags=re.MULTILINE)
    assert tags and all(t.startswith("cp312-cp312-manylinux") and t.endswith("aarch64") for t in tags)

    # Exactly the locked runtime requirements, minus what the Lambda runtime ships.
    installed = dict(d.name.removesuffix(".dist-info").rsplit("-", 1) for d in layer.glob("*.dist-info"))
    exported = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", export_requirements(REPO_ROOT), flags=re.MULTILINE)
    assert {normalized(n): v for n, v in installed.items()} == {normalized(n): v for n, v in exported}
    assert {"aws-lambda-powertools", "pydantic", "pydantic-core", "slack-sdk"} <= {normalized(n) for n in installed}
    for name in RUNTIME_PROVIDED:
        assert normalized(name) not in {normalized(n) for n in installed}
    assert not (layer / "boto3").exists() and not (layer / "botocore").exists()
    assert not list(layer.rglob("*.pyc"))  # no bytecode: the runtime compiles for its own Python
