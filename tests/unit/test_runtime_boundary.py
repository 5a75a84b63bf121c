"""The Lambda handlers import only the runtime package: never a local tool or a test double."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL_MODULES = {"demo", "local", "fake_slack", "replay", "cli", "admin"}
NOT_IN_LAMBDA = ("idle_reaper_tools", "testkit", "benchmarks", "tests", "moto", "matplotlib", "hypothesis")


def test_handlers_import_no_tool_module_in_a_fresh_interpreter() -> None:
    # -I: no PYTHONPATH, no user site, no current directory; the runtime directory goes first on the path.
    code = (
        f"import json, sys; sys.path.insert(0, {str(REPO_ROOT / 'lambdas')!r})\n"
        "import idle_reaper.handlers.sweep, idle_reaper.handlers.slack\n"
        "print(json.dumps({m: getattr(sys.modules[m], '__file__', None) for m in sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"AWS_DEFAULT_REGION": "us-east-1", "POWERTOOLS_LOG_LEVEL": "WARNING"},
    )
    loaded: dict[str, str | None] = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"idle_reaper.handlers.slack", "idle_reaper.handlers.sweep"} <= loaded.keys()
    leaked = [m for m in loaded if m.split(".")[0] in NOT_IN_LAMBDA]
    assert not leaked, f"the handlers imported {leaked}"
    ours = {m: f for m, f in loaded.items() if m.split(".")[0] == "idle_reaper" and f}
    assert all(Path(f).is_relative_to(REPO_ROOT / "lambdas" / "idle_reaper") for f in ours.values())


def test_runtime_package_holds_no_tool_module() -> None:
    runtime = {p.stem for p in (REPO_ROOT / "lambdas" / "idle_reaper").rglob("*.py")}
    assert not runtime & TOOL_MODULES
