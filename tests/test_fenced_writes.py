"""Fenced writes: ``LeaseStore.guard`` lets the caller's own writes commit only under a held epoch.

The timelines that matter (pitfall 2) are forced with threads, events and separate connections,
and observed in ``pg_stat_activity``: a write that waits on a row lock while its lease passes to
a successor must never commit after the successor's epoch exists.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import select
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from freezegun import freeze_time
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from celery_fence import (
    ConfigurationError,
    FenceDatabaseError,
    Lease,
    LeaseLostError,
    LeaseStore,
    Owner,
    StaleEpochError,
)
from celery_fence.store import Executor, engine_from_url, proof

NAME = "release:prod"
ENVIRONMENT = "prod"
WAIT = 10.0

UPDATE = sa.text("UPDATE protected SET value = :value WHERE id = 1")
Expire = Callable[[str], None]


@pytest.fixture
def protected(engine: Engine) -> Engine:
    """The caller's table, with one row, and an audit trail of every committed change to it."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            """
            CREATE TABLE protected (id int PRIMARY KEY, value text NOT NULL);
            CREATE TABLE protected_audit (
                seq bigint GENERATED ALWAYS AS IDENTITY, value text NOT NULL
            );
            CREATE FUNCTION audit_protected() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO protected_audit (value) VALUES (NEW.value);
                RETURN NEW;
            END $$;
            CREATE TRIGGER protected_audit AFTER INSERT OR UPDATE ON protected
                FOR EACH ROW EXECUTE FUNCTION audit_protected();
            INSERT INTO protected VALUES (1, 'initial');
            """
        )
    return engine


def protected_value(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.exec_driver_sql("SELECT value FROM protected WHERE id = 1").scalar_one())


def committed_values(engine: Engine) -> list[str]:
    """Every value ever committed to the protected row, in order."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT value FROM protected_audit ORDER BY seq")
        return [str(value) for value in rows.scalars()]


def acquire(store: LeaseStore, holder: str, ttl: float = 300) -> Lease:
    got = store.acquire(NAME, holder=holder, ttl=ttl, environment=ENVIRONMENT)
    assert got.lease is not None, got
    return got.lease


@contextmanager
def transaction(engine: Engine, kind: str) -> Iterator[Executor]:
    """One transaction on a SQLAlchemy Connection or Session, committed unless it raises."""
    if kind == "connection":
        with engine.begin() as conn:
            yield conn
    else:
        with Session(engine) as session, session.begin():
            yield session


# -- the guard commits only while held --------------------------------------------------------

KINDS = ["connection", "session"]


@pytest.mark.parametrize("kind", KINDS)
def test_guard_commits_writes_while_held(store: LeaseStore, protected: Engine, kind: str) -> None:
    lease = acquire(store, "release-41")
    with transaction(protected, kind) as conn, store.guard(lease, conn, action="publish") as inside:
        assert inside is lease
        conn.execute(UPDATE, {"value": "published"})
    assert protected_value(protected) == "published"
    assert store.stale_runs() == []
    assert store.metrics.get("guard.passed") == 1


def idle_limit_ms(conn: sa.Connection) -> int:
    """The ``idle_in_transaction_session_timeout`` in force on ``conn``, in milliseconds."""
    return int(
        conn.exec_driver_sql(
            "SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
        ).scalar_one()
    )


def test_a_fence_limits_idleness_to_its_leases_time_left_and_never_loosens_a_limit(
    store: LeaseStore, protected: Engine
) -> None:
    later = acquire(store, "release-41", ttl=600)
    soon = store.acquire("release:soon", holder="release-42", ttl=5).lease
    assert soon is not None
    with protected.begin() as conn:
        with store.guard(later, conn, action="first"):
            conn.execute(UPDATE, {"value": "first"})
        assert 590_000 < idle_limit_ms(conn) <= 600_000
        with store.guard(soon, conn, action="second"):
            conn.execute(UPDATE, {"value": "second"})
        assert 0 < idle_limit_ms(conn) <= 5_000
        # A later fence on the longer lease keeps the shorter limit: a stalled writer must not
        # hold the lease expiring first past its expiry.
        with store.guard(later, conn, action="third"):
            conn.execute(UPDATE, {"value": "third"})
        assert 0 < idle_limit_ms(conn) <= 5_000
    with protected.connect() as conn:
        # The session's own limit, shorter than the lease's time left, stays in force.
        conn.exec_driver_sql("SET idle_in_transaction_session_timeout = '1s'")
        conn.commit()
        with conn.begin():
            with store.guard(later, conn, action="fourth"):
                conn.execute(UPDATE, {"value": "fourth"})
            assert idle_limit_ms(conn) == 1_000
        conn.exec_driver_sql("RESET idle_in_transaction_session_timeout")
        conn.commit()
    assert committed_values(protected) == ["initial", "first", "second", "third", "fourth"]


def expire_soon(engine: Engine, name: str, milliseconds: int) -> None:
    """Make a held lease expire ``milliseconds`` from now by the database clock (its row aged
    in SQL), so that the idle limit a fence check sets is that short."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE celery_fence.leases SET expires_at = clock_timestamp() "
                "+ make_interval(secs => :ms / 1000.0) WHERE name = :name"
            ),
            {"name": name, "ms": milliseconds},
        )


def wait_until_told(dbapi_connection: Any) -> None:
    """Wait, without sending anything, until what the server sent a psycopg connection whose
    session it ended (its error, the end of the stream) has reached the client."""
    readable, _, _ = select.select([dbapi_connection.pgconn.socket], [], [], WAIT)
    assert readable, "the server did not end the session, or its message never arrived"


def wait_until_ended(conn: Executor) -> None:
    """:func:`wait_until_told` for the connection under a SQLAlchemy ``Connection`` or
    ``Session``."""
    connection = conn.connection() if isinstance(conn, Session) else conn
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None
    wait_until_told(dbapi_connection)


@pytest.mark.parametrize("kind", KINDS)
def test_a_transaction_left_idle_past_the_lease_expiry_is_rejected_and_recorded(
    store: LeaseStore, protected: Engine, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer stalled between its check and its COMMIT past the lease's expiry has its session
    ended by the idle limit the check set: the commit fails with the write's rejection, which
    is recorded, logged and counted, in place of the driver's error."""
    # Whatever level an earlier worker's logging setup left the root logger at.
    caplog.set_level(logging.WARNING, "celery_fence")
    lease = acquire(store, "release-41")
    expire_soon(protected, NAME, 300)

    def stall_before_commit() -> None:
        with transaction(protected, kind) as conn:
            with store.guard(lease, conn, action="publish manifest"):
                conn.execute(UPDATE, {"value": "stalled"})
            # A second block of the same lease: one rejection is recorded, not one per block.
            with store.guard(lease, conn, action="publish again"):
                conn.execute(UPDATE, {"value": "stalled again"})
            wait_until_ended(conn)

    with pytest.raises(StaleEpochError) as caught:
        stall_before_commit()
    assert (caught.value.reason, caught.value.epoch, caught.value.lease_name) == (
        "expired",
        lease.epoch,
        NAME,
    )
    assert isinstance(caught.value.__cause__, psycopg.errors.IdleInTransactionSessionTimeout)
    assert "the server ended its transaction" in str(caught.value)
    [run] = store.stale_runs(environment=ENVIRONMENT)
    assert (run.action, run.reason, run.enforced, run.stale_epoch) == (
        "publish manifest",
        "expired",
        True,
        lease.epoch,
    )
    assert store.metrics.get("rejected.expired") == 1
    assert "stale publish manifest rejected: lease release:prod epoch 1" in caplog.text
    assert committed_values(protected) == ["initial"]
    # The ended connection left the pool; the others work, and the lease is free to take.
    touch_every_pooled_connection(protected)
    assert store.acquire(NAME, holder="release-42", ttl=60).acquired


@pytest.mark.parametrize("after", ["lease held", "lease expired", "savepoint rolled back"], ids=str)
def test_a_transaction_ended_by_its_own_shorter_idle_limit_keeps_the_drivers_error(
    store: LeaseStore, protected: Engine, expire_lease: Expire, after: str
) -> None:
    """The session's own idle limit, shorter than the lease's time left, stays in force: a
    transaction it ends is no stale run, and fails as it would without the guard, also when
    the lease has run out by the time the caller learns it. So does one whose fence check a
    savepoint's rollback undid (with the idle limit it set)."""
    lease = acquire(store, "release-41")

    def stall_before_commit() -> None:
        with protected.begin() as conn:
            if after == "savepoint rolled back":
                expire_soon(protected, NAME, 1500)
                conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = '2s'")
                savepoint = conn.begin_nested()
                with store.guard(lease, conn, action="publish manifest"):
                    conn.execute(UPDATE, {"value": "rolled back"})
                savepoint.rollback()
                conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
            else:
                conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
                with store.guard(lease, conn, action="publish manifest"):
                    conn.execute(UPDATE, {"value": "stalled"})
            wait_until_ended(conn)
            if after != "lease held":
                expire_lease(NAME)

    with pytest.raises(sa.exc.DBAPIError) as caught:
        stall_before_commit()
    assert isinstance(caught.value.orig, psycopg.errors.IdleInTransactionSessionTimeout)
    assert store.stale_runs() == []
    assert committed_values(protected) == ["initial"]
    if after == "lease held":
        assert store.release(lease) == "released"


def test_a_later_check_in_a_transaction_ended_idle_rejects_the_expired_leases_writes(
    store: LeaseStore, protected: Engine
) -> None:
    """The server ended the transaction for idling past the first lease's expiry; the check of
    a second guard block is what finds out: it fails with the first write's rejection."""
    first = acquire(store, "release-41")
    second = store.acquire("release:other", holder="release-41", ttl=300).lease
    assert second is not None
    expire_soon(protected, NAME, 300)

    def stall_between_guards() -> None:
        with protected.begin() as conn:
            with store.guard(first, conn, action="first write"):
                conn.execute(UPDATE, {"value": "first"})
            wait_until_ended(conn)
            with store.guard(second, conn, action="second write"):
                pass

    with pytest.raises(StaleEpochError) as caught:
        stall_between_guards()
    assert (caught.value.lease_name, caught.value.reason) == (NAME, "expired")
    assert [(run.lease_name, run.action) for run in store.stale_runs()] == [(NAME, "first write")]
    assert committed_values(protected) == ["initial"]


