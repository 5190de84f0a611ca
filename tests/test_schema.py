"""Installing the schema: idempotent, concurrent-safe, equal to ``sql/schema.sql``, shipped in the
wheel, and a clear error where it is missing."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from celery_fence import FenceDatabaseError, Lease, LeaseStore, SchemaNotInstalledError, _sql
from celery_fence.store import _wrap, proof

ROOT = Path(__file__).resolve().parent.parent

# A normalized picture of everything in schema celery_fence that a migration could get wrong.
CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.reloptions
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'celery_fence' ORDER BY c.relname
    """,
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON (d.adrelid, d.adnum) = (a.attrelid, a.attnum)
        WHERE n.nspname = 'celery_fence' AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum
    """,
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'celery_fence'::regnamespace
        ORDER BY 1, 2
    """,
    "indexes": """
        SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid)
        FROM pg_index JOIN pg_class c ON c.oid = indrelid
        WHERE c.relnamespace = 'celery_fence'::regnamespace ORDER BY 1
    """,
    "types": """
        SELECT typname, typtype FROM pg_type
        WHERE typnamespace = 'celery_fence'::regnamespace ORDER BY typname
    """,
    "sequences": """
        SELECT seqrelid::regclass::text, format_type(seqtypid, NULL), seqstart, seqincrement,
               seqmin, seqmax, seqcycle
        FROM pg_sequence JOIN pg_class c ON c.oid = seqrelid
        WHERE c.relnamespace = 'celery_fence'::regnamespace ORDER BY 1
    """,
    "functions": """
        SELECT proname, pg_get_function_identity_arguments(oid), pg_get_function_result(oid),
               provolatile, proisstrict, proconfig, md5(prosrc)
        FROM pg_proc WHERE pronamespace = 'celery_fence'::regnamespace ORDER BY 1, 2
    """,
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = tgrelid
        WHERE c.relnamespace = 'celery_fence'::regnamespace ORDER BY 1, 2
    """,
}


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = sa.create_engine(libpq_url(url, driver="postgresql+psycopg"), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return {
                part: [tuple(row) for row in conn.exec_driver_sql(query)]
                for part, query in CATALOG.items()
            }
    finally:
        engine.dispose()


def migrations_applied(url: str) -> list[tuple[int, str]]:
    engine = sa.create_engine(libpq_url(url, driver="postgresql+psycopg"), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT version, name FROM celery_fence.migrations ORDER BY version"
            )
            return [(row.version, row.name) for row in rows]
    finally:
        engine.dispose()


def libpq_url(url: str, driver: str = "postgresql") -> str:
    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def install(url: str) -> int:
    store = LeaseStore.from_url(url)
    try:
        return store.install()
    finally:
        store.engine.dispose()


@pytest.fixture
def other_empty_database_url(admin_engine: Engine, empty_database_url: str) -> Iterator[str]:
    """A second empty database, for comparing two ways of building the schema."""
    name = f"cf_other_{uuid.uuid4().hex}"
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield make_url(empty_database_url).set(database=name).render_as_string(hide_password=False)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')


def expected_migrations() -> list[tuple[int, str]]:
    return [(migration.version, migration.name) for migration in _sql.migrations()]


# -- idempotent, concurrent-safe -----------------------------------------------------------------


def test_install_twice_on_an_empty_database_changes_nothing_the_second_time(
    empty_database_url: str,
) -> None:
    assert install(empty_database_url) == _sql.latest_version()
    first = catalog(empty_database_url)
    assert install(empty_database_url) == _sql.latest_version()
    assert catalog(empty_database_url) == first
    assert migrations_applied(empty_database_url) == expected_migrations()


def test_install_keeps_the_leases_it_finds(store: LeaseStore) -> None:
    got = store.acquire("scheduler:retention", holder="beat", ttl=60, environment="prod")
    assert store.install() == _sql.latest_version()
    assert store.owner("scheduler:retention") == got.owner


def test_concurrent_installs_on_an_empty_database_both_succeed(
    empty_database_url: str, other_empty_database_url: str
) -> None:
    barrier = threading.Barrier(2)

    def racer() -> int:
        barrier.wait(30)
        return install(empty_database_url)

    with ThreadPoolExecutor(max_workers=2) as pool:
        versions = [future.result(timeout=60) for future in [pool.submit(racer) for _ in range(2)]]
    assert versions == [_sql.latest_version()] * 2
    assert migrations_applied(empty_database_url) == expected_migrations()
    install(other_empty_database_url)
    assert catalog(empty_database_url) == catalog(other_empty_database_url)


# -- the migrations build exactly what schema.sql describes --------------------------------------


def run_script(url: str, *names: str) -> None:
    """Run SQL files as they ship, unparameterized, in one transaction."""
    engine = sa.create_engine(libpq_url(url, driver="postgresql+psycopg"), poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            for name in names:
                conn.connection.cursor().execute(_sql.read(name))
    finally:
        engine.dispose()


def test_replayed_migrations_equal_schema_sql(
    empty_database_url: str, other_empty_database_url: str
) -> None:
    install(empty_database_url)
    run_script(other_empty_database_url, "schema.sql", "functions.sql")
    migrated, declared = catalog(empty_database_url), catalog(other_empty_database_url)
    assert migrated == declared
    # Not an empty comparison: the tables, their shape and their storage are all there.
    relations = {row[0]: row for row in migrated["relations"]}
    for table in ("leases", "lease_history", "stale_runs", "migrations"):
        assert relations[table][1:3] == ("r", "p"), table  # an ordinary, LOGGED table
    assert relations["leases"][3] == ["fillfactor=70"]
    assert ("answer", "c") in migrated["types"]
    checks = [row[3] for row in migrated["constraints"] if row[2] == "c"]
    assert "CHECK ((expires_at <= hold_until))" in checks


# Schema 2 as its code left it: a lease in progress at epoch 3 after one expired epoch and one
# released, and a lease whose only epoch lapsed without being taken over.
UPGRADE_FROM_2 = (
    "INSERT INTO celery_fence.migrations (version, name)"
    " VALUES (1, '0001_initial'), (2, '0002_dispatches')",
    """
    INSERT INTO celery_fence.leases (
        name, environment, holder, epoch, token, acquired_at, renewed_at,
        expires_at, hold_until, released_at
    ) VALUES
        ('held', 'prod', 'c', 3, gen_random_uuid(), :t0 + interval '2 h',
         :t0 + interval '2 h', 'infinity', 'infinity', NULL),
        ('lapsed', 'prod', 'a', 1, gen_random_uuid(), :t0, :t0,
         :t0 + interval '1 min', :t0 + interval '1 day', NULL)
    """,
    """
    INSERT INTO celery_fence.lease_history (
        name, epoch, environment, holder, purpose, acquired_at, ended_at, end_reason
    ) VALUES
        ('held', 1, 'prod', 'a', '', :t0, :t0 + interval '1 min', 'expired'),
        ('held', 2, 'prod', 'b', '', :t0 + interval '1 h', :t0 + interval '1 h 1 min', 'released'),
        ('held', 3, 'prod', 'c', '', :t0 + interval '2 h', NULL, NULL),
        ('lapsed', 1, 'prod', 'a', '', :t0, NULL, NULL)
    """,
)


def test_upgrading_from_schema_2_keeps_every_epoch_in_the_history(empty_database_url: str) -> None:
    """Schema 2 kept an open history row for each epoch in progress; from 3 on, the lease row
    stands for it. The upgrade drops only those rows, and history() reads the same epochs."""
    run_script(
        empty_database_url,
        "bootstrap.sql",
        "migrations/0001_initial.sql",
        "migrations/0002_dispatches.sql",
    )
    engine = sa.create_engine(
        libpq_url(empty_database_url, driver="postgresql+psycopg"), poolclass=sa.NullPool
    )
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    try:
        with engine.begin() as conn:
            for statement in UPGRADE_FROM_2:
                conn.execute(sa.text(statement), {"t0": t0})
        assert install(empty_database_url) == _sql.latest_version()
        with engine.connect() as conn:
            stored = conn.exec_driver_sql(
                "SELECT name, epoch FROM celery_fence.lease_history ORDER BY name, epoch"
            ).all()
    finally:
        engine.dispose()
    assert [tuple(row) for row in stored] == [("held", 1), ("held", 2)]
    store = LeaseStore.from_url(empty_database_url)
    try:
        held = store.history("held")
        lapsed = store.history("lapsed")
    finally:
        store.dispose()
    assert [(e.epoch, e.holder, e.end_reason) for e in held] == [
        (3, "c", None),
        (2, "b", "released"),
        (1, "a", "expired"),
    ]
    assert [(e.epoch, e.ended_at, e.end_reason) for e in lapsed] == [
        (1, t0 + timedelta(minutes=1), "expired")
    ]


@contextmanager
def upgraded(url: str, *, before: int, earlier: str) -> Iterator[sa.Engine]:
    """The database ``url`` as a version before migration ``before`` left it (the current
    schema, with ``earlier``, SQL that puts back what that version had, and without the record of
    migration ``before`` and later), then upgraded by ``install``: an engine on it for the
    block."""
    install(url)
    engine = sa.create_engine(libpq_url(url, driver="postgresql+psycopg"), poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM celery_fence.migrations WHERE version >= :version"),
                {"version": before},
            )
            conn.exec_driver_sql(earlier)
        assert install(url) == _sql.latest_version()
        yield engine
    finally:
        engine.dispose()


# renew's arguments up to schema 4, and a call that leaves every later one out.
RENEW_OF_SCHEMA_4 = """
    p_name text, p_epoch bigint, p_token uuid, p_ttl interval, p_holder text DEFAULT '',
    p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL"""
CALL_RENEW = (
    "SELECT outcome, reason FROM celery_fence.renew('x', 1, gen_random_uuid(), interval '9 s')"
)

# release's and rejoin's arguments in early schemas, a call of each that leaves every later one
# out, and how their arguments end now.
RELEASE_OF_SCHEMA_6 = """
    p_name text, p_epoch bigint, p_token uuid, p_holder text DEFAULT '',
    p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL"""
CALL_RELEASE = "SELECT outcome, reason FROM celery_fence.release('x', 1, gen_random_uuid())"
RELEASE_ENDS = "p_sharer text, p_finished boolean, p_joined_at timestamp with time zone"
REJOIN_OF_SCHEMA_5 = """
    p_name text, p_epoch bigint, p_holder text, p_mode text, p_proof bytea, p_ttl interval,
    p_action text DEFAULT 'rejoin', p_enforced boolean DEFAULT true, p_now timestamptz DEFAULT NULL,
    p_lock_timeout interval DEFAULT interval '2 seconds'"""
CALL_REJOIN = (
    "SELECT outcome, reason FROM celery_fence.rejoin("
    "'x', 1, 'a', 'join', '\\x00'::bytea, interval '9 s')"
)
REJOIN_ENDS = "p_successor text, p_delivery_prefix text, p_record_join boolean"

# Each: the function, the arguments an earlier schema gave it, the version that dropped that
# signature, a call that leaves the newer arguments out, what it answers (outcome and reason),
# and how the arguments of the one left end.
STALE_CALL = ("lost", "missing")
SUPERSEDED_SIGNATURES = [
    pytest.param(
        "renew",
        RENEW_OF_SCHEMA_4,
        5,
        CALL_RENEW,
        STALE_CALL,
        "p_lock_timeout interval, p_environment text",
        id="renew without a lock timeout",
    ),
    pytest.param(
        "renew",
        f"{RENEW_OF_SCHEMA_4}, p_lock_timeout interval DEFAULT interval '2 seconds'",
        7,
        CALL_RENEW,
        STALE_CALL,
        "p_lock_timeout interval, p_environment text",
        id="renew without its environment",
    ),
    pytest.param(
        "release",
        RELEASE_OF_SCHEMA_6,
        7,
        CALL_RELEASE,
        STALE_CALL,
        RELEASE_ENDS,
        id="release without a lock timeout and its environment",
    ),
    pytest.param(
        "release",
        f"{RELEASE_OF_SCHEMA_6}, p_lock_timeout interval DEFAULT interval '2 seconds',"
        " p_environment text DEFAULT NULL",
        16,
        CALL_RELEASE,
        STALE_CALL,
        RELEASE_ENDS,
        id="release without the sharer",
    ),
    pytest.param(
        "release",
        f"{RELEASE_OF_SCHEMA_6}, p_lock_timeout interval DEFAULT interval '2 seconds',"
        " p_environment text DEFAULT NULL, p_sharer text DEFAULT NULL",
        17,
        CALL_RELEASE,
        STALE_CALL,
        RELEASE_ENDS,
        id="release with the sharer, as the first schema 16 wrote it",
    ),
    pytest.param(
        "release",
        f"{RELEASE_OF_SCHEMA_6}, p_lock_timeout interval DEFAULT interval '2 seconds',"
        " p_environment text DEFAULT NULL, p_sharer text DEFAULT NULL,"
        " p_finished boolean DEFAULT true",
        17,
        CALL_RELEASE,
        STALE_CALL,
        RELEASE_ENDS,
        id="release without when the sharer joined, as a later schema 16 wrote it",
    ),
    pytest.param(
        "rejoin",
        REJOIN_OF_SCHEMA_5,
        6,
        CALL_REJOIN,
        STALE_CALL,
        REJOIN_ENDS,
        id="rejoin without its environment, successor and delivery prefix",
    ),
    pytest.param(
        "rejoin",
        f"{REJOIN_OF_SCHEMA_5}, p_environment text DEFAULT NULL",
        11,
        CALL_REJOIN,
        STALE_CALL,
        REJOIN_ENDS,
        id="rejoin with its environment, without its successor and delivery prefix",
    ),
    pytest.param(
        "rejoin",
        f"{REJOIN_OF_SCHEMA_5}, p_environment text DEFAULT NULL, p_successor text DEFAULT NULL,"
        " p_delivery_prefix text DEFAULT NULL",
        16,
        CALL_REJOIN,
        STALE_CALL,
        REJOIN_ENDS,
        id="rejoin without recording joins",
    ),
    pytest.param(
        "rejoin",
        f"{REJOIN_OF_SCHEMA_5}, p_environment text DEFAULT NULL, p_successor text DEFAULT NULL,"
        " p_delivery_prefix text DEFAULT NULL",
        17,
        CALL_REJOIN,
        STALE_CALL,
        REJOIN_ENDS,
        id="rejoin without recording joins, beside the first schema 16",
    ),
    pytest.param(
        "bound_lock_wait",
        "p_wait interval",
        8,
        # A renewal with a lock timeout of its own calls bound_lock_wait with one interval.
        "SELECT outcome, reason FROM celery_fence.renew("
        "'x', 1, gen_random_uuid(), interval '9 s', p_lock_timeout => interval '1 s')",
        STALE_CALL,
        "p_wait interval, p_since timestamp with time zone",
        id="bound_lock_wait without the wait's start",
    ),
    pytest.param(
        "pause",
        "p_name text, p_reason text, p_by text, p_environment text DEFAULT '',"
        " p_now timestamptz DEFAULT NULL",
        10,
        "SELECT outcome, reason FROM celery_fence.pause('x', 'audit', 'ops', 'prod')",
        ("paused", "paused"),
        "p_now timestamp with time zone, p_lock_timeout interval",
        id="pause without a lock timeout",
    ),
    pytest.param(
        "resume",
        "p_name text, p_now timestamptz DEFAULT NULL",
        10,
        "SELECT outcome, reason FROM celery_fence.resume('x')",
        ("missing", None),
        "p_now timestamp with time zone, p_lock_timeout interval",
        id="resume without a lock timeout",
    ),
]


@pytest.mark.parametrize(
    ("function", "earlier", "version", "call", "answer", "arguments_end"), SUPERSEDED_SIGNATURES
)
def test_upgrading_leaves_one_signature_of_a_function(
    empty_database_url: str,
    function: str,
    earlier: str,
    version: int,
    call: str,
    answer: tuple[str, str | None],
    arguments_end: str,
) -> None:
    """Beside the earlier signature, the one taking more arguments would make every call that
    leaves them out ambiguous: the upgrade drops the earlier one."""
    signatures = sa.text(
        "SELECT pg_get_function_identity_arguments(oid) FROM pg_proc"
        " WHERE pronamespace = 'celery_fence'::regnamespace AND proname = :function"
    )
    # The earlier signature (its body is beside the point here).
    with (
        upgraded(
            empty_database_url,
            before=version,
            earlier=f"CREATE FUNCTION celery_fence.{function}({earlier})"
            " RETURNS celery_fence.answer LANGUAGE sql AS $$ SELECT NULL::celery_fence.answer $$",
        ) as engine,
        engine.begin() as conn,
    ):
        (arguments,) = conn.execute(signatures, {"function": function}).scalars()
        assert tuple(conn.execute(sa.text(call)).one()) == answer
    assert arguments.endswith(arguments_end)


def test_upgrading_adds_the_finished_column_where_the_first_schema_16_lacked_it(
    empty_database_url: str,
) -> None:
    """The first installs of schema 16 created the joins table without ``finished``; a
    continuation's join, which reads it, failed on such a database until the upgrade added it."""
    with (
        upgraded(
            empty_database_url,
            before=17,
            earlier="ALTER TABLE celery_fence.joins DROP COLUMN finished",
        ) as engine,
        engine.connect() as conn,
    ):
        column = conn.exec_driver_sql(
            "SELECT data_type, column_default, is_nullable FROM information_schema.columns"
            " WHERE table_schema = 'celery_fence' AND table_name = 'joins'"
            " AND column_name = 'finished'"
        ).one()
    assert tuple(column) == ("boolean", "false", "NO")
    store = LeaseStore.from_url(empty_database_url)
    try:
        parent = store.acquire("release:prod", holder="a", ttl=30).lease
        assert parent is not None
        resume = {
            "epoch": parent.epoch,
            "holder": parent.holder,
            "mode": "resume",
            "proof": proof(parent, "resume"),
            "ttl": 30,
            "action": "start child",
            "delivery_prefix": "child[1]@",
        }
        child = store.rejoin("release:prod", **resume).lease
        assert child is not None
        assert store.release(child) == "left"
        assert store.rejoin("release:prod", **resume).outcome == "done"
    finally:
        store.dispose()


