"""docs/architecture.md names modules, classes and functions; every one of them must exist, so the page
cannot drift from the code unnoticed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "architecture.md"
RUNTIME_DIR = REPO_ROOT / "lambdas" / "idle_reaper"
# Every runtime module by its dotted name below idle_reaper: "core", "core.lifecycle", "slack.routing", ...
MODULES = sorted(
    ".".join(
        p.relative_to(RUNTIME_DIR).with_suffix("").parts[:-1]
        if p.stem == "__init__"
        else p.relative_to(RUNTIME_DIR).with_suffix("").parts
    )
    for p in RUNTIME_DIR.rglob("*.py")
    if p.relative_to(RUNTIME_DIR).parts != ("__init__.py",)
)
CHAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def references() -> tuple[set[str], set[str]]:
    """Backticked code chains (`sweep.delivery.apply_decisions`, `Fleet.stop`) and paths
    (`lambdas/idle_reaper/core/lifecycle.py`), also the `participant X as a.b` names of the diagrams."""
    text = DOC.read_text()
    tokens = set(re.findall(r"`([^`\s]+)`", text))
    for name in re.findall(r"participant \w+ as ([^\n]+)", text):
        tokens.update(part.strip() for part in re.split(r"[ ,()/]+", name) if "." in part)
    chains = {t for t in tokens if CHAIN.match(t) and not t.endswith(".py")}
    paths = {t.rstrip("/") for t in tokens if "/" in t or t.endswith(".py")}
    return chains, paths


def resolves(chain: str) -> bool:
    """`core.lifecycle.decide` (a module path, then attributes) or `Fleet.stop` (a name some module has)."""
    parts = chain.split(".")
    prefixes = [i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES]
    candidates = [(".".join(parts[: prefixes[0]]), parts[prefixes[0] :])] if prefixes else [(m, parts) for m in MODULES]
    for name, rest in candidates:
        obj: object = importlib.import_module(f"idle_reaper.{name}")
        for part in rest:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        else:
            return True
    return False


def test_every_name_in_the_architecture_page_exists() -> None:
    chains, paths = references()
    assert len(chains) >= 20 and len(paths) >= 10, "the page names the code it describes"
    missing = sorted(c for c in chains if not resolves(c))
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
    packages = [p for p in RUNTIME_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    roots = [REPO_ROOT, RUNTIME_DIR, *packages, REPO_ROOT / "tools" / "idle_reaper_tools"]
    absent = sorted(p for p in paths if not any((root / p).exists() for root in roots))
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def test_the_check_catches_a_renamed_function() -> None:
    assert resolves("core.lifecycle.decide") and resolves("Fleet.stop") and resolves("slack.routing.Region.authorize")
    assert not resolves("core.lifecycle.decide_all") and not resolves("Fleet.stop_all")
    assert not resolves("core.signals.decide"), "a name is looked up in the module the page names"
