"""SageMaker real-time endpoints in the core: the policy field, what kind each endpoint is, when it is busy, idle or
unknown, what its deletion saves, the lifecycle under the endpoint window, and what its record keeps to bring it
back. Pure: SageMaker's answer shapes (testkit/sagemaker_answers.py), no AWS."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.core import Action, State, decide, kind_policy
from idle_reaper.core.answers import bring_back_failed
from idle_reaper.core.dollars import of_kind
from idle_reaper.core.endpoints import Restore, endpoint_id, endpoint_name, kept_restore
from idle_reaper.core.kinds import Kind, Lookups, classify, handling, notice_sentence
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord
from idle_reaper.core.signals import Signals, assess
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, PolicyError, TeamPolicy, TeamPolicyRef, parse_team_policy
from idle_reaper.pricing import hourly_price
from testkit.sagemaker_answers import (
    endpoint_config,
    endpoint_facts,
    endpoint_machine,
    serverless_variant,
    variant,
)

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
P = timedelta(minutes=5)
LONG_AGO = NOW - timedelta(days=7)
MANAGED_TO_ZERO = {"Status": "ENABLED", "MinInstanceCount": 0}
PENDING_SINCE = "2026-11-20T15:00:00+00:00"


def invocations(value: float | list[float], minutes: int = 1440 + 60, end: datetime = NOW) -> list:
    """5-minute Sum points covering [end - minutes, end - 5 min], oldest first."""
    count = (minutes - 5) // 5
    start = end - timedelta(minutes=5) - P * count
    values = value if isinstance(value, list) else [float(value)] * count
    return [(start + P * i, v) for i, v in enumerate(values)]


def ref(policy: TeamPolicy | None = None) -> TeamPolicyRef:
    return TeamPolicyRef(team="ml", policy=policy or TeamPolicy(), source="/idle-reaper/teams/ml", version=1)


def judged(facts, series: dict[str, list], *, policy: TeamPolicy | None = None, launched=LONG_AGO, reported=None):
    """The endpoint's own policy, its kind and its assessment, as the sweep makes them."""
    m = endpoint_machine(facts, launched)
    kind = classify(m.facts, Lookups(), NOW)  # an endpoint needs no EC2 look-up
    own = kind_policy(ref(policy), kind, m)
    assert own.policy is not None
    sig = Signals(invocations=tuple(series.items()), reported=tuple((reported or {}).items()))
    return m, kind, own, assess(m, sig, own.policy, now=NOW, period=P, gpu_families=DEFAULT_GPU_FAMILIES)


# ---------------------------------------------------------------------------------------------
# The policy field


class TestEndpointWindow:
    def test_a_day_by_default_and_set_per_team(self):
        assert TeamPolicy().endpoint_idle_minutes == 1440
        assert parse_team_policy("/t/ml", '{"endpoint_idle_minutes": 4320}', TeamPolicy()).endpoint_idle_minutes == 4320

    @pytest.mark.parametrize(
        ("value", "words"),
        [
            (59, "greater than or equal to 60"),
            (10081, "less than or equal to 10080"),
            ('"a day"', "valid integer"),
            ("1440.5", "valid integer"),
            ("null", "valid integer"),
        ],
    )
    def test_out_of_range_or_of_the_wrong_type_is_refused_and_named(self, value, words):
        with pytest.raises(PolicyError) as err:
            parse_team_policy("/t/ml", f'{{"endpoint_idle_minutes": {value}}}', TeamPolicy())
        (problem,) = err.value.problems
        assert problem.startswith("endpoint_idle_minutes:") and words in problem

    def test_it_must_leave_time_to_warn_even_in_a_schedule(self):
        with pytest.raises(PolicyError) as err:
            parse_team_policy("/t/ml", '{"endpoint_idle_minutes": 60, "warn_minutes": 60}', TeamPolicy())
        assert "endpoint_idle_minutes (60) must be longer than warn_minutes (60" in str(err.value)
        schedule = {"days": ["sat"], "warn_minutes": 120, "idle_minutes": 180}
        text = json.dumps({"endpoint_idle_minutes": 120, "schedules": [schedule]})
        with pytest.raises(PolicyError, match=r"endpoint_idle_minutes \(120\) must be longer than warn_minutes \(120"):
            parse_team_policy("/t/ml", text, TeamPolicy())


