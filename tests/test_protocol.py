"""The lease protocol through LeaseStore: acquire, renew, release, pause, history, stale runs.

Time is moved with freezegun through ``fake_store`` (whose SQL then uses the injected clock), or
by ageing rows in SQL; nothing here sleeps through a TTL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from multiprocessing.queues import Queue
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from freezegun import freeze_time
from freezegun.api import FrozenDateTimeFactory
from sqlalchemy.engine import Engine, make_url
from test_fenced_writes import wait_until_told

from celery_fence import (
    Acquisition,
    ConfigurationError,
    FenceDatabaseError,
    Lease,
    LeaseLostError,
    LeasePausedError,
    LeaseStore,
    Owner,
    StaleEpochError,
    _sql,
)
from celery_fence import store as store_module
from celery_fence.store import engine_from_url, proof

START = datetime(2030, 1, 1, tzinfo=timezone.utc)
NAME = "release:prod"


@pytest.fixture
def frozen() -> Iterator[FrozenDateTimeFactory]:
    # pytest's own clock stays real, so that its reported durations do too.
    with freeze_time(START, ignore=["_pytest.timing"]) as factory:
        assert isinstance(factory, FrozenDateTimeFactory)
        yield factory


@pytest.fixture
def protected(engine: Engine) -> Engine:
    """A table of the caller's own that fenced writes protect, with one row."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE protected (id int PRIMARY KEY, value text NOT NULL)")
        conn.exec_driver_sql("INSERT INTO protected VALUES (1, 'initial')")
    return engine


def protected_value(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.exec_driver_sql("SELECT value FROM protected WHERE id = 1").scalar_one())


def fenced_update(store: LeaseStore, lease: Lease, value: str, action: str) -> None:
    with store.engine.begin() as conn, store.guard(lease, conn, action=action):
        conn.execute(sa.text("UPDATE protected SET value = :v WHERE id = 1"), {"v": value})


def held(got: Acquisition) -> Lease:
    assert got.acquired, got
    assert got.lease is not None
    return got.lease


def lease_row(engine: Engine, name: str) -> dict[str, object]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT *, xmin::text, xmax::text, ctid::text"
                " FROM celery_fence.leases WHERE name = :n"
            ),
            {"n": name},
        )
        return dict(row.mappings().one())


# -- a valid lease cannot be replaced early ---------------------------------------------------


def test_another_holder_cannot_take_a_valid_lease(store: LeaseStore) -> None:
    lease = held(store.acquire(NAME, holder="release-41", ttl=30, environment="prod"))
    before = lease_row(store.engine, NAME)
    loser = store.acquire(NAME, holder="release-42", ttl=30, environment="prod")
    assert (loser.outcome, loser.lease) == ("held", None)
    assert loser.owner is not None
    assert (loser.owner.holder, loser.owner.epoch) == ("release-41", lease.epoch)
    assert loser.owner.expires_at == lease.expires_at
    assert lease_row(store.engine, NAME) == before


def test_the_same_holder_name_without_its_token_is_a_loser(store: LeaseStore) -> None:
    lease = held(store.acquire(NAME, holder="beat@host-a", ttl=30, environment="prod"))
    again = store.acquire(NAME, holder="beat@host-a", ttl=30, environment="prod")
    assert (again.outcome, again.lease) == ("held", None)
    assert again.owner is not None
    assert again.owner.epoch == lease.epoch
    # The first acquisition is untouched and still renews.
    assert store.renew(lease).epoch == lease.epoch


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda lease: dataclasses.replace(lease, token=uuid.uuid4()), id="token"),
        pytest.param(lambda lease: dataclasses.replace(lease, epoch=lease.epoch + 1), id="epoch"),
    ],
)
def test_forged_lease_is_rejected_and_recorded(
    store: LeaseStore, protected: Engine, forge: Callable[[Lease], Lease]
) -> None:
    lease = held(store.acquire(NAME, holder="beat@host-a", ttl=30, environment="prod"))
    forged = forge(lease)
    with pytest.raises(LeaseLostError) as renewed:
        store.renew(forged)
    with pytest.raises(LeaseLostError) as released:
        store.release(forged)
    with pytest.raises(StaleEpochError) as written:
        fenced_update(store, forged, "forged", "publish")
    for caught in (renewed, released, written):
        assert caught.value.reason == "forged"
        assert caught.value.owner is not None
        assert caught.value.owner.epoch == lease.epoch
    assert protected_value(protected) == "initial"
    runs = store.stale_runs(environment="prod")
    assert [(run.action, run.reason, run.stale_epoch) for run in runs] == [
        ("publish", "forged", forged.epoch),
        ("release", "forged", forged.epoch),
        ("renew", "forged", forged.epoch),
    ]
    # The real holder keeps its lease through all of it.
    assert store.renew(lease).epoch == lease.epoch
    assert store.owner(NAME) is not None


# -- renew ------------------------------------------------------------------------------------


def test_renew_keeps_the_epoch_and_extends_expiry(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    lease = held(fake_store.acquire(NAME, holder="a", ttl=10, environment="prod"))
    assert lease.expires_at == START + timedelta(seconds=10)
    frozen.tick(4)
    renewed = fake_store.renew(lease)
    assert renewed.epoch == lease.epoch
    assert renewed.token == lease.token
    assert renewed.expires_at == START + timedelta(seconds=14)
    # Renewing twice with the same arguments is harmless: same epoch, same expiry.
    again = fake_store.renew(lease)
    assert (again.epoch, again.expires_at) == (renewed.epoch, renewed.expires_at)
    owner = fake_store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.expires_at, owner.renewed_at) == (
        1,
        renewed.expires_at,
        START + timedelta(seconds=4),
    )
    assert fake_store.stale_runs() == []


def test_renew_cannot_extend_past_max_hold(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    lease = held(fake_store.acquire(NAME, holder="a", ttl=10, max_hold=25, environment="prod"))
    assert lease.hold_until == START + timedelta(seconds=25)
    expiries = []
    for _ in range(3):
        frozen.tick(8)
        lease = fake_store.renew(lease)
        expiries.append(lease.expires_at - START)
    assert expiries == [timedelta(seconds=18), timedelta(seconds=25), timedelta(seconds=25)]
    frozen.tick(2)  # 26 s: past the maximum hold
    with pytest.raises(LeaseLostError) as caught:
        fake_store.renew(lease)
    assert caught.value.reason == "expired"
    # Past the hold, anyone may take the lease, with a new epoch.
    assert held(fake_store.acquire(NAME, holder="b", ttl=10, environment="prod")).epoch == 2


# -- release ----------------------------------------------------------------------------------


def test_release_frees_the_lease_at_once_and_twice_is_harmless(store: LeaseStore) -> None:
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    assert store.release(lease) == "released"
    assert store.release(lease) == "released"
    assert store.metrics.get("release.released") == 2
    owner = store.owner(NAME)
    assert owner is not None
    assert owner.state == "released"
    successor = held(store.acquire(NAME, holder="b", ttl=300, environment="prod"))
    assert successor.epoch == lease.epoch + 1
    assert store.stale_runs() == []


def test_a_release_commits_without_waiting_for_the_disk_and_restores_the_lock_timeout(
    store: LeaseStore,
) -> None:
    """The release's SET clause restores lock_timeout when it returns, and only that: the
    synchronous_commit it turns off for its transaction stays off until the commit; a stale
    release, whose record must last, sets it back to the session's."""
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    params = {"name": NAME, "epoch": lease.epoch, "token": lease.token, "holder": "a"}
    params |= {"enforced": True, "now": None, "lock_timeout": 0.5, "environment": "prod"}
    params |= {"sharer": None, "finished": True, "joined_at": None}
    with store.engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL lock_timeout = '7s'")
        released = conn.execute(sa.text(_sql.queries()["release"]), params).one()
        settings = conn.exec_driver_sql(
            "SELECT current_setting('synchronous_commit'), current_setting('lock_timeout')"
        ).one()
    assert released.outcome == "released"
    assert tuple(settings) == ("off", "7s")
    # Released again once it was taken over: its stale run's record commits as the session's do.
    successor = held(store.acquire(NAME, holder="b", ttl=300, environment="prod"))
    assert successor.epoch == lease.epoch + 1
    with store.engine.begin() as conn:
        refused = conn.execute(sa.text(_sql.queries()["release"]), params).one()
        setting = conn.exec_driver_sql("SELECT current_setting('synchronous_commit')").scalar()
    assert (refused.outcome, refused.reason, setting) == ("lost", "superseded", "on")
    [stale] = store.stale_runs()
    assert (stale.action, stale.stale_epoch, stale.current_epoch) == ("release", 1, 2)


STALE_CALLS: dict[str, Callable[[LeaseStore, Lease], object]] = {
    "renew": lambda store, lease: store.renew(lease),
    "release": lambda store, lease: store.release(lease),
    "start publish": lambda store, lease: store.rejoin(
        lease.name,
        epoch=lease.epoch,
        holder=lease.holder,
        mode="resume",
        proof="00" * 32,
        ttl=30,
        action="start publish",
        environment=lease.environment,
    ),
}


@pytest.mark.parametrize("action", list(STALE_CALLS))
def test_a_stale_run_is_recorded_and_logged_in_the_leases_environment_else_the_callers(
    store: LeaseStore, caplog: pytest.LogCaptureFixture, action: str
) -> None:
    """A renewal, release or continuation of a lease that does not exist is recorded, and
    logged, in the caller's environment; of one that exists, in the lease's own, also for a
    lease that a pause from SQL created."""
    stale = Lease(
        name=NAME, environment="prod", holder="a", purpose="", epoch=3, token=uuid.uuid4(),
        acquired_at=START, expires_at=START, hold_until=START, ttl=30.0,
        deadline=time.monotonic() + 30,
    )  # fmt: skip

    def rejected() -> tuple[str | None, str]:
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, "celery_fence.stale"),
            pytest.raises(LeaseLostError) as caught,
        ):
            STALE_CALLS[action](store, stale)
        [logged] = [record for record in caplog.records if record.name == "celery_fence.stale"]
        return caught.value.reason, logged.environment

    assert rejected() == ("missing", "prod")
    assert store.owner(NAME) is None
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("SELECT celery_fence.pause(:n, 'audit', 'ops', 'staging')"), {"n": NAME}
        )
    assert rejected() == ("forged", "staging")
    runs = store.stale_runs(lease_name=NAME)
    assert [(run.environment, run.reason, run.action, run.stale_epoch) for run in runs] == [
        ("staging", "forged", action, 3),
        ("prod", "missing", action, 3),
    ]
    assert runs[1].current_epoch is None