def test_upgrading_adds_the_sharers_column_where_the_first_schema_lacked_it(
    empty_database_url: str,
) -> None:
    """Early installs of schema 1 created the lease table without ``sharers``; a release, which
    counts them down, failed on such a database until the upgrade added it."""
    with (
        upgraded(
            empty_database_url,
            before=8,
            earlier="ALTER TABLE celery_fence.leases DROP COLUMN sharers",
        ) as engine,
        engine.connect() as conn,
    ):
        column = conn.exec_driver_sql(
            "SELECT data_type, column_default, is_nullable FROM information_schema.columns"
            " WHERE table_schema = 'celery_fence' AND table_name = 'leases'"
            " AND column_name = 'sharers'"
        ).one()
        checks = conn.exec_driver_sql(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'celery_fence.leases'::regclass AND contype = 'c'"
        ).scalars()
        assert "CHECK ((sharers >= 0))" in list(checks)
    assert tuple(column) == ("integer", "1", "NO")
    store = LeaseStore.from_url(empty_database_url)
    try:
        lease = store.acquire("release:prod", holder="a", ttl=30).lease
        assert lease is not None
        assert store.release(lease) == "released"
    finally:
        store.dispose()


def test_upgrading_leaves_exactly_the_functions_of_the_current_version(
    empty_database_url: str,
) -> None:
    """One signature of each function functions.sql creates, and none that an earlier version
    left behind (queue_behind_writers, which upgrades from some development versions kept)."""
    with (
        upgraded(
            empty_database_url,
            before=11,
            earlier="CREATE FUNCTION celery_fence.queue_behind_writers("
            "p_name text, p_lock_timeout interval, p_since timestamptz DEFAULT NULL"
            ") RETURNS void LANGUAGE sql AS ''",
        ) as engine,
        engine.connect() as conn,
    ):
        names = sorted(
            conn.exec_driver_sql(
                "SELECT proname FROM pg_proc WHERE pronamespace = 'celery_fence'::regnamespace"
            ).scalars()
        )
    created = re.findall(
        r"^CREATE OR REPLACE FUNCTION celery_fence\.(\w+)\(", _sql.read("functions.sql"), re.M
    )
    assert names == sorted(created)