@pytest.mark.parametrize("kind", KINDS)
def test_guard_fences_every_transaction_of_a_pooled_connection_also_after_a_reconnect(
    store: LeaseStore, protected: Engine, database_url: str, kind: str
) -> None:
    # One pooled connection, so that every transaction runs on it, and then on the connection
    # that replaces it once it is invalidated (the guard's cursor must follow).
    engine = engine_from_url(database_url, pool_size=1, max_overflow=0)
    lease = acquire(store, "release-41")
    try:
        backends = []
        for value in ("first", "second", "after reconnect"):
            with transaction(engine, kind) as conn:
                with store.guard(lease, conn, action="publish"):
                    conn.execute(UPDATE, {"value": value})
                backends.append(backend_pid(conn))
            assert protected_value(protected) == value
            if value == "second":
                with engine.connect() as conn:
                    conn.invalidate()
        assert backends[0] == backends[1] != backends[2]
        assert store.metrics.get("guard.passed") == 3
        assert store.stale_runs() == []
    finally:
        engine.dispose()


def lose(reason: str, store: LeaseStore, lease: Lease, expire_lease: Expire) -> None:
    """End ``lease`` the way ``reason`` says: it expired, a successor took it, an operator
    paused it, or its holder released it."""
    if reason in ("expired", "superseded"):
        expire_lease(lease.name)
    if reason == "superseded":
        acquire(store, "release-42")
    elif reason == "paused":
        store.pause(lease.name, reason="investigating", by="ops")
    elif reason == "released":
        store.release(lease)


def write_update_and_insert(
    store: LeaseStore, lease: Lease, within: AbstractContextManager[Executor], ran: list[str]
) -> None:
    """An UPDATE and an INSERT under the guard, in the transaction ``within`` opens."""
    with within as conn, store.guard(lease, conn, action="publish manifest"):
        conn.execute(UPDATE, {"value": "stale"})
        ran.append("update")
        conn.execute(sa.text("INSERT INTO protected VALUES (2, 'stale')"))
        ran.append("insert")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reason", ["expired", "paused", "released", "superseded"])
def test_guard_rejects_a_lost_lease_and_records_it(
    store: LeaseStore, protected: Engine, kind: str, reason: str, expire_lease: Expire
) -> None:
    lease = acquire(store, "release-41")
    lose(reason, store, lease, expire_lease)
    current = store.owner(NAME)
    assert current is not None
    ran: list[str] = []
    with pytest.raises(StaleEpochError) as caught:
        write_update_and_insert(store, lease, transaction(protected, kind), ran)
    assert ran == ["update", "insert"]
    assert (caught.value.reason, caught.value.epoch, caught.value.lease_name) == (
        reason,
        lease.epoch,
        NAME,
    )
    assert caught.value.owner is not None
    assert (caught.value.owner.epoch, caught.value.owner.holder) == (current.epoch, current.holder)
    # No trace in the caller's tables; the record survives the rollback.
    assert protected_value(protected) == "initial"
    assert committed_values(protected) == ["initial"]
    [run] = store.stale_runs(environment=ENVIRONMENT)
    assert (run.lease_name, run.action, run.reason, run.enforced) == (
        NAME,
        "publish manifest",
        reason,
        True,
    )
    assert (run.stale_epoch, run.stale_holder) == (lease.epoch, "release-41")
    assert (run.current_epoch, run.current_holder) == (current.epoch, current.holder)