@pytest.mark.parametrize(
    ("enforced", "verdict"), [(True, "rejected"), (False, "would be rejected (shadow mode)")]
)
def test_a_malformed_header_is_logged_as_such_and_as_recorded(
    store: LeaseStore, caplog: pytest.LogCaptureFixture, enforced: bool, verdict: str
) -> None:
    """A header that cannot be read gives no epoch to tell: its line names what was rejected
    and says that it was recorded."""
    with caplog.at_level(logging.WARNING, "celery_fence.stale"):
        record = store.record_stale_run(
            NAME,
            epoch=None,
            holder="(unreadable)",
            reason="malformed",
            action="start publish",
            enforced=enforced,
        )
    [logged] = [record for record in caplog.records if record.name == "celery_fence.stale"]
    assert logged.getMessage() == (
        f"stale start publish {verdict}: malformed celery_fence header for lease {NAME} from "
        "holder (unreadable), recorded as a stale run"
    )
    assert (logged.reason, logged.stale_epoch, logged.enforced) == ("malformed", None, enforced)
    assert store.stale_runs() == [record]


def resume_header(parent: Lease) -> dict[str, Any]:
    """The header fields a continuation of ``parent`` rejoins it with."""
    return {
        "epoch": parent.epoch,
        "holder": parent.holder,
        "mode": "resume",
        "proof": proof(parent, "resume"),
        "ttl": 10,
        "action": "start child",
    }


def delivered(store: LeaseStore, header: dict[str, Any], message: str, host: str) -> Acquisition:
    """A delivery of continuation ``message`` on ``host`` rejoining with ``header``: named, and
    told from other messages' deliveries, as the Celery integration names and tells them."""
    return store.rejoin(
        NAME, **header, successor=f"{message}@{host}", delivery_prefix=f"{message}@"
    )