# -- the listings read an index, whatever the size of the table ---------------------------------

FILL_LISTED_TABLES = (
    """
    INSERT INTO celery_fence.stale_runs (
        recorded_at, environment, lease_name, stale_epoch, stale_holder, reason, action
    )
    SELECT clock_timestamp() - i * interval '1 second', 'env' || mod(i, 20),
           'lease:' || mod(i, 20), i, 'holder', 'expired', 'renew'
    FROM generate_series(1, 20000) AS i
    """,
    """
    INSERT INTO celery_fence.dispatches (
        schedule, entry, slot, task, epoch, holder, dispatched_at
    )
    SELECT 'scheduler:' || mod(i, 4), 'entry' || mod(i, 10),
           clock_timestamp() - i * interval '1 minute', 'task', 1, 'beat', clock_timestamp()
    FROM generate_series(1, 20000) AS i
    """,
    "ANALYZE celery_fence.stale_runs, celery_fence.dispatches",
)

#: Each listing's query, its parameters and the index its plan walks.
LISTINGS = {
    "every stale run": (
        "stale_runs",
        {"environment": None, "lease_name": None, "limit": 100},
        "stale_runs_recorded_idx",
    ),
    "one environment's": (
        "stale_runs",
        {"environment": "env3", "lease_name": None, "limit": 100},
        "stale_runs_environment_idx",
    ),
    "one lease's": (
        "stale_runs",
        {"environment": None, "lease_name": "lease:3", "limit": 100},
        "stale_runs_lease_idx",
    ),
    "a schedule's dispatches": (
        "dispatches",
        {"schedule": "scheduler:1", "limit": 100},
        "dispatches_slot_idx",
    ),
    "one entry's dispatches": (
        "entry_dispatches",
        {"schedule": "scheduler:1", "entry": "entry3", "limit": 1},
        "dispatches_pkey",
    ),
    "each entry's latest dispatch": (
        "latest_dispatches",
        {"schedule": "scheduler:1", "entries": ["entry3", "entry5", "entry7"]},
        "dispatches_pkey",
    ),
}


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


