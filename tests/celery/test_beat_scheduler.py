"""FencedScheduler instances ticked by the test, without a beat process: who leads, what a
standby does with due entries, and that a schedule slot is sent at most once.

Each test has an app of its own on the memory transport with a queue of its own, so the messages
the schedulers send can be counted there; the slots they claimed are rows in
``celery_fence.dispatches``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from celery import Celery, schedules
from celery.beat import ScheduleEntry, Service
from celery.schedules import crontab
from freezegun import freeze_time
from freezegun.api import FrozenDateTimeFactory
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine, make_url

from celery_fence import (
    Acquisition,
    ConfigurationError,
    LeaseStore,
    SchemaNotInstalledError,
    validation,
)
from celery_fence.contrib.celery import HEADER, Fence
from celery_fence.contrib.celery.beat import FencedScheduler, slot_of

ENTRY = "plan-retention"
#: A period of a century, whose slot began in 1970: every slot a test claims is that one, and
#: it began more than half a period ago, so that no scheduler sends it on starting or taking
#: over (see the clocked tests); make_due makes it due.
PERIOD = timedelta(days=36500)

NewScheduler = Callable[[], FencedScheduler]


@pytest.fixture
def app(store: LeaseStore) -> Iterator[Celery]:
    app = Celery("beat-tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"celery-fence-beat-{uuid.uuid4().hex}",
        # No result backend, so no default cleanup entry beside the test's own.
        result_expires=None,
        beat_schedule={ENTRY: {"task": "example.plan_retention", "schedule": PERIOD}},
    )
    Fence(app, store=store)
    yield app
    app.close()


@pytest.fixture
def scheduler(app: Celery) -> Iterator[NewScheduler]:
    """Start another scheduler instance of the app (each with a holder of its own)."""
    started: list[FencedScheduler] = []

    def start() -> FencedScheduler:
        instance = FencedScheduler(app=app, lazy=False)
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.close()


def test_beat_refuses_to_start_without_the_schema(empty_database_url: str) -> None:
    app = Celery("beat-no-schema", set_as_current=False)
    app.conf.update(broker_url="memory://", fence_database_url=empty_database_url)
    fence = Fence(app)
    try:
        with pytest.raises(SchemaNotInstalledError, match="run `celery-fence install`"):
            FencedScheduler(app=app, lazy=False)
    finally:
        fence.store.dispose()
        app.close()


@pytest.mark.parametrize(
    ("name", "said"),
    [
        (" plan", "must not start or end with whitespace"),
        ("plan\t", "must be printable text"),
        ("p" * (validation.MAX_ENTRY_LENGTH + 1), "must be at most 454 characters"),
    ],
    ids=["leading space", "tab", "too long"],
)
def test_beat_refuses_to_start_with_an_entry_name_no_slot_can_be_claimed_for(
    app: Celery, store: LeaseStore, name: str, said: str
) -> None:
    """Such an entry would never be sent: its every slot's claim is refused."""
    app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": PERIOD},
        name: {"task": "example.plan_retention", "schedule": PERIOD},
    }
    with pytest.raises(ConfigurationError, match=f"^beat_schedule entry {re.escape(repr(name))}"):
        FencedScheduler(app=app, lazy=False)
    with pytest.raises(ConfigurationError, match=said):
        FencedScheduler(app=app, lazy=False)
    assert store.leases() == []


def make_due(scheduler: FencedScheduler) -> ScheduleEntry:
    """Move the entry's last run two periods back, so that it is due; return it."""
    entry = scheduler.schedule[ENTRY]
    due = scheduler.Entry(**dict(entry, last_run_at=entry.last_run_at - 2 * PERIOD))
    scheduler.schedule[ENTRY] = due
    return due


def queued(app: Celery) -> list[dict[str, object]]:
    """The headers of the messages waiting in the app's queue (left in it)."""
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        messages = []
        while queue.qsize():
            messages.append(queue.get(timeout=1))
        for message in messages:
            message.requeue()
        return [dict(message.headers) for message in messages]


def test_a_fresh_scheduler_takes_the_lease_and_sends_a_due_entry(
    app: Celery, store: LeaseStore, scheduler: NewScheduler
) -> None:
    beat = scheduler()
    make_due(beat)

    assert beat.tick() == 0  # it sent one entry

    assert beat.lease is not None
    assert (beat.lease.epoch, beat.lease.holder, beat.halted) == (1, beat.holder, None)
    owner = store.owner(beat.lease_name)
    assert owner is not None
    assert (owner.holder, owner.epoch, owner.state) == (beat.holder, 1, "held")
    [dispatch] = store.dispatches(beat.lease_name)
    assert (dispatch.entry, dispatch.epoch, dispatch.holder) == (ENTRY, 1, beat.holder)
    [headers] = queued(app)
    fence_header = headers[HEADER]
    assert isinstance(fence_header, dict)
    assert (fence_header["lease"], fence_header["epoch"], fence_header["mode"]) == (
        beat.lease_name,
        1,
        "join",
    )
    # A publication id per dispatch: two sent with one task id (a task_id option) are told apart.
    assert re.fullmatch("[0-9a-f]{32}", fence_header["publication"])


def test_a_dispatch_adds_its_header_to_the_entrys_own_and_leaves_the_setting_as_it_was(
    app: Celery, scheduler: NewScheduler
) -> None:
    configured = {"headers": {"team": "ops"}, "priority": 3}
    app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": PERIOD, "options": configured}
    }
    beat = scheduler()
    make_due(beat)

    assert beat.tick() == 0

    [headers] = queued(app)
    assert headers["team"] == "ops"
    assert isinstance(headers[HEADER], dict)
    assert configured == {"headers": {"team": "ops"}, "priority": 3}
    assert app.conf.beat_schedule[ENTRY]["options"] == {"headers": {"team": "ops"}, "priority": 3}


def test_a_closed_scheduler_releases_its_lease_and_never_leads_again(
    store: LeaseStore, scheduler: NewScheduler
) -> None:
    """Beat's SIGTERM handler closes the scheduler and raises SystemExit; an exception in the
    publish it interrupted can replace that SystemExit, and the beat's loop then ticks on: the
    next tick stops the beat instead of taking the lease again."""
    beat = scheduler()
    beat.tick()
    assert beat.lease is not None
    beat.close()
    with pytest.raises(SystemExit):
        beat.tick()
    owner = store.owner(beat.lease_name)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "released")
    assert [entry.epoch for entry in store.history(beat.lease_name)] == [1]


