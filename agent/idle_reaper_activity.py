#!/usr/bin/env python3
"""idle-reaper human-activity collector: minutes since the last human input on this machine.

A machine where a person is working is busy even at 1 % CPU and 0 % GPU. Every minute (systemd timer)
this script looks at three sources of human input, takes the most recent, and sends the number of
minutes since then to the local CloudWatch agent as a StatsD gauge (`idle_reaper_minutes_since_input`).
The agent adds this machine's `InstanceId`; the reaper's sweep reads the metric next to CPU and GPU.

Sources (each one is optional; a failure in one never hides the others):
  tty      interactive terminal sessions from utmp (USER_PROCESS records with a tty); the last input on a
           tty is the access time of /dev/<tty>, which is what `who -u` reports as idle. When utmp cannot
           be read, the output of `who -u` is parsed instead.
  jupyter  running Jupyter servers found through their runtime files (jpserver-*.json, nbserver-*.json);
           the server's `api/status` `last_activity`, each kernel's `last_activity`, and a kernel whose
           `execution_state` is `busy` counts as input now. Loopback servers only.
  vscode   VS Code remote: the newest save recorded in the server's local history
           (~/.vscode-server/data/User/History/*/entries.json), and the last input in its integrated
           terminals (the access time of the pty of each shell the server's pty host started). An open
           window nobody types in saves and reads nothing, so it ages like everything else.

Output: minutes in [0, CAP_MINUTES]; CAP_MINUTES (one week) means "no human input seen". A missing
metric therefore means "the collector is not running", never "idle". A timestamp in the future (clock
skew) or one that cannot be parsed is ignored with a log line: never read as "active now" or "active
forever".

Standard library only, Python 3.9 syntax (the system python3 of Amazon Linux 2023 / Ubuntu 22.04+).
See agent/README.md for the threat model and installation.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import logging
import math
import os
import platform
import pwd
import re
import socket
import ssl
import stat
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Callable, NamedTuple

LOG = logging.getLogger("idle_reaper_activity")

METRIC_NAME = "idle_reaper_minutes_since_input"
CAP_MINUTES = 10080  # one week: "no human input seen"; also the ceiling of every published value
STATSD_DEFAULT = "127.0.0.1:8125"
# A timestamp this far ahead of our clock is clock skew, not input: ignored. Within it, it counts as now
# (file times and Jupyter's clock are this machine's clock, so a few seconds is rounding, not skew).
FUTURE_TOLERANCE_SECONDS = 5.0
HTTP_TIMEOUT_SECONDS = 2.0
JUPYTER_BUDGET_SECONDS = 15.0  # all Jupyter servers together; the systemd unit allows a run 30 s
RUNTIME_FILE_MAX_BYTES = 64 * 1024

# glibc `struct utmp` (bits/utmp.h), little-endian. On x86_64 (__WORDSIZE_TIME64_COMPAT32) the session
# and the time are 32-bit, 384 bytes, no padding besides the 2 bytes after ut_type:
#   0 ut_type (short)  2 pad  4 ut_pid (int32)  8 ut_line[32]  40 ut_id[4]  44 ut_user[32]
#   76 ut_host[256]  332 ut_exit (2 x short)  336 ut_session (int32)  340 ut_tv (2 x int32: sec, usec)
#   348 ut_addr_v6 (4 x int32)  364 reserved[20]
# On aarch64 they are `long` and `struct timeval`: 336 ut_session (int64)  344 ut_tv (2 x int64)
#   360 ut_addr_v6  376 reserved[20]  396 tail padding to 400 (8-byte alignment).
UTMP_RECORD = struct.Struct("<h2xi32s4s32s256shhiii16s20x")
UTMP_RECORD_AARCH64 = struct.Struct("<h2xi32s4s32s256shhqqq16s20x4x")
UTMP_RECORD_BY_MACHINE = {"aarch64": UTMP_RECORD_AARCH64, "arm64": UTMP_RECORD_AARCH64}
UTMP_USER_PROCESS = 7
UTMP_DEFAULT_PATH = "/var/run/utmp"

JUPYTER_RUNTIME_PREFIXES = ("jpserver-", "nbserver-")
VSCODE_SERVER_DIRS = (".vscode-server", ".vscode-remote")


class Sighting(NamedTuple):
    """One piece of evidence of human input: where it was seen and when (epoch seconds)."""

    source: str
    at: float


class UtmpEntry(NamedTuple):
    type: int
    pid: int
    line: str
    user: str
    host: str
    login_at: float


# --- the decision: minutes since the most recent valid sighting -------------------------------------------


def minutes_since_input(sightings: Iterable[Sighting], now: float, cap: int = CAP_MINUTES) -> float:
    """The minimum over valid sightings of the minutes since each, clamped to [0, cap]; cap if none."""
    best = float(cap)
    for sighting in sightings:
        minutes = sighting_minutes(sighting, now, cap)
        if minutes is not None:
            best = min(best, minutes)
    return best


def sighting_minutes(sighting: Sighting, now: float, cap: int = CAP_MINUTES) -> float | None:
    """Minutes since one sighting, or None (logged) when its time is garbage or in the future."""
    at = sighting.at
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at):
        LOG.warning("ignoring %s: its time %r is not a number", sighting.source, at)
        return None
    if at > now + FUTURE_TOLERANCE_SECONDS:
        LOG.warning(
            "ignoring %s: its time is %.0f s in the future (clock skew?), never read as active",
            sighting.source,
            at - now,
        )
        return None
    return min(float(cap), max(0.0, (now - at) / 60.0))


# --- source 1: interactive terminals (utmp + tty access time, or `who -u`) --------------------------------


def parse_utmp(data: bytes, record: struct.Struct | None = None) -> list[UtmpEntry]:
    """Every whole record of a glibc utmp file (this machine's layout by default); a partial one is ignored."""
    record = UTMP_RECORD_BY_MACHINE.get(platform.machine(), UTMP_RECORD) if record is None else record
    entries = []
    for offset in range(0, len(data) - record.size + 1, record.size):
        ut_type, pid, line, _id, user, host, _term, _exit, _session, sec, usec, _addr = record.unpack_from(data, offset)
        entries.append(UtmpEntry(ut_type, pid, _c_string(line), _c_string(user), _c_string(host), sec + usec / 1e6))
    return entries


def _c_string(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def human_tty_lines(entries: Iterable[UtmpEntry], ignore_users: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(user, tty) of the interactive sessions: USER_PROCESS records of a named user on a real tty.

    Not human: LOGIN/INIT/DEAD/boot records, records without a user, X displays (":0", no tty device),
    a line that is not a plain device name, and the users the operator lists as automation accounts."""
    sessions = []
    for entry in entries:
        if entry.type != UTMP_USER_PROCESS or not entry.user or entry.user in ignore_users:
            continue
        if not _is_tty_name(entry.line):
            continue
        sessions.append((entry.user, entry.line))
    return sessions


def _is_tty_name(line: str) -> bool:
    # "pts/3", "tty1", "ttyS0"; never a path that leaves /dev or an X display such as ":0".
    return bool(re.fullmatch(r"(pts/\d+|tty[A-Za-z]*\d+)", line))


def tty_sightings(
    utmp_path: str = UTMP_DEFAULT_PATH, dev_root: str = "/dev", ignore_users: Sequence[str] = ()
) -> list[Sighting]:
    """Last input per interactive terminal: the access time of its tty device."""
    with open(utmp_path, "rb") as handle:
        entries = parse_utmp(handle.read())
    sightings = []
    for user, line in human_tty_lines(entries, ignore_users):
        try:
            atime = os.stat(os.path.join(dev_root, line)).st_atime
        except OSError:
            LOG.info("tty %s of %s has no device (session gone): skipped", line, user)
            continue
        sightings.append(Sighting(f"tty {line} ({user})", atime))
    return sightings


# `who -u`: user, line, login time (ISO in the C locale, "May  1 09:12" in others), idle, pid, (host).
WHO_U_LINE = re.compile(
    r"^(?P<user>\S+)\s+(?P<line>\S+)\s+"
    r"(?P<login>\d{4}-\d\d-\d\d \d\d:\d\d|[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d)\s+"
    r"(?P<idle>\.|old|\?|\d+:\d\d)\s+(?P<pid>\d+)(?:\s+\((?P<host>[^)]*)\))?\s*$"
)
WHO_OLD_MINUTES = 24 * 60  # `who` prints "old" past 24 h: that is the least it can be


def parse_who_u(text: str, now: float, ignore_users: Sequence[str] = ()) -> list[Sighting]:
    """Sightings from `who -u` output: "." is input within the last minute, "HH:MM" the idle time."""
    sightings = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        match = WHO_U_LINE.match(raw)
        if match is None:
            LOG.warning("ignoring a `who -u` line that does not parse: %r", raw)
            continue
        user, line, idle = match.group("user"), match.group("line"), match.group("idle")
        if user in ignore_users or not _is_tty_name(line) or idle == "?":
            continue
        if idle == ".":
            minutes = 0
        elif idle == "old":
            minutes = WHO_OLD_MINUTES
        else:
            hours, mins = idle.split(":")
            minutes = int(hours) * 60 + int(mins)
        sightings.append(Sighting(f"who {line} ({user})", now - minutes * 60))
    return sightings


def who_u_sightings(now: float, ignore_users: Sequence[str] = ()) -> list[Sighting]:
    out = subprocess.run(
        ["who", "-u"], capture_output=True, text=True, timeout=10, check=True, env={"LC_ALL": "C", "PATH": _PATH}
    )
    return parse_who_u(out.stdout, now, ignore_users)


_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# --- source 2: Jupyter servers ------------------------------------------------------------------------------


def parse_jupyter_time(value: object) -> float:
    """Epoch seconds of a Jupyter timestamp ("2024-05-01T09:41:07.123456Z"); ValueError if it is not one.

    Jupyter writes UTC; a timestamp without an offset is read as UTC."""
    if not isinstance(value, str):
        raise ValueError(f"not a string: {value!r}")
    text = value.strip()
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:?\d\d)?", text)
    if match is None:
        raise ValueError(f"not an ISO-8601 time: {value!r}")
    moment = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")
    fraction = float("0." + match.group(2)) if match.group(2) else 0.0
    offset = match.group(3) or "Z"
    if offset == "Z":
        offset_seconds = 0
    else:
        digits = offset[1:].replace(":", "")
        offset_seconds = (int(digits[:2]) * 3600 + int(digits[2:]) * 60) * (1 if offset[0] == "+" else -1)
    epoch = moment.replace(tzinfo=datetime.timezone.utc).timestamp()
    return epoch - offset_seconds + fraction


def jupyter_runtime_dirs(homes: Iterable[str], environ: dict[str, str] | None = None) -> list[str]:
    """Each user's runtime directory and JUPYTER_RUNTIME_DIR, if they exist, without duplicates."""
    environ = os.environ if environ is None else environ
    candidates = [os.path.join(home, ".local", "share", "jupyter", "runtime") for home in homes]
    if environ.get("JUPYTER_RUNTIME_DIR"):
        candidates.append(environ["JUPYTER_RUNTIME_DIR"])
    seen: list[str] = []
    for path in candidates:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def jupyter_runtime_files(runtime_dirs: Iterable[str]) -> list[str]:
    files = []
    for directory in runtime_dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError as error:
            LOG.warning("cannot list Jupyter runtime directory %s: %s", directory, error)
            continue
        for name in names:
            if name.startswith(JUPYTER_RUNTIME_PREFIXES) and name.endswith(".json"):
                files.append(os.path.join(directory, name))
    return files


class JupyterServer(NamedTuple):
    base_url: str  # always http(s)://<loopback>:<port>/<base>/
    token: str
    label: str


def jupyter_server_from_runtime(info: object, label: str, proc_root: str = "/proc") -> JupyterServer | None:
    """The loopback API address and token of one runtime file, or None (logged) when it is not usable.

    Never another host: a runtime file is written by whoever started the server, so its URL is input."""
    if not isinstance(info, dict):
        LOG.warning("ignoring %s: not a JSON object", label)
        return None
    pid = info.get("pid")
    if isinstance(pid, int) and os.path.isdir(proc_root) and not os.path.isdir(os.path.join(proc_root, str(pid))):
        LOG.info("ignoring %s: its server (pid %s) is not running", label, pid)
        return None
    if info.get("sock"):
        LOG.info("ignoring %s: servers on a unix socket are not supported", label)
        return None
    url = info.get("url")
    if not isinstance(url, str):
        LOG.warning("ignoring %s: no url", label)
        return None
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or port is None:
        LOG.warning("ignoring %s: unusable url %r", label, url)
        return None
    loopback = _loopback_address(host)
    if loopback is None:
        LOG.warning("ignoring %s: %r is not a loopback address (only this machine's servers are asked)", label, url)
        return None
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    token = info.get("token")
    return JupyterServer(f"{parts.scheme}://{loopback}:{port}{path}", token if isinstance(token, str) else "", label)


def _loopback_address(host: str) -> str | None:
    """The loopback address to connect to for a runtime file's host, or None when it is not this machine.

    "localhost" and the wildcard addresses map to 127.0.0.1 / [::1] without a name lookup."""
    if host in ("localhost", "0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    return f"[{address}]" if address.version == 6 else str(address)


def fetch_json(url: str, token: str, timeout: float) -> object:
    """GET a loopback Jupyter API URL with the server's token; the JSON body or an exception."""
    # no_track_activity: our own poll must not count as activity (jupyter_server honours it on API handlers).
    request = urllib.request.Request(
        url + ("&" if "?" in url else "?") + "no_track_activity=1",
        headers={"Authorization": "token " + token, "Accept": "application/json"},
    )
    # Loopback only: a self-signed certificate proves nothing here, and the token goes where the file says.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=context))
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read(1_000_000).decode("utf-8"))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off this machine: refuse it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.URLError(f"redirect to {newurl} refused")


def jupyter_server_sightings(
    server: JupyterServer, now: float, timeout: float = HTTP_TIMEOUT_SECONDS
) -> list[Sighting]:
    """Server last_activity, each kernel's last_activity, and "now" for a kernel that is executing."""
    sightings = []
    status = fetch_json(server.base_url + "api/status", server.token, timeout)
    if isinstance(status, dict) and "last_activity" in status:
        sightings.extend(_jupyter_time_sighting(f"{server.label} last_activity", status["last_activity"]))
    else:
        LOG.warning("ignoring api/status of %s: unexpected shape", server.label)
    kernels = fetch_json(server.base_url + "api/kernels", server.token, timeout)
    if not isinstance(kernels, list):
        LOG.warning("ignoring api/kernels of %s: not a list", server.label)
        return sightings
    for kernel in kernels:
        if not isinstance(kernel, dict):
            LOG.warning("ignoring a kernel of %s: not an object", server.label)
            continue
        label = f"{server.label} kernel {kernel.get('id', '?')}"
        if kernel.get("execution_state") == "busy":
            sightings.append(Sighting(label + " busy", now))
        elif "last_activity" in kernel:
            sightings.extend(_jupyter_time_sighting(label, kernel["last_activity"]))
    return sightings


def _jupyter_time_sighting(label: str, value: object) -> list[Sighting]:
    try:
        return [Sighting(label, parse_jupyter_time(value))]
    except ValueError as error:
        LOG.warning("ignoring %s: %s", label, error)
        return []


def jupyter_sightings(
    runtime_dirs: Iterable[str],
    now: float,
    timeout: float = HTTP_TIMEOUT_SECONDS,
    proc_root: str = "/proc",
    budget_seconds: float = JUPYTER_BUDGET_SECONDS,
) -> list[Sighting]:
    """Sightings of every live loopback Jupyter server, within a time budget for all of them together.

    Any local user can write runtime files; the budget keeps a pile of slow fake servers from making the
    whole run miss its minute (what is not asked in time is simply not seen)."""
    sightings = []
    deadline = time.monotonic() + budget_seconds
    for path in jupyter_runtime_files(runtime_dirs):
        if time.monotonic() > deadline:
            LOG.warning("Jupyter budget of %.0f s spent: %s and later runtime files not asked", budget_seconds, path)
            break
        try:
            info = json.loads(read_small_file(path, RUNTIME_FILE_MAX_BYTES))
        except (OSError, ValueError) as error:
            LOG.warning("ignoring Jupyter runtime file %s: %s", path, error)
            continue
        server = jupyter_server_from_runtime(info, "jupyter " + os.path.basename(path), proc_root)
        if server is None:
            continue
        try:
            sightings.extend(jupyter_server_sightings(server, now, timeout))
        except (OSError, ValueError, urllib.error.URLError) as error:
            LOG.warning("no answer from %s: %s", server.label, error)
    return sightings


def read_small_file(path: str, max_bytes: int) -> bytes:
    """A regular file's bytes; OSError/ValueError for a FIFO, a device or anything larger than max_bytes.

    Opened non-blocking and checked before reading: a runtime "file" may be a FIFO or /dev/zero behind a
    symlink planted by another local user."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"larger than {max_bytes} bytes")
        return handle.read(max_bytes)


# --- source 3: VS Code remote -------------------------------------------------------------------------------


def vscode_sightings(homes: Iterable[str]) -> list[Sighting]:
    """The newest save made through a VS Code remote window, per user.

    VS Code keeps a local history of every save of a remote file on the remote machine, under the
    server's data/User/History/<file hash>/entries.json (rewritten at each save, also auto-save while
    typing). A connected but untouched window writes nothing there, so it is never active forever;
    a connection alone (no save) is not input."""
    sightings = []
    for home in homes:
        for server_dir in VSCODE_SERVER_DIRS:
            history = os.path.join(home, server_dir, "data", "User", "History")
            try:
                names = os.listdir(history)
            except OSError:
                continue
            newest = None
            for name in names:
                try:
                    mtime = os.stat(os.path.join(history, name, "entries.json")).st_mtime
                except OSError:
                    continue
                newest = mtime if newest is None else max(newest, mtime)
            if newest is not None:
                sightings.append(Sighting(f"vscode save ({os.path.basename(home.rstrip('/'))})", newest))
    return sightings


def vscode_terminal_sightings(proc_root: str = "/proc", dev_root: str = "/dev") -> list[Sighting]:
    """Last input in VS Code's integrated terminals: the access time of each terminal shell's pty.

    Those pseudo-terminals are not in utmp. Their shells are children of the VS Code server's pty host (a
    process under ~/.vscode-server or ~/.vscode-remote started with --type=ptyHost), and a shell's
    controlling terminal is in /proc/<pid>/stat, readable without privilege. As with SSH terminals, only
    what the person types touches the access time; an open terminal nobody types in ages."""
    processes = _processes(proc_root)
    pty_hosts = {pid for pid, (cmdline, _ppid, _tty) in processes.items() if _is_vscode_pty_host(cmdline)}
    sightings = []
    seen: set[int] = set()
    for _cmdline, ppid, tty_nr in processes.values():
        index = _pts_index(tty_nr)
        if ppid not in pty_hosts or index is None or index in seen:
            continue
        seen.add(index)
        try:
            atime = os.stat(os.path.join(dev_root, "pts", str(index))).st_atime
        except OSError:
            continue
        sightings.append(Sighting(f"vscode terminal pts/{index}", atime))
    return sightings


def _processes(proc_root: str) -> dict[int, tuple[str, int, int]]:
    """pid -> (command line, parent pid, controlling tty number) of every process still there."""
    table = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, name, "cmdline"), "rb") as handle:
                cmdline = handle.read(8192).replace(b"\0", b" ").decode("utf-8", "replace")
            with open(os.path.join(proc_root, name, "stat"), "rb") as handle:
                line = handle.read(4096).decode("utf-8", "replace")
            # "pid (comm) state ppid pgrp session tty_nr ...": comm may hold spaces and parentheses.
            fields = line[line.rindex(")") + 2 :].split()
            table[int(name)] = (cmdline, int(fields[1]), int(fields[4]))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
    return table


def _is_vscode_pty_host(cmdline: str) -> bool:
    return "--type=ptyHost" in cmdline and any("/" + name + "/" in cmdline for name in VSCODE_SERVER_DIRS)


def _pts_index(tty_nr: int) -> int | None:
    """/dev/pts/<index> of a controlling-terminal number, None for anything but a pseudo-terminal slave."""
    major = (tty_nr >> 8) & 0xFFF
    minor = (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    if not 136 <= major <= 143:  # UNIX98_PTY_SLAVE_MAJOR and its 7 companions
        return None
    return (major - 136) * 256 + minor


# --- wiring: every source, each one fenced, then the decision -----------------------------------------------


class Settings(NamedTuple):
    utmp_path: str = UTMP_DEFAULT_PATH
    dev_root: str = "/dev"
    homes: Sequence[str] | None = None  # None: every home directory in the password database
    ignore_users: Sequence[str] = ()
    http_timeout: float = HTTP_TIMEOUT_SECONDS
    proc_root: str = "/proc"
    use_who: bool = True  # fall back to `who -u` when utmp cannot be read
    environ: dict[str, str] | None = None


def user_homes() -> list[str]:
    homes = []
    for entry in pwd.getpwall():
        if entry.pw_dir and entry.pw_dir != "/" and os.path.isdir(entry.pw_dir) and entry.pw_dir not in homes:
            homes.append(entry.pw_dir)
    return homes


def collect(now: float, settings: Settings | None = None) -> tuple[float, list[Sighting]]:
    """(minutes since the last human input, the sightings behind it). Never raises."""
    settings = Settings() if settings is None else settings
    homes: Sequence[str] = ()
    try:
        homes = user_homes() if settings.homes is None else settings.homes
    except Exception:
        LOG.exception("cannot list home directories: Jupyter and VS Code sources see nothing")

    def terminals() -> list[Sighting]:
        try:
            return tty_sightings(settings.utmp_path, settings.dev_root, settings.ignore_users)
        except (OSError, struct.error) as error:
            if not settings.use_who:
                raise
            LOG.info("utmp unreadable (%s): falling back to `who -u`", error)
            return who_u_sightings(now, settings.ignore_users)

    sources: list[tuple[str, Callable[[], list[Sighting]]]] = [
        ("tty", terminals),
        (
            "jupyter",
            lambda: jupyter_sightings(
                jupyter_runtime_dirs(homes, settings.environ), now, settings.http_timeout, settings.proc_root
            ),
        ),
        ("vscode", lambda: vscode_sightings(homes)),
        ("vscode-terminal", lambda: vscode_terminal_sightings(settings.proc_root, settings.dev_root)),
    ]
    sightings: list[Sighting] = []
    for name, source in sources:
        try:
            sightings.extend(source())
        except Exception:
            # One broken source must not hide the others; the log says which one.
            LOG.exception("source %s failed; the other sources still count", name)
    return minutes_since_input(sightings, now), sightings


# --- publishing ---------------------------------------------------------------------------------------------


def statsd_packet(minutes: float) -> bytes:
    """The StatsD gauge line. No tags: the CloudWatch agent appends this machine's InstanceId.

    The value is clamped and printed unsigned: a leading "+" or "-" would make StatsD add, not set."""
    value = min(float(CAP_MINUTES), max(0.0, minutes))
    return (f"{METRIC_NAME}:{_format_number(value)}|g").encode("ascii")


def _format_number(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def parse_address(text: str) -> tuple[str, int]:
    """A loopback "host:port" for the StatsD listener; ValueError otherwise."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    if _loopback_address(host) is None or host in ("0.0.0.0", "::", ""):
        raise ValueError(f"the StatsD listener must be a loopback address, got {host!r}")
    return ("127.0.0.1" if host == "localhost" else host), int(port_text)


def send_statsd(packet: bytes, address: tuple[str, int]) -> None:
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.sendto(packet, address)


def main(argv: Sequence[str] | None = None, clock: Callable[[], float] = time.time) -> int:
    parser = argparse.ArgumentParser(description="Publish minutes since the last human input on this machine.")
    parser.add_argument("--print", action="store_true", help="print the value and its evidence; send nothing")
    parser.add_argument("--statsd", default=STATSD_DEFAULT, help="loopback StatsD listener (default %(default)s)")
    parser.add_argument("--utmp", default=UTMP_DEFAULT_PATH, help="utmp file (default %(default)s)")
    parser.add_argument(
        "--ignore-user", action="append", default=[], help="a non-human account whose terminals never count"
    )
    parser.add_argument(
        "--home", action="append", default=[], help="look only in this home directory (default: every user's)"
    )
    parser.add_argument("--proc-root", default="/proc", help="procfs to read (a container sees the host's elsewhere)")
    parser.add_argument("--dev-root", default="/dev", help="device directory holding the ttys")
    parser.add_argument("--timeout", type=float, default=HTTP_TIMEOUT_SECONDS, help="Jupyter API timeout, seconds")
    parser.add_argument("--verbose", action="store_true", help="log every skipped source")
    args = parser.parse_args(argv)
    try:
        address = parse_address(args.statsd)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="idle-reaper-activity %(levelname)s %(message)s"
    )
    now = clock()
    minutes, sightings = collect(
        now,
        Settings(
            utmp_path=args.utmp,
            dev_root=args.dev_root,
            proc_root=args.proc_root,
            homes=tuple(args.home) or None,
            ignore_users=tuple(args.ignore_user),
            http_timeout=args.timeout,
        ),
    )
    if args.print:
        for sighting in sorted(sightings, key=lambda s: -s.at):
            shown = sighting_minutes(sighting, now)
            print(f"{sighting.source:<50} {'ignored' if shown is None else _format_number(shown) + ' min'}")
        print(f"{METRIC_NAME} {_format_number(minutes)}")
        return 0
    try:
        send_statsd(statsd_packet(minutes), address)
    except OSError as error:
        LOG.error("cannot send to the CloudWatch agent at %s:%d: %s", address[0], address[1], error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