@pytest.mark.parametrize("listing", sorted(LISTINGS))
def test_a_listing_reads_the_newest_rows_from_an_index(engine: Engine, listing: str) -> None:
    """The newest rows (a hundred, or one for each entry asked about) out of 20,000: the plan
    walks the listing's index in that order instead of sorting every row."""
    query, params, index = LISTINGS[listing]
    with engine.begin() as conn:
        for statement in FILL_LISTED_TABLES:
            conn.exec_driver_sql(statement)
        explained = sa.text(f"EXPLAIN (FORMAT JSON) {_sql.queries()[query]}")
        nodes = list(plan_nodes(conn.execute(explained, params).scalar_one()[0]["Plan"]))
    assert [node["Node Type"] for node in nodes if node["Node Type"] in ("Sort", "Seq Scan")] == []
    assert {node["Index Name"] for node in nodes if node["Node Type"] == "Index Scan"} == {index}


# -- the printed script is what install runs -----------------------------------------------------


def test_an_install_kept_waiting_for_a_lock_changes_nothing_and_says_so(
    empty_database_url: str,
) -> None:
    """A migration that must lock a table in use gives up after the lock timeout, instead of
    queueing every protocol call behind it; run again once the table is free, it applies."""
    install(empty_database_url)
    engine = sa.create_engine(
        libpq_url(empty_database_url, driver="postgresql+psycopg"), poolclass=sa.NullPool
    )
    (indexes,) = [m for m in _sql.migrations() if m.name == "0013_listing_indexes"]
    try:
        with engine.begin() as conn:  # as the schema was before the migration that builds them
            conn.execute(
                sa.text("DELETE FROM celery_fence.migrations WHERE version >= :version"),
                {"version": indexes.version},
            )
            conn.exec_driver_sql(
                "DROP INDEX celery_fence.stale_runs_recorded_idx, celery_fence.dispatches_slot_idx"
            )
        store = LeaseStore.from_url(empty_database_url, lock_timeout=0.3)
        with engine.begin() as conn:
            # A transaction recording a stale run, still open: the new index must wait for it.
            conn.exec_driver_sql("LOCK TABLE celery_fence.stale_runs IN ROW EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(FenceDatabaseError, match=r"install changed nothing.*\(0.3s\)"):
                store.install()
            assert time.monotonic() - started < 5
        assert max(version for version, _ in migrations_applied(empty_database_url)) == (
            indexes.version - 1
        )
        assert store.install() == _sql.latest_version()
        store.engine.dispose()
    finally:
        engine.dispose()
    assert migrations_applied(empty_database_url) == expected_migrations()


def test_install_on_a_schema_a_newer_package_upgraded_changes_nothing_and_says_so(
    empty_database_url: str,
) -> None:
    install(empty_database_url)
    newer = _sql.latest_version() + 1
    engine = sa.create_engine(
        libpq_url(empty_database_url, driver="postgresql+psycopg"), poolclass=sa.NullPool
    )
    try:
        with engine.begin() as conn:  # as a newer package leaves it: a migration, its functions
            conn.execute(
                sa.text("INSERT INTO celery_fence.migrations (version, name) VALUES (:v, :name)"),
                {"v": newer, "name": f"{newer:04d}_from_a_newer_package"},
            )
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION celery_fence.span(p_span interval) RETURNS interval"
                " LANGUAGE sql IMMUTABLE AS $$ SELECT p_span $$"
            )
    finally:
        engine.dispose()
    before = catalog(empty_database_url)
    with pytest.raises(
        FenceDatabaseError,
        match=rf"schema is at version {newer}, newer than this package's latest "
        rf"\({_sql.latest_version()}\); nothing was changed",
    ):
        install(empty_database_url)
    assert catalog(empty_database_url) == before
    assert [version for version, _ in migrations_applied(empty_database_url)][-1] == newer


