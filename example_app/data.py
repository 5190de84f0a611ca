"""The document service's tables: creating and seeding them, writing and reading them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from celery_fence.store import Executor

T = TypeVar("T")

SCHEMA = Path(__file__).with_name("schema.sql")
SEED_DOCUMENTS = 12


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """An environment's current release, and the release lease epoch that published it."""

    environment: str
    release_id: str
    commit: str
    build: int
    epoch: int
    rollback: bool
    published_at: datetime


@dataclass(frozen=True, kw_only=True)
class ReleaseRecord:
    """How one release attempt ended: ``published``, ``refused`` (an older build without
    ``rollback``) or ``rejected`` (its epoch no longer held when it published)."""

    environment: str
    release_id: str
    commit: str
    build: int
    rollback: bool
    task_id: str
    epoch: int
    holder: str
    outcome: str
    detail: str
    logged_at: datetime


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One retention plan: the documents due, planned under ``lease_name`` at ``epoch``; for
    a run a fenced beat sent, the scheduler lease and epoch that sent it."""

    id: int
    lease_name: str
    epoch: int
    holder: str
    task_id: str
    planned_at: datetime
    document_ids: list[int]
    scheduled_by: str | None
    schedule_epoch: int | None


def create_tables(engine: Engine) -> None:
    """Run schema.sql (idempotent)."""
    with engine.begin() as conn:
        # A plain DB-API execute without parameters runs the whole script at once.
        conn.connection.cursor().execute(SCHEMA.read_text())


def seed(engine: Engine, *, count: int = SEED_DOCUMENTS) -> int:
    """Create the tables and, when there are no documents yet, ``count`` documents whose
    retention dates run from ``count // 2`` days ago into the future. Return how many
    documents there are."""
    create_tables(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("LOCK TABLE example_app.documents IN SHARE ROW EXCLUSIVE MODE"))
        conn.execute(
            sa.text(
                """
                INSERT INTO example_app.documents (title, retention_until)
                SELECT (ARRAY['Invoice', 'Contract', 'Payslip', 'Quote'])[1 + mod(g, 4)]
                           || ' ' || (1000 + g),
                       date_trunc('day', clock_timestamp())
                           + (g - CAST(:count AS integer) / 2 - 1) * interval '1 day'
                FROM generate_series(1, :count) AS g
                WHERE NOT EXISTS (SELECT FROM example_app.documents)
                """
            ),
            {"count": count},
        )
        return document_count(conn)


def document_count(conn: Connection) -> int:
    return int(conn.execute(sa.text("SELECT count(*) FROM example_app.documents")).scalar_one())


def write_plan(
    conn: Executor,
    *,
    lease_name: str,
    epoch: int,
    holder: str,
    task_id: str,
    scheduled_by: str | None = None,
    schedule_epoch: int | None = None,
) -> Plan:
    """Plan the removal of every document past its retention date (nothing is deleted).
    A task id that already planned gets its earlier plan back."""
    params = {
        "lease_name": lease_name,
        "epoch": epoch,
        "holder": holder,
        "task_id": task_id,
        "scheduled_by": scheduled_by,
        "schedule_epoch": schedule_epoch,
    }
    row = conn.execute(
        sa.text(
            """
            INSERT INTO example_app.retention_plans
                (lease_name, epoch, holder, task_id, scheduled_by, schedule_epoch, document_ids)
            SELECT :lease_name, :epoch, :holder, :task_id, :scheduled_by, :schedule_epoch,
                   coalesce(array_agg(d.id ORDER BY d.id), '{}')
            FROM example_app.documents d
            WHERE d.retention_until <= clock_timestamp()
            ON CONFLICT (task_id) DO NOTHING
            RETURNING *
            """
        ),
        params,
    ).first()
    if row is None:
        row = conn.execute(
            sa.text("SELECT * FROM example_app.retention_plans WHERE task_id = :task_id"), params
        ).one()
    return Plan(**row._mapping)


def current_manifest(conn: Executor, environment: str) -> Manifest | None:
    """The environment's manifest, locked until the transaction ends (publishers queue)."""
    row = conn.execute(
        sa.text("SELECT * FROM example_app.manifests WHERE environment = :environment FOR UPDATE"),
        {"environment": environment},
    ).first()
    return None if row is None else Manifest(**row._mapping)


def put_manifest(conn: Executor, **fields: Any) -> Manifest:
    """Make a release the environment's current one."""
    row = conn.execute(
        sa.text(
            """
            INSERT INTO example_app.manifests AS m
                (environment, release_id, commit, build, epoch, rollback, published_at)
            VALUES (:environment, :release_id, :commit, :build, :epoch, :rollback,
                    clock_timestamp())
            ON CONFLICT (environment) DO UPDATE SET
                release_id = excluded.release_id, commit = excluded.commit,
                build = excluded.build, epoch = excluded.epoch, rollback = excluded.rollback,
                published_at = excluded.published_at
            RETURNING m.*
            """
        ),
        fields,
    ).one()
    return Manifest(**row._mapping)


def log_release(engine: Engine, **fields: Any) -> None:
    """Append to the release log, in a transaction of its own."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO example_app.releases (environment, release_id, commit, build,
                    rollback, task_id, epoch, holder, outcome, detail)
                VALUES (:environment, :release_id, :commit, :build, :rollback, :task_id,
                    :epoch, :holder, :outcome, :detail)
                """
            ),
            fields,
        )


def manifests(engine: Engine) -> list[Manifest]:
    return _read(engine, "SELECT * FROM example_app.manifests ORDER BY environment", Manifest)


def releases(engine: Engine) -> list[ReleaseRecord]:
    """Every release attempt, oldest first."""
    return _read(
        engine,
        "SELECT environment, release_id, commit, build, rollback, task_id, epoch, holder, "
        "outcome, detail, logged_at FROM example_app.releases ORDER BY id",
        ReleaseRecord,
    )


def plans(engine: Engine) -> list[Plan]:
    """Every retention plan, oldest first."""
    return _read(engine, "SELECT * FROM example_app.retention_plans ORDER BY id", Plan)


def _read(engine: Engine, query: str, record: Callable[..., T]) -> list[T]:
    with engine.connect() as conn:
        return [record(**row._mapping) for row in conn.execute(sa.text(query))]
