"""Two ``celery beat -S fence`` instances against one schedule, one worker, a real broker.

The leader is stopped with SIGSTOP past its TTL: the standby takes over within about one TTL,
the resumed instance steps down without crashing, a message carrying its old epoch is rejected
at the worker and recorded, and every execution ran on a lease of its own, once, for a message
its epoch's leader sent. Pausing the lease stops both instances from dispatching; resuming it
lets one lead again.
"""

from __future__ import annotations

import collections
import signal
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from celery_fence import LeaseStore, Owner
from celery_fence.contrib.celery import HEADER, REJECTED, FenceHeader

from .conftest import Cluster, Process, wait_until
from .fence_app import TICK

pytestmark = pytest.mark.e2e

LEASE = "scheduler:e2e"
BEAT_TTL = 3.0
RENEW_INTERVAL = BEAT_TTL / 3  # the default: a third of the TTL
TICK_EVERY = 1.0
SLACK = 2.5  # process scheduling on a busy 2-core machine
TAKEOVER = BEAT_TTL + RENEW_INTERVAL + SLACK
RUNS = 3  # executions to see under each epoch before moving on


def start_beats(cluster: Cluster, store: LeaseStore, engine: Engine) -> tuple[list[Process], Owner]:
    """A worker and two beats; return them and the leader once one leads and its ticks run."""
    cluster.env.update(E2E_BEAT_TTL=str(BEAT_TTL), E2E_TICK_EVERY=str(TICK_EVERY))
    cluster.worker("worker")
    beats = [cluster.beat("beat-1"), cluster.beat("beat-2")]
    first = wait_until(lambda: leader(store), timeout=30, what="a beat to lead")
    wait_for_ticks(engine, first.epoch)
    return beats, first


def holds(beat: Process, owner: Owner) -> bool:
    """Whether ``owner`` is this beat process: its holder is ``beat@HOST:PID[:START]``."""
    return f":{beat.pid}:" in f"{owner.holder}:"


def leader(store: LeaseStore, *, newer_than: int = 0) -> Owner | None:
    owner = store.owner(LEASE)
    return owner if owner is not None and owner.held and owner.epoch > newer_than else None


def rows(engine: Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text(sql), params)]


def ticks(engine: Engine, epoch: int) -> int:
    return len(rows(engine, "SELECT 1 FROM ticks WHERE epoch = :epoch", epoch=epoch))


def counts(engine: Engine) -> tuple[int, int]:
    """(slots dispatched, ticks executed) so far."""
    (row,) = rows(
        engine,
        "SELECT (SELECT count(*) FROM celery_fence.dispatches), (SELECT count(*) FROM ticks)",
    )
    return row[0], row[1]


def wait_for_ticks(engine: Engine, epoch: int) -> None:
    wait_until(
        lambda: ticks(engine, epoch) >= RUNS,
        timeout=RUNS * TICK_EVERY + TAKEOVER,
        what=f"{RUNS} ticks under epoch {epoch}",
    )


