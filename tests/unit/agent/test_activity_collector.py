"""The on-machine human-activity collector (agent/idle_reaper_activity.py), against real input formats.

The agent is a single stdlib-only file for the machines' system python3, not a package module: it is
imported by path here and is never part of the Lambda asset."""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from testkit.agent_install import fake_commands, installed_unit, run_install
from testkit.fake_jupyter import FakeJupyter

REPO_ROOT = Path(__file__).resolve().parents[3]
AGENT_FILE = REPO_ROOT / "agent" / "idle_reaper_activity.py"
DATA = REPO_ROOT / "tests" / "data" / "activity"


def _load_agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("idle_reaper_activity", AGENT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NamedTuple and dataclass machinery look the module up by name
    spec.loader.exec_module(module)
    return module


agent = _load_agent()

# The fixtures' Jupyter timestamps are on 2024-05-01; the collector's clock is injected.
NOW = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC).timestamp()
BOOT = datetime(2024, 5, 1, 8, 0, 0, tzinfo=UTC).timestamp()


@pytest.fixture(autouse=True)
def x86_64_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The utmp fixtures hold x86_64 records: read them as such on any machine running the tests."""
    monkeypatch.setattr(agent.platform, "machine", lambda: "x86_64")


def minutes_before_now(minutes: float) -> float:
    return NOW - minutes * 60


def make_dev(tmp_path: Path, atimes: dict[str, float]) -> Path:
    """A stand-in for /dev: one file per tty with the given access time (what the kernel sets on input)."""
    dev = tmp_path / "dev"
    (dev / "pts").mkdir(parents=True, exist_ok=True)
    for line, atime in atimes.items():
        device = dev / line
        device.parent.mkdir(parents=True, exist_ok=True)
        device.touch()
        os.utime(device, (atime, atime - 3600))
    return dev


def fake_proc(tmp_path: Path, processes: dict[int, tuple[bytes, str]] | None = None) -> Path:
    """A stand-in for /proc: our own pid (a running Jupyter server) and the given (cmdline, stat) pairs."""
    proc = tmp_path / "proc"
    (proc / str(os.getpid())).mkdir(parents=True, exist_ok=True)
    for pid, (cmdline, stat_line) in (processes or {}).items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cmdline").write_bytes(cmdline)
        (proc / str(pid) / "stat").write_text(stat_line)
    return proc


def nobody_here_args(tmp_path: Path) -> list[str]:
    """Command-line arguments that point every source at an empty stand-in, never at this machine."""
    return [
        "--utmp",
        str(DATA / "utmp-no-sessions.bin"),
        "--home",
        str(tmp_path),
        "--proc-root",
        str(fake_proc(tmp_path)),
        "--dev-root",
        str(make_dev(tmp_path, {})),
        "--state-dir",
        str(tmp_path / "state"),
    ]


# --- the file itself ----------------------------------------------------------------------------------------


def test_agent_uses_python_3_9_syntax_and_only_the_standard_library() -> None:
    source = AGENT_FILE.read_text()
    tree = ast.parse(source, feature_version=(3, 9))  # a `match` or a parenthesised with would fail here

    def imported(root: ast.AST) -> set[str]:
        return {
            alias.name.split(".")[0]
            for node in ast.walk(root)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }

    # boto3 only inside the Studio mode's publish (a Studio image's Python has it; nothing else imports it).
    (publish,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "put_metric_data"]
    others = [n for n in tree.body if n is not publish]
    assert set().union(*(imported(n) for n in others)) <= set(sys.stdlib_module_names) | {"__future__"}
    assert imported(publish) == {"boto3"}
    # `X | Y` is fine in annotations (postponed by the __future__ import), never evaluated at run time.
    assert "from __future__ import annotations" in source
    runtime_unions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and any(isinstance(arg, ast.BinOp) for arg in node.args)
    ]
    assert not runtime_unions


# --- utmp ---------------------------------------------------------------------------------------------------


class GlibcExitStatus(ctypes.Structure):
    _fields_ = (("e_termination", ctypes.c_short), ("e_exit", ctypes.c_short))


class GlibcTimeval32(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_int32), ("tv_usec", ctypes.c_int32))


class GlibcUtmp(ctypes.Structure):
    """glibc's struct utmp (bits/utmp.h) as a C compiler lays it out: an independent check of the offsets."""

    _fields_ = (
        ("ut_type", ctypes.c_short),
        ("ut_pid", ctypes.c_int32),
        ("ut_line", ctypes.c_char * 32),
        ("ut_id", ctypes.c_char * 4),
        ("ut_user", ctypes.c_char * 32),
        ("ut_host", ctypes.c_char * 256),
        ("ut_exit", GlibcExitStatus),
        ("ut_session", ctypes.c_int32),
        ("ut_tv", GlibcTimeval32),
        ("ut_addr_v6", ctypes.c_int32 * 4),
        ("__glibc_reserved", ctypes.c_char * 20),
    )


class GlibcTimeval64(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_int64), ("tv_usec", ctypes.c_int64))


class GlibcUtmpAarch64(ctypes.Structure):
    """The same struct where glibc does not keep 32-bit times (aarch64): `long` session, `struct timeval`."""

    _fields_ = (
        *GlibcUtmp._fields_[:7],
        ("ut_session", ctypes.c_int64),
        ("ut_tv", GlibcTimeval64),
        *GlibcUtmp._fields_[9:],
    )