def test_a_release_that_failed_at_close_is_tried_again_at_the_next_close(
    engine: Engine, store: LeaseStore, scheduler: NewScheduler
) -> None:
    """Beat closes its scheduler in its SIGTERM handler, which may interrupt a call of the
    store's, and again once its loop ends: a first release that fails (here, the lease's row
    locked past lock_timeout) leaves the lease to the second, not held until it expires."""
    beat = scheduler()
    beat.tick()
    assert beat.lease is not None
    with engine.connect() as blocker:
        blocker.execute(
            sa.text("SELECT 1 FROM celery_fence.leases WHERE name = :name FOR UPDATE"),
            {"name": beat.lease_name},
        )
        beat.close()
        blocker.rollback()
    owner = store.owner(beat.lease_name)
    assert owner is not None
    assert owner.state == "held"

    beat.close()

    owner = store.owner(beat.lease_name)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "released")
    assert beat.lease is None


@contextmanager
def unreachable(admin_engine: Engine, database: str) -> Iterator[None]:
    """The database unreachable for the block: new connections refused, open ones ended."""
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        )
    try:
        yield
    finally:
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')


def test_a_slot_whose_claim_fails_is_not_sent_and_says_so_in_one_line(
    app: Celery,
    store: LeaseStore,
    scheduler: NewScheduler,
    admin_engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database is unreachable when a due slot is claimed, while the leader still trusts its
    lease: the slot is not sent, and the beat says so in one line instead of Celery's "Message
    Error" and a stack trace at every slot of the outage."""
    caplog.set_level(logging.WARNING)
    beat = scheduler()
    beat.tick()
    assert beat.lease is not None
    database = str(make_url(str(store.engine.url)).database)
    entry = make_due(beat)
    with unreachable(admin_engine, database):
        assert beat.apply_entry(entry) is None  # as Celery's tick sends a due entry
    [line] = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert line.startswith(f"slot 1970-01-01T00:00:00+00:00 of {ENTRY} not sent: its claim failed")
    assert not [r for r in caplog.records if r.getMessage().startswith("Message Error")]
    assert queued(app) == []
    assert store.dispatches(beat.lease_name) == []


def test_a_standby_passes_due_entries_without_sending_and_takes_over_without_a_backlog(
    app: Celery, store: LeaseStore, scheduler: NewScheduler
) -> None:
    leader, standby = scheduler(), scheduler()
    leader.tick()
    assert leader.lease is not None
    passed = make_due(standby)

    assert standby.tick() == standby.renew_interval

    assert standby.lease is None
    entry = standby.schedule[ENTRY]
    assert entry.last_run_at > passed.last_run_at
    assert entry.total_run_count == passed.total_run_count + 1
    assert store.dispatches(leader.lease_name) == []
    assert queued(app) == []

    # The leader goes; the standby takes over, with nothing due.
    leader.close()
    standby.tick()
    assert standby.lease is not None
    assert standby.lease.epoch == 2
    assert store.dispatches(standby.lease_name) == []
    assert queued(app) == []


def test_a_slot_is_claimed_and_sent_at_most_once_across_instances(
    app: Celery,
    store: LeaseStore,
    scheduler: NewScheduler,
    expire_lease: Callable[[str], None],
) -> None:
    first, second = scheduler(), scheduler()
    make_due(first)
    first.tick()
    assert len(queued(app)) == 1
    # The first instance's epoch ends in the database while it still trusts its lease.
    expire_lease(first.lease_name)

    make_due(second)
    assert second.tick() == 0  # took the lease, found the slot taken, sent nothing
    assert second.lease is not None
    assert second.lease.epoch == 2

    # The first instance, unaware, dispatches the same slot again: its claim is rejected.
    first.apply_async(make_due(first))

    assert (first.lease, first.halted) == (None, None)
    [dispatch] = store.dispatches(first.lease_name)
    assert (dispatch.epoch, dispatch.holder) == (1, first.holder)
    assert len(queued(app)) == 1
    [stale] = store.stale_runs(lease_name=first.lease_name)
    assert (stale.reason, stale.stale_epoch, stale.current_epoch) == ("superseded", 1, 2)


def test_a_standby_says_where_its_schedule_or_environment_differs_from_the_leaders(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Four instances of one beat lease: the leader, one configured alike, one with an entry
    more and one of another environment. Only the last two say that the leader's lease
    differs, and how."""
    caplog.set_level(logging.WARNING, "celery_fence")
    schedule = {ENTRY: {"task": "example.plan_retention", "schedule": PERIOD}}
    more = {**schedule, "purge": {"task": "example.purge", "schedule": PERIOD, "args": (7,)}}
    configurations = {
        "leader": (schedule, "default"),
        "alike": (schedule, "default"),
        "entry more": (more, "default"),
        "staging": (schedule, "staging"),
    }
    instances = {}
    apps = []
    try:
        for label, (beat_schedule, environment) in configurations.items():
            app = Celery("beat-config", set_as_current=False)
            app.conf.update(
                broker_url="memory://",
                result_expires=None,
                beat_schedule=beat_schedule,
                fence_beat_lease="scheduler:shared",
                fence_environment=environment,
            )
            Fence(app, store=store)
            apps.append(app)
            instances[label] = FencedScheduler(app=app, lazy=False)
            instances[label].tick()
        assert instances["leader"].lease is not None
        leader = instances["leader"].purpose
        assert instances["alike"].purpose == leader
        assert re.fullmatch(r"celery beat, schedule [0-9a-f]{12}", leader)
        assert instances["leader"].info.endswith(f". purpose -> {leader} (1 entry)")
        # The banner's instance, which Celery makes without reading the schedule, says the same.
        banner = Service(app=apps[0], scheduler_cls=FencedScheduler).get_scheduler(lazy=True)
        try:
            assert banner.info.endswith(f". purpose -> {leader} (1 entry)")
        finally:
            banner.close()
    finally:
        for instance in instances.values():
            instance.close()
        for app in apps:
            app.close()
    standby = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("beat on standby")
    ]
    assert len(standby) == 3
    said = f"standby: {instances['leader'].holder} leads at epoch 1"
    assert f"beat on standby for scheduler:shared: {said}" in standby  # the one alike
    more_purpose = instances["entry more"].purpose
    assert more_purpose != leader
    assert (
        f"beat on standby for scheduler:shared: {said}; the leader's lease differs: purpose "
        f"{leader!r}, this instance's {more_purpose!r}"
    ) in standby
    assert (
        f"beat on standby for scheduler:shared: {said}; the leader's lease differs: environment "
        "default, this instance's staging"
    ) in standby


def test_an_acquisition_of_its_own_whose_answer_was_lost_means_standby_until_it_expires(
    app: Celery,
    store: LeaseStore,
    scheduler: NewScheduler,
    expire_lease: Callable[[str], None],
) -> None:
    beat = scheduler()
    # The database granted this instance the lease, but the answer never reached it.
    lost = store.acquire(beat.lease_name, holder=beat.holder, ttl=60)
    assert lost.lease is not None
    make_due(beat)

    assert beat.tick() == beat.renew_interval

    assert (beat.lease, beat.halted) == (None, None)
    assert store.dispatches(beat.lease_name) == []
    assert queued(app) == []

    expire_lease(beat.lease_name)
    beat.tick()
    assert beat.lease is not None
    assert (beat.lease.epoch, beat.halted) == (2, None)


@pytest.mark.parametrize(
    ("led_at", "ended"),
    [
        # Its renewal, due at the slot, is refused: the resume ends the epoch.
        ("10:00:50", "expired"),
        # Its claim of the slot is refused before a renewal is due: the instance gives the
        # epoch back once the pause is over.
        ("10:00:58", "released"),
    ],
)
def test_a_leader_stepped_down_by_a_pause_leads_again_at_the_next_epoch_once_resumed(
    clocked_app: Celery, fake_store: LeaseStore, led_at: str, ended: str
) -> None:
    """The pause refused the leader's renewal or its dispatch of a slot, so it stepped down.
    On resume the lease is free at once (nothing waits for the epoch the pause found to run
    out), and the slot the pause kept from going out is sent, at the next epoch."""
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": timedelta(minutes=1)}
    }
    with freeze_time(f"2030-01-01T{led_at}+00:00", ignore=["_pytest.timing"]) as frozen:
        beat = FencedScheduler(app=clocked_app, lazy=False)
        try:
            # Paused from the start: the beat stands by.
            fake_store.pause(beat.lease_name, reason="investigating double sends", by="ops")
            beat.tick()
            assert beat.lease is None
            fake_store.resume(beat.lease_name)
            beat.tick()  # leads at epoch 1; the 10:00 slot began too long ago to be sent
            assert beat.lease is not None
            fake_store.pause(beat.lease_name, reason="investigating double sends", by="ops")
            frozen.move_to("2030-01-01T10:01:00+00:00")
            beat.tick()  # its claim of the 10:01 slot is refused: it steps down
            assert (beat.lease, beat.halted) == (None, None)
            assert queued(clocked_app) == []

            fake_store.resume(beat.lease_name)
            frozen.tick(1)
            beat.tick()

            assert beat.lease is not None
            assert (beat.lease.epoch, beat.halted) == (2, None)
        finally:
            beat.close()
    [dispatch] = fake_store.dispatches(beat.lease_name)
    assert (dispatch.slot.strftime("%H:%M"), dispatch.epoch) == ("10:01", 2)
    assert len(queued(clocked_app)) == 1
    [_, first] = fake_store.history(beat.lease_name)
    assert (first.epoch, first.end_reason) == (1, ended)


@pytest.fixture
def clocked_app(fake_store: LeaseStore) -> Iterator[Celery]:
    """An app whose scheduler instances use the injected clock, with one crontab entry every
    two minutes."""
    app = Celery("beat-clock-tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"celery-fence-beat-{uuid.uuid4().hex}",
        result_expires=None,
        beat_schedule={ENTRY: {"task": "example.plan_retention", "schedule": crontab("*/2")}},
    )
    Fence(app, store=fake_store)
    yield app
    app.close()


def test_a_former_leader_that_leads_again_sends_nothing_its_successor_sent(
    clocked_app: Celery, fake_store: LeaseStore
) -> None:
    def at(hhmmss: str) -> None:
        frozen.move_to(f"2030-01-01T{hhmmss}+00:00")

    def lead_for(instance: FencedScheduler, seconds: int) -> None:
        """Tick ``instance`` every second for ``seconds`` seconds, as a running beat does."""
        for _ in range(seconds):
            frozen.tick(1)
            instance.tick()
            assert instance.lease is not None

    def sent_at() -> list[str]:
        return sorted(d.slot.strftime("%H:%M") for d in fake_store.dispatches(first.lease_name))

    with freeze_time("2030-01-01T09:59:30+00:00", ignore=["_pytest.timing"]) as frozen:
        first = FencedScheduler(app=clocked_app, lazy=False)
        second = FencedScheduler(app=clocked_app, lazy=False)
        try:
            at("10:00:05")
            first.tick()  # leads and sends the 10:00 slot
            second.tick()  # standby: passes it
            lead_for(first, 10)
            assert sent_at() == ["10:00"]
            # The first instance stalls past its TTL; the second takes over and sends 10:02.
            at("10:02:05")
            second.tick()
            assert second.lease is not None
            assert sent_at() == ["10:00", "10:02"]
            second.close()
            # The first wakes up, steps down, then leads again at 10:03: nothing is due.
            at("10:03:05")
            first.tick()
            assert first.lease is None
            lead_for(first, 50)
            assert first.lease is not None
            assert first.lease.epoch == 3
            assert sent_at() == ["10:00", "10:02"]
            assert len(queued(clocked_app)) == 2
            # Its next slot goes out when due.
            lead_for(first, 10)
            assert sent_at() == ["10:00", "10:02", "10:04"]
        finally:
            first.close()
            second.close()


def restarted(app: Celery, start: str, *, instances: int, ticks: int, every: float) -> list[str]:
    """Run ``instances`` of the app's scheduler one after another from ``start`` (HH:MM:SS on
    2030-01-01, UTC), each ticking ``ticks`` times, ``every`` seconds apart; the slots they
    sent (HH:MM:SS), in order."""
    store = Fence.of(app).store
    with freeze_time(f"2030-01-01T{start}+00:00", ignore=["_pytest.timing"]) as frozen:
        for _ in range(instances):
            beat = FencedScheduler(app=app, lazy=False)
            try:
                for _ in range(ticks):
                    beat.tick()
                    frozen.tick(every)
            finally:
                beat.close()
    return sorted(d.slot.strftime("%H:%M:%S") for d in store.dispatches(beat.lease_name))


def test_interval_slots_go_out_where_they_start_however_often_beat_restarts(
    clocked_app: Celery,
) -> None:
    """An interval entry comes due at the start of each of its slots, not a period after its
    instance started, and a beat that starts sends the current slot unless it was sent: beat
    restarted every 7 s (by deploys, say) still sends a 10 s entry, once per slot."""
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": timedelta(seconds=10)}
    }
    # 42 seconds, one instance after another.
    slots = restarted(clocked_app, "10:00:03", instances=6, ticks=7, every=1)
    assert slots == ["10:00:00", "10:00:10", "10:00:20", "10:00:30", "10:00:40"]
    assert len(queued(clocked_app)) == 5


@pytest.mark.parametrize(
    ("every", "slots"),
    [
        (schedules.schedule(timedelta(seconds=0.5)), ["10:00:03", "10:00:04", "10:00:05"]),
        # Celery rounds a relative period's end to its resolution (90 minutes: to the hour), so
        # it finds the 09:00 slot due at 10:00, too late to be sent (past half its period).
        (schedules.schedule(timedelta(minutes=90), relative=True), ["10:30:00"]),
    ],
    ids=["half a second", "relative"],
)
def test_an_interval_entry_is_not_due_again_within_the_slot_it_was_sent_for(
    clocked_app: Celery,
    caplog: pytest.LogCaptureFixture,
    every: schedules.schedule,
    slots: list[str],
) -> None:
    """Each slot goes out once, and no tick asks to claim a slot already sent (which the claim
    would refuse, logging it)."""
    caplog.set_level(logging.INFO, "celery_fence")
    clocked_app.conf.beat_schedule = {ENTRY: {"task": "example.plan_retention", "schedule": every}}
    start = "10:00:03" if every.run_every < timedelta(seconds=1) else "10:29:58"
    assert restarted(clocked_app, start, instances=1, ticks=6, every=0.5) == slots
    assert "already dispatched" not in caplog.text
    assert len(queued(clocked_app)) == len(slots)


def test_a_standby_that_takes_over_sends_the_slot_that_began_while_nobody_led(
    clocked_app: Celery, fake_store: LeaseStore
) -> None:
    """The leader stops a few seconds before a slot starts, and its lease runs out after: the
    standby passed that slot's start unsent, and sends it when it takes over."""
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": timedelta(minutes=1)}
    }
    with freeze_time("2030-01-01T10:00:03+00:00", ignore=["_pytest.timing"]) as frozen:
        leader = FencedScheduler(app=clocked_app, lazy=False)
        standby = FencedScheduler(app=clocked_app, lazy=False)
        try:
            for _ in range(52):  # until 10:00:55, when the leader stops ticking
                leader.tick()
                standby.tick()
                frozen.tick(1)
            assert leader.lease is not None
            for _ in range(30):  # until 10:01:25: its lease runs out, the standby takes over
                standby.tick()
                frozen.tick(1)
            assert standby.lease is not None
        finally:
            standby.close()
    slots = sorted(d.slot.strftime("%H:%M") for d in fake_store.dispatches(leader.lease_name))
    assert slots == ["10:00", "10:01"]
    assert len(queued(clocked_app)) == 2


