"""Shared fixtures: a real PostgreSQL database per test, cloned from an installed template.

The server comes from ``CELERY_FENCE_TEST_DATABASE_URL`` (else ``CELERY_FENCE_DATABASE_URL``,
else ``postgresql://postgres@127.0.0.1:5432/test``). ``scripts/test`` finds or starts one first.
Without a server, database tests are skipped with the reason, except under ``CI=true``, where
a missing service is a failure.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
from collections.abc import Callable, Iterator
from datetime import datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from celery_fence import LeaseStore
from celery_fence.store import engine_from_url

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
_counter = itertools.count()


def server_url() -> URL:
    raw = (
        os.environ.get("CELERY_FENCE_TEST_DATABASE_URL")
        or os.environ.get("CELERY_FENCE_DATABASE_URL")
        or DEFAULT_URL
    )
    url = make_url(raw)
    return url.set(drivername="postgresql+psycopg")


def missing_service(what: str, error: BaseException | str) -> None:
    """Skip with the reason locally; fail under CI=true."""
    message = f"{what} is not available: {error}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
    pytest.skip(message)


def utc_now() -> datetime:
    """The injected clock: freezegun moves it; the database then uses it instead of its own.

    ``datetime`` is looked up on its module at each call, where freezegun patches it: this
    conftest leaves ``sys.modules`` once another directory's conftest (also named ``conftest``)
    is imported, and freezegun patches only the names of the modules it finds there.
    """
    return dt.datetime.now(dt.timezone.utc)


@pytest.fixture(scope="session")
def admin_engine() -> Iterator[Engine]:
    engine = sa.create_engine(server_url(), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as exc:
        missing_service(f"PostgreSQL at {server_url().render_as_string(hide_password=True)}", exc)
    yield engine
    engine.dispose()


def _drop(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_database(admin_engine: Engine) -> Iterator[str]:
    """A database with celery-fence installed, cloned for each test."""
    name = f"cf_template_{os.getpid()}"
    _drop(admin_engine, name)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    engine = sa.create_engine(server_url().set(database=name), poolclass=sa.NullPool)
    LeaseStore(engine).install()
    engine.dispose()
    yield name
    _drop(admin_engine, name)


@pytest.fixture
def empty_database_url(admin_engine: Engine) -> Iterator[str]:
    """A URL to a new, empty database (nothing installed), dropped after the test."""
    name = f"cf_empty_{os.getpid()}_{next(_counter)}"
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield server_url().set(database=name).render_as_string(hide_password=False)
    _drop(admin_engine, name)


@pytest.fixture
def database_url(admin_engine: Engine, template_database: str) -> Iterator[str]:
    """A URL to a fresh database of this test's own, with celery-fence installed."""
    name = f"cf_test_{os.getpid()}_{next(_counter)}"
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield server_url().set(database=name).render_as_string(hide_password=False)
    _drop(admin_engine, name)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = engine_from_url(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: Engine) -> LeaseStore:
    """A store on the test database that trusts the database clock."""
    return LeaseStore(engine)


@pytest.fixture
def clock() -> Callable[[], datetime]:
    return utc_now


@pytest.fixture
def fake_store(engine: Engine, clock: Callable[[], datetime]) -> LeaseStore:
    """A store whose SQL uses the injected clock: wrap the test in ``freeze_time`` to move it."""
    return LeaseStore(engine, clock=clock)


_AGE_LEASE = sa.text(
    """
    UPDATE celery_fence.leases
    SET acquired_at = clock_timestamp() - interval '2 seconds',
        renewed_at = clock_timestamp() - interval '2 seconds',
        expires_at = clock_timestamp() - interval '1 second'
    WHERE name = :name
    """
)


@pytest.fixture
def expire_lease(engine: Engine) -> Callable[[str], None]:
    """Make a lease expire now by the database clock, without waiting for its TTL or freezing
    time (for tests with threads or workers): its row is aged in SQL."""

    def expire(name: str) -> None:
        with engine.begin() as conn:
            # A fenced writer holding the row would make this wait: fail instead of hanging.
            conn.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
            if conn.execute(_AGE_LEASE, {"name": name}).rowcount != 1:
                raise LookupError(f"no lease named {name!r}")

    return expire
