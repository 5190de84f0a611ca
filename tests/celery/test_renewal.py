"""Background renewal while the body runs, and what the body learns when the lease is lost.

These tests run in real time on purpose (renewal is a thread against the database clock), with
TTLs of a few seconds at most.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.engine import Engine

from celery_fence import LeaseLostError, LeaseStore, Owner, StaleEpochError
from celery_fence.contrib.celery import HEADER, Fence, FenceHeader

if TYPE_CHECKING:
    from conftest import StartWorker, Wait

NAME = "release:prod"
TTL = 1.5
INTRUDER = "intruder@test"

INSERT = sa.text("INSERT INTO manifest VALUES (:environment, 7)")
EXPIRE = sa.text("UPDATE celery_fence.leases SET expires_at = clock_timestamp() WHERE name = :name")
ACQUIRE = sa.text(
    "SELECT outcome, epoch FROM celery_fence.acquire(:name, 'default', :holder, interval '60 s')"
)


def create_manifest(engine: Engine) -> None:
    """The table the bodies' fenced writes go to."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE manifest (environment text PRIMARY KEY, release int)")


def test_renewal_keeps_the_lease_beyond_its_ttl(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    started, finish = threading.Event(), threading.Event()

    @fence.task(lease="release:{environment}", ttl=TTL)
    def publish(environment: str) -> list[Any]:
        started.set()
        assert finish.wait(10)
        run = fence.current()
        return [run.held, run.epoch]

    refusals: list[Owner | None] = []
    with worker():
        result = publish.delay("prod")
        assert started.wait(10)
        try:
            # Twice the TTL: without renewal the lease would have expired, the intruder won.
            until = time.monotonic() + 2 * TTL
            while time.monotonic() < until:
                got = store.acquire(NAME, holder=INTRUDER, ttl=5)
                assert got.lease is None, got
                refusals.append(got.owner)
                time.sleep(0.1)
        finally:
            finish.set()
        assert wait.outcome(result) == [True, 1]

    owners = [owner for owner in refusals if owner is not None]
    assert len(owners) == len(refusals)
    assert {(owner.epoch, owner.state) for owner in owners} == {(1, "held")}
    first, last = owners[0], owners[-1]
    assert last.renewed_at > first.renewed_at
    assert (last.expires_at - first.acquired_at).total_seconds() > 2 * TTL
    [entry] = store.history(NAME)
    assert entry.end_reason == "released"
    assert (entry.ended_at - entry.acquired_at).total_seconds() > 2 * TTL
    assert store.stale_runs() == []


@pytest.mark.parametrize("enforcement", ["enforce", "shadow"])
def test_lost_lease_reaches_the_body_and_its_writes_are_rejected(
    app: Celery,
    fence: Fence,
    worker: StartWorker,
    store: LeaseStore,
    wait: Wait,
    engine: Engine,
    enforcement: str,
) -> None:
    """Renewal finds the lease taken over: the body learns it (``held``), its cooperative check
    raises and its fenced write is rejected; the stale renewal, write and release are recorded.
    In shadow mode, which blocks nothing, the check does not raise, the write commits, and each
    of the three is recorded as what would have been rejected."""
    app.conf.fence_enforcement = enforcement
    enforced = enforcement == "enforce"
    create_manifest(engine)
    started, taken_over = threading.Event(), threading.Event()

    @fence.task(lease="release:{environment}", ttl=3, renew_interval=0.25)
    def publish(environment: str) -> dict[str, Any]:
        run = fence.current()
        seen: dict[str, Any] = {"held at start": run.held}
        started.set()
        assert taken_over.wait(10)
        wait.until(lambda: not run.held, what="renewal to find the lease lost")
        seen["held"] = run.held
        try:
            run.check()
        except LeaseLostError as exc:
            seen["check"] = (type(exc).__name__, exc.reason)
        try:
            with fence.guard("publish manifest") as conn:
                conn.execute(INSERT, {"environment": environment})
        except StaleEpochError as exc:
            seen["write"] = (type(exc).__name__, exc.reason, exc.epoch)
        return seen

    with worker():
        result = publish.delay("prod")
        assert started.wait(10)
        try:
            # Expire the lease and take it in one transaction: a renewal arriving meanwhile
            # waits for the row, then finds the new epoch.
            with engine.begin() as conn:
                conn.execute(EXPIRE, {"name": NAME})
                taken = conn.execute(ACQUIRE, {"name": NAME, "holder": INTRUDER}).one()
        finally:
            taken_over.set()
        assert (taken.outcome, taken.epoch) == ("acquired", 2)
        seen = wait.outcome(result)

    rejected = {
        "check": ["LeaseLostError", "superseded"],
        "write": ["StaleEpochError", "superseded", 1],
    }
    assert seen == {"held at start": True, "held": False, **(rejected if enforced else {})}
    with engine.connect() as conn:
        written = conn.exec_driver_sql("SELECT count(*) FROM manifest").scalar_one()
    assert written == (0 if enforced else 1)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (2, INTRUDER, "held")
    stale = {(run.action, run.reason, run.stale_epoch, run.enforced) for run in store.stale_runs()}
    # Renewal, the write and the release at the end were each refused (or would have been)
    # and recorded.
    assert stale == {
        ("renew", "superseded", 1, enforced),
        ("publish manifest", "superseded", 1, enforced),
        ("release", "superseded", 1, enforced),
    }


def test_a_run_dispatched_by_beat_keeps_its_own_lease_when_the_leader_changes(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, engine: Engine
) -> None:
    """The beat's epoch is checked when the run starts; from then on the run holds its own
    lease, and its writes commit after another instance took over."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE manifest (environment text, release int)")
    beat = store.acquire("scheduler:test", holder="beat@test", ttl=60).lease
    assert beat is not None

    @fence.task(lease="tick")
    def tick() -> list[Any]:
        run = fence.current()
        with fence.guard("write plan") as conn:
            conn.execute(INSERT, {"environment": "prod"})
        store.release(beat)
        store.acquire("scheduler:test", holder="beat-2@test", ttl=60)
        with fence.guard("write plan") as conn:
            conn.execute(INSERT, {"environment": "prod"})
        assert run.lease is not None
        assert run.dispatched_by is not None
        return [
            run.mode,
            run.held,
            run.lease.name,
            run.lease.epoch,
            run.dispatched_by.lease,
            run.dispatched_by.epoch,
            run.dispatched_by.holder,
        ]

    with worker():
        header = FenceHeader.for_lease(beat, "join").to_message()
        result = tick.apply_async(headers={HEADER: header})
        outcome = wait.outcome(result)

    assert result.state == "SUCCESS", outcome
    assert outcome == ["owner", True, "tick", 1, "scheduler:test", 1, "beat@test"]
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM manifest").scalar_one() == 2
    [entry] = store.history("tick")
    assert entry.end_reason == "released"
    assert store.stale_runs() == []


def test_a_rejected_fenced_write_tells_the_body_before_renewal_does(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, engine: Engine
) -> None:
    """Paused between two renewals, the lease refuses the body's write: the run stops trusting
    it at once (``held``, ``check()``), not at the next renewal."""
    create_manifest(engine)
    started, paused = threading.Event(), threading.Event()

    @fence.task(lease="release:{environment}", ttl=30, renew_interval=20)
    def publish(environment: str) -> dict[str, Any]:
        run = fence.current()
        seen: dict[str, Any] = {"held at start": run.held}
        started.set()
        assert paused.wait(10)
        try:
            with fence.guard("publish manifest") as conn:
                conn.execute(INSERT, {"environment": environment})
        except StaleEpochError as exc:
            seen["write"] = exc.reason
        seen["held"] = run.held
        try:
            run.check()
        except StaleEpochError as exc:
            seen["check"] = exc.reason
        return seen

    with worker():
        result = publish.delay("prod")
        assert started.wait(10)
        try:
            store.pause(NAME, reason="investigating")
        finally:
            paused.set()
        seen = wait.outcome(result)
    assert seen == {"held at start": True, "write": "paused", "held": False, "check": "paused"}
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM manifest").scalar() == 0