@pytest.mark.parametrize(
    ("c_struct", "layout", "size"),
    [(GlibcUtmp, agent.UTMP_RECORD, 384), (GlibcUtmpAarch64, agent.UTMP_RECORD_AARCH64, 400)],
)
def test_utmp_layout_matches_the_c_struct(c_struct: type[ctypes.Structure], layout: Any, size: int) -> None:
    assert ctypes.sizeof(c_struct) == layout.size == size
    record = c_struct(ut_type=7, ut_pid=31337, ut_line=b"pts/9", ut_id=b"ts/9", ut_user=b"zoe", ut_host=b"192.0.2.9")
    record.ut_tv.tv_sec, record.ut_tv.tv_usec = 1714557600, 500000
    [entry] = agent.parse_utmp(bytes(record), layout)
    assert entry == agent.UtmpEntry(7, 31337, "pts/9", "zoe", "192.0.2.9", 1714557600.5)


def test_utmp_layout_follows_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    record = GlibcUtmpAarch64(ut_type=7, ut_pid=1, ut_line=b"pts/1", ut_user=b"zoe")
    monkeypatch.setattr(agent.platform, "machine", lambda: "aarch64")
    assert [e.user for e in agent.parse_utmp(bytes(record) * 2)] == ["zoe", "zoe"]
    monkeypatch.setattr(agent.platform, "machine", lambda: "x86_64")
    assert len(agent.parse_utmp(bytes(record) * 2)) == 2 * 400 // 384  # read with the wrong layout


def test_utmp_fixture_parses_every_record_and_ignores_a_partial_one() -> None:
    data = (DATA / "utmp-sessions.bin").read_bytes()
    entries = agent.parse_utmp(data + data[:100], agent.UTMP_RECORD)
    assert len(entries) == 10
    assert [(e.type, e.user, e.line) for e in entries[:4]] == [
        (2, "reboot", "~"),
        (1, "runlevel", "~"),
        (6, "LOGIN", "tty1"),
        (7, "alice", "pts/0"),
    ]
    assert entries[3].host == "203.0.113.7"
    assert entries[3].login_at == pytest.approx(BOOT + 600.123456)


def test_only_interactive_sessions_on_a_tty_count() -> None:
    entries = agent.parse_utmp((DATA / "utmp-sessions.bin").read_bytes(), agent.UTMP_RECORD)
    # Not: boot/run-level/getty/dead records, carol's X display, mallory's path, the automation account.
    assert agent.human_tty_lines(entries, ignore_users=("ci-runner",)) == [
        ("alice", "pts/0"),
        ("bob", "pts/1"),
        ("dave", "pts/4"),
    ]


def test_tty_input_time_is_the_device_access_time(tmp_path: Path) -> None:
    # dave's pts/4 has no device any more (a stale record): skipped, not an error.
    dev = make_dev(tmp_path, {"pts/0": minutes_before_now(42), "pts/1": minutes_before_now(7), "pts/2": NOW})
    sightings = agent.tty_sightings(str(DATA / "utmp-sessions.bin"), str(dev), ignore_users=("ci-runner",))
    assert sorted(sightings) == sorted(
        [
            agent.Sighting("tty pts/0 (alice)", minutes_before_now(42)),
            agent.Sighting("tty pts/1 (bob)", minutes_before_now(7)),
        ]
    )
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(7)


# --- who -u -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        # ".": input within the last minute; "old": idle for more than 24 h; "?": an X display, no tty.
        (
            "who-u-c-locale.txt",
            {"who pts/0 (alice)": 0, "who pts/1 (bob)": 5, "who pts/5 (erin)": 1440, "who tty1 (frank)": 77},
        ),
        ("who-u-en-locale.txt", {"who pts/0 (alice)": 0, "who pts/1 (bob)": 5, "who pts/5 (erin)": 1440}),
    ],
)
def test_who_u_outputs(fixture: str, expected: dict[str, int]) -> None:
    sightings = agent.parse_who_u((DATA / fixture).read_text(), NOW)
    assert {s.source: round((NOW - s.at) / 60) for s in sightings} == expected
    assert agent.minutes_since_input(sightings, NOW) == 0


def test_who_u_garbage_lines_are_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    text = "this is not who output\n" + (DATA / "who-u-c-locale.txt").read_text().splitlines()[1] + "\n"
    with caplog.at_level(logging.WARNING):
        sightings = agent.parse_who_u(text, NOW, ignore_users=())
    assert [s.source for s in sightings] == ["who pts/1 (bob)"]
    assert "does not parse" in caplog.text


# --- the decision -------------------------------------------------------------------------------------------


def test_minimum_over_sources_clamped_to_the_cap() -> None:
    sightings = [
        agent.Sighting("tty", minutes_before_now(30)),
        agent.Sighting("jupyter", minutes_before_now(12.5)),
        agent.Sighting("vscode", minutes_before_now(20_000)),
    ]
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(12.5)
    assert agent.minutes_since_input(sightings[2:], NOW) == agent.CAP_MINUTES == 10080
    assert agent.minutes_since_input([], NOW) == agent.CAP_MINUTES