def test_a_resume_waits_for_its_own_messages_earlier_take_over_and_takes_it_over_once_lapsed(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A continuation redelivered after its first delivery took the lease over: that epoch is
    the same work's, so the redelivery is refused while it is held, never recorded as stale,
    and takes the lease over once it expired. Once a delivery released it, the work is done and
    a later redelivery is stale, as is another message with the same header."""
    caplog.set_level(logging.INFO, logger="celery_fence")
    parent = held(fake_store.acquire(NAME, holder="parent", ttl=10, environment="prod"))
    fake_store.release(parent)
    header = resume_header(parent)

    def delivery(message: str, host: str) -> Acquisition:
        return delivered(fake_store, header, message, host)

    first = delivery("child[1]", "host-a")
    assert first.lease is not None
    assert (first.outcome, first.lease.epoch, first.lease.holder) == (
        "resumed",
        2,
        "child[1]@host-a",
    )
    redelivered = delivery("child[1]", "host-b")
    assert redelivered.owner is not None
    assert (redelivered.outcome, redelivered.lease) == ("held", None)
    assert (redelivered.owner.epoch, redelivered.owner.holder) == (2, "child[1]@host-a")
    fake_store.pause(NAME, reason="audit")
    assert delivery("child[1]", "host-b").outcome == "paused"
    fake_store.resume(NAME)
    with pytest.raises(LeaseLostError) as sibling:
        delivery("child[2]", "host-a")
    assert sibling.value.reason == "superseded"
    frozen.tick(11)
    took = delivery("child[1]", "host-b")
    assert took.lease is not None
    assert (took.outcome, took.lease.epoch, took.lease.holder) == ("resumed", 3, "child[1]@host-b")
    fake_store.release(took.lease)
    with pytest.raises(LeaseLostError) as finished:
        delivery("child[1]", "host-c")
    assert finished.value.reason == "superseded"
    owner = fake_store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.holder, owner.state) == (3, "child[1]@host-b", "released")
    assert [
        (run.stale_holder, run.reason, run.current_epoch) for run in fake_store.stale_runs()
    ] == [
        ("parent", "superseded", 3),
        ("parent", "superseded", 2),
    ]
    assert [m for m in caplog.messages if "taken over" in m] == [
        f"lease {NAME} taken over by child[1]@host-a at epoch 2, continuing epoch 1",
        f"lease {NAME} taken over by child[1]@host-b at epoch 3, continuing epoch 1",
    ]


def test_a_delivery_joins_a_shared_epoch_once_and_its_redelivery_waits_for_it_or_is_dropped(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory, engine: Engine
) -> None:
    """A continuation that joins its publisher's held lease is kept as that delivery's join.
    Its message redelivered (another host, past the broker's visibility timeout) is refused
    while that delivery shares the lease, never joined beside it at the same epoch, and dropped
    once it finished, also after another message's run took the lease; a delivery that left
    unfinished (its message put back) is joined in its place; a delivery lost without leaving
    keeps the lease shared until it expires, and its redelivery then takes it over. None of it
    is a stale run."""
    parent = held(fake_store.acquire(NAME, holder="parent", ttl=10, environment="prod"))
    header = resume_header(parent)

    def delivery(message: str, host: str) -> Acquisition:
        return delivered(fake_store, header, message, host)

    def joins() -> list[tuple[int, str, bool, bool]]:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT epoch, delivery, left_at IS NOT NULL AS left_it, finished"
                    " FROM celery_fence.joins WHERE name = :name ORDER BY epoch, delivery"
                ),
                {"name": NAME},
            )
            return [(row.epoch, row.delivery, row.left_it, row.finished) for row in rows]

    first = held(delivery("child[1]", "host-a"))
    assert (first.epoch, first.holder, first.sharer) == (parent.epoch, "parent", "child[1]@")
    again = delivery("child[1]", "host-b")
    assert (again.outcome, again.lease) == ("shared", None)
    assert again.owner is not None
    assert (again.owner.holder, again.owner.epoch, again.owner.state) == ("parent", 1, "held")
    assert again.expires_in is not None
    assert again.expires_in > 0
    lost = held(delivery("child[2]", "host-a"))  # another message joins beside it
    requeued = held(delivery("child[3]", "host-a"))
    renewed = fake_store.renew(first)
    assert renewed.sharer == "child[1]@"
    assert fake_store.release(renewed) == "left"
    assert fake_store.release(requeued, finished=False) == "left"
    assert joins() == [
        (1, "child[1]@", True, True),
        (1, "child[2]@", False, False),
        (1, "child[3]@", True, False),
    ]
    done = delivery("child[1]", "host-c")
    assert (done.outcome, done.lease) == ("done", None)
    # The put-back message joins in its earlier delivery's place, and finishes.
    assert fake_store.release(held(delivery("child[3]", "host-b"))) == "left"
    assert joins()[2] == (1, "child[3]@", True, True)
    assert fake_store.release(parent) == "left"
    # child[2]'s worker was lost: it never leaves, and its redelivery waits while the lease
    # is shared; once the lease expired, the redelivery takes it over at the next epoch.
    assert delivery("child[2]", "host-b").outcome == "shared"
    assert lost.sharer == "child[2]@"
    frozen.tick(11)
    took = delivery("child[2]", "host-b")
    assert took.lease is not None
    assert (took.outcome, took.lease.epoch, took.lease.sharer) == ("resumed", 2, None)
    # A newer epoch does not hide a finished delivery: its redelivery is dropped, not stale.
    assert delivery("child[1]", "host-d").outcome == "done"
    with pytest.raises(LeaseLostError) as stale:
        delivery("child[4]", "host-a")
    assert stale.value.reason == "superseded"
    assert fake_store.release(took.lease) == "released"
    assert [(run.stale_holder, run.reason) for run in fake_store.stale_runs()] == [
        ("parent", "superseded")
    ]


def test_a_delivery_that_leaves_unfinished_keeps_its_share_for_its_redelivery(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    """The last sharer, whose message was put back, leaves the lease unfinished: the lease is
    not released, so that no other run takes it before the redelivery joins in its place. Not
    redelivered, the lease runs out at its expiry. A share left twice is left once, and the
    first delivery's lease released again leaves nothing of the redelivery's join."""
    parent = held(fake_store.acquire(NAME, holder="parent", ttl=10, environment="prod"))
    header = resume_header(parent)
    child = held(delivered(fake_store, header, "child[1]", "host-a"))
    assert fake_store.release(parent) == "left"
    assert fake_store.release(child, finished=False) == "left"
    assert fake_store.release(child) == "left"  # left already: nothing more
    owner = fake_store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (parent.epoch, "held")
    assert fake_store.acquire(NAME, holder="another", ttl=10).outcome == "held"
    frozen.tick(1)
    again = held(delivered(fake_store, header, "child[1]", "host-b"))
    assert (again.epoch, again.sharer) == (parent.epoch, "child[1]@")
    assert again.joined_at is not None
    assert again.joined_at != child.joined_at
    assert fake_store.release(child) == "left"  # the join is the redelivery's now: untouched
    assert fake_store.release(again) == "released"  # the one share, handed on
    assert [entry.end_reason for entry in fake_store.history(NAME)] == ["released"]
    # Not redelivered: the share kept for it runs out with the lease.
    later = held(fake_store.acquire(NAME, holder="parent", ttl=10, environment="prod"))
    stopped = held(delivered(fake_store, resume_header(later), "child[2]", "host-a"))
    assert fake_store.release(later) == "left"
    assert fake_store.release(stopped, finished=False) == "left"
    frozen.tick(11)
    assert fake_store.acquire(NAME, holder="another", ttl=10).outcome == "acquired"
    assert fake_store.stale_runs() == []


@pytest.mark.parametrize("finished", [True, False])
def test_a_delivery_that_leaves_a_lease_no_longer_held_is_a_stale_release(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory, finished: bool
) -> None:
    """A continuation's delivery that leaves its share after the lease expired, or after a
    newer epoch took it, is refused and recorded as its holder's release would be; one that
    left while the lease was held leaves again harmlessly."""
    parent = held(fake_store.acquire(NAME, holder="parent", ttl=10, environment="prod"))
    header = resume_header(parent)
    early = held(delivered(fake_store, header, "child[1]", "host-a"))
    late = held(delivered(fake_store, header, "child[2]", "host-a"))
    assert fake_store.release(early, finished=finished) == "left"
    frozen.tick(11)
    with pytest.raises(LeaseLostError) as expired:
        fake_store.release(late, finished=finished)
    assert expired.value.reason == "expired"
    assert fake_store.release(early, finished=finished) == "left"  # left already: nothing more
    held(fake_store.acquire(NAME, holder="another", ttl=10, environment="prod"))
    with pytest.raises(LeaseLostError) as superseded:
        fake_store.release(late, finished=finished)
    assert superseded.value.reason == "superseded"
    assert [(run.stale_holder, run.reason, run.environment) for run in fake_store.stale_runs()] == [
        ("parent", "superseded", "prod"),
        ("parent", "expired", "prod"),
    ]


def test_a_resume_from_a_previous_version_joins_as_before_without_recording_its_join(
    store: LeaseStore, engine: Engine
) -> None:
    """Workers of schema 15 pass a delivery prefix but know no ``shared`` or ``done`` answer:
    their resume, which does not ask for its join to be recorded, joins as it did then."""
    parent = held(store.acquire(NAME, holder="parent", ttl=30, environment="prod"))
    earlier_call = sa.text(
        "SELECT outcome FROM celery_fence.rejoin(:name, :epoch, :holder, 'resume', :proof,"
        " interval '30 s', 'start child', true, NULL, interval '2 s', NULL, NULL, :prefix)"
    )
    arguments = {"name": NAME, "epoch": parent.epoch, "holder": parent.holder}
    arguments |= {"proof": bytes.fromhex(proof(parent, "resume")), "prefix": "child[1]@"}
    with engine.begin() as conn:
        outcomes = [conn.execute(earlier_call, arguments).scalar() for _ in range(2)]
        recorded = conn.execute(sa.text("SELECT count(*) FROM celery_fence.joins")).scalar()
    assert (outcomes, recorded) == (["joined", "joined"], 0)
    owner = store.owner(NAME)
    assert owner is not None
    assert (owner.epoch, owner.state) == (parent.epoch, "held")


def test_a_delivery_whose_join_was_pruned_leaves_as_a_sharer_without_one(
    store: LeaseStore, engine: Engine
) -> None:
    """A join deleted while the lease is held (pruned by age, see the runbook) leaves its
    delivery an ordinary sharer: its release counts it out, and the last one releases the
    lease instead of keeping it until it expires."""
    parent = held(store.acquire(NAME, holder="parent", ttl=30, environment="prod"))
    child = held(delivered(store, resume_header(parent), "child[1]", "host-a"))
    with engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM celery_fence.joins")
    assert store.release(parent) == "left"
    assert store.release(child) == "released"
    assert store.stale_runs() == []


def test_a_check_that_an_epoch_holds_answers_without_its_token(
    store: LeaseStore, engine: Engine
) -> None:
    """Every task a fenced beat dispatches carries a join proof; a check with it (mode
    ``join``) tells the epoch's owner, never the token, which would let any reader of the
    broker renew, release or write as the beat."""
    lease = held(store.acquire(NAME, holder="beat@a", ttl=30, environment="prod"))
    with engine.connect() as conn:
        answer = conn.execute(
            sa.text(
                "SELECT outcome, holder, epoch, token FROM celery_fence.rejoin("
                ":name, :epoch, :holder, 'join', :proof, interval '30 s')"
            ),
            {
                "name": NAME,
                "epoch": lease.epoch,
                "holder": lease.holder,
                "proof": bytes.fromhex(proof(lease, "join")),
            },
        ).one()
    assert tuple(answer) == ("joined", "beat@a", lease.epoch, None)


def test_a_release_that_leaves_unsure_whether_it_finished_is_refused(
    store: LeaseStore, engine: Engine
) -> None:
    """``p_finished`` null is an argument error, before anything is changed."""
    parent = held(store.acquire(NAME, holder="parent", ttl=30, environment="prod"))
    child = held(delivered(store, resume_header(parent), "child[1]", "host-a"))
    with pytest.raises(sa.exc.DBAPIError) as refused, engine.begin() as conn:
        conn.execute(
            sa.text(
                "SELECT celery_fence.release(:name, :epoch, :token, :holder,"
                " p_sharer => :sharer, p_finished => NULL, p_joined_at => :joined_at)"
            ),
            {
                "name": NAME,
                "epoch": child.epoch,
                "token": child.token,
                "holder": child.holder,
                "sharer": child.sharer,
                "joined_at": child.joined_at,
            },
        )
    assert isinstance(refused.value.orig, psycopg.errors.InvalidParameterValue)
    assert "finished must be true or false" in str(refused.value.orig)
    assert store.release(child) == "left"
    assert store.release(parent) == "released"


@pytest.fixture
def berlin_store(database_url: str, clock: Callable[[], datetime]) -> Iterator[LeaseStore]:
    """A store whose sessions run in a time zone with daylight saving time."""
    engine = engine_from_url(database_url, connect_args={"options": "-c TimeZone=Europe/Berlin"})
    yield LeaseStore(engine, clock=clock, max_ttl=86400)
    engine.dispose()


def test_spans_are_seconds_across_a_daylight_saving_change(berlin_store: LeaseStore) -> None:
    """A TTL and a hold window are spans of seconds, also where the session's time zone skips an
    hour: a day's hold ends 24 hours later, not at the same time on the next calendar day."""
    before_the_change = datetime(2026, 3, 28, 2, tzinfo=timezone.utc)  # 03:00 in Berlin
    with freeze_time(before_the_change, ignore=["_pytest.timing"]) as frozen:
        # No max_hold: a day's hold.
        day = held(berlin_store.acquire(NAME, holder="a", ttl=3600, environment="prod"))
        assert seconds_between(day.acquired_at, berlin_store.owner(NAME)) == 86400
        berlin_store.release(day)

        parent = held(
            berlin_store.acquire(
                NAME, holder="parent", ttl=3600, max_hold=88200, environment="prod"
            )
        )
        frozen.tick(timedelta(minutes=70))
        taken = berlin_store.rejoin(
            NAME,
            epoch=parent.epoch,
            holder="parent",
            mode="resume",
            proof=proof(parent, "resume"),
            ttl=86400,
            action="start child",
        )
    assert taken.lease is not None
    assert (taken.outcome, taken.lease.epoch) == ("resumed", parent.epoch + 1)
    assert seconds_between(taken.lease.acquired_at, berlin_store.owner(NAME)) == 88200


def seconds_between(acquired_at: datetime, owner: Owner | None) -> float:
    """The real seconds from ``acquired_at`` to the lease's hold limit. (Python subtracts two
    times of one time zone by their wall clocks, so both are taken to UTC first.)"""
    assert owner is not None
    return (
        owner.hold_until.astimezone(timezone.utc) - acquired_at.astimezone(timezone.utc)
    ).total_seconds()


def test_history_records_each_epoch_and_how_it_ended(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    first = held(
        fake_store.acquire(NAME, holder="release-1", ttl=10, environment="prod", purpose="v1")
    )
    frozen.tick(3)
    fake_store.release(first)
    second = held(
        fake_store.acquire(NAME, holder="release-2", ttl=10, environment="prod", purpose="v2")
    )
    frozen.tick(30)
    third = held(
        fake_store.acquire(NAME, holder="release-3", ttl=10, environment="prod", purpose="v3")
    )
    entries = fake_store.history(NAME)
    assert [(e.epoch, e.holder, e.purpose, e.end_reason) for e in entries] == [
        (3, "release-3", "v3", None),
        (2, "release-2", "v2", "expired"),
        (1, "release-1", "v1", "released"),
    ]
    assert [e.acquired_at for e in entries] == [
        third.acquired_at,
        second.acquired_at,
        first.acquired_at,
    ]
    assert [e.ended_at for e in entries] == [None, second.expires_at, START + timedelta(seconds=3)]
    assert {e.environment for e in entries} == {"prod"}
    assert [e.epoch for e in fake_store.history(NAME, limit=1)] == [3]


def test_history_judges_expiry_by_the_clock_as_owner_does(engine: Engine) -> None:
    """Called from psql inside a transaction, history() reads the clock, not the transaction's
    start: an epoch that owner() calls expired is not shown as still running."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT celery_fence.acquire(:n, 'prod', 'ops@psql', interval '1 hour')"),
            {"n": NAME},
        )
        # Age the row in SQL: it expired after this transaction started, before this statement.
        conn.execute(sa.text("SELECT pg_sleep(0.001)"))
        conn.execute(
            sa.text(
                "UPDATE celery_fence.leases"
                " SET expires_at = now() + (clock_timestamp() - now()) / 2 WHERE name = :n"
            ),
            {"n": NAME},
        )
        state = conn.execute(
            sa.text("SELECT state FROM celery_fence.owner(:n)"), {"n": NAME}
        ).scalar_one()
        ended = conn.execute(
            sa.text("SELECT epoch, end_reason FROM celery_fence.history(:n)"), {"n": NAME}
        ).one()
    assert state == "expired"
    assert tuple(ended) == (1, "expired")


# -- pause / resume ---------------------------------------------------------------------------


def test_pause_blocks_acquisition_and_renewal_until_resumed(store: LeaseStore) -> None:
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    paused = store.pause(NAME, reason="investigating double publish", by="oncall@ops")
    assert (paused.paused, paused.paused_by, paused.paused_reason) == (
        True,
        "oncall@ops",
        "investigating double publish",
    )
    store.release(lease)
    store.release(lease)  # releasing twice stays harmless on a paused lease
    with pytest.raises(LeasePausedError) as caught:
        store.acquire(NAME, holder="b", ttl=300, environment="prod")
    assert caught.value.reason == "paused"
    assert caught.value.lease_name == NAME
    assert caught.value.owner is not None
    assert caught.value.owner.paused_by == "oncall@ops"
    assert caught.value.owner.paused_reason == "investigating double publish"
    assert "oncall@ops" in str(caught.value)
    resumed = store.resume(NAME)
    assert (resumed.paused, resumed.paused_by, resumed.paused_reason) == (False, None, None)
    assert (
        held(store.acquire(NAME, holder="b", ttl=300, environment="prod")).epoch == lease.epoch + 1
    )
    assert store.stale_runs() == []


def test_pause_blocks_renewal_of_the_holder(store: LeaseStore) -> None:
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    store.pause(NAME, reason="freeze", by="ops")
    with pytest.raises(LeaseLostError) as caught:
        store.renew(lease)
    assert caught.value.reason == "paused"
    assert caught.value.owner is not None
    assert caught.value.owner.paused_by == "ops"
    [run] = store.stale_runs(environment="prod")
    assert (run.action, run.reason, run.stale_epoch, run.current_epoch) == ("renew", "paused", 1, 1)
    resumed = store.resume(NAME)
    # Resuming ends the epoch the pause found, whose holder was told it lost it: the lease is
    # free for a new one at once, not held by nobody until it runs out.
    assert resumed.state == "expired"
    assert resumed.expires_at < lease.expires_at
    with pytest.raises(LeaseLostError) as caught:
        store.renew(lease)
    assert caught.value.reason == "expired"
    taken = held(store.acquire(NAME, holder="b", ttl=300, environment="prod"))
    assert taken.epoch == lease.epoch + 1
    ended = store.history(NAME)[-1]
    assert (ended.epoch, ended.holder, ended.end_reason) == (1, "a", "expired")
    assert ended.ended_at == resumed.expires_at


def assert_resumed_to(store: LeaseStore, lease: Lease) -> None:
    """Resume the lease, and find it still ``lease``'s: the same epoch and expiry, renewable."""
    resumed = store.resume(lease.name)
    assert (resumed.state, resumed.epoch, resumed.expires_at) == (
        "held",
        lease.epoch,
        lease.expires_at,
    )
    assert store.renew(lease).epoch == lease.epoch


def join(store: LeaseStore, lease: Lease, **arguments: Any) -> Acquisition:
    """A continuation's check at its start that ``lease``'s epoch still holds."""
    return store.rejoin(
        lease.name,
        epoch=lease.epoch,
        holder=lease.holder,
        mode="join",
        proof=proof(lease, "join"),
        ttl=30,
        **arguments,
    )


@pytest.mark.parametrize("refusal", ["shadow write", "renewal in shadow mode", "continuation"])
def test_a_refusal_during_a_pause_that_told_the_holder_nothing_leaves_it_its_lease(
    store: LeaseStore, engine: Engine, refusal: str
) -> None:
    """Only a refused renewal tells the holder it lost the lease. A write let through in shadow
    mode, or a task the holder dispatched refused at its start, leaves it trusting the lease:
    the resume keeps it held, at the same epoch."""
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    store.pause(NAME, reason="freeze", by="ops")
    if refusal == "shadow write":
        with engine.begin() as conn, store.guard(lease, conn, action="w", enforce=False):
            conn.exec_driver_sql("SELECT 1")
    elif refusal == "renewal in shadow mode":
        with pytest.raises(LeaseLostError):
            store.renew(lease, enforce=False)
    else:
        with pytest.raises(LeaseLostError):
            join(store, lease, action="start dispatched task")
    [run] = store.stale_runs()
    assert run.reason == "paused"
    assert_resumed_to(store, lease)


def test_a_stale_run_is_recorded_in_the_environment_of_the_epoch_it_ran_at(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease has moved to another environment since: the stale holder's renewal, release,
    continuation and write are still its own environment's stale runs, and logged as such."""
    old = held(store.acquire(NAME, holder="a", ttl=300, environment="staging"))
    store.release(old)
    held(store.acquire(NAME, holder="b", ttl=300, environment="prod"))
    with caplog.at_level(logging.WARNING, "celery_fence.stale"):
        with pytest.raises(LeaseLostError):
            store.renew(old)
        with pytest.raises(LeaseLostError):
            store.release(old)
        with pytest.raises(LeaseLostError):
            join(store, old, action="start", environment="elsewhere")
    logged = [record.environment for record in caplog.records if record.name.endswith("stale")]
    assert logged == ["staging"] * 3
    with (
        pytest.raises(StaleEpochError),
        store.engine.begin() as conn,
        store.guard(old, conn, action="publish"),
    ):
        conn.exec_driver_sql("SELECT 1")
    assert {run.action for run in store.stale_runs(environment="staging")} == {
        "renew",
        "release",
        "start",
        "publish",
    }
    assert store.stale_runs(environment="prod") == []


def test_a_holder_never_refused_during_a_pause_keeps_its_lease_after_it(
    store: LeaseStore,
) -> None:
    """Nothing told it the lease was paused, so it still trusts it: the resume must not hand
    the lease to another holder while it does."""
    lease = held(store.acquire(NAME, holder="a", ttl=300, environment="prod"))
    store.pause(NAME, reason="freeze", by="ops")
    store.pause(NAME, reason="freeze, ticket 7", by="ops")  # paused again: still one pause
    assert_resumed_to(store, lease)
    # Refused while paused, even if the refusal came before the lease was paused again.
    store.pause(NAME, reason="freeze", by="ops")
    with pytest.raises(LeaseLostError):
        store.renew(lease)
    store.pause(NAME, reason="freeze, ticket 8", by="ops")
    assert store.resume(NAME).state == "expired"


def test_pausing_a_lease_never_acquired_then_resuming_starts_at_epoch_one(
    store: LeaseStore,
) -> None:
    store.pause("scheduler:retention", reason="not yet", by="ops", environment="staging")
    with pytest.raises(LeasePausedError):
        store.acquire("scheduler:retention", holder="beat", ttl=30, environment="staging")
    store.resume("scheduler:retention")
    lease = held(store.acquire("scheduler:retention", holder="beat", ttl=30, environment="staging"))
    assert lease.epoch == 1
    assert [e.epoch for e in store.history("scheduler:retention")] == [1]


# -- a stale holder after fake time has passed ------------------------------------------------


def test_superseded_holder_is_rejected_everywhere_and_recorded(
    fake_store: LeaseStore, protected: Engine, frozen: FrozenDateTimeFactory
) -> None:
    old = held(fake_store.acquire(NAME, holder="release-41", ttl=10, environment="prod"))
    frozen.tick(11)
    new = held(fake_store.acquire(NAME, holder="release-42", ttl=10, environment="prod"))
    assert new.epoch == old.epoch + 1

    with pytest.raises(LeaseLostError) as renewed:
        fake_store.renew(old)
    frozen.tick(1)
    with pytest.raises(LeaseLostError) as released:
        fake_store.release(old)
    frozen.tick(1)
    # The old holder's own deadline has passed too: the write never reaches the database.
    with pytest.raises(StaleEpochError) as written:
        fenced_update(fake_store, old, "release-41", "publish manifest")
    frozen.tick(1)
    # A holder whose clock runs slow still trusts its lease; the fence in the database decides.
    slow_clock = dataclasses.replace(old, deadline=old.deadline + 3600)
    with pytest.raises(StaleEpochError) as fenced:
        fenced_update(fake_store, slow_clock, "release-41", "publish manifest")

    expected_reasons = ["superseded", "superseded", "expired", "superseded"]
    for caught, reason in zip((renewed, released, written, fenced), expected_reasons, strict=True):
        assert caught.value.reason == reason
        assert caught.value.epoch == old.epoch
        assert caught.value.owner is not None
        assert (caught.value.owner.holder, caught.value.owner.epoch) == ("release-42", new.epoch)
    assert protected_value(protected) == "initial"
    runs = fake_store.stale_runs(environment="prod")
    assert [(r.action, r.reason) for r in runs] == [
        ("publish manifest", "superseded"),
        ("publish manifest", "expired"),
        ("release", "superseded"),
        ("renew", "superseded"),
    ]
    assert [r.recorded_at - START for r in runs] == [timedelta(seconds=s) for s in (14, 13, 12, 11)]
    for run in runs:
        assert (run.environment, run.lease_name, run.enforced) == ("prod", NAME, True)
        assert (run.stale_epoch, run.stale_holder) == (old.epoch, "release-41")
        assert (run.current_epoch, run.current_holder) == (new.epoch, "release-42")
    # The successor is unaffected.
    assert fake_store.renew(new).epoch == new.epoch


def test_expired_holder_without_successor_is_rejected_as_expired(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    lease = held(fake_store.acquire(NAME, holder="a", ttl=10, environment="prod"))
    frozen.tick(10)
    with pytest.raises(LeaseLostError) as renewed:
        fake_store.renew(lease)
    with pytest.raises(LeaseLostError) as released:
        fake_store.release(lease)
    for caught in (renewed, released):
        assert caught.value.reason == "expired"
        assert caught.value.owner is not None
        assert (caught.value.owner.epoch, caught.value.owner.state) == (1, "expired")
    runs = fake_store.stale_runs(environment="prod")
    assert [(r.action, r.reason, r.current_epoch, r.current_holder) for r in runs] == [
        ("release", "expired", 1, "a"),
        ("renew", "expired", 1, "a"),
    ]


def test_stale_runs_filter_by_environment_and_lease_newest_first(
    fake_store: LeaseStore, frozen: FrozenDateTimeFactory
) -> None:
    leases = {
        env: held(fake_store.acquire(f"release:{env}", holder=f"r-{env}", ttl=5, environment=env))
        for env in ("prod", "staging")
    }
    frozen.tick(6)
    for env in ("prod", "staging", "prod"):
        with pytest.raises(LeaseLostError):
            fake_store.renew(leases[env])
        frozen.tick(1)
    prod = fake_store.stale_runs(environment="prod")
    assert [(r.lease_name, r.recorded_at - START) for r in prod] == [
        ("release:prod", timedelta(seconds=8)),
        ("release:prod", timedelta(seconds=6)),
    ]
    staging = fake_store.stale_runs(environment="staging")
    assert [(r.lease_name, r.stale_holder) for r in staging] == [("release:staging", "r-staging")]
    assert len(fake_store.stale_runs()) == 3
    assert len(fake_store.stale_runs(lease_name="release:staging")) == 1
    assert fake_store.stale_runs(environment="prod", limit=1) == prod[:1]
    assert fake_store.stale_runs(environment="dev") == []


# -- what a loser learns and writes ------------------------------------------------------------


def test_owner_of_an_unknown_lease_is_none(store: LeaseStore) -> None:
    assert store.owner("never:taken") is None


def test_a_loser_learns_the_owners_time_left_by_the_database_clock(engine: Engine) -> None:
    """The answer says how long the owner's lease has left as the database reckons it, here an
    injected clock a day ahead of this machine's: the figure a busy retry waits for, which no
    client clock goes into."""
    ahead = datetime.now(timezone.utc) + timedelta(days=1)
    clocked = LeaseStore(engine, clock=lambda: ahead)
    try:
        won = clocked.acquire(NAME, holder="a", ttl=60, environment="prod")
        lost = clocked.acquire(NAME, holder="b", ttl=60, environment="prod")
    finally:
        clocked.dispose()
    assert won.expires_in == 60
    assert (lost.outcome, lost.expires_in) == ("held", 60)
    assert lost.owner is not None
    assert lost.owner.expires_at == ahead + timedelta(seconds=60)


def test_a_loser_never_receives_the_token(store: LeaseStore) -> None:
    assert "token" not in {f.name for f in dataclasses.fields(Owner)}
    held(store.acquire(NAME, holder="a", ttl=30, environment="prod"))
    loser = store.acquire(NAME, holder="b", ttl=30, environment="prod")
    assert loser.lease is None
    assert not hasattr(loser.owner, "token")
    # Not in the SQL answer either: any client calling the function directly gets no token.
    with store.engine.connect() as conn:
        answer = conn.execute(
            sa.text(
                "SELECT outcome, token FROM celery_fence.acquire("
                "'release:prod', 'prod', 'c', interval '30 seconds')"
            )
        ).one()
    assert (answer.outcome, answer.token) == ("held", None)


def table_writes(engine: Engine, solo: LeaseStore) -> dict[str, tuple[int, int, int]]:
    """Rows inserted, updated and deleted in each celery_fence table, as counted by PostgreSQL.

    ``solo`` is the dedicated store whose one backend did the work: it is made to publish its
    pending counts first, so that the figures are exact rather than up to a second old.
    """
    with solo.protocol_connection() as connection:
        connection.execute("SELECT pg_stat_force_next_flush()")
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
            "WHERE schemaname = 'celery_fence'"
        )
        return {row.relname: (row.n_tup_ins, row.n_tup_upd, row.n_tup_del) for row in rows}


def test_losing_acquisitions_write_nothing(store: LeaseStore) -> None:
    solo = store.dedicated()
    try:
        lease = held(solo.acquire(NAME, holder="a", ttl=300, environment="prod"))
        before_counts = table_writes(store.engine, solo)
        before_row = lease_row(store.engine, NAME)
        for index in range(200):
            loser = solo.acquire(NAME, holder=f"b{index % 3}", ttl=30, environment="prod")
            assert loser.outcome == "held"
        # Not one row inserted, updated, deleted or even locked (xmax would show a lock).
        assert table_writes(store.engine, solo) == before_counts
        assert lease_row(store.engine, NAME) == before_row
        # The same measure does see a winning acquisition's writes.
        solo.release(lease)
        held(solo.acquire(NAME, holder="b", ttl=30, environment="prod"))
        assert table_writes(store.engine, solo) != before_counts
    finally:
        solo.dispose()


def test_every_protocol_path_runs_its_sql_helpers_inlined(engine: Engine) -> None:
    """A SQL-language helper (answer_of, stale_reason, ...) that PostgreSQL does not inline is
    called as a function, which parses and plans its body again in every transaction. With
    ``track_functions = 'all'`` the server counts exactly those calls: the protocol's paths
    below, through the statements the store sends, must leave them at zero."""
    queries = _sql.queries()
    lease = {"name": "inline", "environment": "prod", "purpose": "", "now": None, "lock_timeout": 2}
    acquire = {**lease, "ttl": 60, "max_hold": None}

    with engine.begin() as conn:

        def call(query: str, **params: Any) -> Any:
            return conn.execute(sa.text(queries[query]), {**lease, **params}).first()

        conn.exec_driver_sql("SET LOCAL track_functions = 'all'")
        # Generic plans only: a custom plan folds a helper whose arguments are all constants by
        # calling it once at planning, which is counted too but is not repeated per call.
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        won = call("acquire", **acquire, holder="a")  # the row does not exist yet
        assert won.outcome == "acquired"
        assert call("acquire", **acquire, holder="b").outcome == "held"
        own = {"epoch": won.epoch, "token": won.token, "holder": "a", "enforced": True}
        own |= {"sharer": None, "finished": True, "joined_at": None}
        forged = {**own, "token": uuid.uuid4()}
        assert call("renew", **own, ttl=60).outcome == "renewed"
        assert call("renew", **forged, ttl=60).outcome == "lost"
        assert call("check_fence", **own).outcome == "held"
        call("fence", **own)
        granted = {field.name: won._mapping.get(field.name) for field in dataclasses.fields(Lease)}
        publisher = Lease(**{**granted, "ttl": 60, "deadline": time.monotonic() + 60})
        for mode in ("join", "resume"):  # a resume joins as a second sharer
            rejoin = {**acquire, **own, "mode": mode, "action": "start"}
            rejoin |= {"successor": None, "delivery_prefix": None}
            signed = bytes.fromhex(proof(publisher, mode))
            assert call("rejoin", **rejoin, proof=signed).outcome == "joined"
            assert call("rejoin", **rejoin, proof=bytes(32)).reason == "forged"
        # A delivery's join (a third sharer), its redelivery while it shares, and after it left.
        delivery = {**rejoin, "proof": signed, "delivery_prefix": "child[1]@"}
        assert call("rejoin", **delivery).outcome == "joined"
        assert call("rejoin", **delivery).outcome == "shared"
        assert call("release", **{**own, "sharer": "child[1]@"}).outcome == "left"
        assert call("rejoin", **delivery).outcome == "done"
        assert call("owner").holder == "a"
        assert call("owner", name="inline:missing").outcome is None
        assert call("leases", environment="prod").holder == "a"
        assert call("release", **forged).outcome == "lost"
        assert call("release", **own).outcome == "left"
        assert call("release", **own).outcome == "released"
        assert call("release", **own).outcome == "released"  # twice is harmless
        assert call("history", limit=10).end_reason == "released"
        assert call("pause", reason="audit", by="ops").outcome == "paused"
        assert call("acquire", **acquire, holder="b").outcome == "paused"
        assert call("resume").outcome == "resumed"
        again = call("acquire", **acquire, holder="b")
        assert again.outcome == "acquired"
        # Taking over an expired lease: the clock injected a day ahead.
        later = {**acquire, "now": again.expires_at + timedelta(days=1)}
        assert call("acquire", **later, holder="c").outcome == "acquired"
        counts = conn.exec_driver_sql(
            "SELECT l.lanname, p.proname, pg_stat_get_xact_function_calls(p.oid) AS calls "
            "FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
            "WHERE p.pronamespace = 'celery_fence'::regnamespace"
        ).all()
    called = {(row.lanname, row.proname): row.calls for row in counts if row.calls}
    # The count is on: the plpgsql protocol functions were called (acquire 5 times).
    assert called[("plpgsql", "acquire")] == 5
    assert {name: calls for (language, name), calls in called.items() if language == "sql"} == {}


# -- header proofs: the same HMAC in SQL and in Python -----------------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (b"", b""),
        (b"k", b"message"),
        (uuid.UUID(int=7).bytes, b"release:prod\n3\nbeat@host-a\njoin"),
        (bytes(range(64)), b"exactly one block of key"),
        (bytes(range(65)), b"a key longer than the block is hashed first"),
        (b"\xff" * 200, b"x" * 1000),
    ],
)
def test_sql_hmac_matches_python(engine: Engine, key: bytes, message: bytes) -> None:
    with engine.connect() as conn:
        digest = conn.execute(
            sa.text("SELECT celery_fence.hmac_sha256(:k, :m)"), {"k": key, "m": message}
        ).scalar_one()
    assert bytes(digest) == hmac.new(key, message, hashlib.sha256).digest()


@pytest.mark.parametrize("mode", ["join", "resume"])
def test_python_proof_matches_the_sql_computation(store: LeaseStore, mode: str) -> None:
    lease = held(store.acquire("release:prød ✓", holder="beat@host-ä", ttl=30, environment="prod"))
    with store.engine.connect() as conn:
        expected = conn.execute(
            sa.text(
                "SELECT encode(celery_fence.hmac_sha256(uuid_send(token), "
                "celery_fence.proof_message(name, epoch, holder, :mode)), 'hex') "
                "FROM celery_fence.leases WHERE name = :name"
            ),
            {"mode": mode, "name": lease.name},
        ).scalar_one()
    assert proof(lease, mode) == expected  # type: ignore[arg-type]


# -- the store's own connections -----------------------------------------------------------------


def test_a_protocol_connection_left_out_of_autocommit_is_not_reused(
    store: LeaseStore, engine: Engine
) -> None:
    with store.protocol_connection() as connection:
        connection.autocommit = False
        lent = connection.info.backend_pid
    got = store.acquire(NAME, holder="a", ttl=30)
    # Committed: another session sees it.
    with engine.connect() as conn:
        epoch = conn.execute(
            sa.text("SELECT epoch FROM celery_fence.leases WHERE name = :n"), {"n": NAME}
        ).scalar_one()
    assert got.lease is not None
    assert epoch == got.lease.epoch
    with store.protocol_connection() as connection:
        assert connection.autocommit
        assert connection.info.backend_pid != lent


@pytest.mark.parametrize("max_connections", [None, 3], ids=["twice the pool size", "three"])
def test_protocol_calls_beyond_max_connections_wait_for_a_connection(
    engine: Engine, max_connections: int | None
) -> None:
    store = LeaseStore(engine, pool_size=1, max_connections=max_connections)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            with ExitStack() as held:
                for _ in range(max_connections or 2):
                    held.enter_context(store.protocol_connection())
                pending = pool.submit(store.owner, NAME)
                done, _ = wait([pending], timeout=0.5)
                assert not done
            assert pending.result(timeout=10) is None
    finally:
        store.dispose()


# Forking with other threads alive (a renewal thread of an earlier test) is what these tests do.
FORK_WARNING = (
    r"ignore:This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to "
    r"deadlocks in the child\.:DeprecationWarning"
)


def test_a_protocol_connection_that_cannot_be_opened_gives_its_place_back(
    database_url: str,
) -> None:
    url = make_url(database_url).set(database="celery_fence_no_such_database")
    store = LeaseStore(sa.create_engine(url), pool_size=1)  # two open at most
    try:
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(FenceDatabaseError, match="does not exist"):
                store.owner(NAME)
        assert time.monotonic() - started < 10
    finally:
        store.dispose()


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_child_forked_while_a_connection_is_lent_leaves_it_to_the_parent(
    store: LeaseStore,
) -> None:
    read_end, write_end = os.pipe()
    with store.protocol_connection() as connection:
        parent_backend = connection.info.backend_pid
        child = os.fork()
    if child == 0:  # the child gives the connection back too, then makes calls of its own
        try:
            with store.protocol_connection() as connection:
                answer = str(connection.info.backend_pid)
        except BaseException as exc:
            answer = repr(exc)
        finally:
            os.write(write_end, answer.encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end) as answers:
        child_backend = answers.read()
    assert child_backend.isdigit(), child_backend
    assert int(child_backend) != parent_backend
    # Still the parent's, open and in use: the child neither reused nor closed it.
    with store.protocol_connection() as connection:
        assert connection.info.backend_pid == parent_backend
        assert connection.execute("SELECT 1").fetchone() == (1,)


def _owner_in_child(store: LeaseStore, answers: Queue[tuple[int, str]]) -> None:
    with store.protocol_connection() as connection:
        pid = connection.info.backend_pid
    owner = store.owner(NAME)
    answers.put((pid, owner.holder if owner else ""))


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_forked_child_opens_its_own_connections_and_leaves_the_parents(
    store: LeaseStore,
) -> None:
    store.acquire(NAME, holder="parent", ttl=30)
    with store.protocol_connection() as connection:
        parent_pid = connection.info.backend_pid
    context = multiprocessing.get_context("fork")
    answers: Queue[tuple[int, str]] = context.Queue()
    child = context.Process(target=_owner_in_child, args=(store, answers))
    child.start()
    child_pid, holder = answers.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert holder == "parent"
    assert child_pid != parent_pid
    # The parent's connection survived the child, its use and its exit.
    with store.protocol_connection() as connection:
        assert connection.info.backend_pid == parent_pid
        assert connection.execute("SELECT 1").fetchone() == (1,)


def test_a_store_needs_psycopg() -> None:
    with pytest.raises(ConfigurationError, match="psycopg 3"):
        LeaseStore(sa.create_engine("sqlite://"))


def test_protocol_connections_are_opened_as_the_engine_opens_its_own(database_url: str) -> None:
    # The URL names no database that exists: the engine's connect_args name the real one, and a
    # connect listener sets a marker. Both must reach the store's own connections.
    url = make_url(database_url)
    engine = sa.create_engine(
        url.set(database="celery_fence_no_such_database"),
        connect_args={"dbname": url.database, "application_name": "fence-connect-args"},
    )

    @sa.event.listens_for(engine, "connect")
    def _mark(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET celery_fence_test.marker = 'from-listener'")
        dbapi_connection.commit()

    store = LeaseStore(engine)
    try:
        got = store.acquire(NAME, holder="a", ttl=30)
        assert got.acquired
        with store.protocol_connection() as connection:
            settings = connection.execute(
                "SELECT current_database(), current_setting('application_name'), "
                "current_setting('celery_fence_test.marker')"
            ).fetchone()
        assert settings == (url.database, "fence-connect-args", "from-listener")
    finally:
        store.dispose()


@pytest.mark.parametrize("date_style", ["SQL,DMY", "German", "Postgres,MDY"])
def test_protocol_calls_read_times_and_spans_whatever_the_session_starts_with(
    database_url: str, date_style: str
) -> None:
    """psycopg reads times only in the ISO date style, and the seconds a lease has left come as
    a float in text, which a low ``extra_float_digits`` rounds (to one digit at -15): a role, a
    database or PGOPTIONS may have set either. The store's connections read both in full."""
    engine = engine_from_url(
        database_url,
        connect_args={"options": f"-c DateStyle={date_style} -c extra_float_digits=-15"},
    )
    store = LeaseStore(engine, safety_margin=0.1)
    try:
        started = time.monotonic()
        lease = store.acquire(NAME, holder="a", ttl=26).lease
        assert lease is not None
        # 26 s less the margin, counted from before the request: 23.4 s, never the 27 s less
        # the margin that a remaining time rounded to 30 s would give.
        assert started + 23.3 <= lease.deadline <= time.monotonic() + 23.4
        owner = store.owner(NAME)
        assert owner is not None
        assert (owner.acquired_at, owner.expires_at) == (lease.acquired_at, lease.expires_at)
        assert [entry.epoch for entry in store.history(NAME)] == [1]
    finally:
        store.dispose()
        engine.dispose()


def test_protocol_calls_do_not_wait_for_an_exhausted_engine_pool(database_url: str) -> None:
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=30)
    store = LeaseStore(engine)
    try:
        with engine.connect():  # the engine's only connection, busy with the work
            started = time.monotonic()
            with store.protocol_connection(), store.protocol_connection():
                pass  # two of the store's own open at once
            assert store.acquire(NAME, holder="a", ttl=30).acquired
            assert time.monotonic() - started < 5
    finally:
        store.dispose()


# -- waiting for a lease ---------------------------------------------------------------------


def listeners(engine: Engine, expected: int) -> int:
    """How many sessions on the test's database listen for releases (their last statement was
    the LISTEN), once that number is ``expected`` or 10 s have passed (a closed session's
    backend leaves shortly after)."""
    deadline = time.monotonic() + 10
    while True:
        with engine.connect() as conn:
            count = int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND query = 'LISTEN celery_fence_released'"
                    )
                ).scalar_one()
            )
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


