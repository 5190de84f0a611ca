"""Simulated releases through real prefork workers on a real broker.

Two releases for one environment race: exactly one manifest is published, the winner's, and the
lease history names it. A release whose lease expired while its worker process was stopped, and
was taken over by another release, cannot publish when it resumes. A release's step that Redis
delivers again while it runs (past the visibility timeout) runs once.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from celery_fence import LeaseStore, StaleEpochError
from celery_fence.contrib.celery import SKIPPED

from .conftest import Cluster, wait_until
from .fence_app import RELEASE, RELEASE_ACKED_LATE, RELEASE_TTL, RELEASE_WITH_STEP

pytestmark = pytest.mark.e2e

MIGRATE = 5.0  # the stopped release's migrate step: long enough to still run when resumed


def manifests(engine: Engine, environment: str) -> list[sa.Row[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT release_id, build, epoch, current FROM manifests "
                    "WHERE environment = :environment ORDER BY id"
                ),
                {"environment": environment},
            )
        )


def started(engine: Engine, task_id: str) -> sa.Row[tuple[Any, ...]] | None:
    """The release's start record: its epoch, holder and the pool process that runs it."""
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT epoch, holder, worker_pid FROM release_starts WHERE task_id = :id"),
            {"id": task_id},
        ).first()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_racing_releases_publish_exactly_one_manifest(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    cluster.worker("w1", concurrency=2)
    builds = {"r-101": "build-101", "r-102": "build-102"}
    results = {rid: cluster.send(RELEASE, "prod", rid, build) for rid, build in builds.items()}

    states = {rid: cluster.finished(result) for rid, result in results.items()}

    assert sorted(states.values()) == [SKIPPED, "SUCCESS"], states
    (winner,) = (rid for rid, state in states.items() if state == "SUCCESS")
    (loser,) = set(builds) - {winner}
    (entry,) = store.history("release:prod")
    assert (entry.epoch, entry.environment, entry.purpose) == (
        1,
        "prod",
        f"release {winner} of {builds[winner]}",
    )
    assert results[winner].id in entry.holder
    assert entry.end_reason == "released"
    assert results[winner].result == {"release_id": winner, "epoch": 1}
    assert manifests(engine, "prod") == [(winner, builds[winner], 1, True)]
    assert started(engine, results[loser].id) is None
    skipped = results[loser].info
    assert skipped["lease"] == "release:prod"
    assert skipped["reason"] == "held"
    assert (skipped["owner_holder"], skipped["owner_epoch"]) == (entry.holder, 1)
    assert skipped["owner_expires_at"] is not None


def test_release_whose_lease_was_taken_over_cannot_publish(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    queue_a, queue_b = f"{cluster.queue}-a", f"{cluster.queue}-b"
    cluster.worker("wa", queue=queue_a)
    cluster.worker("wb", queue=queue_b)
    a = cluster.send(RELEASE, "staging", "r-201", "build-201", queue=queue_a, migrate=MIGRATE)
    start_a = wait_until(lambda: started(engine, a.id), timeout=15, what="release A to start")
    began = time.monotonic()
    # Freeze the pool process running A: its migrate step and its lease renewal both stop.
    os.kill(start_a.worker_pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: getattr(store.owner("release:staging"), "state", None) == "expired",
            timeout=RELEASE_TTL + 5,
            what="A's lease to expire",
        )
        b = cluster.send(RELEASE, "staging", "r-202", "build-202", queue=queue_b, migrate=0.2)
        assert cluster.finished(b) == "SUCCESS"
        # A resumes inside its migrate step, so its keeper finds the deadline passed first.
        assert time.monotonic() - began < MIGRATE - 1
    finally:
        os.kill(start_a.worker_pid, signal.SIGCONT)

    assert cluster.finished(a, timeout=MIGRATE + 15) == "FAILURE"
    assert isinstance(a.result, StaleEpochError)
    assert "passed its deadline before 'publish manifest'" in str(a.result)
    assert b.result == {"release_id": "r-202", "epoch": 2}
    assert manifests(engine, "staging") == [("r-202", "build-202", 2, True)]
    history = store.history("release:staging")
    assert [(h.epoch, h.purpose, h.end_reason) for h in history] == [
        (2, "release r-202 of build-202", "released"),
        (1, "release r-201 of build-201", "expired"),
    ]
    runs = store.stale_runs(lease_name="release:staging")
    # Newest first: the publish was refused because A's own deadline had passed (it never
    # reached the database); the release at the end was refused as superseded. The keeper
    # attempted no renewal past the deadline, so none is recorded.
    assert [(run.action, run.reason) for run in runs] == [
        ("release", "superseded"),
        ("publish manifest", "expired"),
    ]
    for run in runs:
        assert (run.environment, run.enforced) == ("staging", True)
        assert (run.stale_epoch, run.stale_holder) == (1, start_a.holder)
        assert (run.current_epoch, run.current_holder) == (2, history[0].holder)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_release_whose_pool_process_is_terminated_runs_again_once_its_lease_expires(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    """A service manager that signals every process of the worker (systemd's default) sends
    SIGTERM to the pool process running a release too, which raises SystemExit in its body. Its
    message, acknowledged late, is put back. The interrupted run keeps its lease until it
    expires, so that the redelivery runs then, at the next epoch, and publishes, instead of
    being dropped as work already done."""
    worker = cluster.worker("w1", concurrency=1)
    result = cluster.send(RELEASE_ACKED_LATE, "prod", "r-301", "build-301", migrate=MIGRATE / 2)
    first = wait_until(lambda: started(engine, result.id), timeout=15, what="the release to start")
    os.kill(first.worker_pid, signal.SIGTERM)

    assert cluster.finished(result, timeout=RELEASE_TTL + MIGRATE + 30) == "SUCCESS"
    assert result.result == {"release_id": "r-301", "epoch": 2}
    assert manifests(engine, "prod") == [("r-301", "build-301", 2, True)]
    with engine.connect() as conn:
        starts = conn.execute(
            sa.text("SELECT epoch FROM release_starts WHERE task_id = :id ORDER BY epoch"),
            {"id": result.id},
        ).scalars()
        assert list(starts) == [1, 2]
    history = store.history("release:prod")
    assert [(h.epoch, h.end_reason) for h in history] == [(2, "released"), (1, "expired")]
    worker.wait_for_log(
        "keeping lease release:prod until it expires: the run was interrupted (SystemExit)",
        timeout=5,
    )


def test_a_step_redelivered_past_the_visibility_timeout_while_it_runs_runs_once(
    cluster: Cluster, store: LeaseStore, engine: Engine
) -> None:
    """A release hands its migration to a step task on its own lease, acknowledged late, which
    joins the release's epoch. Redis gives the step's message to the worker again once the
    visibility timeout (1 s) passed, while the step still runs: the redelivery does not join
    beside it at the same epoch but waits, and is dropped once the step ran to its end."""
    cluster.env["E2E_VISIBILITY_TIMEOUT"] = "1"
    worker = cluster.worker("w1", concurrency=2)
    result = cluster.send(RELEASE_WITH_STEP, "prod", "r-401")
    assert cluster.finished(result, timeout=30) == "SUCCESS"
    step = cluster.result(result.result)
    assert cluster.finished(step, timeout=40) == "SUCCESS"
    assert step.result is True  # the step saw its redelivery wait for it
    worker.wait_for_log(
        "an earlier delivery of this message ran to its end under lease release:prod; this "
        "delivery is dropped",
        timeout=15,
    )

    with engine.connect() as conn:
        steps = conn.execute(sa.text("SELECT task_id, epoch FROM steps ORDER BY epoch")).all()
        starts = conn.execute(
            sa.text("SELECT epoch FROM release_starts WHERE task_id = :id"), {"id": step.id}
        ).scalars()
        assert list(starts) == [1]
    assert [tuple(row) for row in steps] == [(step.id, 1)]
    assert [(h.epoch, h.end_reason) for h in store.history("release:prod")] == [(1, "released")]
    assert store.stale_runs() == []
    assert step.state == "SUCCESS"  # the dropped redelivery stored no state over the step's