@pytest.mark.parametrize("garbage", [NOW + 3600, NOW + 601, float("nan"), float("inf"), float("-inf"), "12"])
def test_future_or_garbage_times_are_ignored_with_a_log_line(garbage: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A skewed clock must not read as "active now" (0) nor as "active forever"; the other source decides.
    sightings = [agent.Sighting("skewed", garbage), agent.Sighting("tty", minutes_before_now(50))]
    with caplog.at_level(logging.WARNING):
        assert agent.minutes_since_input(sightings, NOW) == pytest.approx(50)
    assert "ignoring skewed" in caplog.text


def test_a_few_seconds_ahead_is_rounding_not_skew() -> None:
    assert agent.minutes_since_input([agent.Sighting("tty", NOW + 2)], NOW) == 0


def test_a_clock_stepped_back_a_few_minutes_reads_input_as_now_not_as_nobody() -> None:
    # NTP steps a fast clock back by 4 minutes: a keystroke a moment ago now has a time 4 minutes ahead.
    assert agent.minutes_since_input([agent.Sighting("pty pts/0 (alice)", NOW + 240)], NOW) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2024-05-01T09:41:07.123456Z", datetime(2024, 5, 1, 9, 41, 7, 123456, tzinfo=UTC).timestamp()),
        ("2024-05-01T09:41:07Z", datetime(2024, 5, 1, 9, 41, 7, tzinfo=UTC).timestamp()),
        ("2024-05-01T11:41:07.5+02:00", datetime(2024, 5, 1, 9, 41, 7, 500000, tzinfo=UTC).timestamp()),
        ("2024-05-01T09:41:07.123456789", datetime(2024, 5, 1, 9, 41, 7, 123457, tzinfo=UTC).timestamp()),
    ],
)
def test_jupyter_timestamps(text: str, expected: float) -> None:
    assert agent.parse_jupyter_time(text) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("garbage", ["yesterday", "", "2024-13-01T00:00:00Z", 1714557600, None, ["2024-05-01"]])
def test_unparsable_jupyter_timestamps_raise_value_error(garbage: object) -> None:
    with pytest.raises(ValueError):
        agent.parse_jupyter_time(garbage)


# --- Jupyter, served by a tiny local server that checks the token (testkit/fake_jupyter.py) -------------------


@pytest.fixture
def jupyter() -> Iterator[FakeJupyter]:
    fake = FakeJupyter()
    yield fake
    fake.close()


def write_runtime(runtime_dir: Path, name: str, fixture: str, url: str, **changes: Any) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((DATA / fixture).read_text())
    parts = urllib.parse.urlsplit(url)
    port = parts.port if parts.scheme in ("http", "https") else info["port"]
    # The url, port and base_url of one server agree in a real runtime file; our own pid: a running server.
    info.update({"url": url, "port": port, "base_url": parts.path or "/", "hostname": parts.hostname})
    info.update(pid=os.getpid(), **changes)
    runtime_dir.mkdir(parents=True, exist_ok=True)
    (runtime_dir / name).write_text(json.dumps(info))
    return info


def run_fixture_server(jupyter: FakeJupyter, runtime_dir: Path, flavour: str, url: str) -> None:
    """A runtime file and the API answers of one recorded server: "lab4" (jupyter_server 2) or "notebook6"."""
    name, fixture = {
        "lab4": ("jpserver-4242.json", "runtime-jpserver-lab4.json"),
        "notebook6": ("nbserver-1717.json", "runtime-nbserver-notebook6.json"),
    }[flavour]
    info = write_runtime(runtime_dir, name, fixture, url.format(port=jupyter.port))
    specs = DATA / f"api-kernelspecs-{flavour}.json"  # the notebook 6 server does not say: every kernel is read
    jupyter.serve(
        urllib.parse.urlsplit(url).path,
        info["token"],
        (DATA / f"api-kernels-{flavour}.json").read_bytes(),
        kernelspecs=specs.read_bytes() if specs.exists() else None,
    )


def alice_home(tmp_path: Path) -> Path:
    return tmp_path / "home" / "alice"


def runtime_dir_of(home: Path) -> Path:
    return home / ".local" / "share" / "jupyter" / "runtime"


def ipython_history(home: Path, minutes_ago: float, profile: str = "profile_default") -> Path:
    """An IPython history database last written `minutes_ago` (a cell sent to a kernel then)."""
    history = home / ".ipython" / profile / "history.sqlite"
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_bytes(b"SQLite format 3\x00")
    os.utime(history, (minutes_before_now(minutes_ago), minutes_before_now(minutes_ago)))
    return history


def test_jupyterlab4_ipython_kernels_are_read_from_their_history_a_busy_one_and_the_servers_own_activity_are_not(
    tmp_path: Path, jupyter: FakeJupyter
) -> None:
    home = alice_home(tmp_path)
    run_fixture_server(jupyter, runtime_dir_of(home), "lab4", "http://localhost:{port}/user/alice/")
    ipython_history(home, 29)
    sightings = agent.ipython_input_sightings([str(home)]) + agent.jupyter_sightings(
        agent.jupyter_runtime_dirs([str(home)], {}), NOW
    )
    by_source = {s.source: round((NOW - s.at) / 60, 2) for s in sightings}
    # The idle python3 kernel's last message at 09:38:52 may be its output: it is IPython (api/kernelspecs), so
    # its cells are read from alice's IPython history (the last one sent at 09:31). The busy one (a hung cell?)
    # is not input; the server's own last_activity (refreshed by an open tab's polling) is not even asked for.
    assert by_source == {"ipython history (alice, profile_default)": 29}
    # Our own polls must not count as activity: every request says so.
    assert "/user/alice/api/kernelspecs?no_track_activity=1" in jupyter.requests
    assert jupyter.requests and all(path.endswith("?no_track_activity=1") for path in jupyter.requests)


def test_a_kernel_that_is_not_ipython_is_read_from_its_last_activity(tmp_path: Path, jupyter: FakeJupyter) -> None:
    # An R kernel keeps no IPython history; jupyter_server cannot tell its input from its output: its last
    # message counts (the reaper does less). The IPython kernel beside it does not.
    info = write_runtime(
        tmp_path / "rt", "jpserver-1.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/"
    )
    kernels = [
        {"id": "r1", "name": "ir", "execution_state": "idle", "last_activity": "2024-05-01T09:50:00Z"},
        {"id": "p1", "name": "python3", "execution_state": "idle", "last_activity": "2024-05-01T09:59:00Z"},
    ]
    specs = (DATA / "api-kernelspecs-lab4.json").read_bytes()
    jupyter.serve("/", info["token"], json.dumps(kernels).encode(), kernelspecs=specs)
    sightings = agent.jupyter_sightings([str(tmp_path / "rt")], NOW)
    assert [(s.source, round((NOW - s.at) / 60)) for s in sightings] == [
        ("jupyter jpserver-1.json kernel r1 (ir) idle since", 10)
    ]


