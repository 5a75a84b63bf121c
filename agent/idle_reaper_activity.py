#!/usr/bin/env python3
"""idle-reaper human-activity collector: minutes since the last human input on this machine.

A machine where a person is working is busy even at 1 % CPU and 0 % GPU. Every minute (systemd timer)
this script looks at three sources of human input, takes the most recent, and sends the number of
minutes since then to the local CloudWatch agent as a StatsD gauge (`idle_reaper_minutes_since_input`).
The agent adds this machine's `InstanceId`; the reaper's sweep reads the metric next to CPU and GPU.

Sources (each one is optional; a failure in one never hides the others). Input is what a person sends:
a keystroke, a cell run, a file saved. What a program prints, displays or sends (a progress bar, a logging
thread, a widget updating, an open tab polling) is never read as input.
  tty      interactive terminals: the access time of every /dev/pts/<n> (the kernel sets it when the
           terminal's reader gets input, never on output), and ttys from utmp (USER_PROCESS records with a
           tty, the access time of /dev/<tty>, what `who -u` reports as idle; `who -u` itself when utmp
           cannot be read).
  jupyter  cells run in IPython kernels (every Python notebook's kernel): the modification time of each
           user's IPython history database (~/.ipython/profile_*/history.sqlite), which IPython writes when
           a cell arrives to be run and never for output. jupyter_server's own `last_activity` of a kernel
           is refreshed by the kernel's output too, so it is read only for kernels that are not IPython (R,
           Julia, ...), whose input cannot be told from their output: there output counts, the reaper does
           less. Notebooks edited: the open notebooks' `last_modified`, from running Jupyter servers found
           through their runtime files (jpserver-*.json, nbserver-*.json), when what the save wrote changed
           a cell's source: an open tab saves a notebook whose outputs changed too (JupyterLab marks it
           unsaved when output arrives and autosaves it), and that is a program's doing. A busy kernel is not
           input, nor the server's own `last_activity` (an open tab's polling refreshes it).
  vscode   VS Code remote: the newest save recorded in the server's local history
           (~/.vscode-server/data/User/History/*/entries.json); its terminals are ptys (tty above). An open
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
import hashlib
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
from typing import Any, Callable, NamedTuple

LOG = logging.getLogger("idle_reaper_activity")

METRIC_NAME = "idle_reaper_minutes_since_input"
CAP_MINUTES = 10080  # one week: "no human input seen"; also the ceiling of every published value
STATSD_DEFAULT = "127.0.0.1:8125"
STATE_DIR_DEFAULT = "/var/lib/idle-reaper-activity"  # the unit's StateDirectory: writable under ProtectSystem
# A timestamp this far ahead of our clock is not input (a corrupt file time, a hostile local user): ignored.
# Within it, it counts as now: file times and Jupyter's clock are this machine's clock, so a time a little
# ahead is an input just before the clock was stepped back (NTP corrects a drifting clock by seconds to
# minutes), and reading it as "no input" would call a person at the keyboard absent for the size of the step.
FUTURE_TOLERANCE_SECONDS = 600.0
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


def sighting_minutes(sighting: Sighting, now: float, cap: int = CAP_MINUTES, log: bool = True) -> float | None:
    """Minutes since one sighting, or None (logged, unless `log` is off) when its time is garbage or far
    in the future. A time up to FUTURE_TOLERANCE_SECONDS ahead (a clock stepped back) is now."""
    at = sighting.at
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at):
        if log:
            LOG.warning("ignoring %s: its time %r is not a number", sighting.source, at)
        return None
    if at > now + FUTURE_TOLERANCE_SECONDS:
        if log:
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


def pty_sightings(dev_root: str = "/dev", ignore_users: Sequence[str] = ()) -> list[Sighting]:
    """Last input on every pseudo-terminal: the access time of /dev/pts/<n>.

    Every interactive terminal is a pty: SSH sessions, tmux and screen panes, `docker exec -it`, Jupyter and
    VS Code terminals. The kernel updates a pty's access time when its reader (the shell, or a program
    reading the keyboard) gets input, and only its modification time when output is written: a terminal
    printing for hours with a browser connected stays as old as its last keystroke (to 8 s, the kernel's
    granularity). Read from the device directory itself, it needs neither utmp (containers and some images
    write none) nor /proc (hidepid). The user is the device's owner; `ignore_users` are automation accounts."""
    directory = os.path.join(dev_root, "pts")
    sightings = []
    for name in os.listdir(directory):
        if not name.isdigit():
            continue  # ptmx
        try:
            info = os.stat(os.path.join(directory, name))
        except OSError:
            continue  # closed meanwhile
        user = _user_name(info.st_uid)
        if user in ignore_users:
            continue
        sightings.append(Sighting(f"pty pts/{name} ({user})", info.st_atime))
    return sightings


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


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


