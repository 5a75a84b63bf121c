"""docs/architecture.md names modules, classes and functions; every one of them must exist, so the page
cannot drift from the code unnoticed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "architecture.md"
RUNTIME = ("core", "policy", "aws", "slack", "notify", "sweep", "payloads", "routing", "answers", "machine_kinds")
CHAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def references() -> tuple[set[str], set[str]]:
    """Backticked code chains (`sweep._apply`, `Fleet.stop`) and paths (`lambdas/idle_reaper/core.py`),
    also the `participant X as a.b` names of the diagrams."""
    text = DOC.read_text()
    tokens = set(re.findall(r"`([^`\s]+)`", text))
    for name in re.findall(r"participant \w+ as ([^\n]+)", text):
        tokens.update(part.strip() for part in re.split(r"[ ,()/]+", name) if "." in part)
    chains = {t for t in tokens if CHAIN.match(t) and not t.endswith(".py")}
    paths = {t.rstrip("/") for t in tokens if "/" in t or t.endswith(".py")}
    return chains, paths


def resolves(chain: str) -> bool:
    parts = chain.split(".")
    modules = [f"idle_reaper.{m}" for m in RUNTIME] + ["idle_reaper.handlers.slack", "idle_reaper.handlers.sweep"]
    if parts[0] in RUNTIME:  # module.attr...
        modules, parts = [f"idle_reaper.{parts[0]}"], parts[1:]
    for name in modules:
        obj: object = importlib.import_module(name)
        for part in parts:
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
    roots = [REPO_ROOT, REPO_ROOT / "lambdas" / "idle_reaper", REPO_ROOT / "tools" / "idle_reaper_tools"]
    absent = sorted(p for p in paths if not any((root / p).exists() for root in roots))
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def test_the_check_catches_a_renamed_function() -> None:
    assert resolves("core.decide") and resolves("Fleet.stop") and resolves("routing.Region.authorize")
    assert not resolves("core.decide_all") and not resolves("Fleet.stop_all")