def test_shadow_mode_commits_and_records_what_would_be_rejected(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    lease = acquire(store, "release-41")
    with protected.begin() as conn, store.guard(lease, conn, action="publish", enforce=True):
        conn.execute(UPDATE, {"value": "held"})
    lose("superseded", store, lease, expire_lease)
    with protected.begin() as conn, store.guard(lease, conn, action="publish", enforce=False):
        conn.execute(UPDATE, {"value": "shadow"})
    assert committed_values(protected) == ["initial", "held", "shadow"]
    [run] = store.stale_runs(environment=ENVIRONMENT)
    assert (run.reason, run.action, run.enforced, run.current_holder) == (
        "superseded",
        "publish",
        False,
        "release-42",
    )


@pytest.mark.parametrize("enforce", [True, False])
def test_a_lease_past_its_local_deadline_is_rejected_before_the_body(
    fake_store: LeaseStore, protected: Engine, enforce: bool
) -> None:
    with freeze_time("2030-01-01T00:00:00+00:00") as frozen:
        lease = acquire(fake_store, "release-41", ttl=10)
        # 9.5 s of 10: the database still holds the lease for us, but the holder keeps a safety
        # margin of 10 % and no longer trusts it.
        frozen.tick(9.5)
        owner = fake_store.owner(NAME)
        assert owner is not None
        assert owner.state == "held"
        assert not lease.trusted
        body_ran = False
        with protected.begin() as conn:
            if enforce:
                with (
                    pytest.raises(StaleEpochError) as caught,
                    fake_store.guard(lease, conn, action="publish"),
                ):
                    body_ran = True
                assert caught.value.reason == "expired"
                assert caught.value.owner == owner
            else:
                with fake_store.guard(lease, conn, action="publish", enforce=False):
                    body_ran = True
                    conn.execute(UPDATE, {"value": "shadow"})
    assert body_ran is not enforce
    assert protected_value(protected) == ("initial" if enforce else "shadow")
    [run] = fake_store.stale_runs()
    assert (run.reason, run.action, run.enforced, run.current_epoch) == (
        "expired",
        "publish",
        enforce,
        lease.epoch,
    )


@pytest.mark.parametrize("reason", ["expired", "superseded"])
def test_shadow_mode_records_a_write_past_its_deadline_once_with_the_database_reason(
    fake_store: LeaseStore, protected: Engine, reason: str
) -> None:
    with freeze_time("2030-01-01T00:00:00+00:00") as frozen:
        lease = acquire(fake_store, "release-41", ttl=10)
        frozen.tick(11)  # past the holder's deadline and, by the database clock, expired
        if reason == "superseded":
            acquire(fake_store, "release-42")
        with (
            protected.begin() as conn,
            fake_store.guard(lease, conn, action="publish", enforce=False),
        ):
            conn.execute(UPDATE, {"value": "shadow"})
    assert protected_value(protected) == "shadow"
    assert [(r.reason, r.action, r.enforced) for r in fake_store.stale_runs()] == [
        (reason, "publish", False)
    ]
    rejected = {k: n for k, n in fake_store.metrics.snapshot().items() if k.startswith("rejected")}
    assert rejected == {f"rejected.{reason}": 1}


# -- pitfall 2: a fenced write that waits on a row lock while its lease passes on ---------------


def backend_pid(conn: Executor) -> int:
    return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def wait_until_blocked(engine: Engine, pid: int) -> list[int]:
    """Wait until backend ``pid`` waits for a lock; return the backends blocking it."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            blockers = conn.execute(
                sa.text("SELECT pg_blocking_pids(:pid)"), {"pid": pid}
            ).scalar_one()
        if blockers:
            return list(blockers)
        time.sleep(0.002)
    raise AssertionError(f"backend {pid} never waited for a lock")


def blocked_write(
    pool: ThreadPoolExecutor,
    engine: Engine,
    write: Callable[[Executor], None],
) -> tuple[Future[None], int]:
    """Start ``write`` in a transaction of its own; return once it waits for a row lock."""
    pid_ready: Future[int] = Future()

    def run() -> None:
        with engine.begin() as conn:
            pid_ready.set_result(backend_pid(conn))
            write(conn)

    done = pool.submit(run)
    pid = pid_ready.result(timeout=WAIT)
    wait_until_blocked(engine, pid)
    return done, pid


def guarded(store: LeaseStore, lease: Lease, value: str) -> Callable[[Executor], None]:
    def write(conn: Executor) -> None:
        with store.guard(lease, conn, action=f"write {value}"):
            conn.execute(UPDATE, {"value": value})

    return write


@contextmanager
def third_party_lock(engine: Engine) -> Iterator[None]:
    """Another session holds the protected row locked until the block ends."""
    with engine.begin() as conn:
        conn.exec_driver_sql("SELECT 1 FROM protected WHERE id = 1 FOR UPDATE")
        yield


def test_a_rejection_is_recorded_also_for_a_lease_whose_environment_the_library_refuses(
    store: LeaseStore, protected: Engine
) -> None:
    """A lease read from a row a SQL client wrote may carry an environment the library would not
    accept (empty here): its rejection is still raised and recorded, under the row's own."""
    lease = dataclasses.replace(acquire(store, "H"), environment="", deadline=0.0)
    with (
        protected.begin() as conn,
        pytest.raises(StaleEpochError) as caught,
        store.guard(lease, conn, action="write H"),
    ):
        conn.execute(UPDATE, {"value": "H"})
    assert caught.value.reason == "expired"
    assert protected_value(protected) == "initial"
    [run] = store.stale_runs()
    assert (run.environment, run.reason, run.stale_holder) == (ENVIRONMENT, "expired", "H")


def test_a_rejection_that_cannot_be_recorded_in_lock_timeout_is_still_raised_and_logged(
    engine: Engine, protected: Engine, expire_lease: Expire, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock on the stale-run table (a VACUUM FULL, a migration) keeps the record out: the
    rejection waits for it no longer than the lock timeout, and is raised, logged and counted."""
    store = LeaseStore(engine, lock_timeout=0.5)
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)
    outcome: list[BaseException] = []

    def write() -> None:
        try:
            with protected.begin() as conn, store.guard(lease, conn, action="publish"):
                conn.execute(UPDATE, {"value": "stale"})
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    with engine.connect() as locker:
        locker.exec_driver_sql("LOCK TABLE celery_fence.stale_runs IN ACCESS EXCLUSIVE MODE")
        writer = threading.Thread(target=write)
        with caplog.at_level(logging.ERROR, "celery_fence.stale"):
            writer.start()
            writer.join(WAIT)
        assert not writer.is_alive(), "the rejection waited for the stale-run table's lock"
        locker.rollback()
    [error] = outcome
    assert isinstance(error, StaleEpochError)
    assert error.reason == "superseded"
    assert "not recorded" in caplog.text
    assert store.metrics.get("rejected.superseded") == 1
    assert committed_values(protected) == ["initial"]
    store.dispose()


def test_a_write_waiting_on_a_row_lock_never_commits_after_the_successor_epoch(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    rounds = 20
    with ThreadPoolExecutor(max_workers=2) as pool:
        for round_number in range(rounds):
            stale = acquire(store, f"H-{round_number}")
            with third_party_lock(protected):
                h_done, _ = blocked_write(
                    pool, protected, guarded(store, stale, f"H-{round_number}")
                )
                # H waits for the row, not for the lease: the lease expires and S takes it at once.
                expire_lease(NAME)
                started = time.monotonic()
                got = store.acquire(
                    NAME, holder=f"S-{round_number}", ttl=300, environment=ENVIRONMENT
                )
                assert got.outcome == "acquired"
                assert time.monotonic() - started < store.lock_timeout
                successor = got.lease
                assert successor is not None
                assert successor.epoch == stale.epoch + 1
                s_done, _ = blocked_write(
                    pool, protected, guarded(store, successor, f"S-{round_number}")
                )
            # The third party commits: H gets the row first, then its fence finds epoch + 1.
            with pytest.raises(StaleEpochError) as caught:
                h_done.result(timeout=WAIT)
            assert caught.value.reason == "superseded"
            assert caught.value.owner is not None
            assert caught.value.owner.epoch == successor.epoch
            s_done.result(timeout=WAIT)
            assert protected_value(protected) == f"S-{round_number}"
            store.release(successor)
    assert committed_values(protected) == ["initial"] + [f"S-{n}" for n in range(rounds)]
    runs = store.stale_runs(limit=rounds)
    assert [(run.stale_holder, run.current_holder, run.reason) for run in runs] == [
        (f"H-{n}", f"S-{n}", "superseded") for n in reversed(range(rounds))
    ]


def test_the_same_timeline_defeats_a_check_without_a_row_lock(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    """Why the guard locks the lease row: an ``EXISTS`` check in the UPDATE itself, from the
    statement's snapshot, lets the stale write commit after the successor's epoch exists."""
    stale = acquire(store, "H")

    def unsafe(conn: Executor) -> None:
        conn.execute(
            sa.text(
                "UPDATE protected SET value = 'H' WHERE id = 1 AND EXISTS ("
                " SELECT 1 FROM celery_fence.leases WHERE name = :name AND epoch = :epoch"
                " AND token = :token AND expires_at > clock_timestamp())"
            ),
            {"name": NAME, "epoch": stale.epoch, "token": stale.token},
        )

    with ThreadPoolExecutor(max_workers=1) as pool:
        with third_party_lock(protected):
            h_done, _ = blocked_write(pool, protected, unsafe)
            expire_lease(NAME)
            assert store.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT).acquired
        h_done.result(timeout=WAIT)
    assert committed_values(protected) == ["initial", "H"]


@pytest.mark.parametrize("successor_commits", [True, False], ids=["committed", "rolled-back"])
def test_a_fence_waiting_behind_an_acquisition_judges_what_it_left(
    store: LeaseStore, protected: Engine, expire_lease: Expire, successor_commits: bool
) -> None:
    """H's fence waits for the lease row itself, held by S's acquisition in flight: it is judged
    on the row as S's transaction leaves it, not on the version H's statement first saw."""
    stale = acquire(store, "H")
    expire_lease(NAME)
    with ThreadPoolExecutor(max_workers=1) as pool, protected.connect() as s_conn:
        s_transaction = s_conn.begin()
        s_conn.exec_driver_sql(
            "SELECT * FROM celery_fence.acquire('release:prod', 'prod', 'S', interval '300 s')"
        )
        h_done, _ = blocked_write(pool, protected, guarded(store, stale, "H"))
        if successor_commits:
            s_transaction.commit()
        else:
            s_transaction.rollback()
        with pytest.raises(StaleEpochError) as caught:
            h_done.result(timeout=WAIT)
    assert caught.value.reason == ("superseded" if successor_commits else "expired")
    assert committed_values(protected) == ["initial"]
    [run] = store.stale_runs()
    assert (run.stale_holder, run.reason) == ("H", caught.value.reason)


def test_a_fence_reads_the_clock_after_waiting_for_the_lease_row(
    store: LeaseStore, protected: Engine
) -> None:
    """Another session locks the lease row, changes nothing, and lets go only once the lease has
    expired: the fence waiting behind it must judge expiry by the clock read after the wait.
    Only the database's own clock can move during a lock wait, so this test gives the lease a
    one-second TTL and waits for the database to say it has passed."""
    stale = acquire(store, "H", ttl=1)
    with ThreadPoolExecutor(max_workers=1) as pool, protected.connect() as blocker:
        transaction = blocker.begin()
        blocker.execute(
            sa.text("SELECT 1 FROM celery_fence.leases WHERE name = :n FOR NO KEY UPDATE"),
            {"n": NAME},
        )
        h_done, _ = blocked_write(pool, protected, guarded(store, stale, "H"))
        expired = sa.text(
            "SELECT expires_at <= clock_timestamp() FROM celery_fence.leases WHERE name = :n"
        )
        deadline = time.monotonic() + WAIT
        while not blocker.execute(expired, {"n": NAME}).scalar_one():
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.02)
        transaction.rollback()
        with pytest.raises(StaleEpochError) as caught:
            h_done.result(timeout=WAIT)
    assert caught.value.reason == "expired"
    assert committed_values(protected) == ["initial"]
    assert [run.reason for run in store.stale_runs()] == ["expired"]


SNAPSHOTS = ["REPEATABLE READ", "SERIALIZABLE"]


def write_meanwhile(
    store: LeaseStore,
    lease: Lease,
    conn: sa.Connection,
    meanwhile: Callable[[], object],
    *,
    enforce: bool = True,
) -> None:
    """A guarded write in a transaction of its own on ``conn``: the write takes the snapshot,
    then ``meanwhile`` happens elsewhere, then the fence check runs."""
    with conn.begin(), store.guard(lease, conn, action="write H", enforce=enforce):
        conn.execute(UPDATE, {"value": "H"})
        meanwhile()


@pytest.mark.parametrize("isolation", SNAPSHOTS)
def test_a_stale_write_under_snapshot_isolation_is_rejected_and_recorded(
    store: LeaseStore, protected: Engine, expire_lease: Expire, isolation: str
) -> None:
    """The successor's epoch came after the transaction's snapshot: locking the lease row fails
    with a serialization error, which the guard judges afresh as the stale run it is."""
    stale = acquire(store, "H")

    def successor() -> None:
        expire_lease(NAME)
        assert store.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT).acquired

    with protected.connect() as conn, pytest.raises(StaleEpochError) as caught:
        write_meanwhile(store, stale, conn.execution_options(isolation_level=isolation), successor)
    assert caught.value.reason == "superseded"
    assert caught.value.owner is not None
    assert caught.value.owner.holder == "S"
    assert committed_values(protected) == ["initial"]
    assert [(run.stale_holder, run.reason) for run in store.stale_runs()] == [("H", "superseded")]


@pytest.mark.parametrize("isolation", SNAPSHOTS)
def test_a_renewal_after_the_snapshot_asks_for_a_retry_not_a_rejection(
    store: LeaseStore, protected: Engine, isolation: str
) -> None:
    leases = [acquire(store, "H")]
    with protected.connect() as conn:
        conn.execution_options(isolation_level=isolation)
        with pytest.raises(FenceDatabaseError, match="still held: retry the transaction"):
            write_meanwhile(store, leases[0], conn, lambda: leases.append(store.renew(leases[0])))
        # The retry, with no renewal in between, commits.
        write_meanwhile(store, leases[-1], conn, lambda: None)
    assert committed_values(protected) == ["initial", "H"]
    assert store.stale_runs() == []


@pytest.mark.parametrize("isolation", SNAPSHOTS)
@pytest.mark.parametrize("enforce", [True, False], ids=["enforce", "shadow"])
def test_a_lease_first_acquired_after_the_snapshot_asks_for_a_retry_not_a_rejection(
    store: LeaseStore, protected: Engine, isolation: str, enforce: bool
) -> None:
    """The transaction's snapshot predates the lease row: the check finds no lease, and the
    guard, judging afresh, finds it held. A retry sees it."""

    def write(conn: sa.Connection, lease: Lease, value: str) -> None:
        with store.guard(lease, conn, action=f"write {value}", enforce=enforce):
            conn.execute(UPDATE, {"value": value})

    taken: list[Lease] = []

    def first(conn: sa.Connection) -> None:
        with conn.begin():
            conn.execute(UPDATE, {"value": "snapshot"})
            taken.append(acquire(store, "H"))
            write(conn, taken[0], "H")

    with protected.connect() as conn:
        conn.execution_options(isolation_level=isolation)
        if enforce:
            with pytest.raises(FenceDatabaseError, match="still held: retry the transaction"):
                first(conn)
            # The retry sees the lease.
            with conn.begin():
                conn.execute(UPDATE, {"value": "snapshot"})
                write(conn, taken[0], "H")
        else:
            first(conn)
    assert committed_values(protected) == ["initial", "snapshot", "H"]
    assert store.stale_runs() == []


@pytest.mark.parametrize("isolation", SNAPSHOTS)
@pytest.mark.parametrize("change", ["renewed", "superseded"])
def test_shadow_mode_under_snapshot_isolation_commits_and_records_once(
    store: LeaseStore, protected: Engine, expire_lease: Expire, isolation: str, change: str
) -> None:
    """The lease row changed after the snapshot, so the shadow check cannot lock it: the write
    still commits, and a successor's epoch is recorded once, as shadow mode promises."""
    lease = acquire(store, "H")

    def meanwhile() -> None:
        if change == "renewed":
            store.renew(lease)
        else:
            expire_lease(NAME)
            assert store.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT).acquired

    with protected.connect() as conn:
        conn.execution_options(isolation_level=isolation)
        write_meanwhile(store, lease, conn, meanwhile, enforce=False)
        # The transaction was left usable: the next one on the connection commits too.
        with conn.begin():
            conn.execute(sa.text("INSERT INTO protected VALUES (2, 'after')"))
    assert committed_values(protected) == ["initial", "H", "after"]
    runs = [(r.stale_holder, r.reason, r.enforced) for r in store.stale_runs()]
    assert runs == ([] if change == "renewed" else [("H", "superseded", False)])
    assert store.metrics.get("rejected.superseded") == (0 if change == "renewed" else 1)


def test_a_rejection_caught_inside_the_transaction_still_rolls_it_back(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    """The fence aborts the transaction in the server: a caller that swallows StaleEpochError
    and commits anyway commits nothing."""
    stale = acquire(store, "H")
    expire_lease(NAME)
    # pytest.raises swallows the error inside the transaction, which then commits.
    with (
        protected.begin() as conn,
        pytest.raises(StaleEpochError) as caught,
        store.guard(stale, conn, action="write H"),
    ):
        conn.execute(UPDATE, {"value": "H"})
    assert caught.value.reason == "expired"
    assert committed_values(protected) == ["initial"]
    assert [run.reason for run in store.stale_runs()] == ["expired"]


class FencedHolder:
    """H: a guarded write that has passed its fence check (the lease row is locked FOR SHARE)
    and keeps its transaction open until told to commit."""

    def __init__(self, pool: ThreadPoolExecutor, store: LeaseStore, lease: Lease) -> None:
        self.fenced = threading.Event()
        self.commit = threading.Event()
        self.pid: Future[int] = Future()
        self.done = pool.submit(self._run, store, lease)
        assert self.fenced.wait(WAIT)

    def _run(self, store: LeaseStore, lease: Lease) -> None:
        with store.engine.begin() as conn:
            self.pid.set_result(backend_pid(conn))
            guarded(store, lease, "H")(conn)
            self.fenced.set()
            assert self.commit.wait(WAIT)


@contextmanager
def fenced_writer(
    store: LeaseStore, lease: Lease, *, workers: int = 1
) -> Iterator[tuple[FencedHolder, ThreadPoolExecutor]]:
    """H holding its checked write open on a pool of ``workers`` threads (the others are the
    block's to use); H commits when the block ends."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        holder = FencedHolder(pool, store, lease)
        try:
            yield holder, pool
        finally:
            holder.commit.set()
            holder.done.result(timeout=WAIT)


def test_an_acquisition_behind_a_renewal_records_the_expiry_the_renewal_gave(
    store: LeaseStore, protected: Engine
) -> None:
    """A renewal that commits between an acquisition's look at the lease and its take-over (the
    lease expired all the same, by the acquirer's clock): the acquisition takes over the renewed
    version, and the history row of the epoch it ends says where the renewal put its expiry, not
    where the look saw it."""
    lease = acquire(store, "H", ttl=10)
    renew = sa.text(
        "SELECT outcome, expires_at FROM celery_fence.renew("
        "    :name, :epoch, :token, interval '5 seconds', 'H', true, :now)"
    )
    successor = LeaseStore(store.engine, clock=lambda: lease.expires_at + timedelta(seconds=10))
    with successor.protocol_connection() as connection:
        successor_pid = connection.info.backend_pid
    try:
        with ThreadPoolExecutor(max_workers=1) as pool, protected.connect() as holder:
            transaction = holder.begin()
            renewed = holder.execute(
                renew,
                {
                    "name": NAME,
                    "epoch": lease.epoch,
                    "token": lease.token,
                    "now": lease.expires_at - timedelta(seconds=1),
                },
            ).one()
            assert renewed.outcome == "renewed"
            assert renewed.expires_at == lease.expires_at + timedelta(seconds=4)
            done = pool.submit(
                successor.acquire, NAME, holder="S", ttl=300, environment=ENVIRONMENT
            )
            assert wait_until_blocked(protected, successor_pid) == [backend_pid(holder)]
            transaction.commit()
            got = done.result(timeout=WAIT)
    finally:
        successor.dispose()
    assert got.lease is not None
    assert got.lease.epoch == lease.epoch + 1
    (ended,) = [entry for entry in store.history(NAME) if entry.epoch == lease.epoch]
    assert (ended.end_reason, ended.ended_at) == ("expired", renewed.expires_at)


def late_store(engine: Engine, lock_timeout: float) -> LeaseStore:
    """A store whose clock reads past the lease's expiry: for it, the lease is free to take."""
    return LeaseStore(
        engine,
        clock=lambda: datetime.now(timezone.utc) + timedelta(seconds=600),
        lock_timeout=lock_timeout,
    )


# How a writer holds the lease row: as celery_fence.fence does (the writers' key shared, then the
# row), or with the row lock alone, as SQL of a client's own may.
FENCED_LOCK = (
    "SELECT pg_advisory_xact_lock_shared(celery_fence.writers_key(:n)), l.name "
    "FROM celery_fence.leases l WHERE l.name = :n FOR SHARE"
)
ROW_LOCK = "SELECT 1 FROM celery_fence.leases WHERE name = :n FOR SHARE"


@pytest.mark.parametrize(
    ("call", "lock"),
    [
        ("acquire", FENCED_LOCK),
        ("renew", FENCED_LOCK),
        ("release", FENCED_LOCK),
        ("renew", ROW_LOCK),
    ],
    ids=["acquire", "renew", "release", "renew-behind-a-row-lock-alone"],
)
def test_a_call_behind_a_fenced_writer_reads_the_clock_once_its_wait_is_over(
    store: LeaseStore, protected: Engine, expire_lease: Expire, call: str, lock: str
) -> None:
    """An acquisition, renewal or release that waits behind a fenced writer (the writers' key
    shared, then the row FOR SHARE, as celery_fence.fence takes them) decides, and stamps its
    times, by the clock read once the wait is over: an UPDATE that read it before the wait would
    judge again only if the writer changed the row, which a fenced writer does not. So what it
    stamps is never earlier than the writer's end. A renewal locks the row itself, so that it
    never extends a lease past a wait behind a row lock taken without the key either."""
    lease = acquire(store, "H")
    if call == "acquire":
        expire_lease(NAME)
    caller = store.dedicated()
    with caller.protocol_connection() as connection:
        caller_pid = connection.info.backend_pid
    calls: dict[str, Callable[[], object]] = {
        "acquire": lambda: caller.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT),
        "renew": lambda: caller.renew(lease),
        "release": lambda: caller.release(lease),
    }
    try:
        with ThreadPoolExecutor(max_workers=1) as pool, protected.connect() as writer:
            transaction = writer.begin()
            writer.execute(sa.text(lock), {"n": NAME})
            done = pool.submit(calls[call])
            assert wait_until_blocked(protected, caller_pid) == [backend_pid(writer)]
            writer_ended = writer.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
            transaction.commit()
            done.result(timeout=WAIT)
    finally:
        caller.dispose()
    owner = store.owner(NAME)
    assert owner is not None
    stamped = {
        "acquire": owner.acquired_at,
        "renew": owner.renewed_at,
        "release": owner.released_at,
    }[call]
    assert stamped is not None
    assert stamped >= writer_ended
    assert owner.epoch == lease.epoch + (call == "acquire")
    assert owner.state == ("released" if call == "release" else "held")
    assert store.stale_runs() == []


def test_an_acquirer_behind_a_fenced_writer_answers_busy(
    store: LeaseStore, protected: Engine
) -> None:
    stale = acquire(store, "H")
    late = late_store(protected, lock_timeout=0.2)
    with fenced_writer(store, stale):
        started = time.monotonic()
        got = late.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT)
        waited = time.monotonic() - started
    assert (got.outcome, got.lease) == ("busy", None)
    assert got.owner is not None
    assert (got.owner.holder, got.owner.epoch) == ("H", stale.epoch)
    assert 0.2 <= waited < 2
    assert late.metrics.get("acquire.busy") == 1
    # The busy attempt changed nothing; H's write committed under its epoch.
    assert committed_values(protected) == ["initial", "H"]
    assert [entry.epoch for entry in store.history(NAME)] == [stale.epoch]
    assert late.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT).acquired