def jupyter_runtime_dirs(
    homes: Iterable[str], environ: dict[str, str] | None = None, extra: Iterable[str] = ()
) -> list[str]:
    """Every directory where a Jupyter server may have written its runtime file, that exists.

    The collector runs as its own user under systemd: its environment says nothing of where a user's
    server writes (JUPYTER_RUNTIME_DIR, JUPYTER_DATA_DIR, XDG_DATA_HOME). So it looks where they usually
    point: each home's ~/.local/share/jupyter/runtime, any `jupyter/runtime` or `runtime` directory holding
    runtime files a few levels under a home (bounded), the old XDG_RUNTIME_DIR location
    /run/user/<uid>/jupyter, its own JUPYTER_RUNTIME_DIR, and directories the admin names (--jupyter-dir).
    A server whose runtime file is still not found is named by jupyter_processes_without_runtime_file."""
    environ = os.environ if environ is None else environ
    candidates = [os.path.join(home, ".local", "share", "jupyter", "runtime") for home in homes]
    for home in homes:
        candidates.extend(_runtime_dirs_under(home))
    candidates.extend(_glob_dirs("/run/user", "jupyter"))
    if environ.get("JUPYTER_RUNTIME_DIR"):
        candidates.append(environ["JUPYTER_RUNTIME_DIR"])
    candidates.extend(extra)
    seen: list[str] = []
    for path in candidates:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


RUNTIME_SEARCH_DEPTH = 4
RUNTIME_SEARCH_DIRS = 2000  # directories looked into per home, at most
_NOT_SEARCHED = {"node_modules", ".git", ".cache", "site-packages", ".npm", ".conda", "envs", "pkgs", "__pycache__"}


def _runtime_dirs_under(home: str) -> list[str]:
    """Directories a few levels under `home` that hold Jupyter runtime files: where XDG_DATA_HOME,
    JUPYTER_DATA_DIR or JUPYTER_RUNTIME_DIR point inside a home. Bounded in depth and in directories read."""
    found: list[str] = []
    budget = RUNTIME_SEARCH_DIRS
    level = [home]
    for _ in range(RUNTIME_SEARCH_DEPTH):
        below: list[str] = []
        for directory in level:
            budget -= 1
            if budget < 0:
                return found
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            if any(e.name.startswith(JUPYTER_RUNTIME_PREFIXES) and e.name.endswith(".json") for e in entries):
                found.append(directory)
            below.extend(e.path for e in entries if e.name not in _NOT_SEARCHED and e.is_dir(follow_symlinks=False))
        level = below
    return found


def _glob_dirs(root: str, child: str) -> list[str]:
    try:
        return [os.path.join(root, name, child) for name in os.listdir(root)]
    except OSError:
        return []


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
    base_urls: tuple[str, ...]  # http(s)://<an address of this machine>:<port>/<base>/, to try in order
    token: str
    label: str
    root_dir: str  # where its notebooks are: read when the API refuses us (a password, no token)
    pid: int | None


def pid_alive(pid: int) -> bool:
    """Whether a process exists, also where /proc hides other users' processes (hidepid): signal 0 is
    refused (EPERM) for a process that exists and is not ours, and fails with ESRCH for one that does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def jupyter_server_from_runtime(
    info: object, label: str, alive: Callable[[int], bool] = pid_alive
) -> JupyterServer | None:
    """Where to ask one runtime file's server, or None (logged) when it is not usable.

    Never another host: a runtime file is written by whoever started the server, so its URL is input. The
    server is asked on loopback at its own port and base URL (jupyter_server 2 writes the machine's
    hostname into `url` when it listens on 0.0.0.0); when it listens on one address of this machine only,
    that address is tried next. Any other host is refused."""
    if not isinstance(info, dict):
        LOG.warning("ignoring %s: not a JSON object", label)
        return None
    pid = info.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and not alive(pid):
        LOG.info("ignoring %s: its server (pid %s) is not running", label, pid)
        return None
    if info.get("sock"):
        LOG.info("ignoring %s: servers on a unix socket are not supported", label)
        return None
    url = info.get("url")
    parts = urllib.parse.urlsplit(url if isinstance(url, str) else "")
    try:
        port = info.get("port") if isinstance(info.get("port"), int) else parts.port
    except ValueError:
        port = None
    scheme = "https" if info.get("secure") is True else parts.scheme or "http"
    if scheme not in ("http", "https") or not isinstance(port, int) or not 0 < port < 65536:
        LOG.warning("ignoring %s: unusable url %r", label, url)
        return None
    base = info.get("base_url") if isinstance(info.get("base_url"), str) else parts.path
    base = "/" + str(base).strip("/") + "/" if str(base).strip("/") else "/"
    hosts = ["127.0.0.1"]
    for named in (info.get("hostname"), parts.hostname):
        if isinstance(named, str) and named not in ("", "localhost", "0.0.0.0", "::"):
            address = _local_address(named)
            if address is None:
                # A name (jupyter_server writes the hostname) is looked up nowhere: loopback only.
                if _is_ip(named):
                    LOG.warning("ignoring %s: %r is not an address of this machine", label, url)
                    return None
                continue
            if address not in hosts:
                hosts.append(address)
    token = info.get("token")
    root = info.get("root_dir") or info.get("notebook_dir")
    return JupyterServer(
        tuple(f"{scheme}://{host}:{port}{base}" for host in hosts),
        token if isinstance(token, str) else "",
        label,
        root if isinstance(root, str) else "",
        pid if isinstance(pid, int) else None,
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _local_address(host: str) -> str | None:
    """The URL form of `host` when it is an IP address of this machine (loopback, or one it can bind),
    else None. Never a name lookup: a name in a runtime file is input."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    text = f"[{address}]" if address.version == 6 else str(address)
    if address.is_loopback:
        return text
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))  # succeeds only for an address of this machine
    except OSError:
        return None
    return text


