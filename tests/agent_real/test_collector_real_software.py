"""The activity collector against the real programs it reads: a real jupyter_server / JupyterLab on a free
port (token, password, --ip=0.0.0.0, runtime files where users' environments put them), real kernels
driven through the REST and websocket APIs, an open tab simulated by polling what the JupyterLab bundle
polls, and real pseudo-terminals (Python's pty, and Jupyter's own terminals) typed into and left printing.

Each test is one of the ways the collector used to be wrong on a real machine (issue 23): it fails on the
collector before that change. The hand-written fixtures in tests/unit/agent stay for what only fakes reach."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jupyter_server", reason="the 'collector' dependency group (make sync installs it)")
import websocket

AGENT_DIR = Path(__file__).resolve().parents[2] / "agent"
sys.path.insert(0, str(AGENT_DIR))
import idle_reaper_activity as agent  # noqa: E402

pytestmark = pytest.mark.integration
JUPYTER = [sys.executable, "-m", "jupyter_server"]
LAB = [sys.executable, "-m", "jupyterlab"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """One running Jupyter server: where it keeps its runtime file, and how to talk to it as a browser."""

    process: subprocess.Popen[bytes]
    home: Path
    root: Path
    runtime_dir: Path
    port: int
    token: str

    @property
    def info(self) -> dict[str, Any]:
        [path] = self.runtime_dir.glob(f"jpserver-{self.process.pid}.json")
        info: dict[str, Any] = json.loads(path.read_text())
        return info

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """A request as the front end makes it (activity tracked, unlike the collector's)."""
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def websocket(self, path: str) -> websocket.WebSocket:
        return websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/{path}", header=[f"Authorization: token {self.token}"], timeout=30
        )


def start_server(
    tmp_path: Path,
    *,
    command: list[str] = JUPYTER,
    ip: str = "127.0.0.1",
    token: str = "t0ken-for-tests",
    password: str | None = None,
    env: dict[str, str] | None = None,
    runtime_dir: Path | None = None,
) -> Server:
    home, root = tmp_path / "home", tmp_path / "notebooks"
    home.mkdir(parents=True, exist_ok=True)
    root.mkdir(exist_ok=True)
    port = free_port()
    args = [
        *command,
        "--no-browser",
        "--allow-root",  # CI machines run tests as root
        f"--ip={ip}",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={'' if password else token}",
    ]
    if password:
        from jupyter_server.auth import passwd

        args.append(f"--PasswordIdentityProvider.hashed_password={passwd(password)}")
    environment = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "JUPYTER_PLATFORM_DIRS": "0",
        **(env or {}),
    }
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115  (closed with the process)
    process = subprocess.Popen(args, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    runtime = runtime_dir or home / ".local" / "share" / "jupyter" / "runtime"
    deadline = time.monotonic() + 60
    while not list(runtime.glob(f"jpserver-{process.pid}.json")):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((tmp_path / "server.log").read_text()[-3000:])
        time.sleep(0.1)
    # The runtime file can precede the listening socket by a moment under load: wait until it answers.
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp_path / "server.log").read_text()[-3000:]) from None
            time.sleep(0.1)
    return Server(process, home, root, runtime, port, token)


@contextlib.contextmanager
def server(tmp_path: Path, **options: Any) -> Iterator[Server]:
    running = start_server(tmp_path, **options)
    try:
        yield running
    finally:
        os.killpg(running.process.pid, signal.SIGTERM)
        try:
            running.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(running.process.pid, signal.SIGKILL)


def collect(server: Server | None, now: float | None = None, **settings: Any) -> agent.Collected:
    """The collector as the timer runs it, told only where the homes are (and no utmp: a container). Its
    scan for Jupyter servers without a runtime file sees no process unless a test gives it /proc: other
    tests' servers run beside this one."""
    homes = (str(server.home),) if server else ()
    no_processes = Path(f"/tmp/idle-reaper-no-processes-{os.getpid()}")
    (no_processes / "1").mkdir(parents=True, exist_ok=True)  # pid 1 is listed: no hidepid
    defaults: dict[str, Any] = {
        "homes": homes,
        "utmp_path": "/nonexistent/utmp",
        "use_who": False,
        "environ": {},
        "proc_root": str(no_processes),
    }
    return agent.collect(time.time() if now is None else now, agent.Settings(**{**defaults, **settings}))