def lead_until(
    instances: FencedScheduler | tuple[FencedScheduler, ...],
    frozen: FrozenDateTimeFactory,
    until: str,
) -> None:
    """Tick each of ``instances`` every second, as a running beat does, until ``until``
    (HH:MM:SS)."""
    ticking = instances if isinstance(instances, tuple) else (instances,)
    stop = datetime.fromisoformat(f"2030-01-01T{until}+00:00")
    while datetime.now(timezone.utc) < stop:
        for instance in ticking:
            instance.tick()
        frozen.tick(1)


def lead_alone(app: Celery, frozen: FrozenDateTimeFactory, until: str) -> FencedScheduler:
    """Start a scheduler of ``app``, tick it every second until ``until`` (HH:MM:SS), which it
    must lead by, and close it."""
    beat = FencedScheduler(app=app, lazy=False)
    try:
        lead_until(beat, frozen, until)
        assert beat.lease is not None
    finally:
        beat.close()
    return beat


def fail_over(
    app: Celery, *, leader_stops: str, lease_holds: str, takes_over: str, leads_until: str
) -> list[tuple[str, str, bool]]:
    """A leader and a standby start at 09:59:50 and tick every second until the leader stops at
    ``leader_stops``; the standby ticks on until ``lease_holds``, while the leader's lease still
    holds, then the clock jumps to ``takes_over`` and the standby leads until ``leads_until``
    (each HH:MM:SS on 2030-01-01, UTC). What went out, sorted: each dispatch's entry, slot
    (HH:MM) and whether the standby sent it."""
    with freeze_time("2030-01-01T09:59:50+00:00", ignore=["_pytest.timing"]) as frozen:
        leader = FencedScheduler(app=app, lazy=False)
        standby = FencedScheduler(app=app, lazy=False)
        try:
            lead_until((leader, standby), frozen, leader_stops)
            assert leader.lease is not None
            lead_until(standby, frozen, lease_holds)
            assert standby.lease is None
            frozen.move_to(f"2030-01-01T{takes_over}+00:00")
            lead_until(standby, frozen, leads_until)
            assert standby.lease is not None
        finally:
            leader.close()
            standby.close()
    return sorted(
        (d.entry, d.slot.strftime("%H:%M"), d.holder == standby.holder)
        for d in Fence.of(app).store.dispatches(leader.lease_name)
    )