class JupyterRefused(Exception):
    """The server answered 401 or 403: it wants a password, or the runtime file's token is not its own."""


class AddressRefused(OSError):
    """Connecting to the server was refused by this machine itself (EPERM/EACCES on connect): the unit's
    IPAddressAllow= does not name that address (a new one since install.sh ran), or a local firewall."""


def own_addresses(proc_net: str = "/proc/net") -> list[str]:
    """This machine's IP addresses besides loopback and link-local, as its kernel lists them: IPv4 from the host
    routes marked LOCAL in fib_trie, IPv6 from if_inet6. install.sh names them in the unit's IPAddressAllow=
    (systemd has no word for "this machine's own addresses"), so that a Jupyter server listening on one of them
    only can be asked there."""
    found: list[str] = []
    try:
        with open(os.path.join(proc_net, "fib_trie")) as handle:
            lines = [line.strip() for line in handle]
        found += [
            before[4:]
            for before, line in zip(lines, lines[1:])
            if line == "/32 host LOCAL" and before.startswith("|-- ")
        ]
    except OSError as error:
        LOG.info("cannot read IPv4 addresses: %s", error)
    try:
        with open(os.path.join(proc_net, "if_inet6")) as handle:
            found += [str(ipaddress.IPv6Address(int(line.split()[0], 16))) for line in handle if line.split()]
    except (OSError, ValueError) as error:
        LOG.info("cannot read IPv6 addresses: %s", error)
    addresses: list[str] = []
    for text in found:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if not (address.is_loopback or address.is_link_local) and str(address) not in addresses:
            addresses.append(str(address))
    return addresses


def fetch_json(url: str, token: str, timeout: float, max_bytes: int = 1_000_000) -> object:
    """GET a Jupyter API URL on this machine with the server's token; the JSON body or an exception."""
    # no_track_activity: our own poll must not count as activity (jupyter_server honours it on API handlers).
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = "token " + token
    request = urllib.request.Request(url + ("&" if "?" in url else "?") + "no_track_activity=1", headers=headers)
    # This machine only: a self-signed certificate proves nothing here, and the token goes where the file says.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise ValueError(f"more than {max_bytes:,} bytes")
            return json.loads(body.decode("utf-8"))
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise JupyterRefused(f"HTTP {error.code}") from error
        raise


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off this machine: refuse it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.URLError(f"redirect to {newurl} refused")


MAX_SESSIONS = 50  # notebooks asked for their last save, per server


def jupyter_server_sightings(
    server: JupyterServer,
    now: float,
    timeout: float = HTTP_TIMEOUT_SECONDS,
    edits: NotebookEdits | None = None,
) -> list[Sighting]:
    """What a person did in one server that only the server can tell: a notebook edited (the open notebooks'
    last save that changed a cell's source, `edits`: see NotebookEdits; JupyterLab saves an edited notebook
    every two minutes), and the cells run in a kernel that is not IPython (its last_activity: see
    _kernel_sightings).

    Not input, and not read: an IPython kernel's last_activity (jupyter_server refreshes it on the kernel's
    output: its cells are read from IPython's history, ipython_input_sightings), the server's own
    last_activity (the front end's polling refreshes it every ~10 s while a tab is open, and terminal output
    refreshes it too), a busy kernel (a hung cell or a pending input() is busy forever at 0 % CPU; a working
    one shows in CPU/GPU), terminals (their ptys are read by pty_sightings, where only typing counts)."""
    error: Exception | None = None
    refused = []
    for base in server.base_urls:
        try:
            kernels = fetch_json(base + "api/kernels", server.token, timeout)
        except (OSError, ValueError) as failure:  # URLError is an OSError: not listening there
            error = failure
            if isinstance(getattr(failure, "reason", failure), PermissionError):
                refused.append(urllib.parse.urlsplit(base).hostname or base)
            continue
        saves = _notebook_save_sightings(server, base, timeout, NotebookEdits() if edits is None else edits)
        return _kernel_sightings(server, kernels, base, timeout) + saves
    if refused:
        raise AddressRefused(f"connecting to {', '.join(refused)} is not permitted here ({error})")
    raise error if error else OSError("no address to ask")


