"""The Lambda dependency layers, built without Docker: the shared one every function has, and the chart's
(Pillow), which only the weekly digest's function has.

CDK's local bundling hook runs `uv` on the synth machine: it exports the locked runtime requirements
(with their hashes) from uv.lock and installs the wheels built for the Lambda platform (Linux arm64,
CPython 3.12) into `python/`, the directory Lambda puts on sys.path for layers. Only binary wheels,
no bytecode (the runtime compiles on import; .pyc files built here would be for the wrong Python).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jsii
from aws_cdk import AssetHashType, BundlingOptions, ILocalBundling
from aws_cdk import aws_lambda as lambda_

REPO_ROOT = Path(__file__).resolve().parent.parent

# What the python3.12 Lambda runtime already ships: boto3 and its dependency closure. Bundling them
# would pin an SDK older than the runtime's and add ~25 MB to every cold start.
RUNTIME_PROVIDED = ("boto3", "botocore", "s3transfer", "jmespath", "urllib3", "python-dateutil", "six")

# What only the weekly digest's chart (lambdas/idle_reaper/slack/chart.py) uses: its own layer, attached to the
# Digest function alone, so no other function carries it (Pillow: ~6 MB zipped, 20 MB installed). Pillow
# depends on nothing; a package added here must bring its own dependencies here too (the install is --no-deps).
CHART_PACKAGES = ("pillow",)

PYTHON_VERSION = "3.12"
# uv's name for pip's `--platform manylinux2014_aarch64 --implementation cp`.
PYTHON_PLATFORM = "aarch64-manylinux2014"

# Bump when the install command changes in a way the lock file does not show.
_BUNDLE_FORMAT = "1"


def find_uv() -> str:
    """uv on PATH, else the copy `make` bootstraps into .tools/."""
    found = shutil.which("uv")
    if found:
        return found
    local = REPO_ROOT / ".tools" / "bin" / "uv"
    if local.exists():
        return str(local)
    raise RuntimeError("uv not found: run `make sync` (it installs uv into .tools/) or put uv on PATH")


def export_requirements(project_dir: Path, uv: str | None = None, *, only: Sequence[str] = ()) -> str:
    """The locked runtime requirements, with hashes, minus what the Lambda runtime provides: the shared layer's
    (without CHART_PACKAGES), or, given `only`, just those packages (a layer of their own)."""
    left_out = RUNTIME_PROVIDED if only else (*RUNTIME_PROVIDED, *CHART_PACKAGES)
    excluded = [arg for name in left_out for arg in ("--no-emit-package", name)]
    result = subprocess.run(
        [
            uv or find_uv(),
            "export",
            "--frozen",
            "--format",
            "requirements.txt",
            "--no-dev",
            "--no-default-groups",
            "--no-emit-project",
            "--no-header",
            "--no-annotate",
            *excluded,
        ],
        cwd=project_dir,
        check=True,
        capture_output=True,
        text=True,
    )
    if not only:
        return result.stdout
    # One entry per package: its `name==version` line and the indented `--hash` lines continuing it.
    entries = re.split(r"\n(?=\S)", result.stdout.strip())
    wanted = {_normalized(n) for n in only}
    kept = [e for e in entries if _normalized(re.split(r"[=<>;\s\\]", e, maxsplit=1)[0]) in wanted]
    if len(kept) != len(wanted):
        raise RuntimeError(f"not all of {sorted(only)} are locked runtime requirements in uv.lock")
    return "\n".join(kept) + "\n"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_locked_requirements(
    project_dir: Path,
    target: Path,
    *,
    only: Sequence[str] = (),
    python_version: str = PYTHON_VERSION,
    python_platform: str = PYTHON_PLATFORM,
) -> None:
    """Install the locked runtime requirements (wheels only, hashes checked) into `target` for a Python
    and platform: Lambda's by default; the tests and the cold-import benchmark use the local ones. The shared
    layer's, or the packages `only` names (export_requirements)."""
    uv = find_uv()
    with tempfile.TemporaryDirectory(prefix="idle-reaper-layer-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(export_requirements(project_dir, uv, only=only))
        command = [
            uv,
            "pip",
            "install",
            "--quiet",
            "--target",
            str(target),
            "--python-version",
            python_version,
            "--python-platform",
            python_platform,
            "--only-binary",
            ":all:",
            "--no-deps",  # the export is the complete, locked closure
            "--require-hashes",  # every wheel must match uv.lock
            "--link-mode",
            "copy",
            "-r",
            str(requirements),
        ]
        completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"installing the locked requirements failed:\n{' '.join(command)}\n{completed.stderr}")


@jsii.implements(ILocalBundling)
class LockedRequirementsBundler:
    """Installs the locked requirements (all of the shared layer's, or `only` those) for the Lambda platform
    into `<output_dir>/python`."""

    def __init__(self, project_dir: Path, only: Sequence[str] = ()) -> None:
        self.project_dir = project_dir
        self.only = tuple(only)

    # jsii passes the BundlingOptions either positionally or as keywords depending on its version;
    # this bundler needs none of them. Raising (not returning False) keeps CDK from falling back to Docker.
    def try_bundle(self, output_dir: str, *_args: object, **_options: object) -> bool:
        install_locked_requirements(self.project_dir, Path(output_dir) / "python", only=self.only)
        return True


def lock_fingerprint(project_dir: Path, only: Sequence[str] = ()) -> str:
    """Asset hash from the inputs of the install, so the layer is rebuilt only when they change
    (and CDK never fingerprints the repository, which holds .venv and node_modules)."""
    digest = hashlib.sha256()
    layer = ("only", *only) if only else ("without", *CHART_PACKAGES)
    for part in (_BUNDLE_FORMAT, PYTHON_VERSION, PYTHON_PLATFORM, *RUNTIME_PROVIDED, *layer):
        digest.update(part.encode() + b"\0")
    for name in ("uv.lock", "pyproject.toml"):
        digest.update((project_dir / name).read_bytes())
    return digest.hexdigest()


def dependency_layer_code(project_dir: Path = REPO_ROOT, *, only: Sequence[str] = ()) -> lambda_.Code:
    """The shared layer's code, or (`only=CHART_PACKAGES`) the chart layer's."""
    return lambda_.Code.from_asset(
        str(project_dir),
        asset_hash_type=AssetHashType.CUSTOM,
        asset_hash=lock_fingerprint(project_dir, only),
        bundling=BundlingOptions(
            # Required by the API, never pulled: local bundling either succeeds or raises.
            image=lambda_.Runtime.PYTHON_3_12.bundling_image,
            local=LockedRequirementsBundler(project_dir, only),
        ),
    )
