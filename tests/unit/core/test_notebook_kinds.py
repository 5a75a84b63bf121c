"""SageMaker notebook instances in the pure core: their kind by status, their GPU family, their price."""

from __future__ import annotations

import pytest
from test_core import NOW, machine, run_assess, series

from idle_reaper.core.dollars import of_kind
from idle_reaper.core.kinds import (
    NEVER_STOPPED,
    InstanceFacts,
    Kind,
    Lookups,
    classify,
    describe,
    family_of,
    handling,
    is_ec2_id,
    notebook_lifecycle_config,
    notebook_no_data_note,
)
from idle_reaper.core.signals import Signals, has_no_gpu, is_gpu_type
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, TeamPolicy
from idle_reaper.pricing import hourly_price


def notebook_kind(status: str):
    return classify(InstanceFacts(notebook_status=status), Lookups(), NOW)


def test_an_in_service_notebook_is_stopped_like_an_ordinary_machine_and_saves_its_sagemaker_price():
    kind = notebook_kind("InService")
    assert kind.kind is Kind.NOTEBOOK and kind.can_stop and not kind.can_terminate and kind.ordinary
    assert handling(kind, "ml.p3.2xlarge", TeamPolicy()).mode == "stop"
    assert of_kind(kind, hourly_price("ml.p3.2xlarge")).stop.hourly == pytest.approx(3.825)
    assert hourly_price("ml.p3.2xlarge") != hourly_price("p3.2xlarge")
    assert describe(kind) == "notebook"


@pytest.mark.parametrize("status", ["Pending", "Updating", "Stopping", "Failed"])
def test_a_notebook_not_in_service_is_held_never_stopped_and_says_why(status):
    kind = notebook_kind(status)
    assert kind.kind is Kind.NOTEBOOK_BUSY and not kind.can_stop and kind.kind in NEVER_STOPPED
    how = handling(kind, "ml.t3.medium", TeamPolicy())
    assert how.mode == "hold"
    assert f"that is {status}, not InService" in describe(kind)
    assert of_kind(kind, 1.0).stop.hourly == 0.0


def test_sagemaker_types_take_their_hardware_family_so_a_gpu_notebook_needs_gpu_data():
    assert family_of("ml.p3.2xlarge") == "p3" and family_of("g5.xlarge") == "g5"
    assert machine(instance_type="ml.g5.xlarge").family == "g5"
    assert is_gpu_type("ml.p3.2xlarge", DEFAULT_GPU_FAMILIES)
    assert has_no_gpu("ml.t3.medium", DEFAULT_GPU_FAMILIES) and not has_no_gpu("ml.g4dn.xlarge", DEFAULT_GPU_FAMILIES)
    # 1 % CPU and no GPU datapoint: a training job could be at 95 % GPU. Never idle.
    gpu_notebook = machine(
        instance_id="nb", instance_type="ml.p3.2xlarge", facts=InstanceFacts(notebook_status="InService")
    )
    cpu = series(1.0, minutes=120)
    assert run_assess(gpu_notebook, Signals(cpu=cpu)).signal == "unknown"
    assert run_assess(gpu_notebook, Signals(cpu=cpu, gpu=series(0.0, minutes=120))).signal == "idle"


def test_machine_ids_are_told_apart_and_the_no_data_note_names_cost_and_how_to_attach():
    assert is_ec2_id("i-0abc123def4567890") and is_ec2_id("i-0abc1234")
    assert not is_ec2_id("team-ml-nb") and not is_ec2_id("i-notebook")
    ours = notebook_lifecycle_config("idle-reaper")
    assert ours == "idle-reaper-notebook-agent", "the default deployment keeps its name"
    note = notebook_no_data_note(3.825, None, ours)
    assert (
        "$3.83/h" in note and "--lifecycle-config-name idle-reaper-notebook-agent`" in note and "never stopped" in note
    )
    assert "unknown price" in notebook_no_data_note(None, None, ours)
    # A second deployment's own configuration is its own; the first's is another configuration to it.
    staging = notebook_lifecycle_config("idle-reaper-staging")
    assert "attached but nothing arrives" in notebook_no_data_note(1.0, staging, staging)
    other = notebook_no_data_note(1.0, ours, staging)
    assert "is idle-reaper-notebook-agent, not this deployment's" in other
    assert "--lifecycle-config-name idle-reaper-staging-notebook-agent`" in other
