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


# Where the runtime may read the wall clock: entry points (a handler's "now") and the defaults of clocks a caller
# can replace. A component that reads it anywhere else cannot be given a test's day (or the demo's, or a replay's):
# a reference written on a fixed day and read against the wall clock expires once that day is a week old, and the
# suite starts failing on some later date (675098c). Take a `clock` (or a `now`) instead, defaulting to wall_clock.
WALL_CLOCK_READS = {
    ("idle_reaper.aws.clients", "wall_clock"),
    ("idle_reaper.handlers.digest", "handler"),
    ("idle_reaper.handlers.slack", "clock"),
    ("idle_reaper.handlers.sweep", "handler"),
    ("idle_reaper.slack.posting", "Posting.__init__"),  # the default of its `clock`
    ("idle_reaper.sweep.owner_messages", "post_across"),  # a record without updated_at (a sweep's never lacks it)
    ("idle_reaper.slack.blocks", "quiet_stop_line"),  # a record without its stop time (a sweep's never lacks it)
}


def wall_clock_reads(name: str, tree: ast.Module) -> list[tuple[str, str]]:
    """(module, the function reading it) for each datetime.now/utcnow/today, date.today or time.time call."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = (*scope, node.name)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = node.func.value, node.func.attr
            if isinstance(owner, ast.Name) and (owner.id, attr) in {
                ("datetime", "now"),
                ("datetime", "utcnow"),
                ("datetime", "today"),
                ("date", "today"),
                ("time", "time"),
            }:
                found.append((name, ".".join(scope)))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, ())
    return found


def test_the_runtime_reads_the_wall_clock_only_where_a_caller_can_give_it_another_time() -> None:
    reads = {read for name, _, tree in runtime_modules() for read in wall_clock_reads(name, tree)}
    unexpected = [f"{module}: {where or '<module>'}" for module, where in sorted(reads - WALL_CLOCK_READS)]
    assert not unexpected, "the wall clock read where no caller can give another time:\n" + "\n".join(unexpected)
    assert reads >= WALL_CLOCK_READS, "an allowed read is gone: drop it from WALL_CLOCK_READS"
    # The check sees one: a component's hidden `datetime.now(UTC)`.
    hidden = ast.parse("def remember(store):\n    store.put(datetime.now(UTC) + REF_TTL)\n")
    assert wall_clock_reads("idle_reaper.slack.shared", hidden) == [("idle_reaper.slack.shared", "remember")]