def test_an_acquirer_behind_a_lock_on_the_lease_table_answers_busy_without_an_owner(
    store: LeaseStore, engine: Engine
) -> None:
    """A lock on the whole table (VACUUM FULL, a migration) keeps the owner from being read
    too: the busy answer comes within the lock timeout all the same, naming no owner."""
    acquire(store, "H")
    late = late_store(engine, lock_timeout=0.2)
    late.owner(NAME)  # its connection opened, before the lock
    with ThreadPoolExecutor(1) as pool, engine.begin() as maintenance:
        maintenance.exec_driver_sql("LOCK TABLE celery_fence.leases IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        answer = pool.submit(late.acquire, NAME, holder="S", ttl=300, environment=ENVIRONMENT)
        try:
            got = answer.result(timeout=WAIT)
        finally:
            maintenance.rollback()  # lets a call still waiting go
    assert (got.outcome, got.lease, got.owner) == ("busy", None, None)
    assert time.monotonic() - started < 2
    assert late.metrics.get("acquire.busy") == 1


@pytest.mark.parametrize(("call", "done"), [("renew", "renewed"), ("release", "released")])
def test_a_renewal_or_release_behind_a_fenced_writer_gives_up_after_lock_timeout(
    store: LeaseStore, protected: Engine, call: str, done: str
) -> None:
    """It fails changing nothing, and may be tried again once the writer committed."""
    held = acquire(store, "H")
    other = LeaseStore(protected, lock_timeout=0.2)
    calls: dict[str, Callable[[], object]] = {
        "renew": lambda: other.renew(held),
        "release": lambda: other.release(held),
    }
    try:
        with fenced_writer(store, held):
            started = time.monotonic()
            with pytest.raises(
                FenceDatabaseError, match=f"not {done}: .* past lock_timeout"
            ) as raised:
                calls[call]()
            waited = time.monotonic() - started
            kept = store.owner(NAME)
        assert 0.2 <= waited < 2
        assert not isinstance(raised.value, LeaseLostError)
        assert other.metrics.get(f"{call}.busy") == 1
        # Nothing was decided: the lease is as it was, no stale run.
        assert kept is not None
        assert (kept.state, kept.epoch, kept.renewed_at, kept.expires_at) == (
            "held",
            held.epoch,
            held.acquired_at,
            held.expires_at,
        )
        assert store.stale_runs() == []
        calls[call]()
        assert other.metrics.get(f"{call}.{done}") == 1
    finally:
        other.dispose()
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (held.epoch, "released" if call == "release" else "held")
    if call == "renew":
        assert owner.expires_at > held.expires_at


@pytest.mark.parametrize(("call", "done"), [("pause", "paused"), ("resume", "resumed")])
def test_a_pause_or_resume_behind_a_fenced_writer_gives_up_after_lock_timeout(
    store: LeaseStore, protected: Engine, call: str, done: str
) -> None:
    """The kill switch waits for the fenced transactions already open on the lease no longer
    than the store's lock timeout: then it fails changing nothing, and may be tried again."""
    held = acquire(store, "H")
    before = store.owner(NAME)
    other = LeaseStore(protected, lock_timeout=0.2)
    calls: dict[str, Callable[[], Owner]] = {
        "pause": lambda: other.pause(NAME, reason="audit", by="ops"),
        "resume": lambda: other.resume(NAME),
    }
    try:
        with fenced_writer(store, held):
            started = time.monotonic()
            with pytest.raises(
                FenceDatabaseError,
                match=rf"^lease {NAME} not {done}: .* past lock_timeout \(0.2s\); it is unchanged$",
            ):
                calls[call]()
            waited = time.monotonic() - started
            kept = store.owner(NAME)
        assert 0.2 <= waited < 2
        assert other.metrics.get(f"{call}.busy") == 1
        assert kept == before
        after = calls[call]()
    finally:
        other.dispose()
    assert (after.paused, after.paused_by) == ((True, "ops") if call == "pause" else (False, None))


@pytest.mark.parametrize("call", ["renew", "release", "pause"])
def test_overlapping_fenced_writers_keep_a_call_waiting_only_for_those_already_in(
    store: LeaseStore, protected: Engine, call: str
) -> None:
    """Two writers whose fenced transactions overlap with no gap (each holds its checked write
    open for 0.2 s, the second starting 0.1 s after the first) never leave the lease row
    unlocked. A call that must lock it still gets it within its lock timeout: the writers that
    arrive while it waits queue behind it. Left to the row lock alone, it would wait as long as
    the overlap lasted (here until the writers give up, after 8 s)."""
    held = acquire(store, "H")
    other = LeaseStore(protected, lock_timeout=1.0)
    calls: dict[str, Callable[[], object]] = {
        "renew": lambda: other.renew(held),
        "release": lambda: other.release(held),
        "pause": lambda: other.pause(NAME, reason="overlap", by="ops"),
    }
    called = threading.Event()
    commits: list[float] = []

    def write(offset: float) -> None:
        time.sleep(offset)
        give_up = time.monotonic() + 8
        while not called.is_set() and time.monotonic() < give_up:
            try:
                # No write of the caller's own: two writers of one row would take turns on it.
                with protected.begin() as conn:
                    with store.guard(held, conn, action="overlap"):
                        pass
                    conn.exec_driver_sql("SELECT pg_sleep(0.2)")
            except StaleEpochError:
                return  # released or paused: the call went through
            commits.append(time.monotonic())

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            writers = [pool.submit(write, offset) for offset in (0.0, 0.1)]
            deadline = time.monotonic() + WAIT
            while len(commits) < 4:
                assert time.monotonic() < deadline, "the writers did not get going"
                time.sleep(0.01)
            started = time.monotonic()
            calls[call]()
            waited = time.monotonic() - started
            called.set()
            for writer in writers:
                writer.result(timeout=WAIT)
    finally:
        other.dispose()
    # One lock timeout, and one writer's open transaction, at most.
    assert waited < 1.5, f"{call} waited {waited:.2f} s behind the overlapping writers"


def test_a_shadow_check_judging_afresh_does_not_queue_behind_a_call_that_waits_for_it(
    store: LeaseStore, protected: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under REPEATABLE READ, a lease acquired after the snapshot is judged afresh on the
    store's own connection while the caller's transaction holds the lease's writers' key. A
    pause that comes in between waits for that transaction: the judgement must not wait for the
    key behind the pause, a wait that would end only with the pause giving up."""
    judged = store._judged_afresh
    ended: list[str] = []

    def pause() -> None:
        store.pause(NAME, reason="meanwhile", by="ops")
        ended.append("pause")

    def pause_first(params: dict[str, object]) -> str | None:
        threading.Thread(target=pause, daemon=True).start()
        # In autocommit: a transaction reads pg_stat_activity once and sees that snapshot after.
        with protected.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            deadline = time.monotonic() + WAIT
            while not conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                " AND query LIKE '%%celery_fence.pause%%'"
            ).scalar_one():
                assert time.monotonic() < deadline, "the pause did not start waiting"
                time.sleep(0.01)
        return judged(params)

    monkeypatch.setattr(store, "_judged_afresh", pause_first)

    def shadow_write() -> None:
        with protected.connect() as conn:
            conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                conn.execute(UPDATE, {"value": "snapshot"})
                lease = acquire(store, "H")
                with store.guard(lease, conn, action="write H", enforce=False):
                    conn.execute(UPDATE, {"value": "H"})
        ended.append("write")

    # Threads of their own, so that a wait that never ends fails the test instead of hanging it.
    writer = threading.Thread(target=shadow_write, daemon=True)
    writer.start()
    deadline = time.monotonic() + WAIT
    while len(ended) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ended) == ["pause", "write"], f"only {ended} ended within {WAIT:g} s"
    assert committed_values(protected) == ["initial", "snapshot", "H"]
    assert store.stale_runs() == []
    owner = store.owner(NAME)
    assert owner is not None
    assert owner.paused


def timed_resume(other: LeaseStore, held: Lease) -> tuple[str, float]:
    """Take ``held`` up on ``other`` as a continuation published under it does: the outcome,
    and how long it took."""
    started = time.monotonic()
    got = other.rejoin(
        NAME,
        epoch=held.epoch,
        holder=held.holder,
        mode="resume",
        proof=proof(held, "resume"),
        ttl=30,
        action="start child",
    )
    return got.outcome, time.monotonic() - started


def test_a_resume_behind_a_fenced_writer_answers_busy_and_changes_nothing(
    store: LeaseStore, protected: Engine
) -> None:
    held = acquire(store, "H")
    other = LeaseStore(protected, lock_timeout=0.2)

    def sharers() -> int:
        with protected.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT sharers FROM celery_fence.leases WHERE name = :n"), {"n": NAME}
                ).scalar_one()
            )

    try:
        with fenced_writer(store, held):
            outcome, waited = timed_resume(other, held)
        assert outcome == "busy"
        assert 0.2 <= waited < 2
        assert other.metrics.get("rejoin.busy") == 1
        # Nothing was decided: no stale run, no sharer added; once H committed, it joins.
        assert store.stale_runs(environment=ENVIRONMENT) == []
        assert sharers() == 1
        assert timed_resume(other, held)[0] == "joined"
        assert sharers() == 2
    finally:
        other.dispose()


def test_resumes_queued_behind_a_fenced_writer_all_answer_busy_within_their_timeout(
    store: LeaseStore, protected: Engine
) -> None:
    """The first resume takes the lease's key and waits on the row; the others, started later,
    wait for the key. A key's wait and the row's share one lock timeout: the one that gets the
    key when the first gives up has only the rest of its timeout left for the row."""
    held = acquire(store, "H")
    first, *later = [LeaseStore(protected, lock_timeout=1.0, pool_size=1) for _ in range(3)]
    for other in later:
        with other.protocol_connection():  # opened before anything is timed
            pass
    with first.protocol_connection() as connection:
        first_pid = connection.info.backend_pid

    try:
        with fenced_writer(store, held, workers=4) as (holder, pool):
            waiting = pool.submit(timed_resume, first, held)
            assert wait_until_blocked(protected, first_pid) == [holder.pid.result()]
            time.sleep(0.3)  # so that the first gives up well before the later ones would
            answers = [
                future.result(timeout=WAIT)
                for future in [pool.submit(timed_resume, other, held) for other in later]
            ]
            answers.append(waiting.result(timeout=WAIT))
    finally:
        for other in (first, *later):
            other.dispose()
    assert [outcome for outcome, _ in answers] == ["busy"] * 3
    # With a whole timeout for each wait, the one that got the key would answer after about 1.7 s.
    assert max(waited for _, waited in answers) < 1.4, answers
    assert store.stale_runs(environment=ENVIRONMENT) == []


def test_a_waiting_acquisition_behind_a_fenced_writer_answers_when_its_time_is_up(
    store: LeaseStore, protected: Engine
) -> None:
    stale = acquire(store, "H")
    late = late_store(protected, lock_timeout=2)
    try:
        with fenced_writer(store, stale):
            started = time.monotonic()
            got = late.acquire(NAME, holder="S", ttl=300, environment=ENVIRONMENT, wait=0.3)
            waited = time.monotonic() - started
    finally:
        late.dispose()
    # Its lock wait took what was left of the 0.3 s, not the 2 s lock timeout.
    assert got.outcome == "busy"
    assert waited < 1.5


def test_acquirers_queued_behind_a_fenced_writer_all_answer_busy_within_their_timeout(
    store: LeaseStore, protected: Engine
) -> None:
    """The first acquirer waits on the row, the others for the first one's transaction: each
    wait takes from one lock timeout, so the last answer comes after about one, not two."""
    stale = acquire(store, "H")
    late = [late_store(protected, lock_timeout=0.5).dedicated() for _ in range(3)]

    def attempt(index: int) -> tuple[str, float]:
        started = time.monotonic()
        got = late[index].acquire(NAME, holder=f"S{index}", ttl=300, environment=ENVIRONMENT)
        return got.outcome, time.monotonic() - started

    try:
        with fenced_writer(store, stale, workers=4) as (_, pool):
            answers = [
                future.result(timeout=WAIT)
                for future in [pool.submit(attempt, index) for index in range(3)]
            ]
    finally:
        for other in late:
            other.dispose()
    assert [outcome for outcome, _ in answers] == ["busy"] * 3
    assert max(waited for _, waited in answers) < 0.9, answers
    assert committed_values(protected) == ["initial", "H"]


def test_an_acquirer_behind_a_fenced_writer_wins_after_it_commits(
    store: LeaseStore, protected: Engine
) -> None:
    stale = acquire(store, "H")
    late = late_store(protected, lock_timeout=5).dedicated()
    with late.protocol_connection() as connection:
        late_pid = connection.info.backend_pid
    try:
        with fenced_writer(store, stale, workers=2) as (holder, pool):
            got = pool.submit(late.acquire, NAME, holder="S", ttl=300, environment=ENVIRONMENT)
            # S waits for H's transaction, and for nothing else.
            assert wait_until_blocked(protected, late_pid) == [holder.pid.result()]
            assert not got.done()
        successor = got.result(timeout=WAIT)
    finally:
        late.dispose()
    assert successor.outcome == "acquired"
    assert successor.lease is not None
    assert successor.lease.epoch == stale.epoch + 1
    # H's write was ordered before S's epoch: it committed, then S's acquisition did.
    assert committed_values(protected) == ["initial", "H"]
    assert store.stale_runs() == []


# -- what the guard is given -------------------------------------------------------------------


@pytest.mark.parametrize("lost", [False, True], ids=["held", "superseded"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_commit_inside_the_guard_block_is_refused_and_nothing_commits(
    store: LeaseStore, protected: Engine, kind: str, lost: bool, expire_lease: Expire
) -> None:
    """The check runs when the block ends: a commit inside it would commit the writes unchecked,
    a stale run's included. It is refused, nothing stays pending on the pooled connection, and
    the lease is left unlocked."""
    lease = acquire(store, "release-41")
    if lost:
        lose("superseded", store, lease, expire_lease)

    def write_and_commit() -> None:
        with transaction(protected, kind) as conn, store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "committed inside"})
            conn.commit()

    with pytest.raises(ConfigurationError, match="commit refused inside a guard block"):
        write_and_commit()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4
    assert store.stale_runs() == []
    if not lost:
        assert store.release(lease) == "released"  # at once: the lease row is not locked


@contextmanager
def session_guarded(
    store: LeaseStore, engine: Engine, lease: Lease, *, lost: bool
) -> Iterator[Session]:
    """A Session in a guard block, committed after it; the guard's ``StaleEpochError`` is
    expected (and the commit then commits nothing) when the lease is ``lost``."""
    with Session(engine) as session:
        with (
            pytest.raises(StaleEpochError) if lost else nullcontext(),
            store.guard(lease, session, action="publish"),
        ):
            yield session
        session.commit()


@pytest.mark.parametrize("lost", [False, True], ids=["held", "superseded"])
def test_a_sessions_refused_commit_leaves_its_transaction_to_the_check(
    store: LeaseStore, protected: Engine, lost: bool, expire_lease: Expire
) -> None:
    """A Session's commit is refused before anything of it happens: its transaction goes on, and
    the check at the block's end fences it, writes from before the refusal included."""
    lease = acquire(store, "release-41")
    if lost:
        lose("superseded", store, lease, expire_lease)
    with session_guarded(store, protected, lease, lost=lost) as session:
        session.execute(UPDATE, {"value": "before"})
        with pytest.raises(ConfigurationError, match="commit refused"):
            session.commit()
        session.execute(UPDATE, {"value": "after"})
    assert committed_values(protected) == ["initial"] + ([] if lost else ["before", "after"])


def test_a_connection_a_guarded_session_gave_back_commits_for_its_next_user(
    store: LeaseStore, protected: Engine
) -> None:
    """A Session rolled back inside a guard block gives its connection back to the pool, where
    another user takes it: that user's commits are theirs, not the guard's to refuse."""
    lease = acquire(store, "release-41")
    with Session(protected) as session:
        with store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": "rolled back"})
            given_back = backend_pid(session)
            session.rollback()
            with protected.begin() as other:
                assert backend_pid(other) == given_back
                other.execute(UPDATE, {"value": "somebody else's"})
            with pytest.raises(ConfigurationError, match="commit refused"):
                session.commit()  # still the guard's, on whichever connection it holds now
        session.commit()
    assert committed_values(protected) == ["initial", "somebody else's"]
    assert store.release(lease) == "released"


def test_a_connection_reconnected_inside_the_block_still_has_its_commit_refused(
    store: LeaseStore, protected: Engine, admin_engine: Engine
) -> None:
    lease = acquire(store, "release-41")

    def reconnect_write_and_commit(conn: sa.Connection) -> None:
        with store.guard(lease, conn, action="publish"):
            with admin_engine.connect() as admin:
                admin.execute(
                    sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": backend_pid(conn)}
                )
            with pytest.raises(sa.exc.OperationalError):
                conn.execute(UPDATE, {"value": "lost"})
            conn.rollback()
            conn.execute(UPDATE, {"value": "on the new connection"})
            conn.commit()

    with protected.connect() as conn, pytest.raises(ConfigurationError, match="commit refused"):
        reconnect_write_and_commit(conn)
    assert committed_values(protected) == ["initial"]


def test_a_two_phase_prepare_inside_the_block_is_refused(
    store: LeaseStore, protected: Engine
) -> None:
    lease = acquire(store, "release-41")

    def write_and_prepare(conn: sa.Connection) -> None:
        prepared = conn.begin_twophase()
        with store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "prepared inside"})
            prepared.prepare()

    with protected.connect() as conn, pytest.raises(ConfigurationError, match="commit refused"):
        write_and_prepare(conn)
    assert committed_values(protected) == ["initial"]
    assert store.release(lease) == "released"