def _kernel_sightings(server: JupyterServer, kernels: object, base: str, timeout: float) -> list[Sighting]:
    """The idle kernels that are not IPython, each at its last_activity.

    jupyter_server (2.x, services/kernels/kernelmanager.py, start_watching_activity) sets a kernel's
    last_activity on the messages the kernel publishes on IOPub, output among them: a `stream` whose parent is
    the cell that started a printing thread, a widget's `comm_msg`, anything while busy. Nothing the server
    keeps records when a client last sent the kernel a request. So an IPython kernel's last_activity is not
    read (its cells are read from IPython's history); a kernel IPython's history does not cover (R, Julia,
    a kernel whose spec the server does not list) is read as before: its output counts, the reaper does less."""
    if not isinstance(kernels, list):
        LOG.warning("ignoring api/kernels of %s: not a list", server.label)
        return []
    idle = []
    for kernel in kernels:
        if not isinstance(kernel, dict):
            LOG.warning("ignoring a kernel of %s: not an object", server.label)
        elif kernel.get("execution_state") != "idle":
            LOG.info(
                "%s kernel %s is %s: not input", server.label, kernel.get("id", "?"), kernel.get("execution_state")
            )
        elif "last_activity" in kernel:
            idle.append(kernel)
    ipython = _ipython_kernel_names(server, base, timeout) if idle else set()
    sightings = []
    for kernel in idle:
        label = f"{server.label} kernel {kernel.get('id', '?')}"
        if kernel.get("name") in ipython:
            LOG.info("%s is IPython: its cells are read from its history, not its last_activity (output)", label)
        else:
            sightings.extend(
                _jupyter_time_sighting(f"{label} ({kernel.get('name')}) idle since", kernel["last_activity"])
            )
    return sightings


def _ipython_kernel_names(server: JupyterServer, base: str, timeout: float) -> set[str]:
    """The kernel names whose spec runs ipykernel (`python -m ipykernel_launcher`, SageMaker's conda_* kernels
    too); empty when the server does not say (then every kernel's last_activity is read: the safe side)."""
    try:
        specs = fetch_json(base + "api/kernelspecs", server.token, timeout)
    except (OSError, ValueError) as error:
        LOG.info("no kernel specs from %s (%s): every kernel's last_activity is read", server.label, error)
        return set()
    entries = specs.get("kernelspecs") if isinstance(specs, dict) else None
    names = set()
    for name, entry in (entries if isinstance(entries, dict) else {}).items():
        spec = entry.get("spec") if isinstance(entry, dict) else None
        argv = spec.get("argv") if isinstance(spec, dict) else None
        if isinstance(argv, list) and any(isinstance(arg, str) and "ipykernel" in arg for arg in argv):
            names.add(name)
    return names


def ipython_input_sightings(homes: Iterable[str]) -> list[Sighting]:
    """The last cell run in an IPython kernel (or IPython shell), per user and profile: the modification time
    of ~/.ipython/profile_<name>/history.sqlite (and of its -wal, when IPython is set to keep one).

    IPython stores a cell in that database as the cell arrives to be run (InteractiveShell.run_cell, every
    execute_request that stores history: every cell a person runs), before running it, so a cell running for
    hours is as old as the moment it was sent. Nothing a kernel prints, displays or sends to a widget is
    written there. Starting and shutting down a kernel write it once each (a notebook opened or closed; a
    kernel culled by the server counts once: the reaper waits longer, never less). A cell run by a program
    (papermill) is a cell run; silent executions (extensions) store nothing and do not count."""
    sightings = []
    for home in homes:
        directory = os.path.join(home, ".ipython")
        try:
            profiles = sorted(name for name in os.listdir(directory) if name.startswith("profile_"))
        except OSError:
            continue
        for profile in profiles:
            newest = None
            for name in ("history.sqlite", "history.sqlite-wal"):
                try:
                    mtime = os.stat(os.path.join(directory, profile, name)).st_mtime
                except OSError:
                    continue
                newest = mtime if newest is None else max(newest, mtime)
            if newest is not None:
                user = os.path.basename(home.rstrip("/"))
                sightings.append(Sighting(f"ipython history ({user}, {profile})", newest))
    return sightings


NOTEBOOK_MAX_BYTES = 32 * 1024 * 1024  # a notebook read whole (its outputs with it) to see what a save changed