@pytest.fixture
def waiter(engine: Engine) -> Iterator[LeaseStore]:
    """A second store, for a caller that waits for the lease."""
    other = LeaseStore(engine)
    yield other
    other.dispose()


def held_lease(store: LeaseStore) -> Lease:
    lease = store.acquire(NAME, holder="a", ttl=60).lease
    assert lease is not None
    return lease


def wait_in_background(
    pool: ThreadPoolExecutor, waiter: LeaseStore, wait: float
) -> Future[Acquisition]:
    """Start ``waiter`` waiting for NAME; return once it has found the lease held again after it
    began to listen."""
    future = pool.submit(waiter.acquire, NAME, holder="b", ttl=60, wait=wait)
    deadline = time.monotonic() + 30
    while waiter.metrics.get("acquire.held") < 2:
        assert not future.done(), future.result()
        assert time.monotonic() < deadline, "the waiter never found the lease held"
        time.sleep(0.01)
    return future


def test_a_waiting_acquisition_takes_the_lease_as_its_holder_releases(
    store: LeaseStore, waiter: LeaseStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the release's notification can wake the waiter within the test's bound.
    monkeypatch.setattr("celery_fence.store.RECHECK_INTERVAL", 120.0)
    held = held_lease(store)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = wait_in_background(pool, waiter, wait=60)
        assert listeners(engine, 1) == 1
        store.release(held)
        released = time.monotonic()
        got = future.result(timeout=30)
        woke_after = time.monotonic() - released
    assert got.lease is not None
    assert (got.lease.holder, got.lease.epoch) == ("b", held.epoch + 1)
    assert woke_after < 30  # far below the 120 s recheck interval, also on a loaded machine
    # The listening connection was the wait's own, and is closed.
    assert listeners(engine, 0) == 0


def test_a_waiting_acquisition_takes_a_lease_that_ran_out(
    store: LeaseStore, waiter: LeaseStore, expire_lease: Callable[[str], None]
) -> None:
    held = held_lease(store)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = wait_in_background(pool, waiter, wait=60)
        # No release, so no notification: the waiter's next look finds the lease expired.
        expire_lease(NAME)
        got = future.result(timeout=30)
    assert got.lease is not None
    assert got.lease.epoch == held.epoch + 1
    [ended] = [entry for entry in store.history(NAME) if entry.epoch == held.epoch]
    assert ended.end_reason == "expired"


def test_a_waiting_acquisition_answers_the_owner_when_its_time_is_up(
    store: LeaseStore, engine: Engine
) -> None:
    held = held_lease(store)
    started = time.monotonic()
    got = store.acquire(NAME, holder="b", ttl=60, wait=0.3)
    waited = time.monotonic() - started
    assert (got.outcome, got.lease) == ("held", None)
    assert got.owner is not None
    assert (got.owner.holder, got.owner.epoch) == ("a", held.epoch)
    assert 0.3 <= waited < 5
    assert listeners(engine, 0) == 0


def test_a_lease_paused_during_a_wait_ends_it(
    store: LeaseStore, waiter: LeaseStore, engine: Engine
) -> None:
    held_lease(store)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = wait_in_background(pool, waiter, wait=60)
        store.pause(NAME, reason="incident 42", by="ops")
        # No notification: the waiter's next look, within RECHECK_INTERVAL, finds it paused.
        with pytest.raises(LeasePausedError, match="incident 42"):
            future.result(timeout=30)
    assert listeners(engine, 0) == 0


def test_a_waiting_acquisition_looks_again_when_the_lease_runs_out(
    store: LeaseStore, waiter: LeaseStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither a notification nor the recheck interval: only the lease's end wakes the waiter.
    monkeypatch.setattr("celery_fence.store.RECHECK_INTERVAL", 120.0)
    held = held_lease(store)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE celery_fence.leases SET expires_at = clock_timestamp() + interval '0.5 s' "
                "WHERE name = :name"
            ),
            {"name": NAME},
        )
    started = time.monotonic()
    got = waiter.acquire(NAME, holder="b", ttl=60, wait=60)
    assert got.lease is not None
    assert got.lease.epoch == held.epoch + 1
    assert time.monotonic() - started < 30  # far below the 120 s recheck interval