@pytest.mark.parametrize(
    "statement",
    [
        "COMMIT",
        "  /* done */ commit and chain",
        "-- done\nEND",
        "ROLLBACK",
        "ABORT",
        "SAVEPOINT mine",
        "RELEASE SAVEPOINT mine",
        "ROLLBACK TO SAVEPOINT mine",
        "PREPARE TRANSACTION 'mine'",
        "/* a /* nested */ comment */ COMMIT",
        "PREPARE /* two words */ TRANSACTION 'mine'",
        "-- a line a carriage return ends\rCOMMIT",
        "PREPARE -- x\r TRANSACTION 'mine'",
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_transaction_control_sent_as_sql_inside_the_block_is_refused_before_it_runs(
    store: LeaseStore, protected: Engine, kind: str, statement: str, expire_lease: Expire
) -> None:
    """SQL that ends or splits the transaction, sent past SQLAlchemy's own commit and
    savepoints, would commit writes unchecked, or put the check where a rollback undoes its
    locks: it never reaches the server, and the block's writes roll back with the error."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)
    words = re.sub(r"/\*.*\*/|--[^\n\r]*", " ", statement).split()
    keyword = " ".join(words[:2] if words[0] == "PREPARE" else words[:1]).upper()

    def write_and_send() -> None:
        with transaction(protected, kind) as conn, store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "stale"})
            conn.execute(sa.text(statement))

    with pytest.raises(ConfigurationError, match=f"^{keyword}.* refused inside a guard block"):
        write_and_send()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4
    assert store.stale_runs() == []


@pytest.mark.parametrize(
    ("statements", "keyword"),
    [
        ("UPDATE protected SET value = 'sent' WHERE id = 2; COMMIT; BEGIN", "COMMIT"),
        ("SELECT ';'; /* ; */ savepoint mine", "SAVEPOINT"),
        (
            "SELECT $$;$$, $x$ ; $$ $x$, E'\\';', '--', \"a;b\" FROM (SELECT 1 AS \"a;b\") AS t;"
            " ROLLBACK; BEGIN",
            "ROLLBACK",
        ),
        ("SELECT 1 -- ; end\r; END; BEGIN", "END"),
        # One E'' string, continued on the next line: its backslashes still escape.
        ("SELECT E'a'\n'\\''; COMMIT; SELECT 'x'", "COMMIT"),
        # PostgreSQL takes every character from U+0080 for an identifier's.
        ("SELECT 1 AS \u20ac$x$; COMMIT; SELECT 1 AS \u20ac$x$", "COMMIT"),
        ("SELECT $\u20ac$'$\u20ac$; COMMIT; SELECT $\u20ac$'$\u20ac$", "COMMIT"),
        # BEGIN opens a function's body only before ATOMIC; END after AS is a name.
        (
            "CREATE FUNCTION pg_temp.begin(begin int) RETURNS int LANGUAGE sql"
            " SET search_path = begin AS 'SELECT 1'; COMMIT",
            "COMMIT",
        ),
        (
            "CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql BEGIN ATOMIC"
            " SELECT CASE WHEN true THEN 1 END AS case; END; COMMIT",
            "COMMIT",
        ),
        (
            "CREATE FUNCTION pg_temp.g() RETURNS int LANGUAGE sql BEGIN ATOMIC"
            " SELECT tt . case FROM (SELECT 1 AS case) AS tt; END; COMMIT; END;",
            "COMMIT",
        ),
        # A body with no END where a statement could end: its statements cannot be told apart.
        (
            "CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; COMMIT",
            "SQL",
        ),
    ],
    ids=[
        "commit then begin",
        "savepoint",
        "after quotes",
        "after a line comment",
        "after a continued E string",
        "after an identifier with a dollar",
        "after a dollar quote with a non-ASCII tag",
        "after a function with begin for names",
        "after a function body with case for a name",
        "after a function body with case for a qualified name",
        "in a function body with no end",
    ],
)
def test_transaction_control_after_another_statement_of_the_same_sql_is_refused(
    store: LeaseStore, protected: Engine, statements: str, keyword: str, expire_lease: Expire
) -> None:
    """Sent in one string (psycopg sends SQL without parameters as one simple query, however
    many statements it holds), a statement after the first that would end or split the
    transaction is refused as the first would be: the writes before it never commit unchecked."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)

    def write_and_send() -> None:
        with protected.begin() as conn, store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "stale"})
            conn.exec_driver_sql(statements)

    with pytest.raises(ConfigurationError, match=f"^{keyword} refused inside a guard block"):
        write_and_send()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4
    assert store.stale_runs() == []


