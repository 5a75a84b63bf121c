"""The activity collector rides in the GPU agent rollout's SSM document: the step runs after the agent's
configure step, embeds agent/'s files byte for byte (no S3, nothing new for the instance role), checks them,
and the same files always give the same document (no new version at every deploy)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from synthesis import Synth
from test_stack import resources

from infra.constructs import COLLECTOR_DIR, COLLECTOR_FILES, collector_bundle, collector_install_commands


@pytest.fixture(scope="module")
def template(synth: Synth) -> dict[str, Any]:
    return synth.template()


def collector_step(template: dict[str, Any]) -> dict[str, Any]:
    [document] = resources(template, "AWS::SSM::Document").values()
    steps = document["Properties"]["Content"]["mainSteps"]
    names = [s["name"] for s in steps]
    assert names.index("installActivityCollector") > names.index("configureAgent")
    return steps[names.index("installActivityCollector")]


def unpack(commands: list[str], tmp_path: Path) -> Path:
    """Run the step's script up to install.sh (which needs root, useradd and systemd), and keep what it
    unpacked."""
    assert commands[-1] == 'sh "$work/install.sh"'
    out = tmp_path / "unpacked"
    script = "\n".join([*commands[:-1], f'cp -R "$work" "{out}"']) + "\n"
    subprocess.run(["sh", "-c", script], check=True, capture_output=True, timeout=30)
    return out


def test_the_step_unpacks_exactly_the_agent_files_and_runs_install_sh(template: dict[str, Any], tmp_path: Path) -> None:
    step = collector_step(template)
    assert step["precondition"] == {"StringEquals": ["platformType", "Linux"]}
    commands = step["inputs"]["runCommand"]
    assert commands == collector_install_commands(collector_bundle())
    unpacked = unpack(commands, tmp_path)
    for name in COLLECTOR_FILES:
        assert (unpacked / name).read_bytes() == (COLLECTOR_DIR / name).read_bytes(), name
    assert (unpacked / "install.sh").stat().st_mode & 0o111
    # Every file install.sh installs from its own directory is shipped.
    install = (COLLECTOR_DIR / "install.sh").read_text()
    for name in (p.name for p in COLLECTOR_DIR.iterdir() if f'$HERE/{p.name}"' in install):
        assert name in COLLECTOR_FILES


def test_a_corrupted_bundle_fails_the_step_before_install(tmp_path: Path) -> None:
    commands = collector_install_commands(collector_bundle())
    body = commands.index("IDLE_REAPER_COLLECTOR_FILES", 4) - 1
    flipped = commands[body][:-2] + ("AA" if commands[body][-2:] != "AA" else "BB")
    broken = [*commands[:body], flipped, *commands[body + 1 :]]
    with pytest.raises(subprocess.CalledProcessError):
        unpack(broken, tmp_path)
    assert not (tmp_path / "unpacked").exists()


def test_the_bundle_is_the_same_bytes_for_the_same_files(tmp_path: Path) -> None:
    first = collector_bundle()
    copy = tmp_path / "agent"
    copy.mkdir()
    for name in COLLECTOR_FILES:
        (copy / name).write_bytes((COLLECTOR_DIR / name).read_bytes())
        (copy / name).chmod(0o600)  # another checkout's modes and times change nothing
    assert collector_bundle(copy) == first
    with tarfile.open(fileobj=io.BytesIO(first), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert list(members) == list(COLLECTOR_FILES)
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members.values())
    assert len("\n".join(collector_install_commands(first))) < 40_000  # SSM documents hold at most 64 KB