# ---------------------------------------------------------------------------------------------
# Kinds


class TestKind:
    def test_an_in_service_endpoint_with_its_model_is_deleted_and_saves_its_instances(self):
        facts = endpoint_facts(config=endpoint_config("config-a", variant(count=2)))
        kind = classify(endpoint_machine(facts, LONG_AGO).facts, Lookups(), NOW)
        assert (kind.kind, kind.can_stop) == (Kind.ENDPOINT, True)
        assert facts.hardware == "ml.g5.2xlarge x2"
        price = hourly_price(facts.hardware)
        assert price == pytest.approx(2 * 1.515)
        assert of_kind(kind, price).stop.text() == "$3.03/h"

    @pytest.mark.parametrize("status", ["Creating", "Updating", "SystemUpdating", "RollingBack"])
    def test_an_endpoint_not_in_service_is_held_without_a_message(self, status):
        kind = classify(endpoint_machine(endpoint_facts(status=status), LONG_AGO).facts, Lookups(), NOW)
        assert (kind.kind, kind.can_stop) == (Kind.ENDPOINT_BUSY, False)
        assert handling(kind, "ml.g5.2xlarge", TeamPolicy()).mode == "hold"
        assert of_kind(kind, 1.515).stop.hourly == 0.0

    @pytest.mark.parametrize(
        ("config", "min_capacity", "words"),
        [
            (endpoint_config("c", serverless_variant()), {}, "serverless variant AllTraffic"),
            (endpoint_config("c", variant(model=None)), {}, "inference components"),
            (endpoint_config("c", variant()), {"AllTraffic": 0}, "scales to zero instances"),
            (endpoint_config("c", {**variant(), "ManagedInstanceScaling": MANAGED_TO_ZERO}), {}, "scales to zero"),
        ],
    )
    def test_an_endpoint_whose_deletion_saves_nothing_is_reported_never_deleted(self, config, min_capacity, words):
        facts = endpoint_facts(config=config, min_capacity=min_capacity)
        kind = classify(endpoint_machine(facts, LONG_AGO).facts, Lookups(), NOW)
        assert (kind.kind, kind.can_stop, kind.can_terminate) == (Kind.ENDPOINT_SAVES_NOTHING, False, False)
        assert words in kind.why
        how = handling(kind, facts.hardware, TeamPolicy())
        assert how.mode == "notify"
        assert notice_sentence(kind, how, facts.hardware).startswith("It is idle, but idle-reaper does not delete it")
        assert of_kind(kind, hourly_price(facts.hardware)).stop.hourly == 0.0

    def test_a_minimum_above_zero_still_saves(self):
        facts = endpoint_facts(min_capacity={"AllTraffic": 1})
        assert classify(endpoint_machine(facts, LONG_AGO).facts, Lookups(), NOW).kind is Kind.ENDPOINT

    @pytest.mark.parametrize(
        ("gone", "missing", "words"),
        [(True, (), "endpoint configuration config-a is gone"), (False, ("model model-a",), "model model-a is gone")],
    )
    def test_an_endpoint_that_could_not_be_brought_back_is_never_deleted(self, gone, missing, words):
        facts = endpoint_facts(gone=gone, missing=missing)
        kind = classify(endpoint_machine(facts, LONG_AGO).facts, Lookups(), NOW)
        assert (kind.kind, kind.can_stop) == (Kind.ENDPOINT_NOT_RESTORABLE, False)
        assert words in kind.why and "does not delete it" in kind.why
        assert handling(kind, facts.hardware, TeamPolicy()).mode == "notify"

    def test_several_variants_are_priced_whole_and_an_unknown_price_is_unknown(self):
        config = endpoint_config("c", variant("a", "ml.g5.2xlarge", 2), variant("b", "ml.m5.large", 1, "model-b"))
        facts = endpoint_facts(config=config)
        assert facts.hardware == "ml.g5.2xlarge x2 + ml.m5.large"
        assert hourly_price(facts.hardware) == pytest.approx(2 * 1.515 + 0.115)
        assert hourly_price("ml.g5.2xlarge x2 + ml.unheard.of") is None
        assert hourly_price("ml.g5.2xlarge xtwo") is None

    def test_machine_ids_never_meet_an_ec2_id_or_a_notebook_name(self):
        assert endpoint_id("demo") == "endpoint:demo" and endpoint_name("endpoint:demo") == "demo"
        for bad in ("demo", "endpoint:", "i-0123456789abcdef0"):
            with pytest.raises(ValueError, match="not an endpoint's id"):
                endpoint_name(bad)


