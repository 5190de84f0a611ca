"""Which lease a run continues, and what bounds a holder that stops or loses its database.

A ``resume`` header counts only for the task's own lease; taking a lease that ended over is a
new epoch, so a stalled earlier delivery of the same work is superseded; runs dispatched by beat
pass no header on, and plain tasks pass on only ``resume`` headers. A fenced write's transaction
may not idle past its lease's expiry, nor run in autocommit; the keeper rides out any error but
a definite "not yours" until the lease's deadline.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from celery import Celery, states
from sqlalchemy.engine import Engine

from celery_fence import (
    Acquisition,
    ConfigurationError,
    FenceDatabaseError,
    Lease,
    LeaseBusyError,
    LeaseLostError,
    LeaseStore,
    StaleEpochError,
)
from celery_fence import keeper as keeper_module
from celery_fence.contrib.celery import HEADER, SKIPPED, Fence, FencedRun, FenceHeader
from celery_fence.keeper import LeaseKeeper
from celery_fence.store import Mode, engine_from_url

if TYPE_CHECKING:
    from conftest import Probe, StartWorker, Wait

NAME = "release:prod"
HOLDER = "release-job@test"
OTHER = "notify:prod"

INSERT = sa.text("INSERT INTO manifest VALUES (:environment, :release)")
IDLE_TIMEOUT = sa.text(
    # The setting in milliseconds, without the unit SHOW would round it to.
    "SELECT setting::int FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
)


def take(store: LeaseStore, name: str = NAME, holder: str = HOLDER, ttl: float = 60) -> Lease:
    got = store.acquire(name, holder=holder, ttl=ttl, environment="default")
    assert got.lease is not None, got
    return got.lease


def continue_under(store: LeaseStore, header: FenceHeader) -> Acquisition:
    """Take up the lease as a task delivered with ``header`` does."""
    return store.rejoin(
        header.lease,
        epoch=header.epoch,
        holder=header.holder,
        mode=header.mode,
        proof=header.proof,
        ttl=60,
        action="start publish",
    )


def received_header(request: Any) -> object | None:
    """The header the task's message brought."""
    return (request.headers or {}).get(HEADER)


