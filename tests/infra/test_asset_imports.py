"""Every handler the template names imports from the built asset, with the shared dependency layer and only
what the Lambda runtime provides (boto3 and its closure) beside it: no repository path, no site-packages.
The digest's chart draws with the chart layer (Pillow) added, as the Digest function has it, and without it
Pillow is not there to import.

The layers are installed from uv.lock for this machine's Python and platform (the real layers are for arm64,
which this machine cannot import); the function code is the asset directory `cdk synth` staged."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import boto3
import pytest
from synthesis import Synth

from infra.bundling import CHART_PACKAGES, REPO_ROOT, RUNTIME_PROVIDED, install_locked_requirements

pytestmark = pytest.mark.infra

# What the runtime ships, as top-level import names.
RUNTIME_MODULES = ("boto3", "botocore", "s3transfer", "jmespath", "urllib3", "dateutil", "six")


def handlers_and_assets(synth: Synth) -> dict[str, Path]:
    """handler -> the staged asset directory of its function's code (our functions only)."""
    template: dict[str, Any] = synth.template()
    found = {}
    for resource in template["Resources"].values():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::Lambda::Function" and props.get("Handler", "").startswith("idle_reaper."):
            found[props["Handler"]] = synth.outdir / f"asset.{props['Code']['S3Key'].removesuffix('.zip')}"
    return found


def runtime_provided(target: Path) -> Path:
    """boto3 and its closure, linked from this environment: the runtime's part of sys.path."""
    site = Path(boto3.__file__).resolve().parents[1]
    target.mkdir()
    for name in RUNTIME_MODULES:
        for source in (site / name, site / f"{name}.py"):
            if source.exists():
                (target / source.name).symlink_to(source)
    assert len(RUNTIME_PROVIDED) == len(RUNTIME_MODULES)
    return target


def test_every_handler_in_the_template_imports_from_the_asset_with_only_the_runtimes_packages(
    synth: Synth, tmp_path: Path
) -> None:
    handlers = handlers_and_assets(synth)
    assert {h.rsplit(".", 1)[0] for h in handlers} == {
        "idle_reaper.handlers.sweep",
        "idle_reaper.handlers.slack",
        "idle_reaper.handlers.alarms",
        "idle_reaper.handlers.fanout",
        "idle_reaper.handlers.digest",
    }
    [asset] = set(handlers.values())  # one code asset for every function
    assert not list(asset.rglob("*.py[co]")) and (asset / "idle_reaper" / "handlers").is_dir()
    layer, chart = tmp_path / "layer", tmp_path / "chart"
    machine = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine()]
    for target, only in ((layer, ()), (chart, CHART_PACKAGES)):
        install_locked_requirements(
            REPO_ROOT,
            target,
            only=only,
            python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
            python_platform=f"{machine}-manylinux2014",
        )
    runtime = runtime_provided(tmp_path / "runtime")
    allowed = [str(p) for p in (asset, layer, runtime)]
    # -I -S: no PYTHONPATH, no current directory, no site-packages: only the stdlib and these three. -B:
    # write no bytecode into the shared asset (other tests check it ships none).
    code = (
        "import importlib, importlib.util, json, sys\n"
        f"sys.path[:0] = {allowed!r}\n"
        f"handlers = {sorted(handlers)!r}\n"
        "for handler in handlers:\n"
        "    module, name = handler.rsplit('.', 1)\n"
        "    assert callable(getattr(importlib.import_module(module), name)), handler\n"
        # Pillow is loaded by no handler on import, and is not in the shared layer; the digest draws its chart
        # with it from the chart layer.
        "assert 'PIL' not in sys.modules, 'a handler imports Pillow at cold start'\n"
        "assert importlib.util.find_spec('PIL') is None, 'Pillow is in the shared layer'\n"
        f"sys.path.insert(1, {str(chart)!r})\n"
        "from datetime import UTC, datetime\n"
        "from idle_reaper.core.digest import Digest, Week\n"
        "from idle_reaper.slack.chart import render_chart\n"
        "when = datetime(2026, 11, 23, tzinfo=UTC)\n"
        "assert render_chart(Digest('ml', 'ml', Week(2026, 47), when, when)).startswith(b'\\x89PNG')\n"
        "print(json.dumps({m: getattr(sys.modules[m], '__file__', None) for m in sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"AWS_DEFAULT_REGION": "us-east-1", "POWERTOOLS_LOG_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded: dict[str, str | None] = json.loads(out.stdout.strip().splitlines()[-1])
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    outside = {
        m: f
        for m, f in loaded.items()
        if f
        and not any(Path(f).resolve().is_relative_to(d) for d in (asset, layer, chart, runtime, stdlib))
        and not Path(f).is_relative_to(runtime)  # symlinks into this environment's boto3
    }
    assert not outside, f"imported from outside the asset, the layer and the runtime: {sorted(outside)[:20]}"
    assert any(f and Path(f).is_relative_to(layer) for f in loaded.values())  # the layer was really used
    assert Path(loaded["PIL"] or "").is_relative_to(chart), "the chart drew with the chart layer's Pillow"