# ---------------------------------------------------------------------------------------------
# Busy, idle, unknown


class TestSignal:
    def test_no_request_on_any_variant_for_the_whole_window_is_idle(self):
        config = endpoint_config("c", variant("a"), variant("b", model="model-b"))
        _, _, own, a = judged(endpoint_facts(config=config), {"a": invocations(0), "b": invocations(0)})
        assert own.policy is not None and own.policy.idle_minutes == 1440
        assert a.signal == "idle"
        assert "no invocations of variant a, no invocations of variant b" in a.reason

    def test_one_request_on_one_variant_is_busy_and_never_warned(self):
        config = endpoint_config("c", variant("a"), variant("b", model="model-b"))
        values = [0.0] * 286
        values[-30] = 1.0  # one request two and a half hours ago, on variant b only
        m, kind, own, a = judged(endpoint_facts(config=config), {"a": invocations(0), "b": invocations(values)})
        assert a.signal == "busy" and "invocations of variant b 1 request" in a.reason
        d = decide(m, own, a, None, now=NOW, kind=kind)
        assert (d.state, d.action, d.notify) == (State.ACTIVE, Action.NONE, None)

    def test_a_variant_without_datapoints_is_unknown_never_idle(self):
        config = endpoint_config("c", variant("a"), variant("b", model="model-b"))
        m, kind, own, a = judged(endpoint_facts(config=config), {"a": invocations(0)})
        assert a.signal == "unknown" and "no metrics from variant b" in a.reason
        d = decide(m, own, a, None, now=NOW, kind=kind)
        assert (d.state, d.action) == (State.UNKNOWN, Action.NONE)

    def test_periods_without_invocations_count_as_none_only_where_its_instances_reported(self):
        # SageMaker publishes Invocations only for periods with requests: the heartbeat says the rest had none.
        heartbeat = invocations(3.0)
        _, _, _, a = judged(endpoint_facts(), {}, reported={"AllTraffic": heartbeat})
        assert a.signal == "idle", a.reason
        # Without the heartbeat, no Invocations datapoint says nothing: unknown, never idle.
        _, _, _, a = judged(endpoint_facts(), {}, reported={})
        assert a.signal == "unknown" and "no metrics from variant AllTraffic" in a.reason
        # A request in a period the heartbeat missed is still a request.
        calls = [(heartbeat[-20][0] + timedelta(minutes=1), 2.0)]
        _, _, _, a = judged(endpoint_facts(), {"AllTraffic": calls}, reported={"AllTraffic": heartbeat})
        assert a.signal == "busy"
        # A heartbeat with a hole longer than max_gap_minutes: not covered, unknown.
        holed = heartbeat[:100] + heartbeat[110:]
        _, _, _, a = judged(endpoint_facts(), {}, reported={"AllTraffic": holed})
        assert a.signal == "unknown" and "gap" in a.reason

    def test_an_asynchronous_endpoint_is_unknown_whatever_its_heartbeat(self):
        # It publishes no Invocations at all: its instances' heartbeat alone must never read as "no request".
        facts = replace(endpoint_facts(), asynchronous=True)
        m, kind, own, a = judged(facts, {}, reported={"AllTraffic": invocations(3.0)})
        assert a.signal == "unknown" and "asynchronous endpoint" in a.reason
        assert decide(m, own, a, None, now=NOW, kind=kind).action is Action.NONE

    def test_a_hole_in_the_metrics_is_unknown(self):
        values = [0.0] * 286
        points = invocations(values)
        del points[100:110]  # 50 minutes without a datapoint, in the middle of the day
        _, _, _, a = judged(endpoint_facts(), {"AllTraffic": points})
        assert a.signal == "unknown" and "gap" in a.reason

    def test_an_endpoint_younger_than_its_window_is_not_idle(self):
        _, _, _, a = judged(endpoint_facts(), {"AllTraffic": invocations(0)}, launched=NOW - timedelta(hours=3))
        assert a.signal == "unknown" and "less than one idle window (1440 min)" in a.reason

    def test_the_machine_signals_of_the_team_do_not_apply(self):
        policy = TeamPolicy(network_threshold_bytes_per_second=1000, human_active_minutes=30, max_runtime_hours=1)
        _, _, own, a = judged(endpoint_facts(), {"AllTraffic": invocations(0)}, policy=policy)
        assert own.policy is not None
        assert (own.policy.network_threshold_bytes_per_second, own.policy.human_active_minutes) == (None, None)
        assert own.policy.max_runtime_hours is None
        assert a.signal == "idle" and a.human_signal == "off"