def jupyter_sightings(collected: agent.Collected) -> list[agent.Sighting]:
    return [s for s in collected.sightings if s.source.startswith("jupyter")]


def execute(server: Server, kernel_id: str, code: str, *, wait: bool = True) -> None:
    """Run a cell over the kernel's websocket, as the front end does; wait until the kernel is idle again."""
    session = uuid.uuid4().hex
    ws = server.websocket(f"api/kernels/{kernel_id}/channels?session_id={session}")
    msg_id = uuid.uuid4().hex
    ws.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "username": "test",
                    "session": session,
                    "msg_type": "execute_request",
                    "version": "5.3",
                    "date": datetime.datetime.now(datetime.UTC).isoformat(),
                },
                "parent_header": {},
                "metadata": {},
                "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {}},
                "channel": "shell",
                "buffers": [],
            }
        )
    )
    deadline = time.monotonic() + 60
    while wait and time.monotonic() < deadline:
        message = json.loads(ws.recv())
        if (
            message.get("channel") == "iopub"
            and message["msg_type"] == "status"
            and message["parent_header"].get("msg_id") == msg_id
            and message["content"]["execution_state"] == "idle"
        ):
            break
    ws.close()


def open_notebook(server: Server, name: str = "analysis.ipynb") -> str:
    """Create a notebook and a session on it (a kernel), as opening it in JupyterLab does: the kernel id."""
    notebook = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    server.api("PUT", f"api/contents/{name}", {"type": "notebook", "format": "json", "content": notebook})
    session = server.api(
        "POST", "api/sessions", {"path": name, "name": name, "type": "notebook", "kernel": {"name": "python3"}}
    )
    kernel_id: str = session["kernel"]["id"]
    return kernel_id  # "starting" until a client connects: execute() does