@pytest.mark.parametrize("setting", ["on", "off"])
def test_backslashes_are_read_as_the_sessions_strings_take_them(
    store: LeaseStore, protected: Engine, setting: str, expire_lease: Expire
) -> None:
    """With ``standard_conforming_strings`` off, a backslash escapes in every string: the quote
    after it does not close the string, and the COMMIT after the string is a statement."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)
    statements = "SELECT 'a\\'' AS quoted; COMMIT; SELECT 'done'"

    def write_and_send() -> None:
        with protected.begin() as conn, store.guard(lease, conn, action="publish"):
            conn.exec_driver_sql(f"SET LOCAL standard_conforming_strings = {setting}")
            conn.execute(UPDATE, {"value": "stale"})
            conn.exec_driver_sql(statements)

    if setting == "off":
        with pytest.raises(ConfigurationError, match=r"^COMMIT refused inside a guard block"):
            write_and_send()
    else:
        # One statement, a string that is not closed: the server refuses it, nothing commits.
        with pytest.raises(sa.exc.ProgrammingError, match="unterminated quoted string"):
            write_and_send()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4
    assert store.stale_runs() == []


@pytest.mark.parametrize(
    "statement",
    [
        "/* app=billing */ UPDATE protected SET value = CASE WHEN id = 1 THEN 'end' ELSE value"
        " /* keep */ END WHERE id = 1",
        "-- commit the manifest\nUPDATE protected SET value = 'end' WHERE id = 1",
        "/*+ IndexScan(protected) */ UPDATE protected SET value = 'end' WHERE id = 1",
        "PREPARE publish AS UPDATE protected SET value = 'end' WHERE id = 1; EXECUTE publish",
        "UPDATE protected SET value = 'end' WHERE id = 1 AND 'a; commit' <> E'\\'; rollback'",
        "DO $$BEGIN UPDATE protected SET value = 'end' WHERE id = 1; END$$",
        "UPDATE protected SET value = 'end' WHERE id = 1 /* ; commit */; -- ; commit",
        "UPDATE protected SET value = 'end' WHERE id = 1 AND E'a'\n'\\'; commit; --' <> ''",
        "CREATE FUNCTION set_end() RETURNS int LANGUAGE sql BEGIN ATOMIC"
        " UPDATE protected SET value = CASE WHEN id = 1 THEN 'end' ELSE value END; SELECT 1; END;"
        " SELECT set_end()",
        "CREATE FUNCTION pg_temp.g() RETURNS int LANGUAGE sql BEGIN ATOMIC"
        " SELECT tt . end FROM (SELECT 1 AS end) AS tt; END;"
        " UPDATE protected SET value = 'end' WHERE id = 1",
    ],
    ids=[
        "comment then END in a CASE",
        "line comment naming a commit",
        "planner hint",
        "PREPARE",
        "semicolons in strings",
        "END of a DO block",
        "semicolons in comments",
        "semicolons in a continued E string",
        "a function body of SQL statements",
        "a function body with end for a qualified name",
    ],
)
def test_statements_that_only_mention_transaction_words_are_not_refused(
    store: LeaseStore, protected: Engine, statement: str
) -> None:
    lease = acquire(store, "release-41")
    with protected.begin() as conn, store.guard(lease, conn, action="publish"):
        conn.exec_driver_sql(statement)
    assert committed_values(protected) == ["initial", "end"]


def test_a_sessions_statements_are_watched_on_its_new_connection_after_a_rollback(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    """Rolled back inside the block, a Session goes on on another connection: a COMMIT sent
    there is refused all the same, and the stale write never commits."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)

    def write_roll_back_and_commit() -> None:
        with Session(protected) as session, store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": "rolled back"})
            session.rollback()
            session.execute(UPDATE, {"value": "stale"})
            session.execute(sa.text("COMMIT"))

    with pytest.raises(ConfigurationError, match=r"^COMMIT refused inside a guard block"):
        write_roll_back_and_commit()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4