@pytest.mark.parametrize(
    ("starts", "missed"),
    [
        ("10:01:25", []),
        ("10:01:40", ["10:01"]),
        ("10:03:20", ["10:01", "10:02"]),
        ("10:03:40", ["10:01", "10:02", "10:03"]),
    ],
    ids=["in time", "one slot late", "two slots missed, the third in time", "three slots late"],
)
@pytest.mark.parametrize("standby", [False, True], ids=["new beat", "stopped standby"])
def test_a_beat_that_takes_over_says_which_interval_slots_nobody_sent(
    clocked_app: Celery,
    fake_store: LeaseStore,
    caplog: pytest.LogCaptureFixture,
    starts: str,
    missed: list[str],
    standby: bool,
) -> None:
    """The leader sends 10:00 of a one-minute entry and stops at 10:00:50 (its lease runs
    out at 10:01:20), and so does its standby, if any. A beat that starts, or the standby that
    resumes, less than half a minute into a slot sends it; one that does later sends the next,
    and says which slots nobody sent, and counts them: what the standby counted before it was
    stopped does not make it send a slot more than half a period late."""
    caplog.set_level(logging.WARNING, "celery_fence")
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": timedelta(minutes=1)}
    }
    hour, minute = (int(part) for part in starts.split(":")[:2])
    current, following = f"{hour}:{minute:02}", f"{hour}:{minute + 1:02}"
    # The first slot the beat that takes over sends.
    first_sent = following if current in missed else current
    with freeze_time("2030-01-01T09:59:50+00:00", ignore=["_pytest.timing"]) as frozen:
        stopped = FencedScheduler(app=clocked_app, lazy=False)
        try:
            other = FencedScheduler(app=clocked_app, lazy=False) if standby else None
            lead_until((stopped, other) if other else stopped, frozen, "10:00:50")
            assert stopped.lease is not None
            frozen.move_to(f"2030-01-01T{starts}+00:00")
            started = other or FencedScheduler(app=clocked_app, lazy=False)
            try:
                lead_until(started, frozen, f"{following}:10")
                assert started.lease is not None
            finally:
                started.close()
        finally:
            stopped.close()
    sent = [d.slot.strftime("%H:%M") for d in fake_store.dispatches(stopped.lease_name)]
    assert sorted(sent) == sorted({"10:00", current, following} - set(missed))
    lines = [r.getMessage() for r in caplog.records if "without sending" in r.getMessage()]
    if missed:
        first, last = (f"2030-01-01T{slot}:00+00:00" for slot in (missed[0], missed[-1]))
        assert lines == [
            f"beat leads {stopped.lease_name} without sending {len(missed)} slot(s) of "
            f"'{ENTRY}', {first} to {last}: no instance sent them, and the last began more "
            f"than half a period ago; next slot 2030-01-01T{first_sent}:00+00:00"
        ]
    else:
        assert lines == []
    assert fake_store.metrics.get("beat.slots_missed") == len(missed)


