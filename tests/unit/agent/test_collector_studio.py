"""The collector's Studio mode (agent/idle_reaper_activity.py, `--cloudwatch`): a Studio app's container runs no
CloudWatch agent, so the collector publishes CPU, network, GPU and its gauges itself, in the agent's names, by
InstanceId = the app's machine id. Pure pieces here; tests/integration/test_studio_agent.py runs it for real against
moto's CloudWatch and reads it back as the sweep does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_activity_collector import _load_agent

from idle_reaper.aws.metrics import HUMAN_METRIC_NAME, HUMAN_METRIC_NAMESPACE
from idle_reaper.policy import MetricSettings

agent = _load_agent()
APP = "studio:d-abc123:alice-space:JupyterLab:default"

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo: {lo} 10 0 0 0 0 0 0 {lo} 10 0 0 0 0 0 0
  eth0: {rx} 20 0 0 0 0 0 0 {tx} 20 0 0 0 0 0 0
"""


def proc(root: Path, busy: int, idle: int, rx: int, tx: int, lo: int = 0) -> str:
    """A /proc with /proc/stat's first line (user nice system idle iowait irq softirq steal guest guest_nice) and
    /proc/net/dev."""
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 77 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "net" / "dev").write_text(NET_DEV.format(lo=lo, rx=rx, tx=tx))
    return str(root)


def test_the_names_are_those_the_sweep_reads_for_an_app() -> None:
    read = MetricSettings()
    assert agent.AGENT_NAMESPACE == read.notebook_cpu.namespace == read.gpu.namespace == HUMAN_METRIC_NAMESPACE
    sweep_reads = (read.notebook_cpu.name, read.gpu.name, HUMAN_METRIC_NAME)
    assert sweep_reads == (agent.CPU_METRIC, agent.GPU_METRIC, agent.METRIC_NAME)
    sweep_reads = (read.notebook_network_in.name, read.notebook_network_out.name)
    assert sweep_reads == (agent.NET_IN_METRIC, agent.NET_OUT_METRIC)


def test_cpu_and_network_are_the_interval_between_two_runs_and_a_stale_or_reset_sample_gives_none(
    tmp_path: Path,
) -> None:
    root, state = tmp_path / "proc", str(tmp_path)
    assert agent.sample_machine(1000.0, proc(root, busy=100, idle=900, rx=5000, tx=700, lo=9), state) == {}
    # Loopback traffic never counts; guest time is inside user time already.
    figures = agent.sample_machine(1060.0, proc(root, busy=130, idle=1170, rx=8000, tx=900, lo=99999), state)
    assert figures == {"cpu_usage_active": 10.0, "net_bytes_recv": 3000.0, "net_bytes_sent": 200.0}
    # A run that came more than five minutes later is not one interval: no figure, never an average read as quiet.
    assert agent.sample_machine(1400.0, proc(root, busy=131, idle=1500, rx=8001, tx=901), state) == {}
    # Counters that went back (an interface reset): CPU yes, network no.
    figures = agent.sample_machine(1460.0, proc(root, busy=191, idle=1740, rx=10, tx=5), state)
    assert figures == {"cpu_usage_active": 20.0}
    (tmp_path / agent.MACHINE_STATE).write_text("not json")
    assert agent.sample_machine(1520.0, proc(root, busy=200, idle=1800, rx=20, tx=6), state) == {}
    assert agent.sample_machine(1580.0, tmp_path / "missing", state) == {}, "an unreadable /proc: no figure"


def test_the_busiest_gpu_or_none_without_an_answer() -> None:
    def answer(stdout: str, code: int = 0) -> Any:
        return lambda *a, **k: subprocess.CompletedProcess(a, code, stdout=stdout, stderr="")

    assert agent.busiest_gpu(answer("3\n97\n0\n")) == 97.0
    assert agent.busiest_gpu(answer("[N/A]\n")) is None
    assert agent.busiest_gpu(answer("50\n", code=9)) is None

    def missing(*a: Any, **k: Any) -> Any:
        raise FileNotFoundError("nvidia-smi")

    assert agent.busiest_gpu(missing) is None


def studio_main(monkeypatch: pytest.MonkeyPatch, argv: list[str], at: float) -> tuple[int, list[Any]]:
    sent: list[Any] = []
    monkeypatch.setattr(agent, "put_metric_data", lambda data, region: sent.append((region, data)))
    monkeypatch.setattr(agent, "busiest_gpu", lambda: None)
    monkeypatch.setattr(
        agent, "collect", lambda now, settings: agent.Collected(12.5, [], {"jupyter": "no runtime file"})
    )
    return agent.main(argv, clock=lambda: at), sent


def test_studio_mode_publishes_by_the_apps_id_and_bad_input_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "proc"
    argv = ["--state-dir", str(tmp_path), "--proc-root", str(root), "--cloudwatch", APP, "--region", "eu-west-1"]
    proc(root, busy=100, idle=900, rx=0, tx=0)
    code, sent = studio_main(monkeypatch, argv, 1000.0)
    assert code == 0
    ((region, first),) = sent
    assert region == "eu-west-1"
    assert {d["MetricName"]: d["Value"] for d in first} == {
        "idle_reaper_minutes_since_input": 12.5,
        "idle_reaper_unreadable_sources": 2.0,
    }, "the first run has no interval yet: no CPU or network, never a zero"
    proc(root, busy=160, idle=940, rx=100, tx=50)
    code, sent = studio_main(monkeypatch, argv, 1060.0)
    ((_, second),) = sent
    assert {d["MetricName"]: d["Value"] for d in second}["cpu_usage_active"] == 60.0
    assert all(d["Dimensions"] == [{"Name": "InstanceId", "Value": APP}] for d in second)
    assert {d["Timestamp"].timestamp() for d in second} == {1060.0}
    before = (tmp_path / agent.MACHINE_STATE).read_text()
    for bad, why in (
        (argv[:-2], "needs --region"),
        ([*argv[:-1], "Ireland"], "needs --region"),
        ([*argv[:5], "", "--region", "eu-west-1"], "1 to 1024 characters"),
        ([*argv[:5], "x" * 1025, "--region", "eu-west-1"], "1 to 1024 characters"),
    ):
        with pytest.raises(SystemExit) as exited:
            studio_main(monkeypatch, bad, 1120.0)
        assert exited.value.code == 2, why
    assert (tmp_path / agent.MACHINE_STATE).read_text() == before, "a refused command line changes nothing"
    assert json.loads(before)["at"] == 1060.0


def test_a_refused_publish_is_said_and_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(data: Any, region: str) -> None:
        raise RuntimeError("AccessDenied: not authorized to perform cloudwatch:PutMetricData")

    monkeypatch.setattr(agent, "put_metric_data", refuse)
    monkeypatch.setattr(agent, "busiest_gpu", lambda: None)
    monkeypatch.setattr(agent, "collect", lambda now, settings: agent.Collected(3.0, [], {}))
    argv = ["--state-dir", str(tmp_path), "--proc-root", str(tmp_path), "--cloudwatch", APP, "--region", "us-east-2"]
    assert agent.main(argv, clock=lambda: 1000.0) == 1