def test_install_runs_exactly_the_printed_script(empty_database_url: str) -> None:
    executed: list[str] = []

    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            executed.append(str(query))
            return super().execute(query, params, **kwargs)

    engine = sa.create_engine(libpq_url(empty_database_url, driver="postgresql+psycopg"))

    @sa.event.listens_for(engine, "connect")
    def record(dbapi_connection: psycopg.Connection[Any], _: object) -> None:
        dbapi_connection.cursor_factory = Recording

    try:
        LeaseStore(engine, lock_timeout=1.1).install()
    finally:
        engine.dispose()
    (script,) = [query for query in executed if "celery-fence install script" in query]
    assert LeaseStore.install_script(lock_timeout=1.1) == f"BEGIN;\n\n{script}\nCOMMIT;\n"
    assert "SET LOCAL lock_timeout = '1100ms';" in script
    for migration in _sql.migrations():
        assert migration.sql.strip() in script
    assert _sql.read("functions.sql").strip() in script


def test_the_printed_script_installs_through_psql(
    request: pytest.FixtureRequest,
    empty_database_url: str,
    other_empty_database_url: str,
    tmp_path: Path,
) -> None:
    psql = shutil.which("psql")
    if psql is None:
        # tests/conftest.py, found by its file: every conftest module is named "conftest".
        shared = request.config.pluginmanager.get_plugin(str(ROOT / "tests" / "conftest.py"))
        assert shared is not None
        shared.missing_service("psql", "not on PATH")
        return
    script = tmp_path / "install.sql"
    script.write_text(LeaseStore.install_script(), encoding="utf-8")
    command = [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", libpq_url(other_empty_database_url)]
    for _ in range(2):  # idempotent from psql too
        subprocess.run([*command, "-f", str(script)], check=True, capture_output=True, timeout=60)
    install(empty_database_url)
    assert catalog(other_empty_database_url) == catalog(empty_database_url)
    assert migrations_applied(other_empty_database_url) == expected_migrations()


# -- the wheel ships the SQL ---------------------------------------------------------------------


def test_the_wheel_contains_the_sql(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path)]
    if importlib.util.find_spec("hatchling") is not None:
        command.append("--no-build-isolation")
    built = subprocess.run([*command, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("celery_fence-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        shipped = {
            path.relative_to(ROOT / "sql").as_posix(): archive.read(
                f"celery_fence/sql/{path.relative_to(ROOT / 'sql').as_posix()}"
            )
            for path in (ROOT / "sql").rglob("*.sql")
        }
    assert {"bootstrap.sql", "functions.sql", "queries.sql", "schema.sql"} <= set(shipped)
    assert any(name.startswith("migrations/") for name in shipped)
    for relative, content in shipped.items():
        assert content == (ROOT / "sql" / relative).read_bytes(), relative
    assert "celery_fence/py.typed" in names


# -- a clear error where the schema is missing ---------------------------------------------------


def some_lease() -> Lease:
    moment = datetime(2030, 1, 1, tzinfo=timezone.utc)
    return Lease(
        name="x", environment="default", holder="h", purpose="", epoch=1, token=uuid.uuid4(),
        acquired_at=moment, expires_at=moment, hold_until=moment, ttl=10.0, deadline=1e12,
    )  # fmt: skip


CALLS: dict[str, Callable[[LeaseStore], object]] = {
    "acquire": lambda store: store.acquire("x", holder="h", ttl=10),
    "renew": lambda store: store.renew(some_lease()),
    "release": lambda store: store.release(some_lease()),
    "owner": lambda store: store.owner("x"),
    "leases": lambda store: store.leases(),
    "stale_runs": lambda store: store.stale_runs(),
    "history": lambda store: store.history("x"),
    "pause": lambda store: store.pause("x", reason="r"),
    "resume": lambda store: store.resume("x"),
}


def test_a_store_on_an_older_schema_refuses_its_first_call_before_it_grants_anything(
    empty_database_url: str,
) -> None:
    """A package upgraded without ``celery-fence install``: the functions of the older schema
    could grant a lease the newer calls cannot renew or release, so the store's first protocol
    call checks the version, and once that holds, later calls do not ask again."""
    install(empty_database_url)
    store = LeaseStore.from_url(empty_database_url)
    latest = _sql.latest_version()
    try:
        with store.engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM celery_fence.migrations WHERE version = :v"), {"v": latest}
            )
        with pytest.raises(SchemaNotInstalledError, match=f"at version {latest - 1}, this"):
            store.acquire("release:prod", holder="a", ttl=30)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM celery_fence.leases").scalar() == 0
        assert store.install() == latest
        lease = store.acquire("release:prod", holder="a", ttl=30).lease
        assert lease is not None
        with store.engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM celery_fence.migrations WHERE version = :v"), {"v": latest}
            )
        assert store.release(lease) == "released"  # checked once, not on every call
    finally:
        store.dispose()


