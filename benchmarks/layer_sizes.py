"""How big the Lambda layers are: the shared one every function has, and the chart layer (Pillow) only the
weekly digest's function has. Each is installed from uv.lock for Lambda's platform (Linux arm64, CPython 3.12)
as `cdk synth` bundles it, then zipped with deflate at level 9 (what CDK does to an asset directory), and its
size installed and zipped is printed.

    python benchmarks/layer_sizes.py
"""

from __future__ import annotations

import io
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from infra.bundling import CHART_PACKAGES, install_locked_requirements  # noqa: E402

LAYERS: dict[str, Sequence[str]] = {"shared (every function)": (), "chart (the digest only)": CHART_PACKAGES}


def sizes(only: Sequence[str]) -> tuple[int, int]:
    """Bytes installed and zipped of one layer."""
    with tempfile.TemporaryDirectory(prefix="idle-reaper-layer-size-") as tmp:
        root = Path(tmp)
        install_locked_requirements(REPO_ROOT, root / "python", only=only)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zipped:
            for path in files:
                zipped.write(path, path.relative_to(root).as_posix())
        return sum(p.stat().st_size for p in files), len(archive.getvalue())


def main() -> None:
    print(f"{'layer':<26} {'installed':>10} {'zipped':>8}")
    for name, only in LAYERS.items():
        installed, zipped = sizes(only)
        print(f"{name:<26} {installed / 1e6:>7.1f} MB {zipped / 1e6:>5.1f} MB")


if __name__ == "__main__":
    main()