class NotebookEdits:
    """When each open notebook's cells were last edited, remembered between runs (the state directory's
    notebooks.json): a save counts as input only when it changed a cell's source or the cells themselves (one
    added, removed, moved, its type changed), what a person types.

    JupyterLab marks a notebook unsaved when output reaches an open tab (its shared model sets `dirty` on every
    output change: a printing thread, a progress bar, a widget, an execution count) and autosaves it every two
    minutes (`autosaveInterval`), with nobody at the keyboard: such a save changes outputs only, and is not input.
    A notebook first seen, one whose content cannot be read (past NOTEBOOK_MAX_BYTES, not JSON), or every save
    when nothing can be remembered (no state directory) counts at its save: the reaper does less, never more."""

    def __init__(self, remembered: dict[str, dict[str, object]] | None = None) -> None:
        self.remembered = remembered or {}
        self.seen: dict[str, dict[str, object]] = {}  # what this run found: the next run's memory

    @classmethod
    def load(cls, state_dir: str | None) -> NotebookEdits:
        if not state_dir:
            return cls()
        try:
            remembered = json.loads(read_small_file(os.path.join(state_dir, "notebooks.json"), 4 * 1024 * 1024))
        except (OSError, ValueError):
            return cls()
        return cls(remembered if isinstance(remembered, dict) else {})

    def save(self, state_dir: str | None) -> None:
        if not state_dir:
            return
        path = os.path.join(state_dir, "notebooks.json")
        try:
            with open(path + ".tmp", "w") as handle:
                json.dump(self.seen, handle)
            os.replace(path + ".tmp", path)
        except OSError as error:
            LOG.info("cannot remember the notebooks' edits in %s: %s", state_dir, error)

    def edited_at(self, key: str, saved: str, read_cells: Callable[[], str | None]) -> float:
        """When the notebook `key`, saved at `saved` (its last_modified), was last edited. `read_cells`: a
        digest of its cells' types and sources, read only when the save is new (None: not readable)."""
        before = self.remembered.get(key)
        if isinstance(before, dict) and before.get("saved") == saved and isinstance(before.get("edited"), float):
            self.seen[key] = before
            return float(before["edited"])
        cells = read_cells()
        edited = parse_jupyter_time(saved)
        if (
            cells is not None
            and isinstance(before, dict)
            and before.get("cells") == cells
            and isinstance(before.get("edited"), float)
        ):
            edited = float(before["edited"])  # outputs, counts or metadata saved: not a person's edit
            LOG.info("notebook %s saved with its cells unchanged: not input", key)
        self.seen[key] = {"saved": saved, "cells": cells, "edited": edited}
        return edited


def cells_digest(model: object) -> str | None:
    """A digest of a notebook model's cells, as a person writes them: each cell's type and source, in order.
    Outputs, execution counts, ids and metadata are left out. None: not a notebook model."""
    content = model.get("content") if isinstance(model, dict) else None
    cells = content.get("cells") if isinstance(content, dict) else None
    if not isinstance(cells, list):
        return None
    written = []
    for cell in cells:
        if not isinstance(cell, dict):
            return None
        source = cell.get("source", "")
        written.append([cell.get("cell_type"), "".join(source) if isinstance(source, list) else source])
    return hashlib.sha256(json.dumps(written).encode("utf-8")).hexdigest()


def _notebook_save_sightings(server: JupyterServer, base: str, timeout: float, edits: NotebookEdits) -> list[Sighting]:
    try:
        sessions = fetch_json(base + "api/sessions", server.token, timeout)
    except (OSError, ValueError) as error:
        LOG.info("no sessions from %s: %s", server.label, error)
        return []
    if not isinstance(sessions, list):
        return []
    sightings = []
    paths = [s.get("path") for s in sessions if isinstance(s, dict) and s.get("type", "notebook") == "notebook"]
    for path in [p for p in paths if isinstance(p, str) and p][:MAX_SESSIONS]:
        url = base + "api/contents/" + urllib.parse.quote(path.lstrip("/"))
        try:
            model = fetch_json(url + "?content=0", server.token, timeout)
        except (OSError, ValueError) as error:
            LOG.info("no model of %s from %s: %s", path, server.label, error)
            continue
        if not isinstance(model, dict) or "last_modified" not in model:
            continue

        def read_cells(url: str = url, path: str = path) -> str | None:
            try:
                return cells_digest(fetch_json(url + "?content=1", server.token, timeout, NOTEBOOK_MAX_BYTES))
            except (OSError, ValueError) as error:
                LOG.info("cannot read %s from %s (%s): its save counts as input", path, server.label, error)
                return None

        label = f"{server.label} notebook {path} edited"
        try:
            at = edits.edited_at(f"{server.label} {path}", str(model["last_modified"]), read_cells)
        except ValueError as error:
            LOG.warning("ignoring %s: %s", label, error)
            continue
        sightings.append(Sighting(label, at))
    return sightings


NOTEBOOK_SCAN_ENTRIES = 20_000  # files and directories looked at under a server's root, at most
NOTEBOOK_SCAN_DEPTH = 6


def notebook_saves_under(root: str, label: str) -> list[Sighting]:
    """The newest notebook save under a server's root directory (bounded): what can be known of a server
    that refuses the API (a password instead of a token). Hidden directories and checkpoints are skipped."""
    newest: float | None = None
    budget = NOTEBOOK_SCAN_ENTRIES
    level = [root]
    for _ in range(NOTEBOOK_SCAN_DEPTH):
        below = []
        for directory in level:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                budget -= 1
                if budget < 0:
                    break
                if entry.name.startswith(".") or entry.name in _NOT_SEARCHED:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    below.append(entry.path)
                elif entry.name.endswith(".ipynb"):
                    try:
                        mtime = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    newest = mtime if newest is None else max(newest, mtime)
        level = below
    return [] if newest is None else [Sighting(f"{label} newest notebook save under {root}", newest)]


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
    alive: Callable[[int], bool] = pid_alive,
    budget_seconds: float = JUPYTER_BUDGET_SECONDS,
    gaps: dict[str, str] | None = None,
    pids: list[int] | None = None,
    edits: NotebookEdits | None = None,
) -> list[Sighting]:
    """Sightings of every live Jupyter server of this machine, within a time budget for all of them together.

    Any local user can write runtime files; the budget keeps a pile of slow fake servers from making the
    whole run miss its minute (what is not asked in time is simply not seen). A server that refuses the API
    (password) is read from its notebooks' saves instead, and that is noted in `gaps` (status shows it)."""
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
        server = jupyter_server_from_runtime(info, "jupyter " + os.path.basename(path), alive)
        if server is None:
            continue
        if pids is not None and server.pid is not None:
            pids.append(server.pid)
        try:
            sightings.extend(jupyter_server_sightings(server, now, timeout, edits))
        except JupyterRefused as refused:
            fallback = notebook_saves_under(server.root_dir, server.label) if server.root_dir else []
            note = f"{server.label} refuses the API ({refused}: a password, or not its token): " + (
                "only notebook saves under its root are seen" if fallback else "nothing is seen"
            )
            if gaps is not None:
                gaps["jupyter"] = note
            sightings.extend(fallback)
        except AddressRefused as refused:
            note = (
                f"{server.label}: {refused}: the unit's IPAddressAllow= names this machine's addresses when "
                "install.sh runs (daily with the association): run it again"
            )
            LOG.warning("%s", note)
            if gaps is not None:
                gaps["jupyter"] = f"{gaps['jupyter']}; {note}" if "jupyter" in gaps else note
        except (OSError, ValueError) as error:
            LOG.warning("no answer from %s: %s", server.label, error)
    return sightings