def test_a_wait_whose_listening_connection_ends_listens_again(
    store: LeaseStore, waiter: LeaseStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ending the wait's listening connection (a restart, a failover, an idle
    timeout) does not end the wait: it listens on a new connection, and a release wakes it."""
    monkeypatch.setattr("celery_fence.store.RECHECK_INTERVAL", 120.0)
    held = held_lease(store)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = wait_in_background(pool, waiter, wait=60)
        assert listeners(engine, 1) == 1
        with engine.connect() as conn:
            pid = conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query = 'LISTEN celery_fence_released'"
                )
            ).scalar_one()
        _end_session(engine, pid)
        # Listening again once it has looked at the lease on the new connection.
        deadline = time.monotonic() + 30
        while waiter.metrics.get("acquire.held") < 3:
            assert not future.done(), future.result()
            assert time.monotonic() < deadline, "the waiter never listened again"
            time.sleep(0.01)
        assert listeners(engine, 1) == 1
        store.release(held)
        got = future.result(timeout=30)
    assert got.lease is not None
    assert (got.lease.holder, got.lease.epoch) == ("b", held.epoch + 1)
    assert listeners(engine, 0) == 0


def _end_session(engine: Engine, pid: int) -> None:
    """End one backend as an administrator (or a failover) would, and wait until it is gone."""
    # In autocommit: a transaction reads pg_stat_activity once and sees that snapshot after.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
        # A busy server (other sessions creating and dropping databases) can take seconds to
        # see a backend out.
        deadline = time.monotonic() + 30
        while conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one():
            assert time.monotonic() < deadline, f"backend {pid} did not end"
            time.sleep(0.01)


def test_a_protocol_connection_ended_by_the_server_while_idle_is_not_used_again(
    store: LeaseStore, engine: Engine, protected: Engine, expire_lease: Callable[[str], None]
) -> None:
    lease = held(store.acquire(NAME, holder="a", ttl=30, environment="prod"))
    with store.protocol_connection() as connection:
        ended = connection.info.backend_pid
    _end_session(engine, ended)
    # Gone from pg_stat_activity a moment before the client hears of it.
    wait_until_told(connection)
    # The next call opens a connection in its place rather than fail on the dead one.
    assert store.renew(lease).epoch == lease.epoch
    with store.protocol_connection() as connection:
        assert connection.info.backend_pid != ended
        replaced = connection.info.backend_pid
    # A rejected write is still recorded when the connection it is recorded on was ended.
    expire_lease(NAME)
    _end_session(engine, replaced)
    wait_until_told(connection)
    with pytest.raises(StaleEpochError, match="expired"):
        fenced_update(store, lease, "stale", "publish")
    assert protected_value(engine) == "initial"
    [record] = store.stale_runs(environment="prod")
    assert (record.reason, record.action, record.stale_epoch) == ("expired", "publish", 1)


@pytest.mark.parametrize("ended_by", ["the server", "its user"])
def test_a_pooled_connection_ended_while_idle_is_replaced_at_checkout(
    database_url: str, engine: Engine, ended_by: str
) -> None:
    """The beat's slot claim and every guard take a connection from the engine's pool: one the
    server ended while it waited there (idle_session_timeout, a failover, pg_terminate_backend),
    or that code using it closed (put back without a reset), must not fail them; SQLAlchemy's
    pool would hand it out as it is."""
    pooled = engine_from_url(
        database_url, poolclass=sa.pool.QueuePool, pool_size=1, pool_reset_on_return=None
    )
    store = LeaseStore(pooled)
    again = LeaseStore(pooled)  # a second store on the engine checks it no second time
    try:
        lease = held(store.acquire(NAME, holder="a", ttl=30, environment="prod"))
        slot = datetime(2026, 12, 1, tzinfo=timezone.utc)
        for attempt in range(2):
            with pooled.connect() as conn:
                ended = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
                if ended_by == "its user":
                    conn.commit()
                    dbapi_connection = conn.connection.dbapi_connection
                    assert dbapi_connection is not None
                    dbapi_connection.close()
            if ended_by == "the server":
                _end_session(engine, ended)
            claimed = store.claim_slot(lease, entry=f"plan-{attempt}", slot=slot, task="t.plan")
            assert claimed
            with pooled.connect() as conn:
                assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() != ended
        assert [event.__name__ for event in pooled.pool.dispatch.checkout] == ["_refuse_ended"]
    finally:
        again.dispose()
        store.dispose()
        pooled.dispose()


def test_an_engine_from_a_url_bounds_connecting_and_keeps_connections_alive(
    database_url: str,
) -> None:
    def parameters(engine: sa.Engine) -> dict[str, str]:
        try:
            with engine.connect() as conn:
                dbapi_connection = conn.connection.dbapi_connection
                assert dbapi_connection is not None
                found: dict[str, str] = dbapi_connection.info.get_parameters()
                return found
        finally:
            engine.dispose()

    assert {
        key: parameters(engine_from_url(database_url)).get(key)
        for key in (
            "fallback_application_name",
            "connect_timeout",
            "keepalives",
            "keepalives_idle",
            "tcp_user_timeout",
        )
    } == {
        "fallback_application_name": "celery-fence",
        "connect_timeout": "10",
        "keepalives": "1",
        "keepalives_idle": "30",
        "tcp_user_timeout": "60000",
    }
    # The URL's and connect_args' own values stay.
    mine = parameters(
        engine_from_url(f"{database_url}?connect_timeout=3", connect_args={"keepalives_idle": 5})
    )
    assert (mine["connect_timeout"], mine["keepalives_idle"]) == ("3", "5")


def test_the_server_sees_sessions_named_celery_fence_unless_they_name_themselves(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def application_name(url: str) -> str:
        store = LeaseStore.from_url(url)
        try:
            with store.protocol_connection() as connection:
                query = "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()"
                (name,) = connection.execute(query).fetchone()
                return str(name)
        finally:
            store.dispose()

    monkeypatch.delenv("PGAPPNAME", raising=False)
    assert application_name(database_url) == "celery-fence"
    assert application_name(f"{database_url}?application_name=billing") == "billing"
    monkeypatch.setenv("PGAPPNAME", "beat-eu")
    assert application_name(database_url) == "beat-eu"


def test_a_server_that_accepts_but_never_answers_fails_the_call_in_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(store_module.CONNECT_DEFAULTS, "connect_timeout", 1)
    answers: list[BaseException | None] = []
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        store = LeaseStore.from_url(f"postgresql://postgres@127.0.0.1:{port}/test")

        def call() -> None:
            try:
                store.owner(NAME)
            except BaseException as exc:
                answers.append(exc)
            else:
                answers.append(None)

        # A thread of its own, so that a call that hangs fails the test instead of stopping it.
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(timeout=15)
        store.dispose()
    assert len(answers) == 1, "the call was still waiting for the server after 15 s"
    assert isinstance(answers[0], FenceDatabaseError)


def test_a_lease_error_is_rebuilt_whole_from_its_args_and_from_a_pickle(
    store: LeaseStore,
) -> None:
    """Celery pickles a task's error from a prefork child to its parent, and its JSON result
    backend stores the error's class and args: either way the caller gets the owner back."""
    held = store.acquire(NAME, holder="deploy-1", ttl=30).lease
    assert held is not None
    owner = store.pause(NAME, reason="freeze", by="ops")
    assert owner.paused_at is not None  # every kind of field: times, optional times, text
    error = LeasePausedError("paused", lease_name=NAME, epoch=held.epoch, owner=owner)
    copies = [
        pickle.loads(pickle.dumps(error)),
        LeasePausedError(*json.loads(json.dumps(error.args))),
    ]
    for copy in copies:
        assert (type(copy), str(copy), repr(copy)) == (
            LeasePausedError,
            "paused",
            "LeasePausedError('paused')",
        )
        assert (copy.lease_name, copy.epoch, copy.reason, copy.owner) == (
            NAME,
            held.epoch,
            None,
            owner,
        )


