"""How long each Lambda handler takes to import on a cold start, from the code as the stack ships it.

Lambda's code and layers are read-only, so a module without bytecode beside it is compiled from source on
every cold start. The runtime's own boto3 has bytecode; our code and the layer (pydantic, slack-sdk,
Powertools) ship none. This builds the layer from uv.lock for the local platform, links boto3's closure,
copies lambdas/, and times `import <handler module>` in fresh interpreters (median of N) three ways:
nothing compiled; only the runtime's packages compiled (what Lambda does today); everything compiled.

Lambda gives a function CPU in proportion to its memory, one full vCPU at 1,769 MB, so the figure measured
on one core here is scaled by 1769 / memory for smaller sizes (a model: say so when quoting it).

    python benchmarks/cold_import.py [--python /path/to/python3.12] [--runs 5]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from infra.bundling import install_locked_requirements  # noqa: E402

HANDLERS = (
    "idle_reaper.handlers.slack",
    "idle_reaper.handlers.sweep",
    "idle_reaper.handlers.fanout",
    "idle_reaper.handlers.alarms",
)
ONE_VCPU_MB = 1769
MEMORY_SIZES = (512, 1024, ONE_VCPU_MB)


def find_python() -> str:
    """The Lambda runtime's Python (3.12) when this machine has one that runs, else this interpreter."""
    for candidate in (shutil.which("python3.12"), str(Path.home() / ".pyenv/versions/3.12.1/bin/python3.12")):
        if candidate and Path(candidate).exists():
            ran = subprocess.run([candidate, "-c", "pass"], capture_output=True)
            if ran.returncode == 0:
                return candidate
    return sys.executable


def version_of(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def build(root: Path, python: str) -> list[Path]:
    version = version_of(python)
    machine = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine()]
    layer, runtime, code = root / "layer", root / "runtime", root / "code"
    install_locked_requirements(REPO_ROOT, layer, python_version=version, python_platform=f"{machine}-manylinux2014")
    uv = shutil.which("uv") or str(REPO_ROOT / ".tools" / "bin" / "uv")
    subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--target",
            str(runtime),
            "--python-version",
            version,
            "--python-platform",
            f"{machine}-manylinux2014",
            "--only-binary",
            ":all:",
            "boto3",
        ],
        check=True,
    )
    shutil.copytree(REPO_ROOT / "lambdas", code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return [code, layer, runtime]


def drop_bytecode(paths: list[Path]) -> None:
    for path in paths:
        for cache in list(path.rglob("__pycache__")):
            shutil.rmtree(cache)


def compile_with(python: str, paths: list[Path]) -> None:
    subprocess.run([python, "-m", "compileall", "-q", *map(str, paths)], check=True, capture_output=True)


def import_ms(python: str, paths: list[Path], module: str, runs: int) -> float:
    code = (
        f"import sys, time; sys.path[:0] = {[str(p) for p in paths]!r}\n"
        f"t = time.perf_counter(); import {module}; print((time.perf_counter() - t) * 1000)"
    )
    times = []
    for _ in range(runs):
        # -B: a run writes no bytecode, as on Lambda's read-only code.
        out = subprocess.run(
            [python, "-I", "-B", "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"AWS_DEFAULT_REGION": "us-east-1"},
        )
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=None, help="the interpreter to time (default: python3.12 if found)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    python = args.python or find_python()
    with tempfile.TemporaryDirectory(prefix="idle-reaper-cold-") as tmp:
        code, layer, runtime = build(Path(tmp), python)
        paths = [code, layer, runtime]
        results: dict[str, dict[str, float]] = {m: {} for m in HANDLERS}
        for label, compiled in (("none", []), ("runtime only (Lambda today)", [runtime]), ("all", paths)):
            drop_bytecode(paths)
            if compiled:
                compile_with(python, compiled)
            for module in HANDLERS:
                results[module][label] = import_ms(python, paths, module, args.runs)
    print(f"cold import, ms (median of {args.runs}), Python {version_of(python)} on {platform.machine()}, one core")
    labels = ["none", "runtime only (Lambda today)", "all"]
    print(f"{'handler':32} " + " ".join(f"{label:>28}" for label in labels))
    for module, row in results.items():
        print(f"{module:32} " + " ".join(f"{row[label]:>28.0f}" for label in labels))
    print("\nmodelled on Lambda (CPU in proportion to memory), Slack handler, as shipped (runtime only):")
    slack = results["idle_reaper.handlers.slack"]["runtime only (Lambda today)"]
    for memory in MEMORY_SIZES:
        print(f"  {memory:>5} MB: {slack * ONE_VCPU_MB / memory:>6.0f} ms of Slack's 3,000 ms for the import alone")


if __name__ == "__main__":
    main()