# ---------------------------------------------------------------------------------------------
# The lifecycle under the endpoint window


def sweep_at(facts, at: datetime, previous: MachineRecord | None, quiet_minutes: int) -> Decision:
    m = endpoint_machine(facts, LONG_AGO)
    kind = classify(m.facts, Lookups(), at)
    own = kind_policy(ref(), kind, m)
    assert own.policy is not None
    values = [1.0] * ((1440 + 60 - 5) // 5 - quiet_minutes // 5) + [0.0] * (quiet_minutes // 5)
    sig = Signals(invocations=(("AllTraffic", invocations(values, end=at)),))
    a = assess(m, sig, own.policy, now=at, period=P, gpu_families=DEFAULT_GPU_FAMILIES)
    return decide(m, own, a, previous, now=at, kind=kind)


class TestLifecycle:
    def test_warned_before_the_window_ends_deleted_at_its_end_and_the_record_keeps_how_to_recreate_it(self):
        facts = endpoint_facts(tags={"Team": "ml", "Owner": "U0OWNER", "project": "demo", "aws:cloudformation:x": "y"})
        quiet = sweep_at(facts, NOW, None, 1380)  # 23 h without a request: not yet at the warning point
        assert (quiet.state, quiet.action) == (State.IDLE, Action.NONE)
        restore = Restore.parse(quiet.record.endpoint)
        assert restore is not None and restore.config == "config-a"
        # AWS's own tags are not CreateEndpoint's to set: kept out.
        assert dict(restore.tags) == {"Team": "ml", "Owner": "U0OWNER", "project": "demo"}

        warned = sweep_at(facts, NOW + timedelta(minutes=35), quiet.record, 1415)
        assert (warned.state, warned.action, warned.notify) == (State.WARNED, Action.WARN, "warning")
        assert "will delete it at" in warned.reason
        record = replace_delivered(warned.record, NOW + timedelta(minutes=35))

        early = sweep_at(facts, NOW + timedelta(minutes=55), record, 1435)
        assert (early.state, early.action) == (State.WARNED, Action.NONE)
        deleted = sweep_at(facts, NOW + timedelta(minutes=70), record, 1450)
        assert (deleted.state, deleted.action, deleted.notify) == (State.REAPED, Action.STOP, "reaped")
        assert Restore.parse(deleted.record.endpoint) == restore

    def test_notify_only_reports_and_never_deletes(self):
        facts = endpoint_facts()
        m = endpoint_machine(facts, LONG_AGO)
        kind = classify(m.facts, Lookups(), NOW)
        own = kind_policy(ref(TeamPolicy(action="notify_only")), kind, m)
        assert own.policy is not None
        sig = Signals(invocations=(("AllTraffic", invocations(0, minutes=1440 * 2)),))
        a = assess(m, sig, own.policy, now=NOW, period=P, gpu_families=DEFAULT_GPU_FAMILIES)
        previous = MachineRecord(
            instance_id=m.instance_id,
            team="ml",
            state=State.WARNED,
            warned_at=NOW - timedelta(hours=2),
            warning_delivered_at=NOW - timedelta(hours=2),
            observed_at=NOW - timedelta(minutes=5),
            idle_since=NOW - timedelta(days=1, hours=1),
            machine_kind="endpoint",
        )
        d = decide(m, own, a, previous, now=NOW, kind=kind)
        assert (d.action, d.applied) == (Action.STOP, False)
        assert d.state is State.WARNED and "notify_only" in d.reason


def replace_delivered(record: MachineRecord, at: datetime) -> MachineRecord:
    return replace(record, warning_delivered_at=at)


# ---------------------------------------------------------------------------------------------
# What the record keeps


class TestRestore:
    def test_round_trip_and_a_pending_bring_back_is_carried_over(self):
        facts = endpoint_facts()
        pending = Restore("config-old", (("Team", "ml"),), "U0OWNER", PENDING_SINCE).to_json()
        kept = Restore.parse(kept_restore(pending, facts))
        assert kept is not None
        assert (kept.config, kept.pending_by, kept.pending_since) == ("config-a", "U0OWNER", PENDING_SINCE)
        assert Restore.parse(kept_restore(None, facts)) == facts.restore()

    @pytest.mark.parametrize(
        "raw", ["", "not json", "[]", '{"tags": []}', '{"config": 3}', '{"config": "c", "tags": 5}']
    )
    def test_text_it_never_wrote_is_nothing_kept(self, raw):
        assert Restore.parse(raw) is None

    def test_recreating_by_hand_is_spelled_out(self):
        assert Restore("config-a").recreate_command("demo") == (
            "aws sagemaker create-endpoint --endpoint-name demo --endpoint-config-name config-a"
        )

    def test_a_bring_back_that_failed_is_deleted_again_told_and_can_be_tried_again(self):
        """The sweep found the endpoint a person brought back Failed: its record is as after a deletion (Bring it back
        accepts it: REAPED by a stop), no longer pending (told once), with SageMaker's reason bounded, and the
        next try forgets that failure."""
        pending = Restore("config-a", (("Team", "ml"),), "U0OWNER", PENDING_SINCE)
        brought = MachineRecord(endpoint_id("demo"), "ml", State.ACTIVE, version=4, endpoint=pending.to_json())
        later = NOW + timedelta(minutes=10)
        again = bring_back_failed(brought, pending, "x" * 5000, later, "ref-try")
        kept = Restore.parse(again.endpoint)
        assert kept == Restore("config-a", (("Team", "ml"),), failed="x" * 1024)
        assert (again.state, again.last_action, again.last_action_at) == (State.REAPED, "stop", later)
        assert (again.warning_ref, again.version) == ("ref-try", 5)
        assert "brought back by U0OWNER, but SageMaker could not create it" in again.reason
        retried = kept.brought_back_by("U0OTHER", later)
        assert (retried.failed, retried.pending_by, retried.pending_since) == (None, "U0OTHER", later.isoformat())
        assert Restore.parse(kept.failed_with("").to_json()).failed == "SageMaker gave no reason"
