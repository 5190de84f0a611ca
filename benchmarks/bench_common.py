"""What the benchmarks share: the server they may use, a scratch database on it, percentiles.

The benchmark scripts import it as ``bench_common`` (run as scripts, their folder is on
``sys.path``); the task benchmark's worker gets the folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from celery_fence import LeaseStore

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"

Samples = dict[str, list[float]]


def add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=os.environ.get("CELERY_FENCE_DATABASE_URL", DEFAULT_URL),
        help="a server where the benchmark may create and drop a scratch database",
    )


@contextmanager
def scratch_database(server_url: str, prefix: str) -> Iterator[URL]:
    """A new database ``<prefix>_<pid>_<random>`` on the server with celery-fence installed,
    dropped afterwards (connections and all), also when the benchmark fails."""
    admin_url = make_url(server_url).set(drivername="postgresql+psycopg")
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin_url.set(database=name)
    try:
        store = LeaseStore(sa.create_engine(url, poolclass=sa.NullPool))
        store.install()
        store.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def server_version(url: URL) -> str:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar_one())
    finally:
        engine.dispose()


def percentile(values: list[float], share: float) -> float:
    """The smallest value at least ``share`` of ``values`` are not above (nearest rank)."""
    ordered = sorted(values)
    return ordered[math.ceil(share * len(ordered)) - 1]