def test_the_latest_dispatches_are_each_entrys_newest_slot_of_its_own_schedule(
    store: LeaseStore,
) -> None:
    """One read answers, for each entry asked about, its newest claimed slot of that schedule:
    not an older one, not another entry's or another schedule's; an entry never claimed is left
    out, and so is one asked about twice but answered once."""
    plans = held(store.acquire("scheduler:plans", holder="beat-a", ttl=30))
    other = held(store.acquire("scheduler:other", holder="beat-b", ttl=30))
    at = datetime(2030, 1, 1, 10, tzinfo=timezone.utc)
    for lease, entry, minutes in [
        (plans, "nightly", 0),
        (plans, "nightly", 2),
        (plans, "hourly", 1),
        (other, "hourly", 5),
        (plans, "unasked", 9),
    ]:
        assert store.claim_slot(lease, entry=entry, slot=at + timedelta(minutes=minutes), task="t")
    latest = store.latest_dispatches("scheduler:plans", ["nightly", "hourly", "never", "nightly"])
    assert {entry: (d.slot, d.holder) for entry, d in latest.items()} == {
        "nightly": (at + timedelta(minutes=2), "beat-a"),
        "hourly": (at + timedelta(minutes=1), "beat-a"),
    }
    assert store.latest_dispatches("scheduler:plans", []) == {}