def jupyter_processes_without_runtime_file(
    runtime_pids: Iterable[int], proc_root: str = "/proc"
) -> tuple[list[tuple[int, str]], str]:
    """Running Jupyter servers whose runtime file was not found ((pid, command line) each), and a note when
    the processes cannot be listed (/proc mounted with hidepid): both mean servers the collector cannot see."""
    known = set(runtime_pids)
    try:
        names = os.listdir(proc_root)
    except OSError as error:
        return [], f"cannot list {proc_root}: {error}"
    if "1" not in names:
        return [], f"{proc_root} hides other users' processes (hidepid): a server without a runtime file goes unseen"
    missing = []
    for name in names:
        if not name.isdigit() or int(name) in known:
            continue
        try:
            with open(os.path.join(proc_root, name, "cmdline"), "rb") as handle:
                argv = handle.read(4096).split(b"\0")
        except OSError:
            continue
        words = [os.path.basename(a.decode("utf-8", "replace")) for a in argv[:4]]
        if _is_jupyter_server(words):
            missing.append((int(name), " ".join(w for w in words if w)))
    return missing, ""


def _is_jupyter_server(words: Sequence[str]) -> bool:
    # "jupyter-lab", "jupyter lab", "python -m jupyter_server", "jupyter-notebook", "jupyter server"
    joined = " ".join(words)
    return bool(
        re.search(r"\bjupyter[- ](lab|notebook|server|nbclassic)\b", joined)
        or re.search(r"-m (jupyter_server|jupyterlab|notebook)\b", joined)
    )


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
    jupyter_dirs: Sequence[str] = ()  # more runtime directories to look in (--jupyter-dir)
    alive: Callable[[int], bool] = pid_alive
    state_dir: str | None = None  # where the notebooks' edits are remembered between runs (NotebookEdits)
    remember: bool = True  # write what was found there (not for --print)


# What the collector could not read, as the second gauge's bits (status names them per machine).
UNREADABLE_BITS = {"terminals": 1, "jupyter": 2}


class Collected(NamedTuple):
    minutes: float  # since the last human input, [0, CAP_MINUTES]
    sightings: list[Sighting]
    gaps: dict[str, str]  # source -> why it could not be read (fully or in part)

    @property
    def unreadable(self) -> int:
        return sum(UNREADABLE_BITS.get(source, 0) for source in self.gaps)


def user_homes() -> list[str]:
    homes = []
    for entry in pwd.getpwall():
        if entry.pw_dir and entry.pw_dir != "/" and os.path.isdir(entry.pw_dir) and entry.pw_dir not in homes:
            homes.append(entry.pw_dir)
    return homes


