"""Policy models, schedules (time zones, daylight saving), the hard cap, quiet hours, and what the
sweep does with them. Pure or over the in-memory AWS fakes: no network."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idle_reaper import aws as aws_adapters
from idle_reaper.aws import InMemoryStateStore, LostUpdate, PolicyStore, VersionConflict
from idle_reaper.core import Action, Assessment, Machine, MachineRecord, State, decide
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import (
    DAYS,
    PolicyError,
    Schedule,
    Settings,
    TeamPolicy,
    TeamPolicyRef,
    active_schedules,
    effective_policy,
    json_schema,
    parse_settings,
    parse_team_policy,
)
from idle_reaper.sweep import logger, run_sweep
from testkit.aws import FakeAws, steady

PARAM = "/idle-reaper/teams/ml"
UTC_NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)  # a Friday


def team(data: dict[str, Any], default: TeamPolicy | None = None) -> TeamPolicy:
    return parse_team_policy(PARAM, json.dumps(data), default or TeamPolicy())


def problems(data: dict[str, Any] | str, default: TeamPolicy | None = None) -> list[str]:
    text = data if isinstance(data, str) else json.dumps(data)
    with pytest.raises(PolicyError) as err:
        parse_team_policy(PARAM, text, default or TeamPolicy())
    assert str(err.value).startswith(f"{PARAM}: "), "every message names the parameter"
    return err.value.problems


def berlin(text: str) -> datetime:
    """An ISO time with an explicit UTC offset, e.g. '2026-10-25T01:30+02:00'."""
    return datetime.fromisoformat(text)


# ---------------------------------------------------------------------------------------------
# Every bad input names the parameter and the field


class TestErrors:
    def test_invalid_json_names_the_parameter_and_the_position(self):
        assert problems('{"idle_minutes": 60,}') == [
            "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 21"
        ]

    def test_not_an_object(self):
        assert problems("[1, 2]") == ["(top level): expected a JSON object, got list"]

    def test_wrong_type_names_the_field_and_the_value(self):
        (p,) = problems({"idle_minutes": "ninety"})
        assert p.startswith("idle_minutes: ") and '"ninety"' in p

    def test_unknown_field(self):
        assert problems({"idle_minuets": 60}) == [
            "idle_minuets: unknown field (not in the schema: see `idle-reaper policy schema`)"
        ]

    @pytest.mark.parametrize(
        "field,value",
        [
            ("idle_minutes", 14),
            ("idle_minutes", 1441),
            ("cpu_threshold_percent", 101),
            ("gpu_threshold_percent", -1),
            ("max_runtime_hours", 0),
            ("max_runtime_hours", 8761),
        ],
    )
    def test_out_of_range(self, field, value):
        (p,) = problems({field: value})
        assert p.startswith(f"{field}: Input should be") and str(value) in p

    def test_warn_not_shorter_than_idle_names_warn_minutes(self):
        assert problems({"idle_minutes": 30, "warn_minutes": 30}) == [
            "warn_minutes: warn_minutes (30) must be shorter than idle_minutes (30)"
        ]

    def test_warn_against_the_default_it_is_merged_on(self):
        # The team sets only idle_minutes; the stored default's warn_minutes makes the merge invalid.
        default = TeamPolicy(idle_minutes=120, warn_minutes=45)
        assert problems({"idle_minutes": 40}, default) == [
            "warn_minutes: warn_minutes (45) must be shorter than idle_minutes (40)"
        ]

    def test_unknown_time_zone_names_the_schedule_field(self):
        data = {"schedules": [{"days": ["sat"], "timezone": "Europe/Berln", "idle_minutes": 45}]}
        assert problems(data) == [
            "schedules[0].timezone: unknown IANA time zone 'Europe/Berln' (e.g. 'Europe/Berlin', 'UTC')"
        ]

    def test_every_error_at_once(self):
        found = problems(
            {
                "idle_minutes": 10,
                "warn_minutes": "x",
                "colour": "blue",
                "schedules": [{"days": ["sat", "someday"], "start": "25:00", "idle_minutes": 45}],
            }
        )
        paths = [p.split(":", 1)[0] for p in found]
        assert paths == ["idle_minutes", "warn_minutes", "schedules[0].days[1]", "schedules[0].start", "colour"]

    def test_overlapping_schedules_that_set_the_same_field(self):
        found = problems(
            {
                "timezone": "Europe/Berlin",
                "schedules": [
                    {"name": "weekend", "days": ["sat", "sun"], "idle_minutes": 45},
                    {"name": "nights", "days": ["fri"], "start": "22:00", "end": "07:00", "idle_minutes": 60},
                ],
            }
        )
        assert found == [
            "schedules[1]: overlaps schedules[0] 'weekend' from sat 00:00 and both set idle_minutes; "
            "schedules in force at the same time must set different fields"
        ]

    def test_overlap_across_the_end_of_the_week(self):
        found = problems(
            {
                "schedules": [
                    {"days": ["sun"], "start": "22:00", "end": "02:00", "warn_minutes": 10},
                    {"days": ["mon"], "start": "01:00", "end": "03:00", "warn_minutes": 5},
                ]
            }
        )
        assert len(found) == 1 and found[0].startswith("schedules[1]: overlaps schedules[0] from mon 01:00")

    def test_schedules_in_different_time_zones(self):
        found = problems(
            {
                "timezone": "Europe/Berlin",
                "schedules": [
                    {"days": ["sat"], "idle_minutes": 45},
                    {"days": ["mon"], "timezone": "America/New_York", "idle_minutes": 45},
                ],
            }
        )
        assert found == [
            "schedules[1].timezone: 'America/New_York' differs from schedules[0]'s 'Europe/Berlin'; use one time zone"
        ]

    def test_a_schedule_that_makes_warn_not_shorter_than_idle(self):
        found = problems({"idle_minutes": 60, "warn_minutes": 20, "schedules": [{"days": ["sat"], "idle_minutes": 20}]})
        assert found == [
            "schedules[0].idle_minutes: from sat 00:00 warn_minutes (20) must be shorter than idle_minutes (20)"
        ]

    def test_two_overlapping_schedules_that_together_make_warn_not_shorter_than_idle(self):
        found = problems(
            {
                "schedules": [
                    {"name": "weekend", "days": ["sat", "sun"], "idle_minutes": 45},
                    {"days": ["sun"], "start": "20:00", "end": "02:00", "warn_minutes": 50},
                ]
            }
        )
        assert found == [
            "schedules[1].warn_minutes: from sun 20:00 (with schedules[0] 'weekend' also in force) "
            "warn_minutes (50) must be shorter than idle_minutes (45)"
        ]

    @pytest.mark.parametrize(
        "schedule,message",
        [
            ({"days": ["sat"], "start": "07:00", "end": "07:00", "idle_minutes": 45}, "start and end are equal"),
            ({"days": ["sat"]}, "overrides nothing"),
            ({"days": [], "idle_minutes": 45}, "days: Tuple should have at least 1 item"),
            ({"days": ["sat", "sat"], "idle_minutes": 45}, "days: a day is listed twice"),
            ({"days": ["sat"], "end": "7:00", "idle_minutes": 45}, "end: String should match pattern"),
            ({"days": ["sat"], "schedules": [], "idle_minutes": 45}, "schedules: unknown field"),
            ({"days": ["sat"], "max_snooze_hours": 2}, "max_snooze_hours: unknown field"),
        ],
    )
    def test_bad_schedules(self, schedule, message):
        (p,) = problems({"schedules": [schedule]})
        assert p.startswith("schedules[0]") and message in p

    def test_settings_errors_name_the_nested_path(self):
        with pytest.raises(PolicyError) as err:
            parse_settings("/idle-reaper/settings", '{"default_policy": {"idle_minutes": 30, "warn_minutes": 30}}')
        assert err.value.problems == [
            "default_policy.warn_minutes: warn_minutes (30) must be shorter than idle_minutes (30)"
        ]


class TestSchema:
    def test_team_policy_schema_has_explicit_bounds_and_rejects_unknown_fields(self):
        schema = json_schema(TeamPolicy)
        props = schema["properties"]
        assert schema["additionalProperties"] is False
        assert (props["idle_minutes"]["minimum"], props["idle_minutes"]["maximum"]) == (15, 1440)
        for name in ("cpu_threshold_percent", "gpu_threshold_percent"):
            assert (props[name]["minimum"], props[name]["maximum"]) == (0, 100)
        schedule = schema["$defs"]["Schedule"]
        assert schedule["additionalProperties"] is False and schedule["required"] == ["days"]
        assert "required" not in schema, "a team file is a partial override: every field is optional"

    def test_an_editor_validating_with_the_schema_agrees_with_the_models(self):
        jsonschema = pytest.importorskip("jsonschema")
        schema = json_schema(TeamPolicy)
        good = {
            "idle_minutes": 45,
            "schedules": [{"days": ["sat"], "start": "22:00", "end": "07:00", "quiet_hours": True}],
        }
        jsonschema.validate(good, schema)
        team(good)
        for bad in ({"idle_minutes": 10}, {"colour": 1}, {"schedules": [{"days": ["someday"], "idle_minutes": 45}]}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)

    def test_settings_schema(self):
        schema = json_schema(Settings)
        assert schema["additionalProperties"] is False and "default_policy" in schema["properties"]


# ---------------------------------------------------------------------------------------------
# Schedules: local wall-clock time, across midnight, over weekends and daylight-saving changes

WEEKEND_AND_NIGHTS = {
    "idle_minutes": 90,
    "warn_minutes": 30,
    "timezone": "Europe/Berlin",
    "schedules": [
        {"name": "weekend", "days": ["sat", "sun"], "idle_minutes": 45, "warn_minutes": 15},
        {"name": "nights", "days": list(DAYS), "start": "22:00", "end": "07:00", "quiet_hours": True},
    ],
}


class TestSchedules:
    policy = team(WEEKEND_AND_NIGHTS)

    def active(self, when: datetime) -> list[str | None]:
        return [s.name for _, s in active_schedules(self.policy, when)]

    def test_a_weekday_afternoon_uses_the_base_policy(self):
        assert self.active(berlin("2026-11-20T15:00+01:00")) == []
        assert effective_policy(self.policy, berlin("2026-11-20T15:00+01:00")) is self.policy

    def test_the_weekend_override(self):
        p = effective_policy(self.policy, berlin("2026-11-21T12:00+01:00"))  # Saturday noon
        assert (p.idle_minutes, p.warn_minutes, p.quiet_hours) == (45, 15, False)

    def test_a_night_spanning_midnight_belongs_to_the_day_it_starts(self):
        assert self.active(berlin("2026-11-19T21:59+01:00")) == []  # Thursday
        assert self.active(berlin("2026-11-19T22:00+01:00")) == ["nights"]
        assert self.active(berlin("2026-11-20T06:59+01:00")) == ["nights"]  # Friday morning, Thursday's night
        assert self.active(berlin("2026-11-20T07:00+01:00")) == [], "end is exclusive"

    def test_overlapping_schedules_that_set_different_fields_compose(self):
        # Saturday 23:00: the weekend's idle_minutes and the night's quiet hours together.
        when = berlin("2026-11-21T23:00+01:00")
        assert self.active(when) == ["weekend", "nights"]
        p = effective_policy(self.policy, when)
        assert (p.idle_minutes, p.warn_minutes, p.quiet_hours) == (45, 15, True)
        ref = TeamPolicyRef(team="ml", policy=self.policy, source=PARAM, version=4).at(when)
        assert ref.label == f"{PARAM}@v4 schedules[0] 'weekend' + schedules[1] 'nights'"
        assert ref.policy is not None and ref.policy.idle_minutes == 45

    def test_the_time_zone_is_the_schedules_not_utc(self):
        # Friday 22:30 in Berlin is 21:30 UTC: already night in Berlin.
        assert self.active(datetime(2026, 11, 20, 21, 30, tzinfo=UTC)) == ["nights"]
        assert self.active(datetime(2026, 11, 20, 20, 59, tzinfo=UTC)) == []

    def test_a_schedule_without_a_zone_uses_the_policys(self):
        p = team({"timezone": "Asia/Tokyo", "schedules": [{"days": ["sat"], "idle_minutes": 45}]})
        assert effective_policy(p, datetime(2026, 11, 20, 15, 0, tzinfo=UTC)).idle_minutes == 45  # Sat 00:00 JST
        assert effective_policy(p, datetime(2026, 11, 20, 14, 59, tzinfo=UTC)).idle_minutes == 90

    def test_sunday_0130_on_the_night_clocks_go_back(self):
        # 2026-10-25, Europe/Berlin: 03:00 CEST becomes 02:00 CET. 01:30 CEST is 23:30 UTC on Saturday.
        sunday_0130 = datetime(2026, 10, 24, 23, 30, tzinfo=UTC)
        assert sunday_0130.astimezone(self.policy_zone()).strftime("%a %H:%M %Z") == "Sun 01:30 CEST"
        assert self.active(sunday_0130) == ["weekend", "nights"]  # Saturday's night, and Sunday
        # The night ends at 07:00 CET, which is 06:00 UTC (one hour later than in summer).
        assert self.active(datetime(2026, 10, 25, 5, 59, tzinfo=UTC)) == ["weekend", "nights"]
        assert self.active(datetime(2026, 10, 25, 6, 0, tzinfo=UTC)) == ["weekend"]

    def test_the_repeated_hour_counts_twice(self):
        # A schedule for Sunday 02:00-03:00 local covers both 02:xx hours that night: 00:00-02:00 UTC.
        p = team(
            {
                "timezone": "Europe/Berlin",
                "schedules": [{"days": ["sun"], "start": "02:00", "end": "03:00", "idle_minutes": 45}],
            }
        )
        covered = [
            datetime(2026, 10, 24, 23, 59, tzinfo=UTC),  # 01:59 CEST
            datetime(2026, 10, 25, 0, 0, tzinfo=UTC),  # 02:00 CEST
            datetime(2026, 10, 25, 0, 59, tzinfo=UTC),  # 02:59 CEST
            datetime(2026, 10, 25, 1, 0, tzinfo=UTC),  # 02:00 CET, the second time
            datetime(2026, 10, 25, 1, 59, tzinfo=UTC),  # 02:59 CET
            datetime(2026, 10, 25, 2, 0, tzinfo=UTC),  # 03:00 CET
        ]
        assert [effective_policy(p, t).idle_minutes for t in covered] == [90, 45, 45, 45, 45, 90]

    def test_a_start_in_the_skipped_hour_begins_when_the_clocks_jump(self):
        # 2026-03-29, Europe/Berlin: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist that night.
        p = team(
            {
                "timezone": "Europe/Berlin",
                "schedules": [{"days": ["sun"], "start": "02:30", "end": "04:00", "idle_minutes": 45}],
            }
        )
        assert effective_policy(p, datetime(2026, 3, 29, 0, 59, tzinfo=UTC)).idle_minutes == 90  # 01:59 CET
        assert effective_policy(p, datetime(2026, 3, 29, 1, 0, tzinfo=UTC)).idle_minutes == 45  # 03:00 CEST
        assert effective_policy(p, datetime(2026, 3, 29, 1, 59, tzinfo=UTC)).idle_minutes == 45  # 03:59 CEST
        assert effective_policy(p, datetime(2026, 3, 29, 2, 0, tzinfo=UTC)).idle_minutes == 90  # 04:00 CEST

    def test_whole_days_by_default_and_days_case_insensitive(self):
        s = Schedule.model_validate({"days": ["SAT"], "idle_minutes": 45})
        assert (s.days, s.start, s.end) == (("sat",), "00:00", "24:00")

    def policy_zone(self):
        from zoneinfo import ZoneInfo

        return ZoneInfo("Europe/Berlin")


_times = st.sampled_from([f"{h:02d}:{m:02d}" for h in range(24) for m in (0, 30)])
_schedule = st.fixed_dictionaries(
    {"days": st.lists(st.sampled_from(DAYS), min_size=1, max_size=3, unique=True), "start": _times, "end": _times},
    optional={
        "idle_minutes": st.integers(15, 120),
        "warn_minutes": st.integers(0, 60),
        "quiet_hours": st.booleans(),
        "action": st.sampled_from(["stop", "notify_only"]),
    },
)


@settings(max_examples=150, deadline=None)
@given(
    schedules=st.lists(_schedule, max_size=3),
    instant=st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2027, 1, 1), timezones=st.just(UTC)),
)
def test_any_valid_policy_gives_a_valid_policy_at_every_instant(schedules, instant):
    try:
        p = team({"timezone": "Europe/Berlin", "idle_minutes": 60, "warn_minutes": 20, "schedules": schedules})
    except PolicyError:
        return
    e = effective_policy(p, instant)
    assert e.warn_minutes < e.idle_minutes
    assert e is p or e.schedules == ()  # resolved: an override in force leaves no schedules of its own
    TeamPolicy.model_validate(e.model_dump())  # the unvalidated copy is a valid policy


def test_the_policy_in_force_is_valid_on_its_own_when_a_wrapping_schedule_shortens_the_window():
    """Found by the property test above: the copy kept the schedules, and re-validating it judged the
    Monday schedule's warn_minutes (15) against the Thursday-to-Friday schedule's idle_minutes (15)."""
    p = team(
        {
            "timezone": "Europe/Berlin",
            "idle_minutes": 60,
            "warn_minutes": 20,
            "schedules": [
                {"days": ["mon"], "start": "00:00", "end": "00:30", "warn_minutes": 15},
                {"days": ["thu"], "start": "02:00", "end": "01:30", "idle_minutes": 15, "warn_minutes": 0},
            ],
        }
    )
    e = effective_policy(p, datetime(2027, 1, 1, tzinfo=UTC))  # Friday 01:00 in Berlin
    assert (e.idle_minutes, e.warn_minutes) == (15, 0)
    TeamPolicy.model_validate(e.model_dump())


# ---------------------------------------------------------------------------------------------
# The decision core: hard cap and quiet hours

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
BASE = TeamPolicy(idle_minutes=60, warn_minutes=20, max_runtime_hours=72)


def machine(launched_hours_ago: float = 100, **kw: Any) -> Machine:
    base: dict[str, Any] = dict(
        instance_id="i-1",
        instance_type="m5.large",
        team="ml",
        launch_time=NOW - timedelta(hours=launched_hours_ago),
        owner="bob@example.com",
    )
    return Machine(**{**base, **kw})


def quiet(minutes: float) -> Assessment:
    return Assessment("idle", "quiet", quiet_since=NOW - timedelta(minutes=minutes), max_cpu=1.0)


def busy() -> Assessment:
    return Assessment("busy", "GPU 95.0% at 14:55 is at or above 5.0%", max_gpu=95.0)


def ref(policy: TeamPolicy = BASE) -> TeamPolicyRef:
    return TeamPolicyRef(team="ml", policy=policy, source=PARAM, version=2)


def snoozed(until: datetime = NOW + timedelta(hours=4)) -> MachineRecord:
    return MachineRecord(
        "i-1",
        "ml",
        State.SNOOZED,
        version=3,
        idle_since=NOW - timedelta(hours=2),
        snoozed_until=until,
        snoozed_by="U0BOB",
    )


class TestHardCap:
    def test_a_snooze_holds_under_the_cap(self):
        d = decide(machine(launched_hours_ago=10), ref(), quiet(120), snoozed(), now=NOW)
        assert d.state is State.SNOOZED and d.action is Action.NONE

    def test_over_the_cap_a_snoozed_idle_machine_is_warned_then_stopped(self):
        d = decide(machine(), ref(), quiet(120), snoozed(), now=NOW)
        assert d.state is State.WARNED and d.action is Action.WARN and d.deliver_warning
        assert "up 100 h, over max_runtime_hours (72): the keep by U0BOB no longer holds" in d.reason
        delivered = replace(d.record, warning_delivered_at=NOW)
        later = NOW + timedelta(minutes=20)
        d2 = decide(machine(), ref(), quiet(140), delivered, now=later)
        assert d2.action is Action.STOP and d2.state is State.REAPED
        assert "max_runtime_hours" in d2.reason

    def test_the_cap_waits_for_a_warning_like_any_stop(self):
        d = decide(machine(), ref(), quiet(120), snoozed(), now=NOW)
        d2 = decide(machine(), ref(), quiet(125), d.record, now=NOW + timedelta(minutes=5))
        assert d2.action is Action.NONE and d2.state is State.WARNED

    def test_over_the_cap_a_busy_machine_is_reported_not_stopped(self):
        d = decide(machine(), ref(), busy(), snoozed(), now=NOW)
        assert d.action is Action.NONE and d.state is State.ACTIVE
        assert "over max_runtime_hours (72) but busy, so not stopped" in d.reason

    def test_over_the_cap_unknown_signals_change_nothing(self):
        unknown = Assessment("unknown", "no CPU datapoints")
        d = decide(machine(), ref(), unknown, snoozed(), now=NOW)
        assert d.action is Action.NONE and d.state is State.UNKNOWN

    def test_over_the_cap_an_exempt_machine_is_left_alone(self):
        d = decide(machine(exempt_tag="true"), ref(), quiet(120), snoozed(), now=NOW)
        assert d.state is State.EXEMPT and d.action is Action.NONE

    def test_no_cap_by_default(self):
        d = decide(
            machine(launched_hours_ago=5000),
            ref(BASE.model_copy(update={"max_runtime_hours": None})),
            quiet(120),
            snoozed(),
            now=NOW,
        )
        assert d.state is State.SNOOZED

    def test_the_cap_counts_from_the_last_start(self):
        d = decide(machine(launched_hours_ago=71.9), ref(), quiet(120), snoozed(), now=NOW)
        assert d.state is State.SNOOZED


class TestQuietHours:
    quiet_policy = BASE.model_copy(update={"quiet_hours": True})

    def test_the_warning_is_recorded_not_sent_and_the_stop_follows_warn_minutes_later(self):
        d = decide(machine(launched_hours_ago=10), ref(self.quiet_policy), quiet(45), None, now=NOW)
        assert d.action is Action.WARN and d.state is State.WARNED
        assert not d.deliver_warning and d.notify is None, "nothing is posted during quiet hours"
        assert d.record.warned_at == NOW and d.record.warning_delivered_at == NOW
        assert "quiet hours: warning recorded, not sent" in d.reason
        d2 = decide(
            machine(launched_hours_ago=10), ref(self.quiet_policy), quiet(65), d.record, now=NOW + timedelta(minutes=20)
        )
        assert d2.action is Action.STOP and d2.state is State.REAPED
        assert d2.notify is None, "no 'stopped' notice in the night either"

    def test_a_pending_warning_from_before_is_not_delivered_during_quiet_hours(self):
        pending = MachineRecord(
            "i-1",
            "ml",
            State.WARNED,
            version=2,
            idle_since=NOW - timedelta(minutes=45),
            warned_at=NOW - timedelta(minutes=5),
            observed_at=NOW - timedelta(minutes=5),
        )
        d = decide(machine(launched_hours_ago=10), ref(self.quiet_policy), quiet(50), pending, now=NOW)
        assert d.state is State.WARNED and d.action is Action.NONE and not d.deliver_warning
        loud = decide(machine(launched_hours_ago=10), ref(), quiet(50), pending, now=NOW)
        assert loud.deliver_warning, "outside quiet hours it is delivered"

    def test_busy_is_still_busy(self):
        d = decide(machine(), ref(self.quiet_policy), busy(), None, now=NOW)
        assert d.action is Action.NONE and d.state is State.ACTIVE


# ---------------------------------------------------------------------------------------------
# The sweep: schedules applied, invalid stored policies alerted once, SSM faults are a safe mode


def account(teams: dict[str, str]) -> FakeAws:
    fake = FakeAws()
    fake.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    for name, text in teams.items():
        fake.ssm.store(f"/idle-reaper/teams/{name}", text)
    return fake


def test_the_sweep_applies_the_schedule_in_force_and_records_it():
    fake = account({"ml": json.dumps(WEEKEND_AND_NIGHTS)})
    box = fake.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=2))
    saturday = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)  # 13:00 in Berlin
    (d,) = run_sweep(fake.adapters(store=InMemoryStateStore()), now=saturday, dry_run=True).decisions
    assert d.machine.instance_id == box
    assert d.policy is not None and d.policy.policy is not None and d.policy.policy.idle_minutes == 45
    assert d.record.policy_version == "/idle-reaper/teams/ml@v1 schedules[0] 'weekend'"
    # Quiet for 80 min: past the weekend's 45-min window (a stop), short of the weekday's 90.
    assert d.action is Action.STOP and "quiet since 10:40 UTC" in d.reason


def test_an_invalid_stored_policy_alerts_the_admins_once_per_bad_version():
    fake = account({"ml": '{"idle_minutes": 5}', "ok": '{"idle_minutes": 60}'})
    fake.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=2))
    store, notifier = InMemoryStateStore(), LoggingNotifier(logger)
    adapters = fake.adapters(store=store, notifier=notifier)

    def alerts() -> list[str]:
        return [text for kind, text in notifier.sent if kind == "admin_alert"]

    run_sweep(adapters, now=NOW, dry_run=True)
    assert alerts() == [], "a dry run alerts nobody"
    for minutes in (0, 5, 10):
        report = run_sweep(adapters, now=NOW + timedelta(minutes=minutes))
        assert report.decisions[0].state is State.SAFE_MODE
    (alert,) = alerts()
    assert "/idle-reaper/teams/ml" in alert and "idle_minutes" in alert and "safe mode" in alert

    fake.ssm.store("/idle-reaper/teams/ml", '{"idle_minutes": 60, "warn_minutes": 60}')  # v2, still bad
    run_sweep(adapters, now=NOW + timedelta(minutes=15))
    run_sweep(adapters, now=NOW + timedelta(minutes=20))
    assert len(alerts()) == 2 and "warn_minutes" in alerts()[1]


def test_a_failed_alert_is_retried_by_the_next_sweep():
    fake = account({"ml": '{"idle_minutes": 5}'})
    fake.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=2))

    class Flaky(LoggingNotifier):
        failures = 1

        def admin_alert(self, text: str, admins: Any = (), channel: str | None = None) -> None:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("slack down")
            super().admin_alert(text, admins, channel)

    notifier = Flaky(logger)
    adapters = fake.adapters(store=InMemoryStateStore(), notifier=notifier)
    run_sweep(adapters, now=NOW)
    run_sweep(adapters, now=NOW + timedelta(minutes=5))
    run_sweep(adapters, now=NOW + timedelta(minutes=10))
    assert [kind for kind, _ in notifier.sent if kind == "admin_alert"] == ["admin_alert"]


def test_throttled_policy_reads_put_every_team_in_safe_mode_without_crashing():
    fake = account({"ml": '{"idle_minutes": 60}'})
    ids = [
        fake.launch("m5.large", team=t, profile=steady(1.0), launch_time=NOW - timedelta(days=2))
        for t in ("ml", "vision")
    ]
    # What botocore raises once its standard retries (with backoff) are exhausted.
    fake.ssm.inject("GetParametersByPath", "ThrottlingException")
    report = run_sweep(fake.adapters(store=InMemoryStateStore()), now=NOW)
    assert {d.machine.instance_id: d.state for d in report.decisions} == dict.fromkeys(ids, State.SAFE_MODE)
    assert all(d.action is Action.NONE for d in report.decisions)
    assert fake.write_calls() == 0
    assert any("ThrottlingException" in w and "safe mode" in w for w in report.warnings)


# ---------------------------------------------------------------------------------------------
# SSM writes: compare the version right before writing


class TestPutIfVersion:
    def store(self) -> tuple[FakeAws, PolicyStore]:
        fake = FakeAws()
        return fake, PolicyStore(fake.ssm, "/idle-reaper")

    def test_creates_when_absent_and_updates_at_the_expected_version(self):
        _, store = self.store()
        assert store.put_if_version(PARAM, '{"idle_minutes": 60}', None) == 1
        assert store.put_if_version(PARAM, '{"idle_minutes": 45}', 1) == 2
        param = store.read(PARAM)
        assert param is not None and (param.version, param.value) == (2, '{"idle_minutes": 45}')

    def test_refuses_when_the_version_moved(self):
        fake, store = self.store()
        fake.ssm.store(PARAM, '{"idle_minutes": 60}')
        fake.ssm.store(PARAM, '{"idle_minutes": 50}')
        with pytest.raises(VersionConflict, match=r"changed since it was read \(was v1, now v2\)"):
            store.put_if_version(PARAM, '{"idle_minutes": 45}', 1)
        assert fake.ssm.calls["PutParameter"] == 0

    def test_refuses_when_someone_created_it_first(self):
        fake, store = self.store()
        fake.ssm.store(PARAM, '{"idle_minutes": 60}')
        with pytest.raises(VersionConflict, match="was absent, now v1"):
            store.put_if_version(PARAM, "{}", None)

    def test_a_write_inside_the_race_window_is_reported(self, monkeypatch):
        fake, store = self.store()
        fake.ssm.store(PARAM, '{"idle_minutes": 60}')
        real_put = aws_adapters.PolicyStore.put

        def racing_put(self: PolicyStore, name: str, value: str, overwrite: bool = True) -> int:
            fake.ssm.store(name, '{"idle_minutes": 30}')  # another admin, between our check and our write
            return real_put(self, name, value, overwrite)

        monkeypatch.setattr(aws_adapters.PolicyStore, "put", racing_put)
        with pytest.raises(LostUpdate, match="v2 was written by someone else"):
            store.put_if_version(PARAM, '{"idle_minutes": 45}', 1)