def test_ipython_history_counts_each_profile_and_its_write_ahead_log(tmp_path: Path) -> None:
    alice, bob, carol = tmp_path / "alice", tmp_path / "bob", tmp_path / "carol"
    ipython_history(alice, 50)
    ipython_history(alice, 12, profile="profile_gpu")
    wal = ipython_history(bob, 80).with_name("history.sqlite-wal")
    wal.write_bytes(b"")
    os.utime(wal, (minutes_before_now(4), minutes_before_now(4)))
    (carol / ".ipython" / "profile_default").mkdir(parents=True)  # IPython ran, no cell was ever stored
    sightings = agent.ipython_input_sightings([str(alice), str(bob), str(carol), str(tmp_path / "nobody")])
    assert {s.source: round((NOW - s.at) / 60) for s in sightings} == {
        "ipython history (alice, profile_default)": 50,
        "ipython history (alice, profile_gpu)": 12,
        "ipython history (bob, profile_default)": 4,
    }


def test_notebook6_runtime_file_from_jupyter_runtime_dir(tmp_path: Path, jupyter: FakeJupyter) -> None:
    runtime = tmp_path / "custom-runtime"
    run_fixture_server(jupyter, runtime, "notebook6", "http://127.0.0.1:{port}/")
    dirs = agent.jupyter_runtime_dirs([str(tmp_path / "nobody")], {"JUPYTER_RUNTIME_DIR": str(runtime)})
    sightings = agent.jupyter_sightings(dirs, NOW)
    # The server does not list its kernel specs (api/kernelspecs 404): its kernel's last message counts.
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(39.5, abs=0.01)  # the kernel at 09:20:30.25


def test_a_refused_token_falls_back_to_notebook_saves_and_is_noted(tmp_path: Path, jupyter: FakeJupyter) -> None:
    root = tmp_path / "notebooks"
    (root / "deep" / "er").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for path, minutes in (("deep/er/a.ipynb", 12), ("b.ipynb", 40), (".hidden/c.ipynb", 1), ("notes.txt", 2)):
        (root / path).write_text("{}")
        os.utime(root / path, (minutes_before_now(minutes), minutes_before_now(minutes)))
    url = f"http://127.0.0.1:{jupyter.port}/"
    write_runtime(tmp_path / "rt", "jpserver-1.json", "runtime-jpserver-lab4.json", url, root_dir=str(root))
    jupyter.serve("/", "another-token", b"[]")
    gaps: dict[str, str] = {}
    sightings = agent.jupyter_sightings([str(tmp_path / "rt")], NOW, gaps=gaps)
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(12)  # not hidden, not a notebook
    assert "refuses the API (HTTP 403" in gaps["jupyter"] and "notebook saves" in gaps["jupyter"]


def test_garbage_json_and_future_kernels_are_ignored(
    tmp_path: Path, jupyter: FakeJupyter, caplog: pytest.LogCaptureFixture
) -> None:
    rt = tmp_path / "rt"
    one = write_runtime(rt, "jpserver-1.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/one/")
    two = write_runtime(rt, "jpserver-2.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/two/")
    three = write_runtime(
        rt, "jpserver-3.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/three/"
    )
    (rt / "jpserver-4.json").write_text("{ not json")
    jupyter.serve("/one/", one["token"], b"<html>login</html>")
    jupyter.serve("/two/", two["token"], (DATA / "api-kernels-future.json").read_bytes())
    idle_at_0915 = b'[42, {"id": "k"}, {"id": "j", "execution_state": "idle", "last_activity": "2024-05-01T09:15:00Z"}]'
    jupyter.serve("/three/", three["token"], idle_at_0915, b'[{"path": 7}, "x", {"type": "file", "path": "a.py"}]')
    with caplog.at_level(logging.WARNING):
        sightings = agent.jupyter_sightings([str(rt)], NOW)
        minutes = agent.minutes_since_input(sightings, NOW)
    assert minutes == pytest.approx(45)  # server three's idle kernel; everything else is garbage or skew
    for expected in ("jpserver-4.json", "no answer from jupyter jpserver-1.json", "in the future"):
        assert expected in caplog.text


IDLE_AT_0959 = b'[{"id": "k", "execution_state": "idle", "last_activity": "2024-05-01T09:59:00Z"}]'


@pytest.mark.parametrize("url", ["http://10.0.3.7:{port}/", "http://[2001:db8::1]:{port}/", "ftp://127.0.0.1:{port}/"])
def test_a_runtime_file_never_leads_off_this_machine(
    url: str, tmp_path: Path, jupyter: FakeJupyter, caplog: pytest.LogCaptureFixture
) -> None:
    info = write_runtime(
        tmp_path / "rt", "jpserver-9.json", "runtime-jpserver-lab4.json", url.format(port=jupyter.port)
    )
    jupyter.serve("/", info["token"], IDLE_AT_0959)
    with caplog.at_level(logging.WARNING):
        assert agent.jupyter_sightings([str(tmp_path / "rt")], NOW) == []
    assert jupyter.requests == []
    assert "ignoring jupyter jpserver-9.json" in caplog.text


