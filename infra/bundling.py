"""The Lambda dependency layer, built without Docker.

CDK's local bundling hook runs `uv` on the synth machine: it exports the locked runtime requirements
(with their hashes) from uv.lock and installs the wheels built for the Lambda platform (Linux arm64,
CPython 3.12) into `python/`, the directory Lambda puts on sys.path for layers. Only binary wheels,
no bytecode (the runtime compiles on import; .pyc files built here would be for the wrong Python).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import jsii
from aws_cdk import AssetHashType, BundlingOptions, ILocalBundling
from aws_cdk import aws_lambda as lambda_

REPO_ROOT = Path(__file__).resolve().parent.parent

# What the python3.12 Lambda runtime already ships: boto3 and its dependency closure. Bundling them
# would pin an SDK older than the runtime's and add ~25 MB to every cold start.
RUNTIME_PROVIDED = ("boto3", "botocore", "s3transfer", "jmespath", "urllib3", "python-dateutil", "six")

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


def export_requirements(project_dir: Path, uv: str | None = None) -> str:
    """The locked runtime requirements, with hashes, minus what the Lambda runtime provides."""
    excluded = [arg for name in RUNTIME_PROVIDED for arg in ("--no-emit-package", name)]
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
    return result.stdout


def install_locked_requirements(
    project_dir: Path, target: Path, *, python_version: str = PYTHON_VERSION, python_platform: str = PYTHON_PLATFORM
) -> None:
    """Install the locked runtime requirements (wheels only, hashes checked) into `target` for a Python
    and platform: Lambda's by default; the tests and the cold-import benchmark use the local ones."""
    uv = find_uv()
    with tempfile.TemporaryDirectory(prefix="idle-reaper-layer-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(export_requirements(project_dir, uv))
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
    """Installs the locked requirements for the Lambda platform into `<output_dir>/python`."""

    def __init__(self, project_dir: Path) -> None:
        self.project_dir = project_dir

    # jsii passes the BundlingOptions either positionally or as keywords depending on its version;
    # this bundler needs none of them. Raising (not returning False) keeps CDK from falling back to Docker.
    def try_bundle(self, output_dir: str, *_args: object, **_options: object) -> bool:
        install_locked_requirements(self.project_dir, Path(output_dir) / "python")
        return True


def lock_fingerprint(project_dir: Path) -> str:
    """Asset hash from the inputs of the install, so the layer is rebuilt only when they change
    (and CDK never fingerprints the repository, which holds .venv and node_modules)."""
    digest = hashlib.sha256()
    for part in (_BUNDLE_FORMAT, PYTHON_VERSION, PYTHON_PLATFORM, *RUNTIME_PROVIDED):
        digest.update(part.encode() + b"\0")
    for name in ("uv.lock", "pyproject.toml"):
        digest.update((project_dir / name).read_bytes())
    return digest.hexdigest()


def dependency_layer_code(project_dir: Path = REPO_ROOT) -> lambda_.Code:
    return lambda_.Code.from_asset(
        str(project_dir),
        asset_hash_type=AssetHashType.CUSTOM,
        asset_hash=lock_fingerprint(project_dir),
        bundling=BundlingOptions(
            # Required by the API, never pulled: local bundling either succeeds or raises.
            image=lambda_.Runtime.PYTHON_3_12.bundling_image,
            local=LockedRequirementsBundler(project_dir),
        ),
    )