@pytest.mark.parametrize("claimant", ["the leader", "a stale former leader"])
def test_a_claim_kept_waiting_by_an_uncommitted_claim_of_its_slot_gives_up(
    engine: Engine, store: LeaseStore, claimant: str
) -> None:
    """Another session wrote the slot and stopped before committing (a former leader paused by
    the OS mid-claim): the leader's claim of that slot waits at most ``lock_timeout``, then
    fails, claiming nothing; a stale lease's claim is rejected by its check, which comes before
    the write, without waiting at all."""
    quick = LeaseStore(engine, lock_timeout=0.3)
    former = held(store.acquire("scheduler:plans", holder="beat-a", ttl=30))
    store.release(former)
    leader = held(store.acquire("scheduler:plans", holder="beat-b", ttl=30))
    lease = leader if claimant == "the leader" else former
    slot = datetime(2030, 1, 1, 10, tzinfo=timezone.utc)
    with engine.connect() as paused:
        paused.execute(
            sa.text(
                "INSERT INTO celery_fence.dispatches"
                " (schedule, entry, slot, task, epoch, holder, dispatched_at)"
                " VALUES ('scheduler:plans', 'nightly', :slot, 't', 1, 'beat-a', now())"
            ),
            {"slot": slot},
        )
        with ThreadPoolExecutor(1) as pool:
            claim = pool.submit(quick.claim_slot, lease, entry="nightly", slot=slot, task="t")
            try:
                # Not waiting for the paused session: the claim gives up by itself.
                error = claim.exception(timeout=10)
            finally:
                paused.rollback()
    if claimant == "the leader":
        assert isinstance(error, FenceDatabaseError)
        assert "lock" in str(error)
        assert quick.dispatches("scheduler:plans") == []
        assert quick.claim_slot(lease, entry="nightly", slot=slot, task="t")
    else:
        assert isinstance(error, StaleEpochError)
        [stale] = store.stale_runs(lease_name="scheduler:plans")
        assert (stale.stale_epoch, stale.current_epoch) == (1, 2)
        assert quick.dispatches("scheduler:plans") == []