@pytest.mark.parametrize("slow", [False, True], ids=["prompt answer", "slow answer"])
def test_a_standby_that_takes_over_as_an_occurrence_falls_sends_it(
    clocked_app: Celery, fake_store: LeaseStore, monkeypatch: pytest.MonkeyPatch, slow: bool
) -> None:
    """A standby that ticked a second ago takes over at 10:05:00, just as a crontab entry no one
    sent before comes due: it sends it, also when the acquisition's answer took 11 s (more than
    two renew intervals). Only an instance that missed ticks (stopped) passes its entries
    first."""
    clocked_app.conf.beat_schedule = {
        "at-five": {"task": "example.report", "schedule": crontab(minute="5")}
    }
    with freeze_time("2030-01-01T10:04:00+00:00", ignore=["_pytest.timing"]) as frozen:
        leader = FencedScheduler(app=clocked_app, lazy=False)
        standby = FencedScheduler(app=clocked_app, lazy=False)
        try:
            lead_until((leader, standby), frozen, "10:04:46")  # the leader renews at 10:04:45
            owner = fake_store.owner(leader.lease_name)
            assert owner is not None
            assert owner.expires_at == datetime(2030, 1, 1, 10, 5, tzinfo=timezone.utc)
            if slow:
                acquire = fake_store.acquire

                def slow_acquire(*args: Any, **kwargs: Any) -> Acquisition:
                    got = acquire(*args, **kwargs)
                    if got.acquired:
                        frozen.tick(11)
                    return got

                monkeypatch.setattr(fake_store, "acquire", slow_acquire)
            lead_until(standby, frozen, "10:05:01")
            assert standby.lease is not None
        finally:
            leader.close()
            standby.close()
    [dispatch] = fake_store.dispatches(leader.lease_name)
    assert (dispatch.entry, dispatch.slot.strftime("%H:%M"), dispatch.holder) == (
        "at-five",
        "10:05",
        standby.holder,
    )