def test_the_schema_check_waits_for_a_locked_migrations_table_no_longer_than_the_lock_timeout(
    database_url: str, engine: Engine
) -> None:
    """An install in progress elsewhere (or maintenance) holds the migrations table: the check a
    worker makes at start-up, and a store's first call, give up after the lock timeout (an
    acquisition answers busy, as behind any lock it waited for too long), and go on once the
    table is free."""
    store = LeaseStore.from_url(database_url, lock_timeout=0.2)
    try:
        with engine.begin() as maintenance:
            maintenance.exec_driver_sql(
                "LOCK TABLE celery_fence.migrations IN ACCESS EXCLUSIVE MODE"
            )
            started = time.monotonic()
            with pytest.raises(FenceDatabaseError, match="lock timeout"):
                store.check_schema()
            assert store.acquire("release:prod", holder="a", ttl=30).outcome == "busy"
            assert time.monotonic() - started < 5
        assert store.check_schema() == _sql.latest_version()
        assert store.acquire("release:prod", holder="a", ttl=30).acquired
    finally:
        store.dispose()


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_missing_schema_says_to_install(empty_database_url: str, call: str) -> None:
    store = LeaseStore.from_url(empty_database_url)
    try:
        with pytest.raises(SchemaNotInstalledError, match="celery-fence install") as caught:
            CALLS[call](store)
    finally:
        store.engine.dispose()
    # The driver's own error is kept as the cause, whichever layer raised it.
    cause = caught.value.__cause__
    assert isinstance(cause, (sa.exc.DBAPIError, store.engine.dialect.loaded_dbapi.Error))
    assert "celery_fence" in str(cause)