@pytest.mark.parametrize("scoped", [False, True], ids=["Session", "scoped_session"])
def test_a_sessions_later_transactions_are_watched_as_its_first(
    store: LeaseStore, protected: Engine, expire_lease: Expire, scoped: bool
) -> None:
    """One Session, one guard block per transaction: the second block, on the connection the
    Session took after its first commit, refuses a COMMIT as the first did."""
    lease = acquire(store, "release-41")
    session = scoped_session(sessionmaker(protected)) if scoped else Session(protected)

    def write_and_try_to_commit(value: str) -> None:
        with store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": value})
            with pytest.raises(ConfigurationError, match=r"^COMMIT refused"):
                session.execute(sa.text("COMMIT"))

    try:
        for value in ("first", "second"):
            write_and_try_to_commit(value)
            session.commit()
        lose("superseded", store, lease, expire_lease)
        with pytest.raises(StaleEpochError):
            write_and_try_to_commit("stale")
        session.rollback()
    finally:
        session.close()
    assert committed_values(protected) == ["initial", "first", "second"]


def test_a_session_whose_first_block_sat_inside_a_connections_is_watched_in_its_next(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    """A guard on the Session inside one on its connection: once both end and the Session
    commits, its next block, on another connection, is watched as a block of its own."""
    lease = acquire(store, "release-41")
    with Session(protected) as session:
        with (
            store.guard(lease, session.connection(), action="outer"),
            store.guard(lease, session, action="inner"),
        ):
            session.execute(UPDATE, {"value": "first"})
        session.commit()
        lose("superseded", store, lease, expire_lease)

        def write_and_commit_the_connection() -> None:
            with store.guard(lease, session, action="publish"):
                session.execute(UPDATE, {"value": "stale"})
                session.connection().commit()

        with pytest.raises(ConfigurationError, match="commit refused inside a guard block"):
            write_and_commit_the_connection()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial", "first"] + ["first"] * 3


def test_a_commit_of_a_sessions_connection_inside_its_block_is_refused(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)

    def write_and_commit_the_connection() -> None:
        with Session(protected) as session, store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": "stale"})
            session.connection().commit()

    with pytest.raises(ConfigurationError, match="commit refused inside a guard block"):
        write_and_commit_the_connection()
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] * 4