def test_a_takeover_does_not_count_slots_off_the_entrys_grid_as_missed(
    clocked_app: Celery, fake_store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The latest claim of an entry whose period changed since (10:00:30, a slot of the
    30-second entry it was) says nothing about the one-minute slots no instance sent."""
    caplog.set_level(logging.WARNING, "celery_fence")
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": timedelta(minutes=1)}
    }
    with fake_store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO celery_fence.dispatches VALUES (:schedule, :entry, :slot, "
                "'example.plan_retention', 1, 'beat@old', :slot)"
            ),
            {
                "schedule": "scheduler:beat-clock-tests",
                "entry": ENTRY,
                "slot": datetime(2030, 1, 1, 10, 0, 30, tzinfo=timezone.utc),
            },
        )
    with freeze_time("2030-01-01T10:05:40+00:00", ignore=["_pytest.timing"]) as frozen:
        beat = lead_alone(clocked_app, frozen, "10:06:10")
    assert "without sending" not in caplog.text
    assert fake_store.metrics.get("beat.slots_missed") == 0
    slots = sorted(d.slot.strftime("%H:%M:%S") for d in fake_store.dispatches(beat.lease_name))
    assert slots == ["10:00:30", "10:06:00"]


@pytest.mark.parametrize("deadline", [None, 30])
def test_a_standby_that_takes_over_sends_the_crontab_occurrence_nobody_sent(
    clocked_app: Celery, deadline: int | None
) -> None:
    """The leader sends 10:00 of a crontab every two minutes and stops at 10:01:59; the standby
    passes 10:02 while the lease still holds, and takes over at 10:03:10. Counting from the
    latest slot claimed (10:00), as Celery counts from its schedule file, it sends the 10:02
    occurrence at once, under that slot; Celery's ``beat_cron_starting_deadline`` (30 s) makes
    it too late."""
    clocked_app.conf.beat_cron_starting_deadline = deadline
    dispatched = fail_over(
        clocked_app,
        leader_stops="10:01:59",
        lease_holds="10:02:05",
        takes_over="10:03:10",
        leads_until="10:04:10",
    )
    sent = [(slot, by_standby) for _, slot, by_standby in dispatched]
    caught_up = [] if deadline else [("10:02", True)]
    assert sent == [("10:00", False), *caught_up, ("10:04", True)]
    assert len(queued(clocked_app)) == len(sent)


def test_a_takeover_catches_each_crontab_up_from_its_own_latest_slot(clocked_app: Celery) -> None:
    """Two crontab entries: the leader sends 10:00, 10:02 and 10:04 of the first and 10:01 of
    the second, and stops at 10:05:59. Taking over at 10:07:10, the standby sends each entry's
    10:06 occurrence, counted from the slots claimed for that entry."""
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": crontab("*/2")},
        "report": {"task": "example.report", "schedule": crontab("1,6")},
    }
    sent = fail_over(
        clocked_app,
        leader_stops="10:05:59",
        lease_holds="10:06:05",
        takes_over="10:07:10",
        leads_until="10:07:20",
    )
    assert sent == [
        (ENTRY, "10:00", False),
        (ENTRY, "10:02", False),
        (ENTRY, "10:04", False),
        (ENTRY, "10:06", True),
        ("report", "10:01", False),
        ("report", "10:06", True),
    ]
    assert len(queued(clocked_app)) == len(sent)


class OnceAt(schedules.BaseSchedule):  # type: ignore[misc]
    """Due once, at ``at``: what a solar event is for its day, a schedule that is neither an
    interval nor a crontab."""

    def __init__(self, at: datetime) -> None:
        super().__init__()
        self.at = at

    def is_due(self, last_run_at: datetime) -> schedules.schedstate:
        now = datetime.now(timezone.utc)
        if self.maybe_make_aware(last_run_at) < self.at <= now:
            return schedules.schedstate(True, 3600.0)
        next_check = (self.at - now).total_seconds() if now < self.at else 3600.0
        return schedules.schedstate(False, next_check)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return self.at - datetime.now(timezone.utc)

    def __repr__(self) -> str:
        return f"OnceAt({self.at.isoformat()})"


def test_a_takeover_does_not_send_again_an_event_of_another_schedule_its_predecessor_sent(
    clocked_app: Celery, fake_store: LeaseStore
) -> None:
    """The slots of a schedule that is neither an interval nor a crontab (``solar``, one of the
    app's own) last a second, and differ from one instance to the next. The leader sends the
    event at 10:00:30 and hands over a second later; the standby, whose last tick came before
    the event, takes over at its next: it counts the entry from when the event was sent, and
    does not send it again under a second of its own."""
    event = OnceAt(datetime(2030, 1, 1, 10, 0, 30, tzinfo=timezone.utc))
    clocked_app.conf.beat_schedule = {"event": {"task": "example.report", "schedule": event}}
    with freeze_time("2030-01-01T10:00:20+00:00", ignore=["_pytest.timing"]) as frozen:
        leader = FencedScheduler(app=clocked_app, lazy=False)
        standby = FencedScheduler(app=clocked_app, lazy=False)
        try:
            leader.tick()
            standby.tick()
            frozen.move_to("2030-01-01T10:00:25+00:00")
            standby.tick()
            frozen.move_to("2030-01-01T10:00:30+00:00")
            leader.tick()  # sends the event
            frozen.move_to("2030-01-01T10:00:31+00:00")
            leader.close()  # gives the lease back, as at a SIGTERM
            frozen.move_to("2030-01-01T10:00:32+00:00")
            lead_until(standby, frozen, "10:00:40")
            assert standby.lease is not None
        finally:
            leader.close()
            standby.close()
    sent = [
        (d.entry, d.slot.strftime("%H:%M:%S"), d.holder == leader.holder)
        for d in fake_store.dispatches(leader.lease_name)
    ]
    assert sent == [("event", "10:00:30", True)]
    assert len(queued(clocked_app)) == 1


class BreaksAt(crontab):  # type: ignore[misc]
    """A crontab whose occurrences cannot be told from 10:01 on (Celery's own raises
    ``RuntimeError`` when it cannot roll a date over)."""

    def remaining_delta(self, *args: Any, **kwargs: Any) -> Any:
        if datetime.now(timezone.utc) >= datetime(2030, 1, 1, 10, 1, tzinfo=timezone.utc):
            raise RuntimeError("unable to rollover")
        return super().remaining_delta(*args, **kwargs)


def test_a_takeover_logs_an_entry_it_cannot_count_from_its_claim_and_leads_on(
    clocked_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """The standby takes over at 10:03:10; one entry's crontab raises when asked whether its
    latest slot (10:00) is one of its occurrences. That entry is logged and keeps its own count;
    the other catches up (10:02) as it would have, and beat leads on instead of stopping (and
    being restarted, in a loop)."""
    caplog.set_level(logging.ERROR, "celery_fence")
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": crontab("*/2")},
        "broken": {"task": "example.report", "schedule": BreaksAt("*/2")},
    }
    sent = fail_over(
        clocked_app,
        leader_stops="10:01:59",
        lease_holds="10:02:05",
        takes_over="10:03:10",
        leads_until="10:04:10",
    )
    assert sent == [
        ("broken", "10:00", False),
        (ENTRY, "10:00", False),
        (ENTRY, "10:02", True),
        (ENTRY, "10:04", True),
    ]
    [said] = [r for r in caplog.records if r.getMessage().startswith("beat cannot count")]
    assert said.getMessage() == (
        "beat cannot count 'broken' from its latest slot, 2030-01-01T10:00:00+00:00; it counts "
        "from its own last run"
    )
    assert said.exc_info is not None
    assert said.exc_info[0] is RuntimeError


class Unknowable(schedules.schedule):  # type: ignore[misc]
    """An interval whose next run cannot be told."""

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        raise ValueError("no next run")


def test_a_standby_passes_over_an_entry_whose_next_run_cannot_be_told(
    clocked_app: Celery, fake_store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """As the leader's tick does, a standby logs an entry whose ``is_due`` raises and goes on
    with the others, rather than stop beat (and a supervisor restart it, in a loop)."""
    caplog.set_level(logging.ERROR)
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": crontab("*/2")},
        "unknowable": {"task": "example.report", "schedule": Unknowable(timedelta(minutes=1))},
    }
    with freeze_time("2030-01-01T09:59:50+00:00", ignore=["_pytest.timing"]) as frozen:
        leader = FencedScheduler(app=clocked_app, lazy=False)
        standby = FencedScheduler(app=clocked_app, lazy=False)
        try:
            lead_until((leader, standby), frozen, "10:00:20")
            assert (leader.lease is not None, standby.lease) == (True, None)
        finally:
            leader.close()
            standby.close()
    said = [r for r in caplog.records if r.getMessage().startswith("beat on standby cannot tell")]
    assert said
    assert {r.getMessage() for r in said} == {
        "beat on standby cannot tell whether 'unknowable' is due"
    }
    assert all(r.exc_info is not None and r.exc_info[0] is ValueError for r in said)


def test_a_takeover_that_cannot_read_the_claims_leads_on_and_says_so(
    clocked_app: Celery, fake_store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The claims cannot be read when the standby takes over (the table is away): it leads,
    with its crontab counted from its own last pass, and says that nothing was caught up."""
    caplog.set_level(logging.WARNING, "celery_fence")
    rename = "ALTER TABLE celery_fence.{} RENAME TO {}"
    with freeze_time("2030-01-01T10:01:00+00:00", ignore=["_pytest.timing"]) as frozen:
        beat = FencedScheduler(app=clocked_app, lazy=False)
        try:
            with fake_store.engine.begin() as conn:
                conn.exec_driver_sql(rename.format("dispatches", "dispatches_away"))
            try:
                beat.tick()
            finally:
                with fake_store.engine.begin() as conn:
                    conn.exec_driver_sql(rename.format("dispatches_away", "dispatches"))
            assert beat.lease is not None
            lead_until(beat, frozen, "10:02:30")
        finally:
            beat.close()
    [line] = [r.getMessage() for r in caplog.records if "could not read" in r.getMessage()]
    assert line.startswith(
        f"beat could not read the slots claimed before it led {beat.lease_name}; crontab "
        "entries count from their next occurrence, and interval slots nobody sent go "
        "unreported: "
    )
    assert [d.slot.strftime("%H:%M") for d in fake_store.dispatches(beat.lease_name)] == ["10:02"]


def test_a_crontab_slot_is_counted_in_the_apps_time_zone() -> None:
    """03:00 in Kolkata (UTC+05:30) is 21:30 UTC the day before."""
    app = Celery("crontab-zone", set_as_current=False)
    app.conf.timezone = "Asia/Kolkata"
    schedule = crontab(minute=0, hour=3, app=app)
    entry = ScheduleEntry(name=ENTRY, task="example.plan_retention", schedule=schedule, app=app)
    now = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)
    assert slot_of(entry, now) == datetime(2029, 12, 31, 21, 30, tzinfo=timezone.utc)


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata"])
@settings(max_examples=200, deadline=None)
@given(
    minutes=st.sets(st.integers(0, 59), min_size=1, max_size=4),
    hours=st.sets(st.integers(0, 23), min_size=1, max_size=3),
    days_of_week=st.sets(st.integers(0, 6), min_size=1, max_size=7),
    now=st.datetimes(datetime(2029, 1, 1), datetime(2031, 1, 1), timezones=st.just(timezone.utc)),
)
def test_a_crontab_slot_is_its_latest_occurrence(
    zone: str, minutes: set[int], hours: set[int], days_of_week: set[int], now: datetime
) -> None:
    """Whenever a crontab entry is sent, its slot is the crontab's latest minute at or before
    then, on the app's clock: the same on every instance, also for a send a tick or a takeover
    made late."""
    app = Celery("crontab-slots", set_as_current=False)
    app.conf.timezone = zone
    schedule = crontab(
        minute=",".join(map(str, sorted(minutes))),
        hour=",".join(map(str, sorted(hours))),
        day_of_week=",".join(map(str, sorted(days_of_week))),
        app=app,
    )
    entry = ScheduleEntry(name=ENTRY, task="example.plan_retention", schedule=schedule, app=app)
    expected = now.replace(second=0, microsecond=0)
    while not (
        (local := expected.astimezone(ZoneInfo(zone))).minute in minutes
        and local.hour in hours
        and local.isoweekday() % 7 in days_of_week
    ):
        expected -= timedelta(minutes=1)
    assert slot_of(entry, now) == expected


@pytest.mark.parametrize(
    ("fields", "now", "expected"),
    [
        ({"minute": "*", "month_of_year": "1"}, "2030-12-07T10:00", "2030-01-31T23:59"),
        ({"minute": "*", "month_of_year": "1"}, "2030-01-15T10:00:30", "2030-01-15T10:00"),
        (
            {"minute": 0, "hour": 3, "day_of_month": 29, "month_of_year": 2},
            "2031-06-01T00:00",
            "2028-02-29T03:00",
        ),
    ],
    ids=["dense in January, sent in December", "within January", "leap days"],
)
def test_a_crontab_slot_is_its_latest_occurrence_however_far_back(
    fields: dict[str, Any], now: str, expected: str
) -> None:
    app = Celery("crontab-sparse", set_as_current=False)
    entry = ScheduleEntry(
        name=ENTRY, task="example.plan_retention", schedule=crontab(**fields, app=app), app=app
    )
    at = datetime.fromisoformat(f"{now}+00:00")
    assert slot_of(entry, at) == datetime.fromisoformat(f"{expected}+00:00")


def test_a_takeover_does_not_catch_up_a_crontab_that_changed_since_its_latest_slot(
    clocked_app: Celery, fake_store: LeaseStore
) -> None:
    """The entry went out at 10:00 every two minutes; redeployed to run at minute 1 and 3 of
    each hour, a beat taking over at 10:04:10 does not count from 10:00, which is no occurrence
    of it now, and so does not send at once the 10:01 it never had."""
    with freeze_time("2030-01-01T09:59:50+00:00", ignore=["_pytest.timing"]) as frozen:
        before = FencedScheduler(app=clocked_app, lazy=False)
        try:
            lead_until(before, frozen, "10:00:10")
        finally:
            before.close()
        clocked_app.conf.beat_schedule = {
            ENTRY: {"task": "example.plan_retention", "schedule": crontab("1,3")}
        }
        frozen.move_to("2030-01-01T10:04:10+00:00")
        after = lead_alone(clocked_app, frozen, "10:05:00")
    assert [d.slot.strftime("%H:%M") for d in fake_store.dispatches(after.lease_name)] == ["10:00"]


def test_a_takeover_catches_a_crontab_up_across_a_daylight_saving_change(
    clocked_app: Celery, fake_store: LeaseStore
) -> None:
    """02:30 in Berlin does not exist on 2030-03-31 (clocks go from 02:00 to 03:00): Celery sends
    that day's run at 01:30 UTC, and that slot still counts as the entry's latest occurrence. A
    beat taking over just after the next day's 02:30 (00:30 UTC) sends it at once."""
    clocked_app.conf.timezone = "Europe/Berlin"
    clocked_app.conf.beat_schedule = {
        ENTRY: {"task": "example.plan_retention", "schedule": crontab(minute=30, hour=2)}
    }

    def tick_for(instance: FencedScheduler, frozen: FrozenDateTimeFactory, seconds: int) -> None:
        """Tick every 2 seconds, within the renew interval."""
        for _ in range(seconds // 2):
            instance.tick()
            frozen.tick(2)

    # 01:50 in Berlin, before the change at 01:00 UTC; led until 01:31 UTC (03:31 there).
    with freeze_time("2030-03-31T00:50:00+00:00", ignore=["_pytest.timing"]) as frozen:
        before = FencedScheduler(app=clocked_app, lazy=False)
        try:
            tick_for(before, frozen, 41 * 60)
        finally:
            before.close()
        frozen.move_to("2030-04-01T00:31:00+00:00")
        after = FencedScheduler(app=clocked_app, lazy=False)
        try:
            tick_for(after, frozen, 10)
            assert after.lease is not None
        finally:
            after.close()
    slots = sorted(d.slot.isoformat() for d in fake_store.dispatches(after.lease_name))
    assert slots == ["2030-03-31T01:30:00+00:00", "2030-04-01T00:30:00+00:00"]


def test_the_schedule_digest_is_the_same_in_every_process_and_tells_schedules_apart() -> None:
    """Sets in an entry's arguments (of strings, of sets) are hashed by seed in each process,
    and a mapping may mix the types of its keys; the digest is the same in every process.
    Objects of a class of the app's own, whose ``repr`` shows where each one is in memory, in the
    arguments and as a schedule, do not change it either. Intervals a few minutes apart, and
    crontabs of two time zones, differ."""
    script = """
from datetime import timedelta
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, crontab, schedule
from celery_fence.contrib.celery.beat import schedule_digest
class Report:
    pass
class Fortnightly(BaseSchedule):
    pass
padding = [Report() for _ in range(__import__("random").randrange(100))]
def digest(every, zone="UTC"):
    app = Celery("digest", set_as_current=False)
    app.conf.timezone = zone
    entries = [
        ScheduleEntry(name="a", task="t.a", schedule=schedule(every, app=app),
                      kwargs={"tags": {"x", "y", "z", "w"},
                              "groups": {frozenset({"b", "x", "q"}), frozenset({"a", "y", "r"})},
                              "by": {1: "one", "two": 2, None: (3, 4)}}, app=app),
        ScheduleEntry(name="b", task="t.b", schedule=crontab(minute=0, hour=3, app=app), app=app),
        ScheduleEntry(name="c", task="t.c", schedule=Fortnightly(app=app), args=(Report(),),
                      app=app),
    ]
    return schedule_digest(entries)
day = timedelta(days=1)
print(digest(day + timedelta(minutes=5)), digest(day + timedelta(minutes=10)),
      digest(day + timedelta(minutes=5), "Europe/Berlin"))
"""
    printed = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3", "4", "5")
    }
    [line] = printed
    assert len(set(line.split())) == 3


@pytest.mark.parametrize(
    ("every", "slots"),
    [
        (crontab("*/2"), ["10:00", "10:02", "10:04"]),
        (timedelta(minutes=1), ["10:00", "10:01", "10:02", "10:03", "10:04"]),
    ],
    ids=["crontab", "interval"],
)
def test_a_leader_whose_maximum_hold_runs_out_leads_on_at_the_next_epoch_without_a_gap(
    clocked_app: Celery,
    fake_store: LeaseStore,
    caplog: pytest.LogCaptureFixture,
    every: object,
    slots: list[str],
) -> None:
    """Taken again at once, the lease was never away: the leader keeps its count, and asks to
    claim no slot it sent already."""
    caplog.set_level(logging.INFO, "celery_fence")
    clocked_app.conf.beat_schedule = {ENTRY: {"task": "example.plan_retention", "schedule": every}}
    clocked_app.conf.fence_beat_max_hold = 120
    with freeze_time("2030-01-01T09:59:30+00:00", ignore=["_pytest.timing"]) as frozen:
        beat = FencedScheduler(app=clocked_app, lazy=False)
        try:
            assert "held at most 120s at one epoch" in beat.info
            beat.tick()
            assert beat.lease is not None
            assert beat.lease.hold_until - beat.lease.acquired_at == timedelta(seconds=120)
            epochs = []
            # Tick every second for five minutes, as a running beat does: the lease is never
            # found missing, and every two-minute slot goes out once.
            for _ in range(300):
                frozen.tick(1)
                beat.tick()
                assert beat.lease is not None
                epochs.append(beat.lease.epoch)
        finally:
            beat.close()
    assert sorted(set(epochs)) == [1, 2, 3]
    history = fake_store.history(beat.lease_name)
    # Each epoch was given up before its maximum hold ran out, and taken over at once.
    assert [(entry.epoch, entry.end_reason) for entry in history] == [
        (3, "released"),
        (2, "released"),
        (1, "released"),
    ]
    assert all(entry.ended_at < entry.acquired_at + timedelta(seconds=120) for entry in history)
    dispatched = fake_store.dispatches(beat.lease_name)
    assert sorted(d.slot.strftime("%H:%M") for d in dispatched) == slots
    assert "already dispatched" not in caplog.text


def test_a_leader_whose_renewals_fail_retries_at_a_pace_until_its_deadline_then_steps_down(
    app: Celery,
    scheduler: NewScheduler,
    admin_engine: Engine,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    database = make_url(database_url).database
    # Whatever level an earlier worker's logging setup left the root logger at.
    caplog.set_level(logging.WARNING, "celery_fence")
    with freeze_time("2030-01-01T00:00:00+00:00", ignore=["_pytest.timing"]) as frozen:
        beat = scheduler()
        beat.tick()
        lease = beat.lease
        assert lease is not None
        ticks = []
        with unreachable(admin_engine, str(database)):
            # Tick as celery beat does, sleeping what tick() returns, until the leader steps
            # down (its lease is trusted for 13.5 s of 15).
            while beat.lease is not None and len(ticks) < 100:
                ticks.append(beat.tick())
                # The frozen clock moves by whole microseconds; a real sleep takes at least one.
                frozen.tick(max(ticks[-1], 1e-6))

    assert (beat.lease, beat.halted) == (None, None)
    assert min(ticks) > 0
    failed = [r for r in caplog.records if r.getMessage().startswith("beat renewal failed")]
    # Due at 5 s, then retried every 1.25 s, or at half the time left, but at least 50 ms apart:
    # about a dozen attempts in the 8.5 s the lease was still trusted.
    assert 8 <= len(failed) <= 14
    assert len(ticks) < 30