def poll_like_an_open_tab(server: Server, seconds: float) -> None:
    """What the JupyterLab bundle polls while a tab is open and nobody touches it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for path in ("api/kernels", "api/sessions", "api/terminals", "api/contents?content=1", "api/me", "api/status"):
            server.api("GET", path)
        time.sleep(0.2)


# --- 1. `jupyter lab --ip=0.0.0.0`: the runtime file names the machine's hostname ---------------------------


def test_a_cell_run_in_jupyterlab_on_all_interfaces_is_seen(tmp_path: Path) -> None:
    with server(tmp_path, command=LAB, ip="0.0.0.0") as lab:
        assert lab.info["hostname"] == "0.0.0.0" and f"//127.0.0.1:{lab.port}" not in lab.info["url"]
        kernel = open_notebook(lab)
        executed = time.time()
        execute(lab, kernel, "x = 1 + 1")
        collected = collect(lab)
        assert collected.minutes < 0.5, collected.sightings
        [seen] = [s for s in jupyter_sightings(collected) if "kernel" in s.source]
        assert executed - 2 <= seen.at <= time.time() and collected.gaps == {}


# --- 6 and 8. an open tab polling, a busy kernel: neither is a person -------------------------------------


def test_an_open_tab_polling_is_not_input_and_a_busy_kernel_is_not_input_now(tmp_path: Path) -> None:
    with server(tmp_path) as jupyter:
        kernel = open_notebook(jupyter)
        execute(jupyter, kernel, "y = 2")
        went_idle = time.time()
        poll_like_an_open_tab(jupyter, 3.0)
        seen = jupyter_sightings(collect(jupyter))
        # The server's own last_activity is now (the polls refreshed it); what the collector reads is not.
        assert jupyter.api("GET", "api/status")["last_activity"] >= datetime.datetime.fromtimestamp(
            went_idle + 2, datetime.UTC
        ).strftime("%Y-%m-%dT%H:%M:%S")
        assert seen and max(s.at for s in seen) <= went_idle + 0.5, seen

        # A cell that waits forever (a pending input(), a hung call) at 0 % CPU: busy, and not input.
        execute(jupyter, kernel, "import time\ntime.sleep(600)", wait=False)
        deadline = time.monotonic() + 30
        while jupyter.api("GET", f"api/kernels/{kernel}")["execution_state"] != "busy":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        half_an_hour_later = collect(jupyter, now=time.time() + 1800)
        assert not [s for s in half_an_hour_later.sightings if s.source.endswith("busy")]
        assert half_an_hour_later.minutes >= 29, half_an_hour_later.sightings


# --- 3. a password instead of a token: the API refuses ------------------------------------------------------


def test_a_password_protected_server_is_read_from_its_notebook_saves_and_says_so(tmp_path: Path) -> None:
    with server(tmp_path, password="correct horse") as guarded:
        assert guarded.info["token"] == ""
        notebook = guarded.root / "project" / "model.ipynb"
        notebook.parent.mkdir()
        notebook.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
        saved = notebook.stat().st_mtime
        collected = collect(guarded)
        assert collected.minutes < 0.5
        [seen] = jupyter_sightings(collected)
        assert seen.at == saved and "newest notebook save" in seen.source
        assert "refuses the API (HTTP 403" in collected.gaps["jupyter"] and collected.unreadable == 2


# --- 4. runtime files where the user's environment puts them ----------------------------------------------


@pytest.mark.parametrize("where", ["XDG_DATA_HOME", "JUPYTER_RUNTIME_DIR"])
def test_runtime_files_outside_the_default_directory_are_found(tmp_path: Path, where: str) -> None:
    home = tmp_path / "home"
    custom = home / ".xdg" / "jupyter" / "runtime" if where == "XDG_DATA_HOME" else home / "work" / "jrt"
    env = {where: str(home / ".xdg" if where == "XDG_DATA_HOME" else custom)}
    with server(tmp_path, env=env, runtime_dir=custom) as jupyter:
        kernel = open_notebook(jupyter)
        execute(jupyter, kernel, "z = 3")
        collected = collect(jupyter)
        assert collected.minutes < 0.5 and jupyter_sightings(collected), collected


def test_a_running_server_whose_runtime_file_cannot_be_found_is_named(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere-runtime"  # outside every home: not searched
    with server(tmp_path, env={"JUPYTER_RUNTIME_DIR": str(elsewhere)}, runtime_dir=elsewhere) as jupyter:
        collected = collect(jupyter, proc_root="/proc")
        assert jupyter_sightings(collected) == []
        assert f"pid {jupyter.process.pid} (python -m jupyter_server" in collected.gaps["jupyter"]
        assert collected.unreadable & 2
        # Told where, it is read, and no longer named.
        told = collect(jupyter, jupyter_dirs=(str(elsewhere),), proc_root="/proc")
        assert f"pid {jupyter.process.pid} " not in told.gaps.get("jupyter", "")


# --- 5. /proc with hidepid: a server is alive though its /proc entry is hidden ----------------------------


def test_a_live_server_is_asked_even_where_proc_hides_it(tmp_path: Path) -> None:
    hidden = tmp_path / "proc"  # what an unprivileged reader sees of /proc under hidepid=2: not the server
    hidden.mkdir()
    with server(tmp_path) as jupyter:
        kernel = open_notebook(jupyter)
        execute(jupyter, kernel, "w = 4")
        collected = collect(jupyter, proc_root=str(hidden))
        assert collected.minutes < 0.5 and jupyter_sightings(collected)
    # Once it has exited, its runtime file is ignored (signal 0 finds no process).
    assert not agent.pid_alive(jupyter.process.pid)


# --- 2 and 7. terminals: typing counts, output does not; no utmp needed ------------------------------------


def spawn_shell() -> tuple[int, int, Path]:
    """A real shell on a new pseudo-terminal, in its own session, as sshd or a terminal emulator starts one:
    (pid, master fd, the pty's device). Nothing is written to utmp."""
    before = set(os.listdir("/dev/pts"))
    pid, master = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        os.execvpe("sh", ["sh", "-i"], {"PATH": os.environ["PATH"], "PS1": "$ ", "HOME": "/tmp"})
    [new] = set(os.listdir("/dev/pts")) - before
    return pid, master, Path("/dev/pts") / new


def drain(master: int, seconds: float) -> bytes:
    out, end = b"", time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):
                out += os.read(master, 65536)
    return out