def collect(now: float, settings: Settings | None = None) -> Collected:
    """Minutes since the last human input, the sightings behind it, and what could not be read. Never raises."""
    settings = Settings() if settings is None else settings
    gaps: dict[str, str] = {}
    homes: Sequence[str] = ()
    try:
        homes = user_homes() if settings.homes is None else settings.homes
    except Exception:
        LOG.exception("cannot list home directories: Jupyter and VS Code sources see nothing")

    def terminals() -> list[Sighting]:
        found: list[Sighting] = []
        problems = []
        try:
            found += pty_sightings(settings.dev_root, settings.ignore_users)
        except OSError as error:
            problems.append(f"pseudo-terminals: {error}")
        try:
            found += tty_sightings(settings.utmp_path, settings.dev_root, settings.ignore_users)
        except (OSError, struct.error) as error:
            if settings.use_who:
                LOG.info("utmp unreadable (%s): falling back to `who -u`", error)
                try:
                    found += who_u_sightings(now, settings.ignore_users)
                except (OSError, subprocess.SubprocessError) as who_error:
                    LOG.info("`who -u` failed too: %s", who_error)
        if problems:
            gaps["terminals"] = "; ".join(problems)
        return found

    def jupyter() -> list[Sighting]:
        pids: list[int] = []
        found = ipython_input_sightings(homes)
        edits = NotebookEdits.load(settings.state_dir)
        found += jupyter_sightings(
            jupyter_runtime_dirs(homes, settings.environ, settings.jupyter_dirs),
            now,
            settings.http_timeout,
            settings.alive,
            gaps=gaps,
            pids=pids,
            edits=edits,
        )
        if settings.remember:
            edits.save(settings.state_dir)
        missing, note = jupyter_processes_without_runtime_file(pids, settings.proc_root)
        unseen = [f"pid {pid} ({command})" for pid, command in missing]
        if unseen:
            note = (
                f"Jupyter server {', '.join(unseen)} runs but its runtime file was not found (its notebooks are "
                "not seen; start it with the default runtime dir, or pass --jupyter-dir)"
            )
            gaps["jupyter"] = f"{gaps['jupyter']}; {note}" if "jupyter" in gaps else note
        elif note and "jupyter" not in gaps:
            LOG.info("%s", note)
        return found

    sources: list[tuple[str, Callable[[], list[Sighting]]]] = [
        ("terminals", terminals),
        ("jupyter", jupyter),
        ("vscode", lambda: vscode_sightings(homes)),
    ]
    sightings: list[Sighting] = []
    for name, source in sources:
        try:
            sightings.extend(source())
        except Exception as error:
            # One broken source must not hide the others; the log says which one, and status shows it.
            LOG.exception("source %s failed; the other sources still count", name)
            gaps.setdefault(name, f"failed: {error}")
    return Collected(minutes_since_input(sightings, now), sightings, gaps)


def report_gaps(gaps: dict[str, str], state_dir: str | None) -> None:
    """Log each source that cannot be read at WARNING once (when it first appears or its reason changes),
    then at INFO: the collector runs every minute. Without a writable state directory, every run warns."""
    path = os.path.join(state_dir, "unreadable.json") if state_dir else None
    said: dict[str, str] = {}
    if path:
        try:
            said = json.loads(read_small_file(path, RUNTIME_FILE_MAX_BYTES))
        except (OSError, ValueError):
            said = {}
    for source, why in sorted(gaps.items()):
        level = logging.INFO if said.get(source) == why else logging.WARNING
        LOG.log(level, "cannot read %s: %s (idle-reaper status shows it)", source, why)
    if path:
        try:
            with open(path + ".tmp", "w") as handle:
                json.dump(gaps, handle)
            os.replace(path + ".tmp", path)
        except OSError as error:
            LOG.info("cannot remember what was said in %s: %s", state_dir, error)


# --- publishing ---------------------------------------------------------------------------------------------


UNREADABLE_METRIC_NAME = "idle_reaper_unreadable_sources"


def unreadable_packet(bits: int) -> bytes:
    """The second gauge: which sources could not be read (UNREADABLE_BITS), 0 when all could."""
    return f"{UNREADABLE_METRIC_NAME}:{max(0, int(bits))}|g".encode("ascii")


def statsd_packet(minutes: float) -> bytes:
    """The StatsD gauge line. No tags: the CloudWatch agent appends this machine's InstanceId.

    The value is clamped and printed unsigned: a leading "+" or "-" would make StatsD add, not set."""
    value = min(float(CAP_MINUTES), max(0.0, minutes))
    return (f"{METRIC_NAME}:{_format_number(value)}|g").encode("ascii")