# What PostgreSQL says of a missing object: the schema's own (celery-fence install is the cure)
# or another one, which installing would not bring.
MISSING_OBJECTS = {
    "a celery_fence function": ("SELECT celery_fence.no_such_function()", True),
    "a celery_fence type": ("SELECT NULL::celery_fence.no_such_type", True),
    "a celery_fence table": ("SELECT * FROM celery_fence.no_such_table", True),
    "an operator": ("SELECT 'a'::text = 1::smallint", False),
    "a function of no schema": ("SELECT no_such_function()", False),
    "a type of no schema": ("SELECT NULL::celery_fence_no_such_type", False),
    "a table of no schema": ("SELECT * FROM no_such_table", False),
}


@pytest.mark.parametrize("case", list(MISSING_OBJECTS))
def test_only_a_missing_celery_fence_object_says_to_install(engine: Engine, case: str) -> None:
    statement, of_the_schema = MISSING_OBJECTS[case]
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
        conn.exec_driver_sql(statement)
    assert caught.value.orig is not None
    assert caught.value.orig.sqlstate in {"42883", "42704", "42P01"}
    error = _wrap(caught.value)
    assert isinstance(error, FenceDatabaseError)
    assert isinstance(error, SchemaNotInstalledError) is of_the_schema
    assert ("celery-fence install" in str(error)) is of_the_schema


