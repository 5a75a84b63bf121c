"""The activity collector against the real programs it reads: a real jupyter_server / JupyterLab on a free
port (token, password, --ip=0.0.0.0, runtime files where users' environments put them), real kernels
driven through the REST and websocket APIs, an open tab simulated by polling what the JupyterLab bundle
polls, and real pseudo-terminals (a shell on a new pty, and Jupyter's own terminals) typed into and left printing.

Each test is one of the ways the collector used to be wrong on a real machine (issue 23): it fails on the
collector before that change. The hand-written fixtures in tests/unit/agent stay for what only fakes reach.

Kept fast (issue 41): the tests that need nothing but a plain server share one (emptied after each test: every
test opens its own kernel or terminal, and finds none of another's); a test whose configuration is its subject
has its own. Servers start a few tests ahead, side by side, and stop while later tests run (Servers)."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import termios
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jupyter_server", reason="the 'collector' dependency group (make sync installs it)")
import websocket

from testkit.agent_install import fake_commands, run_install

AGENT_DIR = Path(__file__).resolve().parents[2] / "agent"
AGENT = AGENT_DIR / "idle_reaper_activity.py"
sys.path.insert(0, str(AGENT_DIR))
import idle_reaper_activity as agent  # noqa: E402

pytestmark = pytest.mark.integration
JUPYTER = (sys.executable, "-m", "jupyter_server")
LAB = (sys.executable, "-m", "jupyterlab")
# Another person (a Jupyter server of theirs) and the collector's system user, as the unit runs it: uids without
# a name, so that nothing is added to this machine's users. They run the system's python3 (this environment's
# interpreter may live where another user cannot enter, e.g. under /root), the server with this environment's
# packages, the collector as on a machine: `python3 -I`, standard library only.
STRANGER, COLLECTOR_UID = 40001, 40002
SYSTEM_PYTHON = "/usr/bin/python3"


_PORTS_HANDED_OUT: set[int] = set()


def this_machines_address() -> str | None:
    """An address of this machine besides loopback: the source of its route to the documentation networks (a
    UDP socket's connect sends nothing). None on a machine with loopback alone."""
    for family, target in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                address = str(probe.getsockname()[0])
        except OSError:
            continue
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


OWN_ADDRESS = this_machines_address()


def free_port() -> int:
    """A port nothing listens on, never the same twice in this process: servers start side by side here."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port


@dataclass(frozen=True)
class Spec:
    """How one server is started. Paths (`env` values, `runtime`) are relative to the server's own directory,
    which holds its HOME (`home/`) and its root (`notebooks/`)."""

    command: tuple[str, ...] = JUPYTER
    ip: str = "127.0.0.1"
    password: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    runtime: str = "home/.local/share/jupyter/runtime"  # where its runtime file goes (JUPYTER_PLATFORM_DIRS=0)
    user: int | None = None  # another user's server (the system's python3): its directory is outside pytest's


# Each server configuration the tests use, by the name of the fixture that hands it out (the runtime-dir test's
# by its `where`). "jupyter" is shared by the tests that need nothing but a plain server (module-scoped, emptied
# after each test); every other one belongs to one test, because its configuration is what that test is about.
SPECS: dict[str, Spec] = {
    "jupyter": Spec(),
    "lab": Spec(command=LAB, ip="0.0.0.0"),
    "guarded": Spec(password="correct horse"),
    "XDG_DATA_HOME": Spec(env=(("XDG_DATA_HOME", "home/.xdg"),), runtime="home/.xdg/jupyter/runtime"),
    "JUPYTER_RUNTIME_DIR": Spec(env=(("JUPYTER_RUNTIME_DIR", "home/work/jrt"),), runtime="home/work/jrt"),
    # outside every home: not searched
    "unfound": Spec(env=(("JUPYTER_RUNTIME_DIR", "elsewhere-runtime"),), runtime="elsewhere-runtime"),
    "mortal": Spec(),  # the hidepid test's, which watches it exit
    "stranger": Spec(user=STRANGER),  # the real hidepid test's: another user's server
    "bound": Spec(ip=OWN_ADDRESS or "127.0.0.1"),  # listening on one address of this machine only, not loopback
}


@dataclass
class Server:
    """One running Jupyter server: where it keeps its runtime file, and how to talk to it as a browser."""

    process: subprocess.Popen[bytes]
    home: Path
    root: Path
    runtime_dir: Path
    port: int
    token: str
    log: Path
    host: str = "127.0.0.1"  # where it listens: loopback, unless it listens on one other address only

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def info(self) -> dict[str, Any]:
        [path] = self.runtime_dir.glob(f"jpserver-{self.process.pid}.json")
        info: dict[str, Any] = json.loads(path.read_text())
        return info

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """A request as the front end makes it (activity tracked, unlike the collector's)."""
        import urllib.request

        request = urllib.request.Request(
            f"http://{self.netloc}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def websocket(self, path: str) -> websocket.WebSocket:
        return websocket.create_connection(
            f"ws://{self.netloc}/{path}", header=[f"Authorization: token {self.token}"], timeout=30
        )


def launch(directory: Path, spec: Spec, token: str = "t0ken-for-tests") -> Server:
    """Start a server and return at once (wait_ready waits for it): servers start side by side."""
    home, root = directory / "home", directory / "notebooks"
    home.mkdir(parents=True, exist_ok=True)
    root.mkdir(exist_ok=True)
    port = free_port()
    command = spec.command
    if spec.user is not None:  # its own HOME and root, which it alone may enter (jupyter makes its runtime dir 0700)
        for path in (directory, home, root):
            os.chown(path, spec.user, spec.user)
        user = (f"--reuid={spec.user}", f"--regid={spec.user}", "--clear-groups")
        command = ("setpriv", *user, SYSTEM_PYTHON, "-m", "jupyter_server")
    args = [
        *command,
        "--no-browser",
        "--allow-root",  # CI machines run tests as root
        f"--ip={spec.ip}",
        f"--port={port}",  # a free port, which another process may take before the server binds it: then the
        # server tries the next ones (port_retries), and wait_ready reads the one it chose from its runtime file
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={'' if spec.password else token}",
    ]
    if spec.command == JUPYTER:
        # A plain server loads what the collector and these tests talk to: jupyter_server itself and its terminals
        # (api/terminals, which an open tab polls). The environment enables JupyterLab, LSP and the notebook shim
        # for every server too: together about half a second of each start-up, and nothing the collector reads
        # (JupyterLab itself is the `lab` server's, with everything enabled, as users start it).
        args += [
            f"--ServerApp.jpserver_extensions={name}=False" for name in ("jupyterlab", "jupyter_lsp", "notebook_shim")
        ]
    if spec.password:
        from jupyter_server.auth import passwd

        args.append(f"--PasswordIdentityProvider.hashed_password={passwd(spec.password)}")
    environment = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "JUPYTER_PLATFORM_DIRS": "0",
        **{name: str(directory / value) for name, value in spec.env},
        **({"PYTHONPATH": sysconfig.get_paths()["purelib"]} if spec.user is not None else {}),
    }
    log = directory / "server.log"
    with open(log, "wb") as output:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            args, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    host = "127.0.0.1" if spec.ip in ("127.0.0.1", "0.0.0.0") else spec.ip
    return Server(process, home, root, directory / spec.runtime, port, token, log, host)


def wait_ready(server: Server, seconds: float = 60) -> Server:
    """Wait until the server has written its runtime file and answers on its port."""
    deadline = time.monotonic() + seconds
    while not list(server.runtime_dir.glob(f"jpserver-{server.process.pid}.json")):
        if server.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(server.log.read_text()[-3000:])
        time.sleep(0.05)
    runtime_file = server.runtime_dir / f"jpserver-{server.process.pid}.json"
    while True:  # the port it bound, once the file is whole
        with contextlib.suppress(ValueError, KeyError):
            server.port = int(json.loads(runtime_file.read_text())["port"])
            break
        if time.monotonic() > deadline:
            raise RuntimeError(server.log.read_text()[-3000:])
        time.sleep(0.05)
    # The runtime file can precede the listening socket by a moment under load: wait until it answers.
    while True:
        try:
            socket.create_connection((server.host, server.port), timeout=1).close()
            return server
        except OSError:
            if server.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(server.log.read_text()[-3000:]) from None
            time.sleep(0.05)


def stop(server: Server, wait: bool = True) -> None:
    """SIGTERM (the server shuts its kernels and terminals down); with `wait`, until it has exited."""
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
    if not wait:
        return
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


# Servers started ahead of the tests that use them. Starting one is CPU-bound (about 1.5 s of CPU), so a few at
# once keep two cores busy; under pytest-xdist a worker may start one for a neighbouring test that another worker
# runs (stopped with the module, unused): at most this many.
START_AHEAD = 2


def spec_name(item: pytest.Item) -> str | None:
    """The SPECS entry a test uses: the fixture it asks for, or for runtime_server its `where`."""
    names = getattr(item, "fixturenames", ())
    if "runtime_server" in names:
        where: str = item.callspec.params["where"]  # type: ignore[attr-defined]
        return where
    return next((name for name in names if name in SPECS), None)


class Servers:
    """This module's servers by SPECS name: each is started (not waited for) as soon as one of the next few tests
    in run order will use it, so that it starts while earlier tests run, and is waited for by the test's fixture."""

    def __init__(self, factory: pytest.TempPathFactory, items: list[pytest.Item]) -> None:
        self.factory, self.items = factory, items
        self.running: dict[str, Server] = {}
        self.stopping: list[Server] = []
        self.outside: list[Path] = []  # other users' server directories: pytest's own are 0700, root's

    def start(self, *names: str | None) -> None:
        for name in names:
            if name is not None and name not in self.running:
                self.running[name] = launch(self.directory(name), SPECS[name])

    def directory(self, name: str) -> Path:
        if SPECS[name].user is None:
            return self.factory.mktemp(name)
        self.outside.append(Path(tempfile.mkdtemp(prefix=f"idle-reaper-{name}-")))
        return self.outside[-1]

    def start_ahead(self, item: pytest.Item) -> None:
        """Start this test's server and those of the next START_AHEAD tests (in the order they run here)."""
        index = self.items.index(item) if item in self.items else len(self.items)
        self.start(*(spec_name(upcoming) for upcoming in self.items[index : index + 1 + START_AHEAD]))

    def take(self, name: str) -> Server:
        self.start(name)
        return wait_ready(self.running[name])

    def release(self, name: str) -> None:
        """Stop a test's own server: it exits while the next tests run (close() waits for it)."""
        server = self.running.pop(name, None)
        if server is not None:
            stop(server, wait=False)
            self.stopping.append(server)

    def close(self) -> None:
        servers = [*self.running.values(), *self.stopping]
        for server in servers:
            stop(server, wait=False)
        for server in servers:
            stop(server)
        for directory in self.outside:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    pool = Servers(tmp_path_factory, items)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def _start_servers_ahead(servers: Servers, request: pytest.FixtureRequest) -> None:
    servers.start_ahead(request.node)


@pytest.fixture(scope="module")
def shared_jupyter(servers: Servers) -> Server:
    """One plain server for every test of the module that needs nothing else (each gets it through `jupyter`)."""
    return servers.take("jupyter")


def nothing_open(server: Server) -> bool:
    return not (
        server.api("GET", "api/sessions") or server.api("GET", "api/kernels") or server.api("GET", "api/terminals")
    )


def ipython_history(server: Server) -> Path:
    """Where the server's IPython kernels keep the cells they were sent (its user's HOME)."""
    return server.home / ".ipython" / "profile_default" / "history.sqlite"


@pytest.fixture
def jupyter(shared_jupyter: Server) -> Iterator[Server]:
    """The shared plain server, as a fresh one: no session, kernel, terminal or notebook when a test starts, and
    whatever the test opened is shut down after it (a busy kernel interrupted first), so no test sees another's
    and the order they run in changes nothing."""
    server = shared_jupyter
    assert server.process.poll() is None and nothing_open(server) and not list(server.root.iterdir())
    assert not (server.home / ".ipython").exists()
    yield server
    for kernel in server.api("GET", "api/kernels"):
        if kernel["execution_state"] != "idle":  # a hung cell: interrupted, else shutting down waits for it
            server.api("POST", f"api/kernels/{kernel['id']}/interrupt")
    for session in server.api("GET", "api/sessions"):
        server.api("DELETE", f"api/sessions/{session['id']}")  # shuts its kernel down
    for kernel in server.api("GET", "api/kernels"):
        server.api("DELETE", f"api/kernels/{kernel['id']}")
    for terminal in server.api("GET", "api/terminals"):
        server.api("DELETE", f"api/terminals/{terminal['name']}")
    for entry in server.root.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.rmtree(server.home / ".ipython", ignore_errors=True)  # the kernels' history: written until they exited


def _own_server(name: str) -> Any:
    """A fixture handing a test its own server (SPECS[name]), stopped after the test."""

    @pytest.fixture(name=name)
    def fixture(servers: Servers) -> Iterator[Server]:
        yield servers.take(name)
        servers.release(name)

    return fixture


def _own_server_if_allowed(name: str) -> Any:
    """A fixture handing a test a function that waits for its own server (SPECS[name], started ahead like the
    others): for the tests that first ask whether this machine allows what the server needs."""

    @pytest.fixture(name=name)
    def fixture(servers: Servers) -> Iterator[Callable[[], Server]]:
        yield lambda: servers.take(name)
        servers.release(name)

    return fixture


lab = _own_server("lab")
guarded = _own_server("guarded")
unfound = _own_server("unfound")
mortal = _own_server("mortal")
stranger = _own_server_if_allowed("stranger")
bound = _own_server_if_allowed("bound")


@pytest.fixture
def runtime_server(servers: Servers, where: str) -> Iterator[Server]:
    yield servers.take(where)
    servers.release(where)


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
    """What the collector read of Jupyter: the servers' answers and the IPython kernels' history."""
    return [s for s in collected.sightings if s.source.startswith(("jupyter", "ipython"))]


def asked(collected: agent.Collected, server: Server) -> list[agent.Sighting]:
    """What the collector read from the server's own API (the runtime file names the server's pid)."""
    return [s for s in collected.sightings if s.source.startswith(f"jupyter jpserver-{server.process.pid}.json ")]


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
    if wait:
        stored(server, code)


def stored(server: Server, code: str) -> None:
    """Wait until IPython has written the cell into its history: its saving thread does, as the cell arrives,
    beside the kernel; on a loaded machine that can be a moment after the kernel went idle again."""
    history, deadline = ipython_history(server), time.monotonic() + 20
    while True:
        with (
            contextlib.suppress(sqlite3.Error),
            contextlib.closing(sqlite3.connect(f"file:{history}?mode=ro", uri=True)) as db,
        ):
            if db.execute("SELECT count(*) FROM history WHERE source_raw = ?", (code,)).fetchone()[0]:
                return
        assert time.monotonic() < deadline, f"IPython did not store {code!r} in {history}"
        time.sleep(0.05)


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


def save_like_an_open_tab(server: Server, name: str, source: str, outputs: list[dict[str, Any]]) -> None:
    """What JupyterLab's autosave sends (PUT api/contents, the whole notebook): one code cell, as the tab holds it."""
    cell = {
        "cell_type": "code",
        "id": "c0",
        "metadata": {},
        "execution_count": 1 if outputs else None,
        "source": source,
        "outputs": outputs,
    }
    notebook = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    server.api("PUT", f"api/contents/{name}", {"type": "notebook", "format": "json", "content": notebook})


def printed_to_a_tab(server: Server, kernel_id: str, lines: int = 5) -> list[dict[str, Any]]:
    """The stream output a tab connected to the kernel receives (IOPub goes to every connection), as nbformat
    outputs: what reaches an open notebook while nobody types."""
    ws = server.websocket(f"api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}")
    text, deadline = "", time.monotonic() + 20
    while text.count("\n") < lines:
        assert time.monotonic() < deadline, "no output reached the tab"
        message = json.loads(ws.recv())
        if message.get("channel") == "iopub" and message["msg_type"] == "stream":
            text += message["content"]["text"]
    ws.close()
    return [{"output_type": "stream", "name": "stdout", "text": text}]


# --- 1. `jupyter lab --ip=0.0.0.0`: the runtime file names the machine's hostname ---------------------------


def test_a_cell_run_in_jupyterlab_on_all_interfaces_is_seen(lab: Server) -> None:
    assert lab.info["hostname"] == "0.0.0.0" and f"//127.0.0.1:{lab.port}" not in lab.info["url"]
    kernel = open_notebook(lab)
    executed = time.time()
    execute(lab, kernel, "x = 1 + 1")
    collected = collect(lab)
    assert collected.minutes < 0.5, collected.sightings
    [seen] = [s for s in jupyter_sightings(collected) if s.source.startswith("ipython history")]
    assert executed - 2 <= seen.at <= time.time() and collected.gaps == {}
    # Asked on loopback at its own port: its open notebook, saved when it was created.
    assert [s.source.split()[-2] for s in asked(collected, lab)] == ["analysis.ipynb"]


# --- 6 and 8. an open tab polling, a busy kernel: neither is a person -------------------------------------


def test_an_open_tab_polling_is_not_input_and_a_busy_kernel_is_not_input_now(jupyter: Server) -> None:
    kernel = open_notebook(jupyter)
    execute(jupyter, kernel, "y = 2")
    went_idle = time.time()
    # An open tab polls for a second and a half (JupyterLab polls every ~10 s; these every 0.2 s). That is enough:
    # the server's own last_activity must move a full second past the moment the kernel went idle, while what
    # the collector reads must stay within half a second of it, so the two are told apart by half a second and
    # more, at the precision the server writes (microseconds); any further polling only widens that gap.
    poll_like_an_open_tab(jupyter, 1.5)
    seen = jupyter_sightings(collect(jupyter))
    # The server's own last_activity is now (the polls refreshed it); what the collector reads is not.
    assert agent.parse_jupyter_time(jupyter.api("GET", "api/status")["last_activity"]) >= went_idle + 1.0
    assert seen and max(s.at for s in seen) <= went_idle + 0.5, seen

    # A cell that waits forever (a pending input(), a hung call) at 0 % CPU: busy, and not input.
    execute(jupyter, kernel, "import time\ntime.sleep(600)", wait=False)
    deadline = time.monotonic() + 30
    while jupyter.api("GET", f"api/kernels/{kernel}")["execution_state"] != "busy":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    half_an_hour_later = collect(jupyter, now=time.time() + 1800)
    assert not [s for s in half_an_hour_later.sightings if s.source.endswith("busy")]
    assert half_an_hour_later.minutes >= 29, half_an_hour_later.sightings


# --- issue 44, 1. output is not a person: a kernel printing while nobody types ----------------------------


PRINTING_THREAD = """import threading, time
def progress():
    while True:
        print("step", flush=True)  # a progress line, a logger, a metric printed by a training loop
        time.sleep(0.05)
threading.Thread(target=progress, daemon=True).start()"""


def test_a_kernel_printing_while_nobody_types_is_not_input_and_a_cell_sent_is(jupyter: Server, tmp_path: Path) -> None:
    kernel = open_notebook(jupyter)
    save_like_an_open_tab(jupyter, "analysis.ipynb", PRINTING_THREAD, [])  # a person wrote the cell
    execute(jupyter, kernel, PRINTING_THREAD)  # and ran it; it ends at once, its thread prints on, nobody types
    # Nobody has typed for an hour: the cell that started the thread, and the notebook's save, set an hour back.
    hour_ago = time.time() - 3600
    for evidence in (ipython_history(jupyter), jupyter.root / "analysis.ipynb"):
        os.utime(evidence, (hour_ago, hour_ago))
    aged = time.time()
    memory = {"state_dir": str(tmp_path)}  # the unit's StateDirectory: what the collector saw of each notebook

    def server_says() -> float:
        return agent.parse_jupyter_time(jupyter.api("GET", f"api/kernels/{kernel}")["last_activity"])

    # jupyter_server refreshes the idle kernel's last_activity on each line it prints (what the collector read).
    deadline = time.monotonic() + 20
    while server_says() < aged + 0.5:
        assert time.monotonic() < deadline, "the kernel's output did not refresh the server's last_activity"
        time.sleep(0.05)
    assert jupyter.api("GET", f"api/kernels/{kernel}")["execution_state"] == "idle"
    collected = collect(jupyter, **memory)
    assert collected.minutes == pytest.approx(60, abs=0.5), collected.sightings
    assert not [s for s in collected.sightings if s.at > hour_ago + 60], collected.sightings

    # Issue 44 read-over, 4: an open tab receives the thread's output, and JupyterLab marks the notebook unsaved
    # (its shared model sets `dirty` on each output change) and autosaves it every two minutes, nobody typing. The
    # save is new (the server says: now), its cells are not: not input (on main: "input 0 min ago").
    save_like_an_open_tab(jupyter, "analysis.ipynb", PRINTING_THREAD, printed_to_a_tab(jupyter, kernel))
    saved = agent.parse_jupyter_time(jupyter.api("GET", "api/contents/analysis.ipynb?content=0")["last_modified"])
    assert saved > hour_ago + 3000
    collected = collect(jupyter, **memory)
    assert collected.minutes == pytest.approx(60, abs=0.5), collected.sightings
    [notebook] = [s for s in asked(collected, jupyter) if "analysis.ipynb" in s.source]
    assert notebook.at == pytest.approx(hour_ago, abs=1)

    # A person edits the cell and the tab saves it: input, now.
    edited = PRINTING_THREAD + "\n# stopped with the kernel"
    save_like_an_open_tab(jupyter, "analysis.ipynb", edited, printed_to_a_tab(jupyter, kernel))
    assert collect(jupyter, **memory).minutes < 0.5

    # A person runs a cell (an execute_request from a client, as JupyterLab sends it): input, now.
    sent = time.time()
    execute(jupyter, kernel, "result = 6 * 7")
    collected = collect(jupyter)
    assert collected.minutes < 0.5, collected.sightings
    [cell] = [s for s in collected.sightings if s.source.startswith("ipython history")]
    assert sent - 1 <= cell.at <= time.time() and collected.gaps == {}


# --- 3. a password instead of a token: the API refuses ------------------------------------------------------


def test_a_password_protected_server_is_read_from_its_notebook_saves_and_says_so(guarded: Server) -> None:
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
def test_runtime_files_outside_the_default_directory_are_found(runtime_server: Server, where: str) -> None:
    # XDG_DATA_HOME=~/.xdg (the file in ~/.xdg/jupyter/runtime), or JUPYTER_RUNTIME_DIR=~/work/jrt: SPECS[where].
    assert runtime_server.runtime_dir != runtime_server.home / ".local" / "share" / "jupyter" / "runtime"
    kernel = open_notebook(runtime_server)
    execute(runtime_server, kernel, "z = 3")
    collected = collect(runtime_server)
    assert collected.minutes < 0.5 and jupyter_sightings(collected), collected


def test_a_running_server_whose_runtime_file_cannot_be_found_is_named(unfound: Server) -> None:
    elsewhere = unfound.runtime_dir  # JUPYTER_RUNTIME_DIR outside every home: not searched
    assert not elsewhere.is_relative_to(unfound.home)
    collected = collect(unfound, proc_root="/proc")
    assert jupyter_sightings(collected) == []
    assert f"pid {unfound.process.pid} (python -m jupyter_server" in collected.gaps["jupyter"]
    assert collected.unreadable & 2
    # Told where, it is read, and no longer named.
    told = collect(unfound, jupyter_dirs=(str(elsewhere),), proc_root="/proc")
    assert f"pid {unfound.process.pid} " not in told.gaps.get("jupyter", "")


# --- 5. /proc with hidepid: a server is alive though its /proc entry is hidden ----------------------------


def test_a_live_server_is_asked_even_where_proc_hides_it(mortal: Server, tmp_path: Path) -> None:
    hidden = tmp_path / "proc"  # what an unprivileged reader sees of /proc under hidepid=2: not the server
    hidden.mkdir()
    kernel = open_notebook(mortal)
    execute(mortal, kernel, "w = 4")
    collected = collect(mortal, proc_root=str(hidden))
    assert collected.minutes < 0.5 and asked(collected, mortal)
    stop(mortal)  # and waited for: it has exited
    # Once it has exited, its runtime file is ignored (signal 0 finds no process).
    assert not agent.pid_alive(mortal.process.pid)


# --- 2 and 7. terminals: typing counts, output does not; no utmp needed ------------------------------------


def spawn_shell() -> tuple[int, int, Path]:
    """A real shell on a new pseudo-terminal, in its own session, as sshd or a terminal emulator starts one:
    (pid, master fd, the pty's device). Nothing is written to utmp."""
    return spawn(["sh", "-i"], {"PATH": os.environ["PATH"], "PS1": "$ ", "HOME": "/tmp"})


def spawn(argv: list[str], env: dict[str, str]) -> tuple[int, int, Path]:
    """A program on a new pseudo-terminal, in its own session (its controlling terminal): (pid, master fd, the
    pty's device). What pty.fork does, with the device named by the pty itself (not by which /dev/pts entry
    appeared: other processes open ptys meanwhile)."""
    master, slave = os.openpty()
    device = Path(os.ttyname(slave))
    pid = os.fork()
    if pid == 0:  # the child: a new session, whose controlling terminal is the pty
        os.close(master)
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(slave, fd)
        os.execvpe(argv[0], argv, env)
    os.close(slave)
    return pid, master, device


def read_until(master: int, done: Callable[[bytes], bool], seconds: float = 20) -> bytes:
    """What the terminal prints until `done` says it has printed enough."""
    out, deadline = b"", time.monotonic() + seconds
    while not done(out):
        assert time.monotonic() < deadline, out
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):
                out += os.read(master, 65536)
    return out


def prompt(out: bytes) -> bool:
    """The shell has read its input and waits for more."""
    return out.endswith(b"$ ")


def age(device: Path, seconds: float) -> None:
    """Set a pty's last input back, so that a new input (or its absence) shows."""
    info = device.stat()
    os.utime(device, (time.time() - seconds, info.st_mtime))


def pty_minutes(collected: agent.Collected, device: Path) -> float:
    [seen] = [s for s in collected.sightings if s.source.startswith(f"pty {device.relative_to('/dev')} ")]
    return (time.time() - seen.at) / 60


def test_typing_in_a_terminal_without_utmp_counts_and_its_output_does_not() -> None:
    pid, master, device = spawn_shell()
    try:
        read_until(master, prompt)
        age(device, 3600)
        assert pty_minutes(collect(None), device) == pytest.approx(60, abs=0.5)
        os.write(master, b"echo typed\n")  # a keystroke: the shell reads it
        assert b"\r\ntyped" in read_until(master, prompt)  # its output, after the line discipline's echo
        assert pty_minutes(collect(None), device) < 0.5
        # A loop that prints, nobody typing: the shell writes, nobody reads. The pty is set an hour back once the
        # shell has read the loop (its first line is out): any output that refreshed the last input would show
        # as 0 minutes, so the 29 lines written one by one after that, in 0.6 s, prove it as well as 3 s of them
        # did (an hour is far beyond the kernel's 8 s granularity for a pty's times).
        os.write(master, b"i=0; while [ $i -lt 30 ]; do echo line $i; i=$((i+1)); sleep 0.02; done\n")
        read_until(master, lambda out: b"line 0\r\n" in out)
        age(device, 3600)
        assert b"line 29\r\n" in read_until(master, prompt)
        assert pty_minutes(collect(None), device) == pytest.approx(60, abs=0.5)
        ignored = collect(None, ignore_users=(agent._user_name(device.stat().st_uid),))
        assert not [s for s in ignored.sightings if s.source.startswith("pty")]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(master)


def test_a_jupyter_terminal_printing_to_a_connected_browser_is_not_input(jupyter: Server) -> None:
    name = jupyter.api("POST", "api/terminals")["name"]
    ws = jupyter.websocket(f"terminals/websocket/{name}")
    printed = ""  # what the browser has received

    def receive_until(pattern: str) -> re.Match[str]:
        nonlocal printed
        deadline = time.monotonic() + 20
        while (found := re.search(pattern, printed)) is None:
            assert time.monotonic() < deadline, printed
            message = json.loads(ws.recv())
            printed += message[1] if message[0] == "stdout" else ""
        return found

    try:
        ws.send(json.dumps(["stdin", "tty\r"]))  # which pty is it (others open ptys meanwhile)
        device = Path(receive_until(r"(/dev/pts/\d+)\r\n").group(1))  # the whole line: not /dev/pts/1 of 12
        # Printing a line every 20 ms, for longer than the test watches (the terminal is deleted after it).
        ws.send(json.dumps(["stdin", "i=0; while [ $i -lt 1000 ]; do echo tick $i; i=$((i+1)); sleep 0.02; done\r"]))
        receive_until(r"tick 3\r\n")  # the shell has read the loop: from here on it only writes
        age(device, 3600)
        # The browser receives twenty more lines: an hour back, any refresh of the last input by them would show
        # as 0 minutes, so twenty lines in 0.4 s prove it as well as twenty in 2 s did.
        receive_until(r"tick 23\r\n")
        collected = collect(jupyter)
        # The server counts the output as activity; the collector sees no keystroke for an hour.
        assert pty_minutes(collected, device) == pytest.approx(60, abs=0.5)
        assert not [s for s in collected.sightings if "last_activity" in s.source]
    finally:
        ws.close()


# --- issue 44, 2. what the tests above simulate, for real where the machine allows it --------------------------
# A real procfs mounted with hidepid=2, seen by the collector's own user, beside a server of another user; a login
# record written by the system's own login(1). Both need root and a mount namespace of their own (nothing of
# this machine's /proc or utmp is touched). Where the machine does not allow it (not root; a container without
# CAP_SYS_ADMIN; no util-linux or shadow tools) the test says why in the run's warnings and in those words only
# (tests/README.md lists them): the simulated tests above and the utmp fixtures in tests/unit run everywhere.

AS_COLLECTOR = (
    f"setpriv --reuid={COLLECTOR_UID} --regid={COLLECTOR_UID} --clear-groups "
    "--inh-caps=+dac_read_search --ambient-caps=+dac_read_search"  # the unit's user: CAP_DAC_READ_SEARCH alone
)
HIDEPID_PROBE = (
    f"mount -t proc -o hidepid=2 proc /proc && {AS_COLLECTOR} {SYSTEM_PYTHON} -I -c 'import os' && "
    f"PYTHONPATH={sysconfig.get_paths()['purelib']} setpriv --reuid={STRANGER} --regid={STRANGER} --clear-groups "
    f"{SYSTEM_PYTHON} -c 'import jupyter_server, ipykernel'"
)
RUN_DIR = os.path.realpath("/var/run")  # glibc's utmp is /var/run/utmp: /run/utmp on today's systems
LOGIN_PROBE = f"mount -t tmpfs tmpfs {RUN_DIR} && command -v login"


def machine_refuses(probe: str) -> str | None:
    """None when this machine runs `probe` (a shell script of what a test needs) as root in a mount namespace of
    its own; else why not: "not root ...", "missing ..." or "not permitted ..." (anything else is a test's bug)."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): mounting a procfs or tmpfs, login -f and other users need root"
    missing = [tool for tool in ("unshare", "setpriv", "mount", SYSTEM_PYTHON) if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    if version.stdout.decode().strip() != str(sys.version_info[:2]):  # another user's server imports our packages
        return f"missing {SYSTEM_PYTHON} {sys.version_info[0]}.{sys.version_info[1]} (it is {version.stdout!r})"
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", probe]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode == 0:
        return None
    said = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")[-300:]
    denied = "not permitted" in said or "Permission denied" in said
    return f"{'not permitted' if denied else 'failed'}: {shlex.join(command[:5])} sh -c {probe!r}: {said}"


def say_why_not(what: str, why: str) -> None:
    warnings.warn(f"{what}: not run on this machine, {why}", stacklevel=2)
    assert why.startswith(("not root", "missing", "not permitted")), why


def test_a_server_of_another_user_is_asked_under_a_real_hidepid_proc(
    stranger: Callable[[], Server], tmp_path: Path
) -> None:
    why = machine_refuses(HIDEPID_PROBE)
    if why is not None:
        return say_why_not("a real hidepid=2 /proc", why)
    server = stranger()  # uid 40001, its runtime directory 0700
    kernel = open_notebook(server)
    execute(server, kernel, "v = 5")
    pid = server.process.pid
    dev = tmp_path / "dev"
    (dev / "pts").mkdir(parents=True)  # no terminal: not this test's subject
    collector = (
        f"test -e /proc/{pid} && echo 'pid {pid} visible' >&2; "
        f"exec {SYSTEM_PYTHON} -I {AGENT} --print --verbose --home {server.home} --utmp /nonexistent --dev-root {dev}"
    )
    # The collector as its unit runs it, in a mount namespace whose /proc is a real procfs with hidepid=2.
    hidden = f"mount -t proc -o hidepid=2 proc /proc && exec {AS_COLLECTOR} sh -c {shlex.quote(collector)}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", hidden],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "visible" not in done.stderr and "hides other users' processes (hidepid)" in done.stderr, done.stderr
    minutes = {line.rsplit(None, 2)[0]: line.rsplit(None, 2)[1] for line in done.stdout.splitlines()[:-2]}
    # Signal 0 says the server lives (EPERM: not ours); its runtime file and history are read with the capability.
    assert float(minutes[f"jupyter jpserver-{pid}.json notebook analysis.ipynb edited"]) < 0.5, done.stdout
    assert float(minutes["ipython history (home, profile_default)"]) < 0.5, done.stdout


def test_a_login_recorded_by_the_systems_own_login_accounting_is_read(tmp_path: Path) -> None:
    why = machine_refuses(LOGIN_PROBE)
    if why is not None:
        return say_why_not("a real login record", why)
    # login(1) as on a console or behind sshd, on a new pty: it writes the USER_PROCESS record through libc's
    # pututxline into /var/run/utmp, which is this test's file in a mount namespace of its own.
    utmp = tmp_path / "utmp"
    utmp.touch()
    script = f"mount -t tmpfs tmpfs {RUN_DIR} && touch {RUN_DIR}/utmp && mount --bind {utmp} {RUN_DIR}/utmp"
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f"{script} && exec login -f root"]
    pid, master, device = spawn(command, {"PATH": os.environ["PATH"], "TERM": "dumb"})
    line = str(device.relative_to("/dev"))

    def tty_minutes() -> float:
        [seen] = [s for s in collect(None, utmp_path=str(utmp)).sightings if s.source == f"tty {line} (root)"]
        return (time.time() - seen.at) / 60

    try:
        os.write(master, b"echo LOGGED''IN\n")  # read by root's login shell once it runs
        read_until(master, lambda out: b"LOGGEDIN" in out)
        [record] = [e for e in agent.parse_utmp(utmp.read_bytes()) if e.type == agent.UTMP_USER_PROCESS]
        assert (record.user, record.line) == ("root", line) and time.time() - record.login_at < 60
        parent = int(Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == pid, "the session of the login started here: its shell, login's child"
        age(device, 3600)
        assert tty_minutes() == pytest.approx(60, abs=0.5)
        os.write(master, b"echo TYPED''X\n")  # a keystroke on that terminal
        read_until(master, lambda out: b"TYPEDX" in out)
        assert tty_minutes() < 0.5
    finally:
        os.write(master, b"exit\n")
        os.close(master)  # a hang-up for whatever is left of the session
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# --- issue 44, 3. the unit's sandbox and a server listening on one address of this machine ----------------------
# systemd is not PID 1 here (`systemd-run -p IPAddressDeny=any true`: "System has not been booted with systemd as
# init system"), so the unit is not run: its settings, as install.sh writes them on this machine, are held to
# every socket call the collector really makes (Python's audit events), by systemd's own rules.

AUDITED = """import atexit, json, runpy, sys
record, sys.argv = sys.argv[1], sys.argv[2:]
calls = []
def hook(event, args):
    if event == "socket.__new__":
        calls.append(["family", int(args[1])])
    elif event in ("socket.connect", "socket.sendto"):
        calls.append([event, list(args[1])[:2]])
sys.addaudithook(hook)
atexit.register(lambda: open(record, "w").write(json.dumps(calls)))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
IP_WORDS = {  # systemd.resource-control(5): the names IPAddressAllow=/IPAddressDeny= know
    "any": ("0.0.0.0/0", "::/0"),
    "localhost": ("127.0.0.0/8", "::1/128"),
    "link-local": ("169.254.0.0/16", "fe80::/64"),
    "multicast": ("224.0.0.0/4", "ff00::/8"),
}


def sandbox(unit: str) -> tuple[Callable[[str], bool], set[int]]:
    """What a unit's IPAddressAllow=/IPAddressDeny= let through (an address on an allow list is let through, else
    one on a deny list is dropped, else let through; an empty assignment empties a list), and the address
    families RestrictAddressFamilies= allows."""
    rules: dict[str, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {"IPAddressAllow": [], "IPAddressDeny": []}
    families: set[int] = set()
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key in rules:
            words = value.split()
            rules[key] = [] if not words else rules[key]
            rules[key] += [ipaddress.ip_network(net) for word in words for net in IP_WORDS.get(word, (word,))]
        elif key == "RestrictAddressFamilies":
            families |= {int(getattr(socket, name)) for name in value.split()}

    def permitted(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        on = {key: any(ip in net for net in nets if net.version == ip.version) for key, nets in rules.items()}
        return on["IPAddressAllow"] or not on["IPAddressDeny"]

    return permitted, families


def test_the_units_sandbox_lets_the_collector_ask_a_server_on_this_machines_own_address(
    bound: Callable[[], Server], tmp_path: Path
) -> None:
    if OWN_ADDRESS is None:
        return say_why_not("a server on an address besides loopback", "missing an address besides loopback")
    server = bound()  # jupyter server --ip=<this machine's address>: nothing on loopback
    open_notebook(server)
    bin_dir, _ = fake_commands(tmp_path)
    installed = run_install(tmp_path, bin_dir, bin_dir / "amazon-cloudwatch-agent-ctl")
    assert installed.returncode == 0, installed.stderr
    unit = (tmp_path / "units" / "idle-reaper-activity.service").read_text()
    nothing = tmp_path / "none"
    (nothing / "pts").mkdir(parents=True)
    (nothing / "1").mkdir()  # a /proc stand-in listing pid 1 alone: other tests' servers are not this test's
    where = ["--home", str(server.home), "--utmp", "/nonexistent", "--dev-root", str(nothing)]
    where += ["--proc-root", str(nothing), "--state-dir", str(tmp_path)]
    calls, shown = [], ""
    for mode in (["--print"], []):  # what it reads, printed; then a run as the timer's, sending to StatsD
        record = tmp_path / f"calls{len(mode)}.json"
        command = [sys.executable, "-I", "-c", AUDITED, str(record), str(AGENT), *mode, *where]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        calls += json.loads(record.read_text())
        shown += done.stdout
    assert f"jupyter jpserver-{server.process.pid}.json notebook analysis.ipynb edited" in shown, shown  # asked there
    permitted, families = sandbox(unit)
    connected = [tuple(args) for event, args in calls if event == "socket.connect"]
    sent = [tuple(args) for event, args in calls if event == "socket.sendto"]
    assert (OWN_ADDRESS, server.port) in connected and sent == [("127.0.0.1", 8125)] * 2, calls
    assert [address for address, _ in connected + sent if not permitted(address)] == [], unit
    assert {args for event, args in calls if event == "family"} <= families
    # What lets it through is the line install.sh writes: the unit as shipped names loopback alone.
    assert not sandbox((AGENT_DIR / "idle-reaper-activity.service").read_text())[0](OWN_ADDRESS)