def _format_number(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _loopback_address(host: str) -> str | None:
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(address) if address.is_loopback else None


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


# --- Studio mode (--cloudwatch): no CloudWatch agent there; publishes what it would (infra/studio.py)

AGENT_NAMESPACE = "CWAgent"
CPU_METRIC, GPU_METRIC = "cpu_usage_active", "nvidia_smi_utilization_gpu"
NET_IN_METRIC, NET_OUT_METRIC = "net_bytes_recv", "net_bytes_sent"
MACHINE_STATE = "machine.json"
SAMPLE_MAX_AGE_SECONDS = 300.0  # an older sample is no interval: no figure
DIMENSION_MAX = 1024


def read_machine(proc_root: str, now: float) -> dict[str, Any]:
    # CPU jiffies (busy, total), bytes (received, sent) but loopback's
    with open(os.path.join(proc_root, "stat"), encoding="ascii") as handle:
        cpu = [float(w) for w in handle.readline().split()[1:9]]
    with open(os.path.join(proc_root, "net", "dev"), encoding="ascii") as handle:
        rows = [line.split(":")[1].split() for line in handle.readlines()[2:] if line.split(":")[0].strip() != "lo"]
    net = [sum(float(r[0]) for r in rows), sum(float(r[8]) for r in rows)]
    return {"at": now, "cpu": [sum(cpu) - cpu[3] - cpu[4], sum(cpu)], "net": net}


def machine_figures(previous: Any, current: dict[str, Any]) -> dict[str, float]:
    # none against a missing or stale sample, nor after a reset
    try:
        age = current["at"] - previous["at"]
        (busy, total), (received, sent) = ([b - a for a, b in zip(previous[k], current[k])] for k in ("cpu", "net"))
    except (KeyError, TypeError, ValueError):
        return {}
    if not 0 < age <= SAMPLE_MAX_AGE_SECONDS:
        return {}
    figures = {CPU_METRIC: round(100.0 * busy / total, 2)} if 0 <= busy <= total and total > 0 else {}
    if received >= 0 and sent >= 0:
        figures.update({NET_IN_METRIC: received, NET_OUT_METRIC: sent})
    return figures


def sample_machine(now: float, proc_root: str, state_dir: str) -> dict[str, float]:
    path = os.path.join(state_dir, MACHINE_STATE)
    try:
        current = read_machine(proc_root, now)
    except (OSError, ValueError, IndexError) as error:
        LOG.error("cannot read CPU or network: %s", error)
        return {}
    try:
        previous = json.loads(read_small_file(path, RUNTIME_FILE_MAX_BYTES))
    except (OSError, ValueError):
        previous = None
    try:
        with open(path, "w", encoding="ascii") as handle:
            json.dump(current, handle)
    except OSError as error:
        LOG.warning("%s", error)
    return machine_figures(previous, current)


def busiest_gpu(run: Callable[..., Any] = subprocess.run) -> float | None:
    query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    try:
        done = run(query, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    values = [float(v) for v in done.stdout.split() if v.isdigit()] if done.returncode == 0 else []
    return max(values) if values else None


def put_metric_data(data: list[dict[str, Any]], region: str) -> None:
    import boto3

    boto3.client("cloudwatch", region_name=region).put_metric_data(Namespace=AGENT_NAMESPACE, MetricData=data)


def publish(collected: Collected, args: argparse.Namespace, now: float) -> int:
    figures = sample_machine(now, args.proc_root, args.state_dir)
    figures[METRIC_NAME] = min(float(CAP_MINUTES), max(0.0, collected.minutes))
    figures[UNREADABLE_METRIC_NAME] = float(collected.unreadable)
    gpu = busiest_gpu()
    if gpu is not None:
        figures[GPU_METRIC] = gpu
    stamp = datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc)
    dimensions = [{"Name": "InstanceId", "Value": args.cloudwatch}]
    data = [{"MetricName": k, "Dimensions": dimensions, "Timestamp": stamp, "Value": v} for k, v in figures.items()]
    try:
        put_metric_data(data, args.region)
    except Exception as error:  # the next run tries again
        LOG.error("cannot publish: %s", error)
        return 1
    return 0


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
    parser.add_argument(
        "--jupyter-dir", action="append", default=[], help="another directory where Jupyter writes runtime files"
    )
    parser.add_argument(
        "--state-dir",
        default=STATE_DIR_DEFAULT,
        help="where to remember which warnings were said and when open notebooks were edited "
        "(default %(default)s; systemd's StateDirectory)",
    )
    parser.add_argument("--verbose", action="store_true", help="log every skipped source")
    parser.add_argument(
        "--own-addresses", action="store_true", help="print this machine's addresses for the unit's IPAddressAllow="
    )
    parser.add_argument("--cloudwatch", metavar="INSTANCE_ID", help="Studio mode: publish by this InstanceId")
    parser.add_argument("--region", help="where to publish (--cloudwatch)")
    args = parser.parse_args(argv)
    if args.cloudwatch is not None and not 0 < len(args.cloudwatch.strip()) <= DIMENSION_MAX:
        parser.error(f"--cloudwatch: 1 to {DIMENSION_MAX} characters")
    if args.cloudwatch is not None and not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", args.region or ""):
        parser.error("--cloudwatch needs --region, such as eu-west-1")
    if args.own_addresses:
        print(" ".join(own_addresses()))
        return 0
    try:
        address = parse_address(args.statsd)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="idle-reaper-activity %(levelname)s %(message)s"
    )
    now = clock()
    collected = collect(
        now,
        Settings(
            utmp_path=args.utmp,
            dev_root=args.dev_root,
            proc_root=args.proc_root,
            homes=tuple(args.home) or None,
            ignore_users=tuple(args.ignore_user),
            http_timeout=args.timeout,
            jupyter_dirs=tuple(args.jupyter_dir),
            state_dir=args.state_dir,
            remember=not args.print,
        ),
    )
    if args.print:
        report_gaps(collected.gaps, None)
        for sighting in sorted(collected.sightings, key=lambda s: -s.at):
            shown = sighting_minutes(sighting, now, log=False)  # collect() already said why one is ignored
            print(f"{sighting.source:<50} {'ignored' if shown is None else _format_number(shown) + ' min'}")
        print(f"{METRIC_NAME} {_format_number(collected.minutes)}")
        print(f"{UNREADABLE_METRIC_NAME} {collected.unreadable}")
        return 0
    report_gaps(collected.gaps, args.state_dir)
    if args.cloudwatch is not None:
        return publish(collected, args, now)
    try:
        send_statsd(statsd_packet(collected.minutes), address)
        send_statsd(unreadable_packet(collected.unreadable), address)
    except OSError as error:
        LOG.error("cannot send to the CloudWatch agent at %s:%d: %s", address[0], address[1], error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