@pytest.fixture
def manifest(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE manifest (environment text, release int)")
    return engine


def manifest_rows(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT environment, release FROM manifest ORDER BY release")
        return [(str(environment), int(release)) for environment, release in rows]


# -- which lease a continuation runs under --------------------------------------------------


@pytest.mark.parametrize("other_lease", ["free", "held"])
def test_child_on_another_lease_takes_a_lease_of_its_own(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, app: Celery, other_lease: str
) -> None:
    @fence.task(lease="release:{environment}")
    def parent(environment: str) -> str:
        return str(child.delay(environment).id)

    @fence.task(lease="notify:{environment}", on_busy="skip", bind=True)
    def child(self: Any, environment: str) -> list[Any]:
        run = fence.current()
        assert run.lease is not None
        header = received_header(self.request)
        assert isinstance(header, dict)
        return [header["lease"], run.mode, run.lease.name, run.epoch, run.lease.holder]

    if other_lease == "held":
        take(store, OTHER, holder="notifier@test")
    with worker():
        result = app.AsyncResult(wait.outcome(parent.delay("prod")))
        state = wait.finished(result)

    # The parent's lease saw one run; the child's header did not make it share or take that one.
    [parent_epoch] = store.history(NAME)
    assert (parent_epoch.epoch, parent_epoch.end_reason) == (1, "released")
    assert store.stale_runs() == []
    if other_lease == "free":
        assert state == states.SUCCESS
        header_lease, mode, name, epoch, holder = result.result
        assert (header_lease, mode, name, epoch) == (NAME, "owner", OTHER, 1)
        assert holder.startswith(f"{child.name}[{result.id}]")
        [entry] = store.history(OTHER)
        assert (entry.holder, entry.end_reason) == (holder, "released")
    else:
        # The normal busy policy applies to the child's own lease.
        assert state == SKIPPED
        assert (result.info["lease"], result.info["reason"]) == (OTHER, "held")
        assert result.info["owner_holder"] == "notifier@test"
        assert [entry.holder for entry in store.history(OTHER)] == ["notifier@test"]


@pytest.mark.parametrize("lease_ends", ["released", "expired"])
def test_a_continuation_takes_an_ended_lease_over_and_the_stalled_run_is_superseded(
    store: LeaseStore,
    manifest: Engine,
    expire_lease: Callable[[str], None],
    lease_ends: str,
) -> None:
    """Two deliveries of one message: the first stalls, its lease ends, the second takes the
    lease over. The first can then neither renew nor write, and the same header is spent."""
    first = take(store)
    header = FenceHeader.for_lease(first, "resume")
    if lease_ends == "released":
        store.release(first)
    else:
        expire_lease(NAME)

    got = continue_under(store, header)

    assert got.outcome == "resumed"
    assert got.lease is not None
    second = got.lease
    assert (second.name, second.epoch, second.holder) == (NAME, 2, HOLDER)
    assert second.token != first.token
    history = store.history(NAME)
    assert [(entry.epoch, entry.end_reason) for entry in history] == [(2, None), (1, lease_ends)]

    with pytest.raises(LeaseLostError) as renewal:
        store.renew(first)
    assert (renewal.value.reason, renewal.value.epoch) == ("superseded", 1)
    assert renewal.value.owner is not None
    assert renewal.value.owner.epoch == 2
    with (
        pytest.raises(StaleEpochError) as write,
        manifest.begin() as conn,
        store.guard(first, conn, action="publish manifest"),
    ):
        conn.execute(INSERT, {"environment": "prod", "release": 1})
    assert (write.value.reason, write.value.epoch) == ("superseded", 1)
    with pytest.raises(LeaseLostError) as again:
        continue_under(store, header)
    assert again.value.reason == "superseded"

    with manifest.begin() as conn, store.guard(second, conn, action="publish manifest"):
        conn.execute(INSERT, {"environment": "prod", "release": 2})
    assert manifest_rows(manifest) == [("prod", 2)]
    stale = {(run.action, run.reason, run.stale_epoch) for run in store.stale_runs()}
    assert stale == {
        ("renew", "superseded", 1),
        ("publish manifest", "superseded", 1),
        ("start publish", "superseded", 1),
    }


def test_a_continuation_while_held_joins_and_the_last_sharer_releases(store: LeaseStore) -> None:
    first = take(store)

    got = continue_under(store, FenceHeader.for_lease(first, "resume"))

    assert got.outcome == "joined"
    assert got.lease is not None
    assert (got.lease.epoch, got.lease.token) == (first.epoch, first.token)
    store.release(first)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "held")
    store.release(got.lease)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (1, "released")
    [entry] = store.history(NAME)
    assert entry.end_reason == "released"


def test_a_continuation_kept_waiting_by_a_fenced_writer_gets_the_busy_policy(
    app: Celery,
    fence: Fence,
    probe: Callable[..., Probe],
    worker: StartWorker,
    store: LeaseStore,
    engine: Engine,
    wait: Wait,
    failures: dict[str, BaseException],
) -> None:
    app.conf.fence_lock_timeout = 0.2
    publish = probe(on_busy="skip")

    @fence.task(lease="release:{environment}", on_busy="raise")
    def publish_or_fail(environment: str) -> None:
        raise AssertionError("the body of a refused run ran")

    held = take(store)
    header = FenceHeader.for_lease(held, "resume").to_message()
    with worker():
        # A fenced writer of the holder between its check and its commit: the lease row is
        # locked FOR SHARE, so a resume cannot lock it to join.
        with engine.begin() as conn:
            with store.guard(held, conn, action="publish manifest"):
                pass  # the check runs as the block ends, in the transaction left open
            started = time.monotonic()
            result = publish.task.apply_async(("prod",), headers={HEADER: header})
            assert wait.finished(result) == SKIPPED
            # After fence_lock_timeout (0.2 s), not the default 2 s.
            assert time.monotonic() - started < 1.8
            failed = publish_or_fail.apply_async(("prod",), headers={HEADER: header})
            assert wait.finished(failed) == states.FAILURE
        assert not publish.ran.is_set()
        assert isinstance(failures[failed.id], LeaseBusyError)
        assert result.info["reason"] == "busy"
        assert (
            "is busy: the call waited past lock_timeout for a lock held by fenced writers or "
            "other acquirers" in (result.info["message"])
        )
        assert fence.store.metrics.get("rejoin.busy") == 2
        # Nothing was recorded against the holder; once its write committed, a continuation joins.
        assert store.stale_runs() == []
        again = publish.task.apply_async(("prod",), headers={HEADER: header})
        assert wait.finished(again) == states.SUCCESS
    assert publish.ran.is_set()


def test_a_run_dispatched_by_beat_passes_its_own_lease_on_not_the_beats(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    seen: list[list[Any]] = []

    @fence.task(lease="tick")
    def tick() -> None:
        notify.delay("body")

    @fence.task(lease="notify:{label}", bind=True)
    def notify(self: Any, label: str) -> None:
        run = fence.current()
        assert run.lease is not None
        received = received_header(self.request)
        assert isinstance(received, dict)
        seen.append(
            [label, received["lease"], received["mode"], run.mode, run.lease.name, run.epoch]
        )

    beat = take(store, "scheduler:test", holder="beat@test")
    header = FenceHeader.for_lease(beat, "join").to_message()
    with worker():
        # A child published in the body, and a link the worker publishes after it: both carry
        # the run's own lease, and take leases of their own (theirs is another).
        result = tick.apply_async(headers={HEADER: header}, link=notify.si("link"))
        assert wait.finished(result) == states.SUCCESS
        wait.until(lambda: len(seen) == 2, what="the child and the link")

    assert sorted(seen) == [
        ["body", "tick", "resume", "owner", "notify:body", 1],
        ["link", "tick", "resume", "owner", "notify:link", 1],
    ]
    owner = store.owner("scheduler:test")
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (1, "beat@test", "held")
    assert store.stale_runs() == []


def test_a_retry_of_a_run_dispatched_by_beat_continues_its_lease_not_the_beats(
    fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait
) -> None:
    """Celery copies the request's headers into a retry; the run replaces the beat's header
    with its own lease's, so that the retry runs even after another beat instance took over."""
    seen: list[list[Any]] = []
    beat = take(store, "scheduler:test", holder="beat@test")

    @fence.task(lease="tick", bind=True)
    def tick(self: Any) -> str:
        run = fence.current()
        assert run.lease is not None
        received = received_header(self.request)
        assert isinstance(received, dict)
        seen.append([self.request.retries, received["lease"], run.mode, run.epoch])
        if self.request.retries == 0:
            store.release(beat)
            take(store, "scheduler:test", holder="beat-2@test")
            raise self.retry(countdown=0)
        return run.lease.name

    header = FenceHeader.for_lease(beat, "join").to_message()
    with worker():
        result = tick.apply_async(headers={HEADER: header})
        assert wait.finished(result) == states.SUCCESS

    assert result.result == "tick"
    # The first run released its lease when it ended; the retry took it over at the next epoch.
    assert seen == [[0, "scheduler:test", "owner", 1], [1, "tick", "resume", 2]]
    assert [entry.end_reason for entry in store.history("tick")] == ["released", "released"]
    assert store.stale_runs() == []


@pytest.mark.parametrize("mode", ["resume", "join"])
def test_a_plain_task_passes_on_resume_headers_only(
    app: Celery, fence: Fence, worker: StartWorker, store: LeaseStore, wait: Wait, mode: Mode
) -> None:
    seen: list[list[Any]] = []

    @app.task(shared=False)
    def relay(environment: str) -> None:
        publish.delay(environment)

    @fence.task(lease="release:{environment}", bind=True)
    def publish(self: Any, environment: str) -> None:
        run = fence.current()
        seen.append([received_header(self.request), run.mode, run.epoch])

    held = take(store, NAME if mode == "resume" else "scheduler:test")
    header = FenceHeader.for_lease(held, mode).to_message()
    with worker():
        relay.apply_async(("prod",), headers={HEADER: header})
        wait.until(lambda: seen, what="the fenced task the plain one published")

    [entry] = store.history(NAME)
    if mode == "resume":
        # It joined the held lease it continues, and left it held. It was sent the header the
        # plain task received, as a message of its own: with a publication id.
        [[received, run_mode, epoch]] = seen
        assert (run_mode, epoch) == ("resume", 1)
        assert {key: value for key, value in received.items() if key != "publication"} == header
        assert re.fullmatch("[0-9a-f]{32}", received["publication"])
        assert (entry.holder, entry.end_reason) == (HOLDER, None)
    else:
        # It took the lease itself.
        assert seen == [[None, "owner", 1]]
        assert entry.holder.startswith(f"{publish.name}[")
        assert entry.end_reason == "released"
    assert store.stale_runs() == []


# -- a fenced write's transaction -----------------------------------------------------------


def idle_timeouts(store: LeaseStore, lease: Lease, engine: Engine) -> list[int]:
    """``idle_in_transaction_session_timeout`` before a guarded transaction, inside it once the
    guard's check ran, and after it, on one connection."""
    with engine.connect() as conn:
        seen = [conn.execute(IDLE_TIMEOUT).scalar_one()]
        conn.commit()
        with conn.begin():
            with store.guard(lease, conn, action="publish manifest"):
                conn.execute(INSERT, {"environment": "prod", "release": 1})
            seen.append(conn.execute(IDLE_TIMEOUT).scalar_one())
        seen.append(conn.execute(IDLE_TIMEOUT).scalar_one())
    return seen


def test_the_fence_check_bounds_the_idle_time_of_its_transaction_by_the_lease(
    store: LeaseStore, manifest: Engine
) -> None:
    lease = take(store, ttl=30)

    before, inside, after = idle_timeouts(store, lease, manifest)

    # The lease's remaining time, for the rest of the transaction only.
    assert 20_000 < inside <= 30_000
    assert after == before != inside
    assert manifest_rows(manifest) == [("prod", 1)]


def test_with_an_injected_clock_the_fence_check_leaves_the_idle_timeout_alone(
    fake_store: LeaseStore, manifest: Engine
) -> None:
    lease = take(fake_store, ttl=30)

    before, inside, after = idle_timeouts(fake_store, lease, manifest)

    assert before == inside == after
    assert manifest_rows(manifest) == [("prod", 1)]


def test_a_writer_stopped_before_commit_loses_its_session_at_the_lease_expiry(
    store: LeaseStore, manifest: Engine
) -> None:
    lease = take(store, ttl=2)
    with manifest.connect() as conn:
        transaction = conn.begin()
        with store.guard(lease, conn, action="publish manifest"):
            conn.execute(INSERT, {"environment": "prod", "release": 1})
        # The writer stops between the check and its COMMIT, holding the lease row FOR SHARE,
        # until past the lease's expiry: the server ends its session, which frees the row.
        time.sleep(2.5)
        successor = store.acquire(NAME, holder="successor@test", ttl=30)
        with pytest.raises(StaleEpochError, match="the server ended its transaction") as caught:
            transaction.commit()

    assert successor.lease is not None, successor
    assert successor.lease.epoch == 2
    assert manifest_rows(manifest) == []
    assert caught.value.reason == "superseded"
    assert [(run.action, run.reason) for run in store.stale_runs()] == [
        ("publish manifest", "superseded")
    ]
    assert [(entry.epoch, entry.end_reason) for entry in store.history(NAME)] == [
        (2, None),
        (1, "expired"),
    ]


def test_guard_refuses_an_autocommit_connection_before_the_body(
    store: LeaseStore, manifest: Engine
) -> None:
    lease = take(store)
    conn = manifest.connect().execution_options(isolation_level="AUTOCOMMIT")
    with (
        conn,
        pytest.raises(ConfigurationError, match="autocommit"),
        store.guard(lease, conn, action="publish manifest"),
    ):
        # In autocommit this would commit at once, whatever the check said after it.
        conn.execute(INSERT, {"environment": "prod", "release": 1})

    assert manifest_rows(manifest) == []
    assert store.stale_runs() == []
    assert store.metrics.get("guard.passed") == 0


def test_a_run_whose_guard_cannot_get_a_connection_fails_with_the_librarys_error(
    database_url: str, manifest: Engine
) -> None:
    """``fence.guard()`` opens its transaction on the store's engine: with every pooled
    connection taken (a threads or gevent worker busier than the pool) and none back within the
    pool's timeout, the run gets ``FenceDatabaseError``, as for any database failure."""
    engine = engine_from_url(database_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    store = LeaseStore(engine)
    run = FencedRun(store=store, mode="owner", enforced=True, lease=take(store))

    def publish(release: int) -> None:
        with run.guard("publish manifest") as conn:
            conn.execute(INSERT, {"environment": "prod", "release": release})

    try:
        with engine.connect(), pytest.raises(FenceDatabaseError, match="QueuePool limit"):
            publish(1)  # the pool's one connection is taken
        publish(2)
    finally:
        store.dispose()
    assert manifest_rows(manifest) == [("prod", 2)]


# -- the keeper -----------------------------------------------------------------------------


@pytest.fixture
def short_lease(store: LeaseStore) -> Callable[[float], Lease]:
    """A held lease whose holder trusts it for only ``seconds`` more."""

    def make(seconds: float) -> Lease:
        return dataclasses.replace(take(store), deadline=time.monotonic() + seconds)

    return make


def test_keeper_rides_out_an_unexpected_error_until_the_deadline(
    short_lease: Callable[[float], Lease],
) -> None:
    lease = short_lease(1.0)
    calls: list[float] = []

    def refresh(current: Lease) -> Lease:
        calls.append(time.monotonic())
        raise RuntimeError("the renewal connection broke")

    with LeaseKeeper(lease, refresh, interval=0.05) as keeper:
        assert keeper.lost.wait(5)
        lost_at = time.monotonic()

    assert lost_at >= lease.deadline
    assert len(calls) >= 2
    assert keeper.error is not None
    assert (keeper.error.reason, keeper.error.epoch) == ("expired", 1)
    assert "the renewal connection broke" in str(keeper.error)


def test_keeper_does_not_renew_a_lease_past_its_deadline(
    store: LeaseStore, short_lease: Callable[[float], Lease]
) -> None:
    """An attempt that comes after the deadline (a retry of a failed renewal, say) ends the
    lease instead of bringing it back: the work saw it lost, and it stays lost."""
    lease = short_lease(0)
    refreshed: list[Lease] = []

    def refresh(current: Lease) -> Lease:
        refreshed.append(current)
        return store.renew(current)

    keeper = LeaseKeeper(lease, refresh, interval=10)

    assert keeper.renew_once() is None
    assert refreshed == []
    assert keeper.lost.is_set()
    assert not keeper.held
    assert keeper.error is not None
    assert (keeper.error.reason, keeper.error.epoch) == ("expired", lease.epoch)
    assert "passed its deadline" in str(keeper.error)


def test_keeper_renews_its_own_lease_every_interval_and_a_shared_one_before_its_trust_ends(
    store: LeaseStore, short_lease: Callable[[float], Lease]
) -> None:
    own = LeaseKeeper(take(store, name="keeper:own", ttl=30), store.renew, interval=10)
    # A lease shared with a holder that renews it elsewhere: each refresh finds only 2 s left.
    lease = short_lease(2)
    shared = LeaseKeeper(
        lease,
        lambda current: dataclasses.replace(current, deadline=time.monotonic() + 2),
        interval=10,
    )

    assert own.renew_once() == 10
    wait = shared.renew_once()
    assert wait is not None
    assert 0.9 < wait <= 1
    assert own.held
    assert shared.held


@pytest.fixture
def renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal thread of the test's own, with no keepers of earlier tests to wake it."""
    monkeypatch.setattr(keeper_module, "_renewals", keeper_module._Renewals())


@pytest.mark.usefixtures("renewals")
def test_a_keeper_started_after_one_due_later_is_renewed_on_its_own_time(
    store: LeaseStore, wait: Wait
) -> None:
    # The renewal thread is asleep until the first keeper is due, a minute from now.
    with LeaseKeeper(take(store, name="keeper:slow"), store.renew, interval=60) as slow:
        fast_lease = take(store, name="keeper:fast")
        with LeaseKeeper(fast_lease, store.renew, interval=0.05) as fast:
            wait.until(lambda: fast.lease is not fast_lease, what="the fast keeper's renewal")
            assert fast.held
        assert slow.held


@pytest.mark.usefixtures("renewals")
def test_stopped_keepers_leave_the_queue_without_a_renewal_attempt(
    store: LeaseStore, wait: Wait, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[str] = []
    renew_once = LeaseKeeper.renew_once

    def attempt(keeper: LeaseKeeper) -> float | None:
        attempts.append(keeper.lease.name)
        return renew_once(keeper)

    monkeypatch.setattr(LeaseKeeper, "renew_once", attempt)
    for index in range(5):
        name = f"keeper:ended:{index}"
        LeaseKeeper(take(store, name=name), store.renew, interval=0.05).start().stop()
    live_lease = take(store, name="keeper:live")
    with LeaseKeeper(live_lease, store.renew, interval=0.1) as live:
        wait.until(lambda: attempts.count("keeper:live") >= 2, what="two renewals of the live one")
        assert live.lease is not live_lease
    assert set(attempts) == {"keeper:live"}


@pytest.mark.usefixtures("renewals")
def test_a_renewal_kept_waiting_by_a_fenced_writer_does_not_hold_up_the_other_leases(
    store: LeaseStore, manifest: Engine, wait: Wait
) -> None:
    """A renewal waiting for its lease's row behind a fenced writer's open transaction gives up
    after ``lock_timeout`` and is tried again. The other leases' renewals go on meanwhile, on
    other renewer threads, also during each single wait: a lease renewed every tenth of a second
    is renewed again and again while the first wait lasts."""
    renewing = LeaseStore(
        store.engine,
        lock_timeout=1.5,
        pool_size=1,
        max_connections=keeper_module.RENEWALS_AT_ONCE,
    )
    events: list[tuple[str, str]] = []

    def refresh(current: Lease) -> Lease:
        events.append(("start", current.name))
        lease = renewing.renew(current)
        events.append(("done", current.name))
        return lease

    blocked_lease = take(store, name="keeper:blocked")
    free_lease = take(store, name="keeper:free")
    try:
        with (
            LeaseKeeper(blocked_lease, refresh, interval=0.1) as blocked,
            LeaseKeeper(free_lease, refresh, interval=0.1) as free,
        ):
            with manifest.begin() as conn:
                with store.guard(blocked_lease, conn, action="publish manifest"):
                    conn.execute(INSERT, {"environment": "prod", "release": 1})
                # The blocked lease's row stays locked FOR SHARE until this transaction ends.
                since = len(events)

                def free_renewals_during_the_first_wait() -> int:
                    later = events[since:]
                    if ("start", "keeper:blocked") not in later:
                        return 0
                    during = later[later.index(("start", "keeper:blocked")) :]
                    return during.count(("done", "keeper:free"))

                wait.until(
                    lambda: free_renewals_during_the_first_wait() >= 3,
                    what="three renewals of the free lease while the other's renewal waits",
                )
                assert renewing.metrics.get("renew.busy") == 0  # still in its first wait
                wait.until(
                    lambda: renewing.metrics.get("renew.busy") >= 2,
                    what="two renewals of the blocked lease given up after the lock timeout",
                )
                assert ("done", "keeper:blocked") not in events[since:]
            wait.until(
                lambda: ("done", "keeper:blocked") in events[since:],
                what="the blocked lease's renewal",
            )
            assert blocked.held
            assert free.held
    finally:
        renewing.dispose()

    assert blocked.lease.epoch == blocked_lease.epoch
    assert blocked.lease.expires_at > blocked_lease.expires_at
    assert manifest_rows(manifest) == [("prod", 1)]
    assert store.stale_runs() == []


class Halt(BaseException):
    """Something a renewal lets through: not an ``Exception``, as ``GreenletExit`` is not."""


@pytest.mark.usefixtures("renewals")
def test_a_renewal_that_ends_its_renewer_thread_loses_its_lease_and_others_go_on(
    store: LeaseStore, wait: Wait
) -> None:
    def halt(current: Lease) -> Lease:
        raise Halt

    renewals = keeper_module._renewals
    ended: list[type[BaseException]] = []
    previous, threading.excepthook = threading.excepthook, lambda args: ended.append(args.exc_type)
    try:
        doomed = LeaseKeeper(take(store, name="keeper:doomed"), halt, interval=0.05).start()
        wait.until(lambda: ended and renewals._renewers == 0, what="the renewer to end")
    finally:
        threading.excepthook = previous
    assert ended == [Halt]
    assert doomed.lost.is_set()
    assert doomed.error is not None
    assert "no longer renewed" in str(doomed.error)
    assert not doomed.held
    doomed.stop()
    later_lease = take(store, name="keeper:later")
    with LeaseKeeper(later_lease, store.renew, interval=0.05) as later:
        wait.until(lambda: later.lease is not later_lease, what="a renewal by another renewer")
        assert later.held


def test_keeper_keeps_the_lease_when_a_retry_after_an_unexpected_error_renews(
    store: LeaseStore, short_lease: Callable[[float], Lease], wait: Wait
) -> None:
    lease = short_lease(3)
    calls: list[float] = []

    def refresh(current: Lease) -> Lease:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise RuntimeError("the renewal connection broke")
        return store.renew(current)

    with LeaseKeeper(lease, refresh, interval=0.05) as keeper:
        wait.until(lambda: keeper.lease is not lease, what="a renewal")
        renewed = keeper.lease
        assert keeper.held

    assert len(calls) >= 3
    assert keeper.error is None
    assert not keeper.lost.is_set()
    assert (renewed.epoch, renewed.token) == (lease.epoch, lease.token)
    assert renewed.deadline > lease.deadline


class Interrupted(Exception):
    """What a signal handler raises in the task's thread (as Celery's soft time limit does)."""


@pytest.mark.usefixtures("renewals")
def test_a_keeper_whose_stop_is_interrupted_while_a_renewal_waits_is_still_stopped(
    store: LeaseStore, manifest: Engine, wait: Wait
) -> None:
    """``stop()`` waits for a renewal in flight; a signal (a soft time limit) that interrupts
    that wait must not leave the keeper renewing a lease whose run has ended."""
    lease = take(store, name="keeper:interrupted")
    started: list[Lease] = []

    def refresh(current: Lease) -> Lease:
        started.append(current)
        return store.renew(current)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    keeper = LeaseKeeper(lease, refresh, interval=0.05)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with manifest.begin() as conn:
            with store.guard(lease, conn, action="publish manifest"):
                conn.execute(INSERT, {"environment": "prod", "release": 1})
            # The lease's row stays locked FOR SHARE: the renewal waits for it.
            keeper.start()
            wait.until(lambda: bool(started), what="a renewal in flight")
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Interrupted):
                keeper.stop()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert keeper.stopped
    assert keeper.renew_once() is None