def test_a_claim_whose_session_the_server_ends_after_its_check_is_rejected_and_recorded(
    engine: Engine, store: LeaseStore
) -> None:
    """The claimant stalls after its fence check (a leader paused by the OS) until the server
    ends the session for idling past the lease's expiry, the idle limit the check set: the
    claim fails with its rejection, recorded, as a commit after such a stall does, and nothing
    is claimed."""
    lease = held(store.acquire("scheduler:plans", holder="beat-a", ttl=30))
    with engine.begin() as conn:  # the lease runs out 300 ms from now, by the database clock
        conn.execute(
            sa.text(
                "UPDATE celery_fence.leases SET expires_at = clock_timestamp()"
                " + interval '300 milliseconds' WHERE name = 'scheduler:plans'"
            )
        )

    def stall(_conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "bound_lock_wait" in statement:
            wait_until_told(cursor.connection)

    slot = datetime(2030, 1, 1, 10, tzinfo=timezone.utc)
    sa.event.listen(engine, "before_cursor_execute", stall)
    try:
        with pytest.raises(StaleEpochError) as caught:
            store.claim_slot(lease, entry="nightly", slot=slot, task="t")
    finally:
        sa.event.remove(engine, "before_cursor_execute", stall)
    assert (caught.value.reason, caught.value.epoch) == ("expired", 1)
    [stale] = store.stale_runs(lease_name="scheduler:plans")
    assert (stale.reason, stale.action) == ("expired", f"dispatch nightly for {slot.isoformat()}")
    assert store.dispatches("scheduler:plans") == []