def age(device: Path, seconds: float) -> None:
    """Set a pty's last input back, so that a new input (or its absence) shows."""
    info = device.stat()
    os.utime(device, (time.time() - seconds, info.st_mtime))


def pty_minutes(collected: agent.Collected, device: Path) -> float:
    [seen] = [s for s in collected.sightings if s.source.startswith(f"pty {device.relative_to('/dev')} ")]
    return (time.time() - seen.at) / 60


def test_typing_in_a_terminal_without_utmp_counts_and_its_output_does_not(tmp_path: Path) -> None:
    pid, master, device = spawn_shell()
    try:
        drain(master, 0.5)
        age(device, 3600)
        assert pty_minutes(collect(None), device) == pytest.approx(60, abs=0.5)
        os.write(master, b"echo typed\n")  # a keystroke: the shell reads it
        assert b"typed" in drain(master, 1.0)
        assert pty_minutes(collect(None), device) < 0.5
        # A loop that prints for seconds, nobody typing: the shell writes, nobody reads.
        os.write(master, b"i=0; while [ $i -lt 30 ]; do echo line $i; i=$((i+1)); sleep 0.1; done\n")
        drain(master, 0.3)
        age(device, 3600)
        assert b"line" in drain(master, 3.0)
        assert pty_minutes(collect(None), device) == pytest.approx(60, abs=0.5)
        ignored = collect(None, ignore_users=(agent._user_name(device.stat().st_uid),))
        assert not [s for s in ignored.sightings if s.source.startswith("pty")]
        # With utmp (as sshd writes it): the same terminal, the same last input, named as a login session.
        utmp = tmp_path / "utmp"
        line = str(device.relative_to("/dev")).encode()
        record = agent.UTMP_RECORD_BY_MACHINE.get(os.uname().machine, agent.UTMP_RECORD)
        logged_in = int(time.time()) - 60
        if record is agent.UTMP_RECORD:  # glibc's x86_64 utmp keeps 32-bit seconds: from 2038 on, sshd's wrap
            logged_in = (logged_in + 2**31) % 2**32 - 2**31
        fields = [7, pid, line, b"ts/0", b"alice", b"10.0.0.9", 0, 0, 0, logged_in, 0, b""]
        utmp.write_bytes(record.pack(*fields))
        with_utmp = collect(None, utmp_path=str(utmp))
        [login] = [s for s in with_utmp.sightings if s.source.startswith("tty ")]
        assert login.source == f"tty {line.decode()} (alice)" and login.at == device.stat().st_atime
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(master)


def test_a_jupyter_terminal_printing_to_a_connected_browser_is_not_input(tmp_path: Path) -> None:
    with server(tmp_path) as jupyter:
        before = set(os.listdir("/dev/pts"))
        name = jupyter.api("POST", "api/terminals")["name"]
        ws = jupyter.websocket(f"terminals/websocket/{name}")
        try:
            ws.send(json.dumps(["stdin", "i=0; while [ $i -lt 60 ]; do echo tick $i; i=$((i+1)); sleep 0.1; done\r"]))
            deadline = time.monotonic() + 20
            [device] = [Path("/dev/pts") / n for n in set(os.listdir("/dev/pts")) - before]
            while b"tick 3" not in json.dumps(ws.recv()).encode() and time.monotonic() < deadline:
                pass
            age(device, 3600)
            printed = 0
            while printed < 20 and time.monotonic() < deadline:  # the browser receives the output
                message = json.loads(ws.recv())
                printed += message[0] == "stdout"
            collected = collect(jupyter)
            # The server counts the output as activity; the collector sees no keystroke for an hour.
            assert pty_minutes(collected, device) == pytest.approx(60, abs=0.5)
            assert not [s for s in collected.sightings if "last_activity" in s.source]
        finally:
            ws.close()