@pytest.mark.parametrize(
    ("schema", "error"),
    [("missing", SchemaNotInstalledError), ("installed", FenceDatabaseError)],
)
def test_a_guard_on_another_database_names_both(
    store: LeaseStore, empty_database_url: str, schema: str, error: type[Exception]
) -> None:
    """The check finds no schema, or no lease, where the store's own connection finds one held:
    the error names the databases the two connections were given. Nothing commits."""
    elsewhere = LeaseStore.from_url(empty_database_url)
    if schema == "installed":
        elsewhere.install()
    got = store.acquire("release:prod", holder="deploy", ttl=30)
    assert got.lease is not None
    try:
        with (
            pytest.raises(error, match="fenced writes must run in the database") as raised,
            elsewhere.engine.begin() as conn,
            store.guard(got.lease, conn, action="publish"),
        ):
            conn.exec_driver_sql("CREATE TABLE written (x int)")
        assert make_url(empty_database_url).database in str(raised.value)
        assert store.engine.url.database in str(raised.value)
        # The other database is the cause given, not a snapshot to retry.
        assert "snapshot" not in str(raised.value)
        with elsewhere.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regclass('written')").scalar() is None
    finally:
        elsewhere.engine.dispose()
    assert store.stale_runs() == []


def test_a_missing_schema_says_to_install_inside_a_guard(
    empty_database_url: str,
) -> None:
    store = LeaseStore.from_url(empty_database_url)
    try:
        with (
            pytest.raises(SchemaNotInstalledError, match="celery-fence install"),
            store.engine.begin() as conn,
            store.guard(some_lease(), conn, action="write"),
        ):
            conn.exec_driver_sql("SELECT 1")
    finally:
        store.engine.dispose()