@pytest.mark.parametrize("host", ["gpu-box-7", "jupyter.internal.example", "127.0.0.1.nip.io"])
def test_a_hostname_in_the_runtime_file_is_never_looked_up_the_server_is_asked_on_loopback(
    host: str, tmp_path: Path, jupyter: FakeJupyter
) -> None:
    # jupyter_server 2 on --ip=0.0.0.0 writes the machine's hostname into `url`: its own port on loopback.
    url = f"http://{host}:{jupyter.port}/"
    info = write_runtime(tmp_path / "rt", "jpserver-9.json", "runtime-jpserver-lab4.json", url, hostname="0.0.0.0")
    jupyter.serve("/", info["token"], IDLE_AT_0959)
    sightings = agent.jupyter_sightings([str(tmp_path / "rt")], NOW)
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(1)
    assert jupyter.requests[0] == "/api/kernels?no_track_activity=1"


def test_a_redirect_off_this_machine_is_refused(tmp_path: Path, jupyter: FakeJupyter) -> None:
    info = write_runtime(
        tmp_path / "rt", "jpserver-9.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/"
    )
    jupyter.routes["/api/kernels"] = (info["token"], 302, b"", {"Location": "http://198.51.100.1/api/kernels"})
    assert agent.jupyter_sightings([str(tmp_path / "rt")], NOW) == []
    assert jupyter.requests == ["/api/kernels?no_track_activity=1"]


def test_runtime_file_of_a_server_that_exited_is_skipped(tmp_path: Path, jupyter: FakeJupyter) -> None:
    # Signal 0 finds no such process: the server is gone, its port may be someone else's now.
    write_runtime(tmp_path / "rt", "jpserver-9.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/")
    assert agent.jupyter_sightings([str(tmp_path / "rt")], NOW, alive=lambda pid: False) == []
    assert jupyter.requests == []


def test_a_process_that_exists_but_is_not_ours_is_alive() -> None:
    assert agent.pid_alive(os.getpid())
    assert agent.pid_alive(1)  # init: EPERM for an unprivileged caller, still alive
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not agent.pid_alive(dead.pid)


# --- VS Code ------------------------------------------------------------------------------------------------


def test_vscode_saves_count_an_open_untouched_window_does_not(tmp_path: Path) -> None:
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    for directory, minutes in (("3f2a1b", 95), ("-7c6d5e", 7)):
        entries = alice / ".vscode-server" / "data" / "User" / "History" / directory / "entries.json"
        entries.parent.mkdir(parents=True)
        entries.write_text(
            '{"version":1,"resource":"vscode-remote://ssh-remote%2Bgpu/home/alice/train.py","entries":[]}'
        )
        os.utime(entries, (minutes_before_now(minutes), minutes_before_now(minutes)))
    # bob is connected (server installed, logs written) but never saved anything.
    (bob / ".vscode-server" / "data" / "logs" / "20240501T080000").mkdir(parents=True)
    sightings = agent.vscode_sightings([str(alice), str(bob)])
    assert [s.source for s in sightings] == ["vscode save (alice)"]
    assert agent.minutes_since_input(sightings, NOW) == pytest.approx(7)


def test_every_pseudo_terminal_counts_by_its_access_time_with_its_owner(tmp_path: Path) -> None:
    # Typing updates a pty's access time; output only its modification time (the real pty test shows it).
    dev = make_dev(tmp_path, {"pts/0": minutes_before_now(4), "pts/3": minutes_before_now(30)})
    (dev / "pts" / "ptmx").write_text("")  # the multiplexer: not a terminal
    os.utime(dev / "pts" / "0", (minutes_before_now(4), minutes_before_now(0)))  # printing now, typed 4 min ago
    sightings = agent.pty_sightings(str(dev))
    me = agent._user_name(os.getuid())
    assert {s.source: round((NOW - s.at) / 60) for s in sightings} == {f"pty pts/0 ({me})": 4, f"pty pts/3 ({me})": 30}
    assert agent.pty_sightings(str(dev), ignore_users=(me,)) == []


def test_runtime_files_that_are_not_small_regular_files_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = tmp_path / "rt"
    rt.mkdir()
    os.mkfifo(rt / "jpserver-1.json")  # reading would block forever
    (rt / "jpserver-2.json").symlink_to("/dev/zero")  # reading would never end
    (rt / "jpserver-3.json").write_text(json.dumps({"url": "http://127.0.0.1:1/", "pad": "x" * 70_000}))
    with caplog.at_level(logging.WARNING):
        assert agent.jupyter_sightings([str(rt)], NOW) == []
    assert caplog.text.count("not a regular file") == 2
    assert "larger than 65536 bytes" in caplog.text


def test_jupyter_budget_stops_asking(tmp_path: Path, jupyter: FakeJupyter, caplog: pytest.LogCaptureFixture) -> None:
    info = write_runtime(
        tmp_path / "rt", "jpserver-1.json", "runtime-jpserver-lab4.json", f"http://127.0.0.1:{jupyter.port}/"
    )
    jupyter.serve("/", info["token"], IDLE_AT_0959)
    with caplog.at_level(logging.WARNING):
        assert agent.jupyter_sightings([str(tmp_path / "rt")], NOW, budget_seconds=-1) == []
    assert jupyter.requests == []
    assert "budget" in caplog.text


# --- the whole collector ------------------------------------------------------------------------------------


