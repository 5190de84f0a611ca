"""The Celery app the end-to-end tests run as real worker and beat processes.

    python -m celery -A tests.e2e.fence_app worker -Q QUEUE
    python -m celery -A tests.e2e.fence_app beat -S fence

Everything comes from the environment, so that each test has its own database, broker and
queue: ``CELERY_FENCE_DATABASE_URL``, ``E2E_BROKER_URL``, ``E2E_RESULT_BACKEND``,
``E2E_QUEUE``, ``E2E_BEAT_TTL`` (seconds), ``E2E_TICK_EVERY`` (seconds between beat runs of
:func:`tick`; unset, beat has nothing to schedule) and ``E2E_VISIBILITY_TIMEOUT`` (seconds
after which Redis gives an unacknowledged message to a consumer again; unset, kombu's hour).

The tasks write what they saw into plain tables of the test database (:data:`SCHEMA`), so that
the tests can compare every execution with the lease history.
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa
from celery import Celery, signals

from celery_fence import Lease
from celery_fence.contrib.celery import HEADER, Fence

TICK = "e2e.tick"
RELEASE = "e2e.release"
RELEASE_ACKED_LATE = "e2e.release_acked_late"
RELEASE_WITH_STEP = "e2e.release_with_step"
MIGRATE_STEP = "e2e.migrate_step"
RELEASE_TTL = 2.0

SCHEMA = """
CREATE TABLE ticks (
    task_id     text        NOT NULL,
    epoch       bigint      NOT NULL,
    holder      text        NOT NULL,
    lease_epoch bigint      NOT NULL,
    worker_pid  integer     NOT NULL,
    ran_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE sends (
    task_id text        NOT NULL,
    epoch   bigint      NOT NULL,
    holder  text        NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE release_starts (
    task_id    text    NOT NULL,
    release_id text    NOT NULL,
    epoch      bigint  NOT NULL,
    holder     text    NOT NULL,
    worker_pid integer NOT NULL
);
CREATE TABLE manifests (
    id           integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    environment  text        NOT NULL,
    release_id   text        NOT NULL,
    build        text        NOT NULL,
    epoch        bigint      NOT NULL,
    current      boolean     NOT NULL,
    published_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE UNIQUE INDEX manifests_one_current ON manifests (environment) WHERE current;
CREATE TABLE steps (
    task_id    text    NOT NULL,
    epoch      bigint  NOT NULL,
    worker_pid integer NOT NULL
);
"""


def _env_seconds(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


app = Celery(
    "e2e",
    broker=os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("E2E_RESULT_BACKEND", "redis://127.0.0.1:6379/0"),
    set_as_current=False,
)
app.conf.update(
    fence_database_url=os.environ.get("CELERY_FENCE_DATABASE_URL"),
    fence_beat_ttl=_env_seconds("E2E_BEAT_TTL", 3.0),
    task_default_queue=os.environ.get("E2E_QUEUE", "e2e"),
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("E2E_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": _env_seconds("E2E_VISIBILITY_TIMEOUT", 3600),
        # Look for messages past it every second, not every 100 s.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if os.environ.get("E2E_TICK_EVERY"):
    app.conf.beat_schedule = {
        "tick": {"task": TICK, "schedule": _env_seconds("E2E_TICK_EVERY", 1.0)},
    }
fence = Fence(app)


@fence.task(name=TICK, lease="e2e-tick", bind=True)
def tick(self: Any) -> int:
    """A scheduled run: record the scheduler epoch that sent it and the epoch of its own
    lease, in a fenced write."""
    run = fence.current()
    lease, scheduler = run.lease, run.dispatched_by
    assert lease is not None
    assert scheduler is not None
    with fence.guard("record tick") as conn:
        conn.execute(
            sa.text(
                "INSERT INTO ticks (task_id, epoch, holder, lease_epoch, worker_pid) "
                "VALUES (:task_id, :epoch, :holder, :lease_epoch, :pid)"
            ),
            {
                "task_id": self.request.id,
                "epoch": scheduler.epoch,
                "holder": scheduler.holder,
                "lease_epoch": lease.epoch,
                "pid": os.getpid(),
            },
        )
    return scheduler.epoch


def _release(
    self: Any, environment: str, release_id: str, build: str, migrate: float = 1.0
) -> dict[str, Any]:
    """A simulated release: validate, migrate, then publish the manifest as the current one."""
    if not build.startswith("build-"):
        raise ValueError(f"release {release_id}: {build!r} is not a build")
    lease = _record_start(self, release_id)
    time.sleep(migrate)
    with fence.guard("publish manifest") as conn:
        conn.execute(
            sa.text("UPDATE manifests SET current = false WHERE environment = :environment"),
            {"environment": environment},
        )
        conn.execute(
            sa.text(
                "INSERT INTO manifests (environment, release_id, build, epoch, current) "
                "VALUES (:environment, :release_id, :build, :epoch, true)"
            ),
            {
                "environment": environment,
                "release_id": release_id,
                "build": build,
                "epoch": lease.epoch,
            },
        )
    return {"release_id": release_id, "epoch": lease.epoch}


RELEASE_OPTIONS: dict[str, Any] = {
    "lease": "release:{environment}",
    "environment": "{environment}",
    "purpose": "release {release_id} of {build}",
    "ttl": RELEASE_TTL,
    "bind": True,
}
release = fence.task(name=RELEASE, **RELEASE_OPTIONS)(_release)
#: The same release, its message acknowledged only once it ran, and put back when the worker
#: process running it is lost.
release_acked_late = fence.task(
    name=RELEASE_ACKED_LATE, acks_late=True, reject_on_worker_lost=True, **RELEASE_OPTIONS
)(_release)


def _record_start(self: Any, release_id: str) -> Lease:
    """Note that this run of a release (or of its step) started, at which epoch, where; the
    run's lease."""
    lease = fence.current().lease
    assert lease is not None
    with fence.store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO release_starts (task_id, release_id, epoch, holder, worker_pid) "
                "VALUES (:task_id, :release_id, :epoch, :holder, :pid)"
            ),
            {
                "task_id": self.request.id,
                "release_id": release_id,
                "epoch": lease.epoch,
                "holder": lease.holder,
                "pid": os.getpid(),
            },
        )
    return lease


def _step_started(task_id: str) -> bool:
    with fence.store.engine.connect() as conn:
        started = conn.execute(
            sa.text("SELECT 1 FROM release_starts WHERE task_id = :id"), {"id": task_id}
        ).first()
    return started is not None


@fence.task(name=RELEASE_WITH_STEP, lease="release:{environment}", ttl=RELEASE_TTL, bind=True)
def release_with_step(self: Any, environment: str, release_id: str) -> str:
    """A release that hands its migration to a step on its own lease, and ends once the step
    started: the step shares the release's epoch. Returns the step's task id."""
    step = migrate_step.delay(environment, release_id)
    deadline = time.monotonic() + 20
    while not _step_started(step.id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"release {release_id}: its step never started")
        time.sleep(0.05)
    return str(step.id)


@fence.task(
    name=MIGRATE_STEP, lease="release:{environment}", ttl=RELEASE_TTL, acks_late=True, bind=True
)
def migrate_step(self: Any, environment: str, release_id: str) -> bool:
    """The release's migration, acknowledged once it ran: it goes on until its message was
    delivered again (the redelivery, waiting for this run, leaves the task's state RETRY), at
    most 20 s, then writes its row under the lease. Returns whether it saw the redelivery."""
    lease = _record_start(self, release_id)
    deadline = time.monotonic() + 20
    while not (redelivered := self.AsyncResult(self.request.id).state == "RETRY"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    with fence.guard("migrate") as conn:
        conn.execute(
            sa.text("INSERT INTO steps (task_id, epoch, worker_pid) VALUES (:id, :epoch, :pid)"),
            {"id": self.request.id, "epoch": lease.epoch, "pid": os.getpid()},
        )
    return redelivered


@signals.before_task_publish.connect(sender=TICK, weak=False)
def record_send(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """In beat: record each dispatched tick with the epoch its header carries."""
    headers = headers or {}
    header = headers.get(HEADER)
    if not headers.get("celery_beat_task") or not isinstance(header, dict):
        return
    with fence.store.engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO sends (task_id, epoch, holder) VALUES (:id, :epoch, :holder)"),
            {"id": headers["id"], "epoch": header["epoch"], "holder": header["holder"]},
        )