def test_a_session_joined_to_an_outer_transaction_through_a_savepoint_is_fenced(
    store: LeaseStore, protected: Engine
) -> None:
    """A Session in ``join_transaction_mode="create_savepoint"`` (a test fixture's pattern)
    keeps a savepoint of its own on the Connection, and makes a new one when it rolls back:
    that is not a nested transaction the block left open."""
    lease = acquire(store, "release-41")
    with (
        protected.connect() as conn,
        conn.begin(),
        Session(bind=conn, join_transaction_mode="create_savepoint") as session,
    ):
        with store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": "rolled back"})
            session.rollback()
            session.execute(UPDATE, {"value": "kept"})
            with session.begin_nested():
                session.execute(UPDATE, {"value": "in a savepoint"})
            with session.connection().begin_nested():
                session.execute(UPDATE, {"value": "in a savepoint of its connection"})
        session.commit()
    expected = ["initial", "kept", "in a savepoint", "in a savepoint of its connection"]
    assert committed_values(protected) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_a_commit_of_the_dbapi_connection_inside_the_block_is_named_not_taken_for_a_rejection(
    store: LeaseStore, protected: Engine, kind: str, expire_lease: Expire
) -> None:
    """A commit past SQLAlchemy and its events cannot be stopped: the guard says that the
    writes before it were not fenced, rather than claim it rejected them."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)

    def write_and_commit_underneath() -> None:
        with transaction(protected, kind) as conn, store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "committed past the guard"})
            under = conn.connection() if isinstance(conn, Session) else conn
            under.connection.dbapi_connection.commit()

    with pytest.raises(ConfigurationError, match="transaction ended inside the block"):
        write_and_commit_underneath()
    assert committed_values(protected) == ["initial", "committed past the guard"]
    assert store.stale_runs() == []


def test_a_nested_transaction_left_open_by_the_block_is_refused_before_the_check(
    store: LeaseStore, protected: Engine
) -> None:
    """Checked inside a savepoint, the lease row's lock would go with a rollback to it after the
    block, and a successor could take the lease before the rest of the transaction commits."""
    lease = acquire(store, "release-41")

    def write_and_open_a_savepoint(conn: sa.Connection | Session) -> None:
        with store.guard(lease, conn, action="publish"):
            conn.execute(UPDATE, {"value": "before the savepoint"})
            conn.begin_nested()  # a Session's is emitted at its next statement: the check

    with protected.connect() as conn:
        with pytest.raises(ConfigurationError, match="left a nested transaction"):
            write_and_open_a_savepoint(conn)
        conn.rollback()
    with Session(protected) as session:
        with pytest.raises(ConfigurationError, match="left a nested transaction"):
            write_and_open_a_savepoint(session)
        session.rollback()

    opened: list[sa.NestedTransaction] = []

    def open_a_savepoint_of_its_connection(session: Session, *, roll_back: bool) -> None:
        with store.guard(lease, session, action="publish"):
            session.execute(UPDATE, {"value": "before the savepoint"})
            if roll_back:  # a Session's own savepoint comes back with its next statement
                session.rollback()
                session.execute(UPDATE, {"value": "before the savepoint"})
            opened.append(session.connection().begin_nested())

    # A savepoint of the Session's Connection, opened past the Session.
    for joined in (False, True):  # to an outer transaction through a savepoint of its own
        with protected.connect() as conn, conn.begin():
            mode = "create_savepoint" if joined else "rollback_only"
            with Session(bind=conn, join_transaction_mode=mode) as session:
                with pytest.raises(ConfigurationError, match="left a nested transaction"):
                    open_a_savepoint_of_its_connection(session, roll_back=joined)
                opened.pop().rollback()
                session.rollback()
    assert committed_values(protected) == ["initial"]
    assert store.stale_runs() == []
    assert store.release(lease) == "released"  # at once: no check left the row locked


@pytest.mark.parametrize("kind", KINDS)
def test_nested_transactions_closed_in_the_block_or_open_around_it_are_fenced(
    store: LeaseStore, protected: Engine, kind: str, expire_lease: Expire
) -> None:
    lease = acquire(store, "release-41")

    def write_in_savepoints(first: str, second: str) -> None:
        with (
            transaction(protected, kind) as conn,
            conn.begin_nested(),
            store.guard(lease, conn, action="publish"),
        ):
            conn.execute(UPDATE, {"value": first})
            with conn.begin_nested():
                conn.execute(UPDATE, {"value": second})
            inner = conn.begin_nested()
            conn.execute(UPDATE, {"value": "rolled back inside"})
            inner.rollback()

    write_in_savepoints("in a savepoint around the block", "released inside")
    expected = ["initial", "in a savepoint around the block", "released inside"]
    assert committed_values(protected) == expected
    lose("superseded", store, lease, expire_lease)
    with pytest.raises(StaleEpochError):
        write_in_savepoints("stale", "stale too")
    assert protected_value(protected) == "released inside"
    assert [run.reason for run in store.stale_runs()] == ["superseded"]


def test_a_connection_without_a_transaction_is_fenced_in_one_sqlalchemy_begins(
    store: LeaseStore, protected: Engine
) -> None:
    """Before its first statement a Connection has no transaction: the check must not open one
    behind SQLAlchemy's back, which ``commit()`` would not end."""
    lease = acquire(store, "release-41")
    with protected.connect() as conn:
        with store.guard(lease, conn, action="nothing written"):
            pass
        assert conn.in_transaction()
        conn.commit()
        assert conn.connection.dbapi_connection.info.transaction_status == 0  # idle
    assert store.release(lease) == "released"


def touch_every_pooled_connection(engine: Engine) -> None:
    """A write on each of the pool's connections at once: each must be idle, not in a
    transaction left open or aborted, nor holding the lease row."""
    with engine.connect() as a, engine.connect() as b, engine.connect() as c:
        for conn in (a, b, c):
            conn.execute(sa.text("UPDATE protected SET value = value"))
            conn.commit()


@pytest.mark.parametrize("lost", [False, True], ids=["held", "superseded"])
def test_writes_after_a_rollback_inside_the_block_are_fenced(
    store: LeaseStore, protected: Engine, lost: bool, expire_lease: Expire
) -> None:
    """A Session rolled back inside the block writes on another connection afterwards (here
    its first went back to the pool, to somebody else): the check runs where the later writes
    went, not on the connection the Session gave back."""
    lease = acquire(store, "release-41")
    if lost:
        lose("superseded", store, lease, expire_lease)
    with session_guarded(store, protected, lease, lost=lost) as session:
        session.execute(UPDATE, {"value": "rolled back"})
        session.rollback()
        with protected.connect() as other:
            other.exec_driver_sql("SELECT 1")  # the Session's first connection
            session.execute(UPDATE, {"value": "after the rollback"})
            with pytest.raises(ConfigurationError, match="commit refused"):
                session.commit()  # on its new connection: refused all the same
    touch_every_pooled_connection(protected)
    values = committed_values(protected)
    assert values == ["initial"] + ([] if lost else ["after the rollback"]) + [values[-1]] * 3
    if not lost:
        assert store.release(lease) == "released"


def test_a_scoped_session_is_fenced_like_its_session(
    store: LeaseStore, protected: Engine, expire_lease: Expire
) -> None:
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)
    scoped = scoped_session(sessionmaker(protected))
    try:
        with pytest.raises(StaleEpochError), store.guard(lease, scoped, action="publish"):
            scoped.execute(UPDATE, {"value": "stale"})
        scoped.rollback()
        expire_lease(NAME)
        fresh = acquire(store, "release-43")
        with store.guard(fresh, scoped, action="publish"):
            scoped.execute(UPDATE, {"value": "published"})
        scoped.commit()
    finally:
        scoped.remove()
    assert committed_values(protected) == ["initial", "published"]


def test_what_the_guard_cannot_fence_is_refused_before_the_block(
    store: LeaseStore, protected: Engine, tmp_path: Path
) -> None:
    got = store.acquire(NAME, holder="release-41", ttl=300)
    assert got.lease is not None
    ran: list[str] = []

    def body(lease: object, conn: object) -> None:
        with store.guard(lease, conn, action="publish"):  # type: ignore[arg-type]
            ran.append("body")

    with protected.begin() as conn, pytest.raises(ConfigurationError) as caught:
        body(got, conn)
    assert str(caught.value) == (
        "guard needs a Lease (an acquisition's .lease), got celery_fence.models.Acquisition"
    )
    sqlite = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        with sqlite.begin() as conn, pytest.raises(ConfigurationError) as caught:
            body(got.lease, conn)
    finally:
        sqlite.dispose()
    assert "guard needs a connection through psycopg 3" in str(caught.value)
    assert str(caught.value).endswith("got sqlite+pysqlite")
    with protected.connect() as conn, pytest.raises(ConfigurationError) as caught:
        body(got.lease, conn.connection.dbapi_connection)
    assert str(caught.value) == (
        "guard needs a SQLAlchemy Connection or Session, got psycopg.Connection"
    )
    table = sa.Table("protected", sa.MetaData())
    other = sa.create_engine(protected.url)
    try:
        for several in (
            Session(binds={table: protected}),
            # A default bind too: its connection is not the one the table's writes use.
            Session(bind=protected, binds={table: other}),
        ):
            with (
                several,
                pytest.raises(ConfigurationError, match=r"session\.connection\(bind_arguments="),
            ):
                body(got.lease, several)
    finally:
        other.dispose()
    assert ran == []
    # Binds that all name the default bind's engine leave one connection to fence.
    with Session(bind=protected, binds={table: protected}) as one:
        body(got.lease, one)
        one.commit()
    assert ran == ["body"]
    assert store.release(got.lease) == "released"


def test_a_guard_whose_connection_is_lost_during_the_check_raises_the_librarys_error(
    store: LeaseStore, protected: Engine
) -> None:
    """The check runs on the DB-API connection, behind SQLAlchemy's back: when the server ends
    that connection during the check, SQLAlchemy is told, so that its rollback of the caller's
    transaction does not fail in the error's place."""
    lease = acquire(store, "release-41")
    with ThreadPoolExecutor(1) as pool, protected.begin() as locker:
        locker.execute(
            sa.text("SELECT 1 FROM celery_fence.leases WHERE name = :name FOR UPDATE"),
            {"name": NAME},
        )
        done, pid = blocked_write(pool, protected, guarded(store, lease, "lost"))
        locker.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(FenceDatabaseError, match="terminating connection"):
            done.result(timeout=WAIT)
    touch_every_pooled_connection(protected)
    assert committed_values(protected) == ["initial"] + ["initial"] * 3


def cut_off(admin: Engine, database: str, keep: int) -> None:
    """Let no new connection into ``database`` and end every one there but ``keep``'s."""
    with admin.connect() as conn:
        conn.exec_driver_sql(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        others = sa.text(
            "SELECT pid FROM pg_stat_activity WHERE datname = :database AND pid <> :keep"
        )
        for pid in conn.execute(others, {"database": database, "keep": keep}).scalars():
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})


@pytest.mark.parametrize("enforce", [True, False], ids=["enforce", "shadow"])
def test_a_rejection_the_database_cannot_record_is_still_a_rejection(
    store: LeaseStore,
    protected: Engine,
    expire_lease: Expire,
    admin_engine: Engine,
    caplog: pytest.LogCaptureFixture,
    enforce: bool,
) -> None:
    """When the store cannot reach the database to record a rejected write (its connections
    ended, none can be opened), the write is rejected all the same (in shadow mode, let
    through), logged and counted, and the missing record is logged."""
    lease = acquire(store, "release-41")
    lose("superseded", store, lease, expire_lease)
    database = str(protected.url.database)

    def write() -> None:
        with (
            protected.begin() as conn,
            store.guard(lease, conn, action="publish", enforce=enforce),
        ):
            conn.execute(UPDATE, {"value": "written"})
            cut_off(admin_engine, database, keep=backend_pid(conn))

    try:
        if enforce:
            with pytest.raises(StaleEpochError) as caught:
                write()
            assert (caught.value.reason, caught.value.owner) == ("superseded", None)
        else:
            write()
    finally:
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
    assert store.metrics.get("rejected.superseded") == 1
    assert (
        "stale publish of lease release:prod epoch 1 not recorded: database error:" in caplog.text
    )
    assert committed_values(protected) == ["initial"] + ([] if enforce else ["written"])
    assert store.stale_runs() == []