def test_collect_takes_the_minimum_over_every_source(tmp_path: Path, jupyter: FakeJupyter) -> None:
    home = alice_home(tmp_path)
    run_fixture_server(jupyter, runtime_dir_of(home), "notebook6", "http://127.0.0.1:{port}/")
    dev = make_dev(tmp_path, {"pts/0": minutes_before_now(64), "pts/1": minutes_before_now(300)})
    settings = agent.Settings(
        utmp_path=str(DATA / "utmp-sessions.bin"),
        dev_root=str(dev),
        proc_root=str(fake_proc(tmp_path)),
        homes=[str(home)],
        environ={},
        use_who=False,
    )
    minutes, sightings, gaps = agent.collect(NOW, settings)
    assert minutes == pytest.approx(39.5, abs=0.01)  # the Jupyter kernel beats alice's terminal (64) and bob's (300)
    assert {s.source.split()[0] for s in sightings} == {"tty", "pty", "jupyter"} and gaps == {}


def test_no_human_session_publishes_the_cap(tmp_path: Path) -> None:
    settings = agent.Settings(
        utmp_path=str(DATA / "utmp-no-sessions.bin"),
        dev_root=str(make_dev(tmp_path, {})),  # not this machine's /dev, whose terminals are anyone's
        proc_root=str(fake_proc(tmp_path)),
        homes=[str(tmp_path)],
        environ={},
        use_who=False,
    )
    assert agent.collect(NOW, settings)[:2] == (10080, [])


def test_a_crashing_source_leaves_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> list[Any]:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(agent, "jupyter_sightings", broken)
    monkeypatch.setattr(agent, "vscode_sightings", broken)
    dev = make_dev(tmp_path, {"pts/1": minutes_before_now(3)})
    settings = agent.Settings(
        utmp_path=str(DATA / "utmp-sessions.bin"),
        dev_root=str(dev),
        proc_root=str(fake_proc(tmp_path)),
        homes=[],
        environ={},
    )
    with caplog.at_level(logging.ERROR):
        minutes, _, gaps = agent.collect(NOW, settings)
    assert minutes == pytest.approx(3)
    assert "source jupyter failed" in caplog.text and "source vscode failed" in caplog.text
    assert set(gaps) == {"jupyter", "vscode"}  # and status will say so


def test_unreadable_utmp_without_who_is_no_terminal_information(tmp_path: Path) -> None:
    settings = agent.Settings(
        utmp_path=str(tmp_path / "missing"),
        dev_root=str(make_dev(tmp_path, {})),
        proc_root=str(fake_proc(tmp_path)),
        homes=[],
        environ={},
        use_who=False,
    )
    assert agent.collect(NOW, settings)[:2] == (10080, [])


def test_an_unreadable_source_is_warned_once_then_again_when_its_reason_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def warnings(gaps: dict[str, str]) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            agent.report_gaps(gaps, str(tmp_path))
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    refused = {"jupyter": "jupyter jpserver-1.json refuses the API (HTTP 403)"}
    assert warnings(refused) == [
        "cannot read jupyter: jupyter jpserver-1.json refuses the API (HTTP 403) (idle-reaper status shows it)"
    ]
    assert warnings(refused) == []  # the next minute: INFO only
    assert len(warnings({"jupyter": "another reason", "terminals": "pseudo-terminals: denied"})) == 2
    assert warnings({}) == [] and warnings(refused) != []  # fixed, then broken again: said again


# --- publishing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("minutes", "packet"),
    [
        (0.0, b"idle_reaper_minutes_since_input:0|g"),
        (12.5, b"idle_reaper_minutes_since_input:12.5|g"),
        (7.04, b"idle_reaper_minutes_since_input:7|g"),
        (10080.0, b"idle_reaper_minutes_since_input:10080|g"),
        (99999.0, b"idle_reaper_minutes_since_input:10080|g"),  # clamped to the cap
        (-3.0, b"idle_reaper_minutes_since_input:0|g"),  # never signed: "-3|g" would be a StatsD decrement
    ],
)
def test_statsd_gauge_packet(minutes: float, packet: bytes) -> None:
    assert agent.statsd_packet(minutes) == packet


@pytest.fixture
def statsd() -> Iterator[socket.socket]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(5)
    yield listener
    listener.close()