def join_header(engine: Engine) -> dict[str, Any]:
    """The header the current leader puts on what it dispatches, as it would send it."""
    (row,) = rows(
        engine,
        "SELECT name, epoch, holder, encode(celery_fence.hmac_sha256(uuid_send(token), "
        "celery_fence.proof_message(name, epoch, holder, 'join')), 'hex') "
        "FROM celery_fence.leases WHERE name = :name",
        name=LEASE,
    )
    name, epoch, holder, proof = row
    header = FenceHeader(lease=name, epoch=epoch, holder=holder, mode="join", proof=proof)
    return header.to_message()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_standby_takes_over_from_a_stopped_leader_which_steps_down_on_resume(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    beats, first = start_beats(cluster, store, engine)
    old_header = join_header(engine)
    (old,) = [beat for beat in beats if holds(beat, first)]
    (standby,) = [beat for beat in beats if beat is not old]

    old.popen.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    second = wait_until(
        lambda: leader(store, newer_than=first.epoch), timeout=TAKEOVER + 5, what="a takeover"
    )
    took = time.monotonic() - stopped_at
    assert took <= TAKEOVER, f"takeover took {took:.1f}s"
    assert second.epoch == first.epoch + 1
    assert holds(standby, second)
    wait_for_ticks(engine, second.epoch)

    # What the stopped leader would still send: rejected at the worker before the body runs.
    stale = cluster.send(TICK, headers={HEADER: old_header})
    assert cluster.finished(stale) == REJECTED
    assert (stale.info["reason"], stale.info["owner_epoch"]) == ("superseded", second.epoch)
    recorded = [
        (run.stale_holder, run.current_epoch)
        for run in store.stale_runs(lease_name=LEASE)
        if (run.action, run.reason, run.stale_epoch) == (f"start {TICK}", "superseded", first.epoch)
    ]
    assert (first.holder, second.epoch) in recorded

    old.popen.send_signal(signal.SIGCONT)
    old.wait_for_log("beat on standby", f"stepped down from epoch {first.epoch}", timeout=SLACK)
    old.wait_for_log(f"leads at epoch {second.epoch}", timeout=RENEW_INTERVAL + SLACK)
    assert old.alive
    assert standby.alive
    current = leader(store)
    assert current is not None
    assert (current.epoch, current.holder) == (second.epoch, second.holder)
    assert len(old.lines("beat leads")) == 1  # no restart, no second bid that won

    for beat in (old, standby):
        beat.stop()  # quiesce before accounting for every dispatch
    check_every_dispatch(cluster, store, engine)
    stale_renewals = [
        run
        for run in store.stale_runs(lease_name=LEASE)
        if (run.action, run.stale_holder) == ("renew", first.holder)
    ]
    assert [(r.reason, r.stale_epoch, r.current_epoch) for r in stale_renewals] == [
        ("superseded", first.epoch, second.epoch)
    ]


def check_every_dispatch(cluster: Cluster, store: LeaseStore, engine: Engine) -> None:
    """Each slot was dispatched once, each dispatch sent once, each send ran at most once,
    on a lease epoch of its own, and only under the epoch that sent it; a run that did not is
    REJECTED and recorded."""
    granted = {entry.epoch: entry.acquired_at for entry in store.history(LEASE)}
    dispatched = collections.Counter(d.epoch for d in store.dispatches(LEASE, limit=10_000))
    sends = rows(engine, "SELECT task_id, epoch FROM sends")
    sent = collections.Counter(epoch for _, epoch in sends)
    for epoch in granted:
        assert sent[epoch] <= dispatched[epoch] <= sent[epoch] + 1, (epoch, sent, dispatched)
    runs = {
        task_id: (epoch, lease_epoch)
        for task_id, epoch, lease_epoch in rows(
            engine, "SELECT task_id, epoch, lease_epoch FROM ticks"
        )
    }
    assert len(runs) == len(rows(engine, "SELECT 1 FROM ticks")), "a tick ran twice"
    lease_epochs = [lease_epoch for _, lease_epoch in runs.values()]
    assert len(set(lease_epochs)) == len(lease_epochs), "two ticks shared a lease epoch"
    stale_runs = store.stale_runs(lease_name=LEASE)
    rejected_starts = collections.Counter(
        run.stale_epoch for run in stale_runs if run.action == f"start {TICK}"
    )
    rejected: collections.Counter[int] = collections.Counter()
    for task_id, epoch in sends:
        state = cluster.finished(cluster.result(task_id))
        if state == REJECTED:
            assert task_id not in runs
            rejected[epoch] += 1
        else:
            assert state == "SUCCESS"
            assert runs[task_id][0] == epoch
    for epoch, count in rejected.items():
        assert rejected_starts[epoch] >= count


def test_pausing_the_lease_stops_dispatching_until_resumed(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    beats, first = start_beats(cluster, store, engine)

    store.pause(LEASE, reason="e2e kill switch", by="e2e")
    paused = time.monotonic()
    before = counts(engine)
    for beat in beats:
        beat.wait_for_log("beat on standby", "paused", timeout=BEAT_TTL)
    # Nothing is dispatched or executed while paused, by either instance.
    time.sleep(max(0.0, BEAT_TTL - (time.monotonic() - paused)))
    assert counts(engine) == before

    store.resume(LEASE)
    second = wait_until(
        lambda: leader(store, newer_than=first.epoch), timeout=TAKEOVER, what="a leader again"
    )
    wait_for_ticks(engine, second.epoch)
    assert all(beat.alive for beat in beats)
