"""The runtime's shape holds: rooms of a readable size, and imports that only point down the layers
(handlers -> sweep and the Slack endpoint's requests -> adapters -> core -> policy)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "lambdas" / "idle_reaper"
MAX_MODULE_LINES = 750
MAX_FUNCTION_LINES = 130
MAX_CLASS_LINES = 300

# Lower numbers sit lower. A module may import its own layer (within reason: siblings) or any below it.
LAYERS: dict[str, int] = {
    "idle_reaper.policy": 0,
    "idle_reaper.organization": 0,
    "idle_reaper.pricing": 0,
    "idle_reaper.core": 1,
    "idle_reaper.aws": 2,
    "idle_reaper.notify": 2,
    "idle_reaper.slack.blocks": 2,
    "idle_reaper.slack.notifier": 2,
    "idle_reaper.slack": 2,  # the package re-exports the adapter (blocks, notifier) only
    "idle_reaper.sweep": 3,
    "idle_reaper.slack.requests": 3,
    "idle_reaper.slack.routing": 3,
    "idle_reaper.slack.answers": 3,
    "idle_reaper.handlers": 4,
}


def layer(module: str) -> int:
    if module == "idle_reaper":  # the package itself holds its __version__ alone: below every layer
        return -1
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len, default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return LAYERS[best]


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_modules() -> list[tuple[str, Path, ast.Module]]:
    return [(module_name(p), p, ast.parse(p.read_text())) for p in sorted(RUNTIME.rglob("*.py"))]


def test_every_runtime_module_is_a_readable_size() -> None:
    too_long = []
    for name, path, tree in runtime_modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {lines} lines")
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > MAX_FUNCTION_LINES:
                too_long.append(f"function {name}.{node.name}: {size} lines")
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {size} lines")
    assert not too_long, "\n".join(too_long)


def test_imports_only_point_down_the_layers() -> None:
    upward = []
    for name, _, tree in runtime_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("idle_reaper"):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("idle_reaper")]
            else:
                continue
            upward += [f"{name} -> {t}" for t in targets if layer(t) > layer(name)]
    assert not upward, "\n".join(upward)


def test_the_core_imports_neither_boto3_nor_slack() -> None:
    impure = []
    for name, _, tree in runtime_modules():
        if not name.startswith("idle_reaper.core"):
            continue
        for node in ast.walk(tree):
            roots = (
                [a.name.split(".")[0] for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module.split(".")[0]]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            impure += [f"{name} imports {r}" for r in roots if r in {"boto3", "botocore", "slack_sdk"}]
    assert not impure, "\n".join(impure)


def test_the_checks_see_a_violation() -> None:
    # The layer table would miss nothing silently: an unknown runtime module fails loudly.
    assert layer("idle_reaper.sweep.run") > layer("idle_reaper.aws.fleet") > layer("idle_reaper.core.lifecycle")
    assert layer("idle_reaper.slack.routing") > layer("idle_reaper.slack.notifier")
