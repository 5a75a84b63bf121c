"""install.sh as it runs on a machine, its system commands stood in for (each logs its arguments): what the unit
tests of the collector and the real-software tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AGENT_DIR = Path(__file__).resolve().parents[1] / "agent"


FAKE_COMMAND = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
{body}
"""


def fake_commands(tmp_path: Path, **bodies: str) -> tuple[Path, Path]:
    """A directory of stand-ins for the system commands install.sh calls; each logs its arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    defaults = {
        "getent": f'[ -e "{tmp_path}/user-created" ]',
        "useradd": f'touch "{tmp_path}/user-created"',
        "systemctl": "true",
        "amazon-cloudwatch-agent-ctl": "true",
    }
    for name, body in {**defaults, **bodies}.items():
        command = bin_dir / name
        command.write_text(FAKE_COMMAND.format(log=log, body=body))
        command.chmod(0o755)
    return bin_dir, log


def run_install(
    tmp_path: Path, bin_dir: Path, ctl: Path, *, pythons: str | None = None, systemd: bool = True
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "run-systemd").mkdir(exist_ok=True)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "IDLE_REAPER_PREFIX": str(tmp_path / "opt"),
        "IDLE_REAPER_UNIT_DIR": str(tmp_path / "units"),
        "CWAGENT_CTL": str(ctl),
        # The system interpreters install.sh tries, in order (absolute paths: never PATH's python3).
        "IDLE_REAPER_PYTHONS": pythons or sys.executable,
        "IDLE_REAPER_STATE_DIR": str(tmp_path / "state"),
        "IDLE_REAPER_SYSTEMD_DIR": str(tmp_path / ("run-systemd" if systemd else "no-systemd")),
    }
    return subprocess.run(
        ["/bin/sh", str(AGENT_DIR / "install.sh")], capture_output=True, text=True, timeout=60, env=env
    )


def installed_unit(python: str) -> str:
    """The service unit as install.sh writes it: running the interpreter it checked, allowed to reach this
    machine's own addresses besides loopback (as the collector lists them)."""
    unit = (AGENT_DIR / "idle-reaper-activity.service").read_text()
    own = [sys.executable, "-I", str(AGENT_DIR / "idle_reaper_activity.py"), "--own-addresses"]
    addresses = subprocess.run(own, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    allowed = f"IPAddressAllow=localhost {addresses}" if addresses else "IPAddressAllow=localhost"
    return unit.replace("ExecStart=/usr/bin/python3 -I", f"ExecStart={python} -I").replace(
        "\nIPAddressAllow=localhost\n", f"\n{allowed}\n"
    )
