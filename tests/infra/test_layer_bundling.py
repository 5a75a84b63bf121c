"""The dependency layers, bundled for real (no Docker): wheels for Lambda's arm64 Python 3.12 from
uv.lock, without what the runtime already ships; the shared layer without Pillow, which only the weekly
digest's function has, in a layer of its own. Needs the Python package index (or uv's cache).

Under `make test` the layers read are the ones its synth bundled (the app's own stack, as `make synth` bundles
it; the Makefile removes the synth's directory first, so they are bundled by this checkout's code): bundling them
again here cost a jsii start and a uv install, about 5 s. Without that synth, the test bundles them itself."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_lambda as lambda_
from synthesis import Synth

from infra.bundling import CHART_PACKAGES, REPO_ROOT, RUNTIME_PROVIDED, dependency_layer_code, export_requirements

pytestmark = pytest.mark.infra

ELF_MACHINE_AARCH64 = 183


def bundle_layers(outdir: Path) -> tuple[Path, Path]:
    """The shared layer's and the chart layer's `python/` directories, bundled as `make synth` bundles them."""
    app = cdk.App(outdir=str(outdir))  # bundling on, as in `make synth`
    stack = cdk.Stack(app, "LayerOnly")
    shared = lambda_.LayerVersion(stack, "Dependencies", code=dependency_layer_code(REPO_ROOT))
    chart = lambda_.LayerVersion(stack, "Chart", code=dependency_layer_code(REPO_ROOT, only=CHART_PACKAGES))
    app.synth()
    template = json.loads((outdir / "LayerOnly.template.json").read_text())["Resources"]

    def staged(layer: lambda_.LayerVersion) -> Path:
        key = template[stack.get_logical_id(layer.node.default_child)]["Properties"]["Content"]["S3Key"]
        return outdir / f"asset.{key.removesuffix('.zip')}" / "python"

    return staged(shared), staged(chart)


def installed_packages(layer: Path) -> dict[str, str]:
    found = dict(d.name.removesuffix(".dist-info").rsplit("-", 1) for d in layer.glob("*.dist-info"))
    return {normalized(n): v for n, v in found.items()}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def made_layers(synth: Synth) -> tuple[Path, Path]:
    """The shared layer's and the chart layer's `python/` directories as `make test`'s synth bundled them."""
    resources = synth.template()["Resources"]
    layers = {i: r["Properties"] for i, r in resources.items() if r["Type"] == "AWS::Lambda::LayerVersion"}
    [chart] = [i for i in layers if i.startswith("ChartDependencies")]
    [shared] = [i for i in layers if i.startswith("Dependencies")]

    def staged(logical_id: str) -> Path:
        key = layers[logical_id]["Content"]["S3Key"]
        directory = synth.outdir / f"asset.{key.removesuffix('.zip')}" / "python"
        assert directory.is_dir(), f"{synth.outdir} holds no bundled {logical_id}: synthesized without bundling?"
        return directory

    return staged(shared), staged(chart)


# One test, so that pytest-xdist never bundles twice.
def test_layers_are_built_for_lambda_arm64_python312_from_the_lock_without_boto3_and_pillow_apart(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    made = os.environ.get("IDLE_REAPER_TEST_SYNTH")  # conftest's MADE_SYNTH: the `synth` fixture reads it
    layer, chart = made_layers(request.getfixturevalue("synth")) if made else bundle_layers(tmp_path)

    # pydantic-core's compiled extension is for Linux aarch64 and CPython 3.12.
    [extension] = (layer / "pydantic_core").glob("_pydantic_core*.so")
    assert extension.name == "_pydantic_core.cpython-312-aarch64-linux-gnu.so"
    header = extension.read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", header, 18)[0] == ELF_MACHINE_AARCH64
    [wheel] = layer.glob("pydantic_core-*.dist-info/WHEEL")
    tags = re.findall(r"^Tag: (.+)$", wheel.read_text(), flags=re.MULTILINE)
    assert tags and all(t.startswith("cp312-cp312-manylinux") and t.endswith("aarch64") for t in tags)

    # Exactly the locked runtime requirements, minus what the Lambda runtime ships and the chart's Pillow.
    installed = installed_packages(layer)
    exported = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", export_requirements(REPO_ROOT), flags=re.MULTILINE)
    assert installed == {normalized(n): v for n, v in exported}
    assert {"aws-lambda-powertools", "pydantic", "pydantic-core", "slack-sdk"} <= set(installed)
    for name in (*RUNTIME_PROVIDED, "pillow"):
        assert normalized(name) not in installed
    assert not (layer / "boto3").exists() and not (layer / "botocore").exists() and not (layer / "PIL").exists()
    assert not list(layer.rglob("*.pyc"))  # no bytecode: the runtime compiles for its own Python

    # The chart layer: Pillow alone, at its locked version, built for Linux aarch64 and CPython 3.12.
    locked = re.search(r'name = "pillow"\nversion = "([^"]+)"', (REPO_ROOT / "uv.lock").read_text())
    assert locked and installed_packages(chart) == {"pillow": locked[1]}
    [imaging] = (chart / "PIL").glob("_imaging.*.so")
    assert imaging.name == "_imaging.cpython-312-aarch64-linux-gnu.so"
    assert struct.unpack_from("<H", imaging.read_bytes()[:20], 18)[0] == ELF_MACHINE_AARCH64
    assert not list(chart.rglob("*.pyc"))


def test_a_chart_package_that_is_not_locked_is_refused() -> None:
    with pytest.raises(RuntimeError, match="are locked runtime requirements"):
        export_requirements(REPO_ROOT, only=("pillow", "no-such-package"))


def test_only_the_digest_function_has_the_chart_layer(synth: Synth) -> None:
    resources = synth.template()["Resources"]
    layers = {i: r["Properties"] for i, r in resources.items() if r["Type"] == "AWS::Lambda::LayerVersion"}
    [chart] = [i for i in layers if i.startswith("ChartDependencies")]
    [shared] = [i for i in layers if i != chart]
    attached = {
        r["Properties"]["Handler"]: [ref["Ref"] for ref in r["Properties"]["Layers"]]
        for r in resources.values()
        if r["Type"] == "AWS::Lambda::Function" and r["Properties"].get("Handler", "").startswith("idle_reaper.")
    }
    assert sorted(attached.pop("idle_reaper.handlers.digest.handler")) == sorted([shared, chart])
    assert attached and all(refs == [shared] for refs in attached.values()), attached
    assert layers[chart]["CompatibleArchitectures"] == ["arm64"] and layers[chart]["CompatibleRuntimes"] == [
        "python3.12"
    ]