def test_main_sends_one_gauge_to_the_agent(
    tmp_path: Path, statsd: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JUPYTER_RUNTIME_DIR", raising=False)
    port = statsd.getsockname()[1]
    argv = ["--statsd", f"127.0.0.1:{port}", *nobody_here_args(tmp_path)]
    assert agent.main(argv, clock=lambda: NOW) == 0
    assert statsd.recv(1024) == b"idle_reaper_minutes_since_input:10080|g"
    assert statsd.recv(1024) == b"idle_reaper_unreadable_sources:0|g"  # every source could be read


def test_print_mode_says_each_ignored_sighting_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = nobody_here_args(tmp_path)
    make_dev(tmp_path, {"pts/4": NOW + 86_400})  # a day ahead: ignored, and said so
    with caplog.at_level(logging.WARNING):
        assert agent.main(["--print", *args], clock=lambda: NOW) == 0
    assert caplog.text.count("in the future") == 1


def test_print_mode_prints_and_sends_nothing(
    tmp_path: Path, statsd: socket.socket, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JUPYTER_RUNTIME_DIR", raising=False)
    port = statsd.getsockname()[1]
    argv = ["--print", "--statsd", f"127.0.0.1:{port}", *nobody_here_args(tmp_path)]
    assert agent.main(argv, clock=lambda: NOW) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        "idle_reaper_minutes_since_input 10080",
        "idle_reaper_unreadable_sources 0",
    ]
    statsd.settimeout(0.2)
    with pytest.raises(TimeoutError):
        statsd.recv(1024)


@pytest.mark.parametrize(
    ("address", "error"),
    [
        ("10.0.0.5:8125", "must be a loopback address"),
        ("0.0.0.0:8125", "must be a loopback address"),
        ("metrics.example:8125", "must be a loopback address"),
        ("127.0.0.1", "expected host:port"),
        ("127.0.0.1:0", "expected host:port"),
    ],
)
def test_statsd_address_must_be_loopback(address: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        agent.main(["--statsd", address])
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_agent_runs_as_a_script(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-I", str(AGENT_FILE), "--print", *nobody_here_args(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert out.stdout.strip().splitlines() == [
        "idle_reaper_minutes_since_input 10080",
        "idle_reaper_unreadable_sources 0",
    ]


# --- agent configuration, systemd units, install script ----------------------------------------------------

AGENT_DIR = REPO_ROOT / "agent"


def test_agent_config_listens_on_loopback_and_merges_with_the_gpu_config() -> None:
    activity = json.loads((AGENT_DIR / "cloudwatch-agent-activity.json").read_text())
    gpu = json.loads((REPO_ROOT / "infra" / "cloudwatch-agent-gpu.json").read_text())
    statsd = activity["metrics"]["metrics_collected"]["statsd"]
    assert statsd["service_address"] == "127.0.0.1:8125"  # the agent's default listens on every interface
    assert statsd["metrics_collection_interval"] in (60, 300)
    assert statsd["metrics_aggregation_interval"] == 60
    # append-config merges both files: shared keys must agree, and InstanceId must come from the agent.
    for key in ("namespace", "append_dimensions", "aggregation_dimensions"):
        assert activity["metrics"][key] == gpu["metrics"][key]
    assert activity["metrics"]["append_dimensions"] == {"InstanceId": "${aws:InstanceId}"}
    assert activity["metrics"]["aggregation_dimensions"] == [["InstanceId"]]


def test_units_run_the_installed_collector_every_minute_as_the_service_user() -> None:
    service = (AGENT_DIR / "idle-reaper-activity.service").read_text()
    timer = (AGENT_DIR / "idle-reaper-activity.timer").read_text()
    install = (AGENT_DIR / "install.sh").read_text()
    settings = dict(line.split("=", 1) for line in service.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["ExecStart"] == "/usr/bin/python3 -I /opt/idle-reaper/idle_reaper_activity.py"
    assert "PREFIX=${IDLE_REAPER_PREFIX:-/opt/idle-reaper}" in install
    assert settings["User"] == "idle-reaper-activity" and "SERVICE_USER=idle-reaper-activity" in install
    # install.sh writes the interpreter it checked in place of /usr/bin/python3 (installed_unit).
    assert 'sed -e "s|/usr/bin/python3 -I|$PYTHON -I|"' in install
    assert settings["CapabilityBoundingSet"] == settings["AmbientCapabilities"] == "CAP_DAC_READ_SEARCH"
    assert (settings["IPAddressDeny"], settings["IPAddressAllow"]) == ("any", "localhost")
    assert "OnCalendar=minutely" in timer.splitlines()
    assert f"/var/lib/{settings['StateDirectory']}" == agent.STATE_DIR_DEFAULT  # where report_gaps remembers


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 10.0.3.0/24 2 0 2
        |-- 10.0.3.0
           /24 link UNICAST
        |-- 10.0.3.7
           /32 host LOCAL
        |-- 10.0.3.9
           /32 host LOCAL
        |-- 10.0.3.255
           /32 link BROADCAST
     +-- 169.254.0.0/16 2 0 2
        |-- 169.254.7.1
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     +-- 10.0.3.0/24 2 0 2
        |-- 10.0.3.7
           /32 host LOCAL
"""
IF_INET6 = """fe8000000000000000fc00fffe000001 04 40 20 80     eth0
2600190000000000000000000000abcd 04 80 00 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
"""


def test_own_addresses_are_the_kernels_local_ones_without_loopback_or_link_local(tmp_path: Path) -> None:
    # /proc/net as Linux writes it: a primary and a secondary IPv4 address, a link-local one, IPv6 global and
    # link-local, loopback. The unit may reach what install.sh writes; systemd cannot name them itself.
    (tmp_path / "fib_trie").write_text(FIB_TRIE)
    (tmp_path / "if_inet6").write_text(IF_INET6)
    assert agent.own_addresses(str(tmp_path)) == ["10.0.3.7", "10.0.3.9", "2600:1900::abcd"]
    assert agent.own_addresses(str(tmp_path / "absent")) == []


def test_a_server_address_this_machine_refuses_is_said_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server listens on one address of this machine only; connecting there fails with EPERM, as the unit's
    # IPAddressDeny= makes it fail for an address install.sh did not name (one added since): status says so.
    url = "http://127.0.0.2:8888/"
    write_runtime(tmp_path / "rt", "jpserver-9.json", "runtime-jpserver-lab4.json", url, hostname="127.0.0.2")

    def connect(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        if address[0] == "127.0.0.2":
            raise PermissionError(1, "Operation not permitted")
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", connect)
    gaps: dict[str, str] = {}
    assert agent.jupyter_sightings([str(tmp_path / "rt")], NOW, gaps=gaps) == []
    assert "connecting to 127.0.0.2 is not permitted here" in gaps["jupyter"] and "IPAddressAllow" in gaps["jupyter"]


def test_install_is_idempotent(tmp_path: Path) -> None:
    bin_dir, log = fake_commands(tmp_path)
    ctl = bin_dir / "amazon-cloudwatch-agent-ctl"
    for _ in range(2):
        result = run_install(tmp_path, bin_dir, ctl)
        assert result.returncode == 0, result.stderr
    for name in ("idle_reaper_activity.py", "cloudwatch-agent-activity.json", "README.md"):
        assert (tmp_path / "opt" / name).read_bytes() == (AGENT_DIR / name).read_bytes()
    assert (tmp_path / "units" / "idle-reaper-activity.timer").read_bytes() == (
        AGENT_DIR / "idle-reaper-activity.timer"
    ).read_bytes()
    assert (tmp_path / "units" / "idle-reaper-activity.service").read_text() == installed_unit(sys.executable)
    calls = log.read_text().splitlines()
    assert sum(call.startswith("useradd") for call in calls) == 1  # the second run finds the user
    assert calls.count("systemctl enable --now idle-reaper-activity.timer") == 2
    append = (
        f"amazon-cloudwatch-agent-ctl -a append-config -m ec2 -s -c file:{tmp_path}/opt/cloudwatch-agent-activity.json"
    )
    assert calls.count(append) == 2


def test_install_without_the_cloudwatch_agent_says_so(tmp_path: Path) -> None:
    bin_dir, _ = fake_commands(tmp_path)
    result = run_install(tmp_path, bin_dir, tmp_path / "no-agent-here")
    assert result.returncode == 0
    assert "no CloudWatch agent" in result.stderr
    assert (tmp_path / "units" / "idle-reaper-activity.timer").exists()


def test_on_amazon_linux_2_it_says_so_once_installs_nothing_and_succeeds(tmp_path: Path) -> None:
    """AL2's /usr/bin/python3 is 3.7, whatever newer python3 a user put first on PATH: the association must
    not fail (and alert the admins) on every such machine every day."""
    bin_dir, log = fake_commands(tmp_path, python3="exit 1")  # fails the 3.9 check, as 3.7 does
    pythons = f"{bin_dir / 'python3'} {tmp_path / 'python3.9-absent'}"
    first = run_install(tmp_path, bin_dir, bin_dir / "amazon-cloudwatch-agent-ctl", pythons=pythons)
    assert first.returncode == 0, first.stderr
    assert "not installed: no Python 3.9 or newer" in first.stderr and '"no collector"' in first.stderr
    assert not (tmp_path / "opt").exists() and not (tmp_path / "units").exists()
    assert [call.split()[0] for call in log.read_text().splitlines()] == ["python3"]  # no useradd, no systemctl
    # The next day's run: silent, still a success.
    again = run_install(tmp_path, bin_dir, bin_dir / "amazon-cloudwatch-agent-ctl", pythons=pythons)
    assert (again.returncode, again.stderr) == (0, "")


def test_without_systemd_it_says_so_and_succeeds(tmp_path: Path) -> None:
    bin_dir, log = fake_commands(tmp_path)
    result = run_install(tmp_path, bin_dir, bin_dir / "amazon-cloudwatch-agent-ctl", systemd=False)
    assert result.returncode == 0, result.stderr
    assert "not installed: systemd is not running" in result.stderr
    assert not (tmp_path / "units").exists() and not log.exists()


def test_the_unit_runs_the_first_interpreter_that_passed_the_check(tmp_path: Path) -> None:
    bin_dir, _ = fake_commands(tmp_path, python3="exit 1")
    ctl = bin_dir / "amazon-cloudwatch-agent-ctl"
    unsupported = run_install(tmp_path, bin_dir, ctl, pythons=str(bin_dir / "python3"))
    assert unsupported.returncode == 0 and (tmp_path / "state" / "collector-unsupported").exists()
    # Python 3.9+ installed later: the next run installs, runs that interpreter, and forgets the old note.
    result = run_install(tmp_path, bin_dir, ctl, pythons=f"{bin_dir / 'python3'} {sys.executable}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "units" / "idle-reaper-activity.service").read_text() == installed_unit(sys.executable)
    assert not (tmp_path / "state" / "collector-unsupported").exists()


def _model(*sources: str, outputs: str = "") -> dict[str, object]:
    cells = [
        {"cell_type": "code", "source": s, "outputs": [{"output_type": "stream", "text": outputs}], "metadata": {}}
        for s in sources
    ]
    return {"content": {"cells": cells, "metadata": {}}}


def test_a_notebook_save_counts_only_when_a_cells_source_changed_and_is_remembered_between_runs(tmp_path) -> None:
    """Issue 44 read-over, 4 (the edge cases; tests/agent_real has it against a real server and what an open tab
    saves): outputs saved are not an edit; a new cell, an edited one, a notebook first seen or unreadable are."""
    saves = iter(["2026-11-20T10:00:00Z", "2026-11-20T11:00:00Z", "2026-11-20T12:00:00Z", "2026-11-20T13:00:00Z"])
    at = {s: agent.parse_jupyter_time(s) for s in ["2026-11-20T10:00:00Z", "2026-11-20T12:00:00Z"]}

    def run(model: object) -> float:
        edits = agent.NotebookEdits.load(str(tmp_path))
        edited = edits.edited_at("server a.ipynb", next(saves), lambda: agent.cells_digest(model))
        edits.save(str(tmp_path))
        return edited

    assert run(_model("x = 1")) == at["2026-11-20T10:00:00Z"]  # first seen: its save
    assert run(_model("x = 1", outputs="step 1\nstep 2\n")) == at["2026-11-20T10:00:00Z"]  # output saved: not input
    assert run(_model("x = 1", "")) == at["2026-11-20T12:00:00Z"]  # a cell added
    assert run({"content": "not a notebook"}) == agent.parse_jupyter_time("2026-11-20T13:00:00Z")  # unreadable
    # Nothing remembered (no state directory, or a corrupt file): every save counts, as before.
    (tmp_path / "notebooks.json").write_text("{corrupt")
    fresh = agent.NotebookEdits.load(str(tmp_path))
    assert fresh.edited_at("server a.ipynb", "2026-11-20T14:00:00Z", lambda: None) == agent.parse_jupyter_time(
        "2026-11-20T14:00:00Z"
    )
    assert agent.NotebookEdits.load(None).remembered == {}
